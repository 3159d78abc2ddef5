"""The torch engine's in-flight batching against its request-level batching, called directly (no server), on a
random-weight model of t5-small shape (d_model 512, 6+6 layers, vocab 32128) or, with `--arch gpt2`, GPT-2 small
shape (d_model 768, 12 layers, vocab 50257), built as benchmarks.generation builds them, under a mixed-length
load; optionally the same for the engine of another git revision, side by side.

    python -m benchmarks.inflight_vs_request                        # this checkout, 2 rounds
    python -m benchmarks.inflight_vs_request --compare-with HEAD~3  # and the engine as it was at HEAD~3
    python -m benchmarks.inflight_vs_request --compare-with A --compare-with B --no-checkout   # revisions only
    python -m benchmarks.inflight_vs_request --quick                # tiny model, short windows: checks the script
    python -m benchmarks.inflight_vs_request --arch gpt2 --threads 1  # the decoder-only model

Request-level batching is measured two ways: `request` (finished rows leave the batch at once; new sequences join
only an empty batch) and `static` (finished rows decode on, their tokens discarded, until the batch's last sequence
ends: how FasterTransformer's backend and transformers' `generate` batch).

The load: `--in-flight` closed-loop clients submit sequences (prompts of 8 to 64 token ids, the last one the end
token as T5's tokenizer writes it; 8 to 128 new tokens, uniform, seeded) to one engine with `max_batch_rows` 16;
end tokens are off (`end_ids=[]`), so every sequence is exactly as long as asked. Each configuration runs in a
process of its own (the revision's `src` on the path) for a warm-up and then a measured window; throughput counts
the tokens streamed inside the window. Rounds alternate the configurations, and each row shows the load average
when it started (the machine is shared). On a shared 2-core machine, `--threads 2` swings several-fold from window
to window (torch's worker threads wait for each other whenever other load takes a core); `--threads 1` is steady.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.common.generation_models import NEW_TOKENS, PROMPT_IDS, PROMPT_LENGTHS, SHAPES, build_model
from benchmarks.common.results import REPO_ROOT, add_json_option, write_json
from benchmarks.common.servers import transerve_source_at

#: The engine's schedulings: in-flight, and request-level with finished rows leaving at once (`request`) or decoding
#: on until the batch ends (`static`, as FasterTransformer's backend and transformers' `generate` do).
SCHEDULINGS = ("inflight", "request", "static")


def load(count: int, seed: int, eos: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        prompt = [rng.randrange(*PROMPT_IDS) for _ in range(rng.randint(*PROMPT_LENGTHS))]
        prompt[-1] = eos
        requests.append((prompt, rng.randint(*NEW_TOKENS)))
    return requests


def worker(args: argparse.Namespace) -> None:
    """One configuration in this process: print its tokens/s as JSON."""
    import torch

    from transerve.backends.generation.engine import DecodingOptions, GenerationRequest
    from transerve.backends.generation.torch.engine import TorchEngine

    try:  # the engine takes a scheduling object; revisions before the split took its name
        from transerve.backends.generation.torch.static_scheduling import scheduling_named

        scheduling = scheduling_named(args.scheduling)
    except ImportError:
        scheduling = args.scheduling
    torch.set_num_threads(args.threads)
    engine = TorchEngine(Path(args.model), max_batch_rows=args.rows, scheduling=scheduling)
    requests = load(1000, args.seed, engine.eos_token_ids[0])
    lock = threading.Lock()
    produced = [0]
    completed = [0]
    order = iter(requests)
    stop = threading.Event()

    def on_tokens(new: list[int]) -> None:
        with lock:
            produced[0] += len(new)

    def start() -> None:
        with lock:
            prompt, new_tokens = next(order)
        options = DecodingOptions(max_new_tokens=new_tokens, end_ids=[])
        engine.submit(GenerationRequest(prompt, options, stream=True), on_tokens, done)

    def done(result: object) -> None:
        if not hasattr(result, "hypotheses"):
            print(f"failed: {result}", file=sys.stderr)
            os._exit(1)
        with lock:
            completed[0] += 1
        if not stop.is_set():
            start()

    for _ in range(args.in_flight):
        start()
    time.sleep(args.warmup)
    with lock:
        tokens0, completed0, started, cpu0 = produced[0], completed[0], time.perf_counter(), time.process_time()
    time.sleep(args.seconds)
    with lock:
        tokens1, completed1, ended, cpu1 = produced[0], completed[0], time.perf_counter(), time.process_time()
    stop.set()
    tokens = tokens1 - tokens0
    print(json.dumps({"tokens_per_s": tokens / (ended - started), "tokens_per_cpu_s": tokens / (cpu1 - cpu0),
                      "completed": completed1 - completed0}), flush=True)
    os._exit(0)  # the engine thread may be inside torch: do not wait for it


def measure(src: Path, scheduling: str, model: Path, args: argparse.Namespace) -> dict:
    command = [sys.executable, "-m", "benchmarks.inflight_vs_request", "--worker", "--model", str(model),
               "--scheduling", scheduling,
               "--rows", str(args.rows), "--in-flight", str(args.in_flight), "--threads", str(args.threads),
               "--warmup", str(args.warmup), "--seconds", str(args.seconds), "--seed", str(args.seed)]
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare-with", metavar="REVISION", action="append", default=[],
                        help="also measure the engine of this git revision (repeatable)")
    parser.add_argument("--no-checkout", action="store_true", help="measure only the --compare-with revisions")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--in-flight", type=int, default=32, help="closed-loop clients")
    parser.add_argument("--rows", type=int, default=16, help="max_batch_rows")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--seconds", type=float, default=40.0, help="measured window per configuration")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "transerve-inflight-bench")
    parser.add_argument("--quick", action="store_true", help="tiny model, short windows")
    parser.add_argument("--schedulings", default=",".join(SCHEDULINGS),
                        help="those to measure; in-flight is always one (revisions before static: inflight,request)")
    parser.add_argument("--arch", choices=sorted(SHAPES), default="t5", help="the model's architecture and shape")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--scheduling", help=argparse.SUPPRESS)
    add_json_option(parser)
    args = parser.parse_args()
    schedulings = ["inflight", *(s for s in args.schedulings.split(",") if s != "inflight")]
    if args.worker:
        worker(args)
        return
    if args.quick:
        args.warmup, args.seconds = 2.0, 5.0
    args.workdir.mkdir(parents=True, exist_ok=True)
    model = build_model(args.workdir, args.arch, args.quick)
    with tempfile.TemporaryDirectory() as scratch:
        trees = [(revision, transerve_source_at(revision, Path(scratch) / revision.replace("/", "_")))
                 for revision in args.compare_with]
        if not args.no_checkout:
            trees.append(("this checkout", REPO_ROOT / "src"))
        print(f"{model.name}: in flight {args.in_flight}, max_batch_rows {args.rows}, {args.threads} torch threads, "
              f"window {args.seconds:.0f} s after {args.warmup:.0f} s warm-up; tok/s: per wall-clock second, "
              f"tok/cpu-s: per second of the process's CPU time (less sensitive to other load)")
        print("| round | engine | scheduling | load avg | tok/s | tok/cpu-s |")
        print("|---|---|---|---|---|---|")
        results: dict[tuple[str, str], list[dict]] = {}
        for round_ in range(1, args.rounds + 1):
            for label, src in trees:
                for scheduling in schedulings:
                    load_average = os.getloadavg()[0]
                    result = measure(src, scheduling, model, args)
                    results.setdefault((label, scheduling), []).append(result)
                    print(f"| {round_} | {label} | {scheduling} | {load_average:.1f} | {result['tokens_per_s']:.1f} "
                          f"| {result['tokens_per_cpu_s']:.1f} |", flush=True)
        print("\nin-flight / request-level, from the rounds' median and best tok/s (and tok/cpu-s)")
        print("| engine | against | median tok/s | best tok/s | median tok/cpu-s | best tok/cpu-s |")
        print("|---|---|---|---|---|---|")
        for label, _ in trees:
            for other in schedulings[1:]:
                cells = []
                for key in ("tokens_per_s", "tokens_per_cpu_s"):
                    for pick in (statistics.median, max):
                        inflight, request = (pick(r[key] for r in results[(label, s)]) for s in ("inflight", other))
                        cells.append(f"{inflight:.0f} / {request:.0f} = {inflight / request:.2f}x")
                print(f"| {label} | {other} | {' | '.join(cells)} |")
        write_json(args.json, "inflight_vs_request", [{"engine": label, "scheduling": scheduling, "runs": runs}
                                                      for (label, scheduling), runs in results.items()], args)


if __name__ == "__main__":
    main()
