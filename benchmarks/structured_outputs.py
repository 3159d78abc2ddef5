"""Structured outputs' cost in the torch engine: the same generation load decoded free and with every request under
a JSON schema (tokens/s, and their ratio), the grammar compile time of a typical tool schema, and the token-mask
cost per step and per row. In process (the engine called directly), on a random-weight GPT-2 small shape model.

    python -m benchmarks.structured_outputs            # GPT-2 small shape (d_model 768, 12 layers, vocab 50257)
    python -m benchmarks.structured_outputs --quick    # a tiny model: checks the script in seconds

Constrained requests end where their JSON document ends (or at `--new-tokens`); the free run that follows each
constrained one decodes exactly as many tokens per request (`min_new_tokens`), so both runs are the same load.
Runs alternate `--rounds` times; the best rate of each is reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

TOOL_SCHEMA = {
    "type": "object",
    "properties": {
        "location": {"type": "string", "description": "City and country", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "include_hourly": {"type": "boolean"},
        "fields": {"type": "array", "items": {"type": "string", "enum": ["temp", "wind", "rain", "uv"]},
                   "maxItems": 4},
    },
    "required": ["location", "unit", "days"],
    "additionalProperties": False,
}


def run_load(engine, constraint, lengths: list[int], prompt: int) -> tuple[float, list[int]]:
    """Tokens/s and each request's tokens for one sequence per entry of `lengths`, submitted at once: free ones
    decode exactly their length, constrained ones up to it."""
    from transerve.backends.generation.engine import DecodingOptions, GenerationRequest

    finished = threading.Semaphore(0)
    produced = [0] * len(lengths)

    def done(index: int, outcome) -> None:
        if isinstance(outcome, Exception):
            print("error:", outcome, file=sys.stderr)
        else:
            produced[index] = len(outcome.hypotheses[0].token_ids)
        finished.release()

    start = time.perf_counter()
    for index, length in enumerate(lengths):
        options = DecodingOptions(max_new_tokens=length, min_new_tokens=0 if constraint else length,
                                  constraint=constraint)
        ids = [(index * 7 + k) % 200 + 1 for k in range(prompt)]
        engine.submit(GenerationRequest(ids, options), None, lambda outcome, index=index: done(index, outcome))
    for _ in lengths:
        finished.acquire()
    elapsed = time.perf_counter() - start
    return sum(produced) / elapsed, produced


def mask_costs(compiler, tokenizer, vocab: int, rows_list: list[int]) -> dict[int, float]:
    """Median seconds of one step's masks (fill and apply) for `rows` constrained rows, mid-document."""
    import torch

    from transerve.backends.generation.grammar.constraint import constraint
    from transerve.backends.generation.grammar.masks import apply_masks

    schema = constraint("json_schema", TOOL_SCHEMA, "bench")
    prefix = tokenizer.encode('{"location":"Par')
    costs = {}
    for rows in rows_list:
        grammars = []
        for _ in range(rows):
            grammar = compiler.row(schema, [tokenizer.eos_token_id])
            for token in prefix:
                grammar.consume(token)
            grammars.append(grammar)
        logits = torch.zeros(rows, vocab)
        times = []
        for _ in range(50):
            begin = time.perf_counter()
            apply_masks(list(enumerate(grammars)), logits)
            times.append(time.perf_counter() - begin)
        costs[rows] = statistics.median(times)
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rows", type=int, default=16, help="max_batch_rows")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    import torch
    import transformers

    from tests.support.generation_models import build_generation_model
    from transerve.backends.generation.grammar.compiler import GrammarCompiler
    from transerve.backends.generation.grammar.constraint import constraint
    from transerve.backends.generation.torch.engine import TorchEngine

    sizes = {"d_model": 64, "layers": 2, "vocab_size": 2000} if args.quick else \
        {"d_model": 768, "layers": 12, "vocab_size": 50257}
    with tempfile.TemporaryDirectory() as workdir:
        path = build_generation_model("gpt2", Path(workdir) / "gpt2", **sizes)
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        vocab = sizes["vocab_size"]
        begin = time.perf_counter()
        compiler = GrammarCompiler.from_model_dir(path, vocab, [tokenizer.eos_token_id], torch.device("cpu"))
        tokenizer_seconds = time.perf_counter() - begin
        schema = constraint("json_schema", TOOL_SCHEMA, "bench")
        begin = time.perf_counter()
        compiler.row(schema, [])
        compile_seconds = time.perf_counter() - begin
        begin = time.perf_counter()
        compiler.row(schema, [])
        cached_seconds = time.perf_counter() - begin
        costs = mask_costs(compiler, tokenizer, vocab, [1, 8, args.rows])

        engine = TorchEngine(path, max_batch_rows=args.rows)
        run_load(engine, schema, [8] * 4, args.prompt)  # warm-up: the engine's tokenizer and compiled schema
        run_load(engine, None, [8] * 4, args.prompt)
        # The constrained run first, then the free one with each request's length as the constrained run produced
        # it: the same load (lengths, joins, the batch's occupancy), with and without grammars.
        free, constrained = [], []
        for _ in range(args.rounds):
            constrained.append(run_load(engine, schema, [args.new_tokens] * args.requests, args.prompt))
            free.append(run_load(engine, None, [max(n, 1) for n in constrained[-1][1]], args.prompt))
        engine.close()
        engine.join(10)
    best_free, best_constrained = max(free), max(constrained)
    best_free = best_free[0], sum(best_free[1])
    best_constrained = best_constrained[0], sum(best_constrained[1])
    print(json.dumps({
        "model": f"gpt2 d_model {sizes['d_model']}, {sizes['layers']} layers, vocab {vocab}",
        "load": f"{args.requests} requests, prompt {args.prompt}, up to {args.new_tokens} new tokens, "
                f"max_batch_rows {args.rows}",
        "free_tokens_per_s": round(best_free[0], 1), "free_tokens": best_free[1],
        "schema_tokens_per_s": round(best_constrained[0], 1), "schema_tokens": best_constrained[1],
        "ratio": round(best_constrained[0] / best_free[0], 3),
        "all_rounds": {"free": [round(r, 1) for r, _ in free], "schema": [round(r, 1) for r, _ in constrained]},
        "tokenizer_init_ms": round(tokenizer_seconds * 1e3, 1),
        "tool_schema_compile_ms": round(compile_seconds * 1e3, 2),
        "cached_schema_row_ms": round(cached_seconds * 1e3, 3),
        "mask_per_step_us": {rows: round(cost * 1e6, 1) for rows, cost in costs.items()},
        "mask_per_row_us": {rows: round(cost * 1e6 / rows, 1) for rows, cost in costs.items()},
    }, indent=1))


if __name__ == "__main__":
    main()
