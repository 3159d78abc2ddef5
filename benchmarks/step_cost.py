"""What in-flight batching can gain over request-level batching on this machine, from the cost of a decoding step
alone: the torch engine's step (`decoder_batch.ModelRunner.step`, as the engine calls it) timed at 1 to 16 rows on
the random-weight t5-small and GPT-2 small shapes that benchmarks/inflight_vs_request.py builds, and the load of
that benchmark (8 to 128 new tokens per sequence, uniform) decoded in batches of 16 under each scheduling with
those step costs:

- in-flight: every step runs 16 rows;
- request-level, finished rows leave (`scheduling: "request"`): a batch of 16 runs until its longest sequence
  ends, each step with the rows still decoding;
- static (`scheduling: "static"`, as FasterTransformer's backend and `generate` batch): every step of a batch runs
  16 rows until its longest sequence ends.

Joining costs (prefill or encoder calls, cache writes) are left out of all three, so the ratios are what in-flight
batching would reach if joining cost it nothing more than it costs request-level batching: where a step's cost
grows with its rows, rows that leave early make request-level steps cheaper, and the ratio against the stronger
request-level batcher stays low however fast joins are.

    python benchmarks/step_cost.py                  # both shapes, 2 threads
    python benchmarks/step_cost.py --quick          # tiny models: checks the script
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS))

from inflight_vs_request import NEW_TOKENS, PROMPT_IDS, PROMPT_LENGTHS, build_model  # noqa: E402

ROWS = (1, 2, 4, 6, 8, 10, 12, 14, 16)
BATCH = 16
STEPS_BEFORE = 60


def measure(model_dir: Path, threads: int, repeats: int, rows_counts: tuple[int, ...] = ROWS) -> dict[int, float]:
    """This process: the median ms of a step at each row count, with `STEPS_BEFORE` steps in the cache."""
    import torch
    import transformers

    from transerve.backends.generation.decoder_batch import ModelRunner
    from transerve.backends.generation.onednn_linear import use_onednn_linears

    torch.set_num_threads(threads)
    config = transformers.AutoConfig.from_pretrained(model_dir)
    loader = transformers.AutoModelForSeq2SeqLM if config.is_encoder_decoder else transformers.AutoModelForCausalLM
    model = loader.from_pretrained(model_dir).eval()
    use_onednn_linears(model, pack=True)  # the engine's default on CPU float32
    runner = ModelRunner(model, model.generation_config.decoder_start_token_id, config.pad_token_id or 0, BATCH)
    rng = random.Random(0)
    costs = {}
    with torch.inference_mode():
        for rows in rows_counts:
            inputs = [[rng.randrange(*PROMPT_IDS) for _ in range(rng.randint(*PROMPT_LENGTHS))] for _ in range(rows)]
            batch, first = runner.new_rows(inputs, [1] * rows)
            tokens = first if config.is_encoder_decoder else first.argmax(-1)
            times = []
            for step in range(STEPS_BEFORE + repeats):
                started = time.perf_counter()
                tokens = runner.step(batch, tokens).argmax(-1)
                if step >= STEPS_BEFORE:
                    times.append(time.perf_counter() - started)
            costs[rows] = statistics.median(times) * 1000
    return costs


def cost(costs: dict[int, float], rows: int) -> float:
    """A step's ms at `rows` rows, interpolated linearly between the measured row counts."""
    measured = sorted(costs)
    below = max(r for r in measured if r <= rows)
    above = min(r for r in measured if r >= rows)
    if below == above:
        return costs[below]
    return costs[below] + (costs[above] - costs[below]) * (rows - below) / (above - below)


def throughputs(costs: dict[int, float], batches: int, seed: int) -> dict[str, float]:
    """Tokens per second of each scheduling over `batches` batches of the load's lengths."""
    rng = random.Random(seed)
    tokens = request_ms = static_ms = 0.0
    for _ in range(batches):
        lengths = [rng.randint(*NEW_TOKENS) for _ in range(BATCH)]
        tokens += sum(lengths)
        static_ms += max(lengths) * costs[BATCH]
        request_ms += sum(cost(costs, sum(n > step for n in lengths)) for step in range(max(lengths)))
    return {
        "in-flight": BATCH / costs[BATCH] * 1000,
        "request": tokens / request_ms * 1000,
        "static": tokens / static_ms * 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archs", default="t5,gpt2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20, help="timed steps per row count (the median counts)")
    parser.add_argument("--batches", type=int, default=1000, help="batches of the load the schedulings decode")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "transerve-inflight-bench")
    parser.add_argument("--quick", action="store_true", help="tiny models, few repeats")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(Path(args.worker), args.threads, args.repeats)))
        return
    if args.quick:
        args.repeats, args.batches = 3, 50
    args.workdir.mkdir(parents=True, exist_ok=True)
    print(f"decoding step, median ms of {args.repeats} steps after {STEPS_BEFORE}, {args.threads} threads; "
          f"tokens/s of {args.batches} batches of {BATCH} (new tokens {NEW_TOKENS[0]}-{NEW_TOKENS[1]}, uniform) from "
          "those step costs alone")
    header = " | ".join(f"{rows} row{'s' if rows > 1 else ''}" for rows in ROWS)
    print(f"| model | {header} | in-flight | request-level | static | in-flight / request-level "
          "| in-flight / static |")
    print("|---|" + "---:|" * (len(ROWS) + 5))
    for arch in args.archs.split(","):
        model = build_model(args.workdir, arch, args.quick)
        command = [sys.executable, __file__, "--worker", str(model), "--threads", str(args.threads),
                   "--repeats", str(args.repeats)]
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        costs = {int(rows): ms for rows, ms in json.loads(out.strip().splitlines()[-1]).items()}
        rates = throughputs(costs, args.batches, args.seed)
        steps = " | ".join(f"{costs[rows]:.1f}" for rows in ROWS)
        print(f"| {model.name} | {steps} | {rates['in-flight']:.0f} | {rates['request']:.0f} | {rates['static']:.0f} "
              f"| {rates['in-flight'] / rates['request']:.2f}x | {rates['in-flight'] / rates['static']:.2f}x |",
              flush=True)


if __name__ == "__main__":
    main()
