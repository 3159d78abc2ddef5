"""What in-flight batching can gain over request-level batching on this machine, from the cost of a decoding step
alone: the torch engine's step (`torch.model_runner.ModelRunner.step`, as the engine calls it) timed at 1 to 16 rows on
the random-weight t5-small and GPT-2 small shapes that benchmarks.inflight_vs_request builds, and the load of
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

With `--joins` it times the joining work instead: one encoder call or prefill (`ModelRunner.new_rows`) of 1 to 8
sequences, per input token, the inputs of random lengths or of like length, which is what the engine's
`join_group` saves by computing several waiting sequences' rows in one call.

    python -m benchmarks.step_cost                  # both shapes, 2 threads
    python -m benchmarks.step_cost --quick          # tiny models: checks the script
    python -m benchmarks.step_cost --joins          # joining calls instead: cost per input token by group size
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

from benchmarks.common.decoding_step import BATCH, ROWS, STEPS_BEFORE, load_runner, measure
from benchmarks.common.generation_models import NEW_TOKENS, PROMPT_IDS, PROMPT_LENGTHS, build_model
from benchmarks.common.results import add_json_option, write_json

#: Sequences per joining call (`--joins`), and how far apart a like-length group's input lengths are at most.
GROUPS = (1, 2, 4, 8)
LIKE_SPREAD = 6


def measure_joins(model_dir: Path, threads: int, repeats: int) -> dict[str, dict[int, float]]:
    """This process: the median ms per input token of one joining call (`ModelRunner.new_rows`: encoder call or
    prefill) of each group size in `GROUPS`, the inputs' lengths drawn from the load's at random or of like length
    (within `LIKE_SPREAD` tokens of each other, as the engine's `join_group` picks them)."""
    import torch

    runner, _ = load_runner(model_dir, threads)
    rng = random.Random(0)
    low, high = PROMPT_LENGTHS

    def lengths(kind: str, group: int) -> list[int]:
        if kind == "random":
            return [rng.randint(low, high) for _ in range(group)]
        base = rng.randint(low, high - LIKE_SPREAD)
        return [base + rng.randint(0, LIKE_SPREAD) for _ in range(group)]

    costs: dict[str, dict[int, float]] = {"random": {}, "like": {}}
    with torch.inference_mode():
        runner.new_rows([[PROMPT_IDS[0]] * high] * 2, [1, 1])  # oneDNN's first calls set up its kernels
        for group in GROUPS:
            for kind, by_group in costs.items():
                per_token = []
                for _ in range(repeats):
                    inputs = [[rng.randrange(*PROMPT_IDS) for _ in range(n)] for n in lengths(kind, group)]
                    started = time.perf_counter()
                    runner.new_rows(inputs, [1] * group)
                    per_token.append((time.perf_counter() - started) * 1000 / sum(map(len, inputs)))
                by_group[group] = statistics.median(per_token)
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
    parser.add_argument("--joins", action="store_true", help="time joining calls by group size instead of steps")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    add_json_option(parser)
    args = parser.parse_args()
    if args.worker:
        work = measure_joins if args.joins else measure
        print(json.dumps(work(Path(args.worker), args.threads, args.repeats)))
        return
    if args.quick:
        args.repeats, args.batches = 3, 50
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.joins:
        print(f"joining call (encoder call or prefill) of 1 to {GROUPS[-1]} sequences, median ms per input token of "
              f"{args.repeats} calls, {args.threads} threads; input lengths {PROMPT_LENGTHS[0]}-{PROMPT_LENGTHS[1]} "
              f"at random, or of like length (within {LIKE_SPREAD} tokens)")
        print(f"| model | inputs | {' | '.join(f'{g} at once' for g in GROUPS)} |")
        print("|---|---|" + "---:|" * len(GROUPS))
    else:
        print(f"decoding step, median ms of {args.repeats} steps after {STEPS_BEFORE}, {args.threads} threads; "
              f"tokens/s of {args.batches} batches of {BATCH} (new tokens {NEW_TOKENS[0]}-{NEW_TOKENS[1]}, uniform) "
              "from those step costs alone")
        header = " | ".join(f"{rows} row{'s' if rows > 1 else ''}" for rows in ROWS)
        print(f"| model | {header} | in-flight | request-level | static | in-flight / request-level "
              "| in-flight / static |")
        print("|---|" + "---:|" * (len(ROWS) + 5))
    results: dict[str, dict] = {}
    for arch in args.archs.split(","):
        model = build_model(args.workdir, arch, args.quick)
        command = [sys.executable, "-m", "benchmarks.step_cost", "--worker", str(model), "--threads", str(args.threads),
                   "--repeats", str(args.repeats)] + (["--joins"] if args.joins else [])
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        measured = json.loads(out.strip().splitlines()[-1])
        results[model.name] = measured
        if args.joins:
            for kind, by_group in measured.items():
                print(f"| {model.name} | {kind} | {' | '.join(f'{by_group[str(g)]:.3f}' for g in GROUPS)} |",
                      flush=True)
            continue
        costs = {int(rows): ms for rows, ms in measured.items()}
        rates = throughputs(costs, args.batches, args.seed)
        results[model.name] = {"step_ms": costs, "tokens_per_s": rates}
        steps = " | ".join(f"{costs[rows]:.1f}" for rows in ROWS)
        print(f"| {model.name} | {steps} | {rates['in-flight']:.0f} | {rates['request']:.0f} | {rates['static']:.0f} "
              f"| {rates['in-flight'] / rates['request']:.2f}x | {rates['in-flight'] / rates['static']:.2f}x |",
              flush=True)
    write_json(args.json, "step_cost", results, args)


if __name__ == "__main__":
    main()
