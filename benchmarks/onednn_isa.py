"""The generation engines with oneDNN's default instruction set against oneDNN limited to AVX2
(`ONEDNN_MAX_CPU_ISA=AVX2`), on the random-weight t5-small and GPT-2 small shapes of benchmarks.generation.

On an AMD CPU, CTranslate2 multiplies with oneDNN (it uses MKL only on Intel CPUs), in float32 (sgemm) and in int8;
torch's oneDNN, a copy of its own, computes the torch engine's linear layers (`onednn_linear`). Both read
`ONEDNN_MAX_CPU_ISA` once, when the process first uses them, so the setting holds for a whole process: a server,
not a model. This measures what it does to each engine, each setting in a process of its own, in alternating
rounds so that the machine's noise falls on both alike; the best round counts.

    python -m benchmarks.onednn_isa                          # both shapes, 2 rounds
    python -m benchmarks.onednn_isa --quick                  # tiny models: checks the script

Rows, for each thread count of the engines (`--threads`, 1 and 2: the served CTranslate2 engine runs two calls
of one thread each on 2 cores, and one call of 1 thread at concurrency 1):
- CTranslate2 float32 and int8: batch-16 throughput on the first 32 requests of benchmarks.generation's load (prompts
  8-64 tokens, 8-128 new tokens), as its ceiling measures it; time to first token of one request at a time (p50
  of 20, prompts 8-64 tokens, called directly).
- torch engine (float32, `onednn_linear` packed weights): a decoding step of 1 and 16 rows, as benchmarks.step_cost
  times it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import decoding_step, generation_models
from benchmarks.common.results import add_json_option, write_json

SETTINGS = {"default": None, "AVX2": "AVX2"}
CEILING_REQUESTS = 32
TTFT_REQUESTS = 20
TTFT_TOKENS = 4
STEP_ROWS = (1, 16)


def measure(model_name: str, workdir: Path, threads: int, quick: bool) -> dict[str, float]:
    """This process, in whatever oneDNN setting it started with: every row of one model at `threads` threads."""
    shapes = generation_models.QUICK_SHAPES if quick else generation_models.SHAPES
    model = generation_models.prepare_model(model_name, shapes[model_name], workdir)
    load = generation_models.make_load(CEILING_REQUESTS + TTFT_REQUESTS + 1, 7, model)
    rows: dict[str, float] = {}
    for precision in ("float32", "int8"):
        ceiling = generation_models.ceiling_ct2(model, precision, load[:CEILING_REQUESTS], 16, threads, 1, 1.0, 0.0)
        rows[f"CTranslate2 {precision}, batch 16, tokens/s"] = ceiling.rate
        first = generation_models.ttft_direct_ct2(model, precision, load[CEILING_REQUESTS:], TTFT_TOKENS, threads)
        rows[f"CTranslate2 {precision}, time to first token p50, ms"] = first.percentile(50)
    steps = decoding_step.measure(model.hf_dir, threads, 5 if quick else 20, STEP_ROWS)
    for count in STEP_ROWS:
        rows[f"torch engine, {count}-row decoding step, ms"] = steps[count]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="t5,gpt2")
    parser.add_argument("--threads", default="1,2", help="the engines' threads, a row set each")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of both settings; the best counts")
    parser.add_argument("--workdir", type=Path, help="keep the built and converted models here for the next run")
    parser.add_argument("--quick", action="store_true", help="tiny models: a check of the script")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    add_json_option(parser)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    workdir = args.workdir or Path(tempfile.gettempdir()) / "transerve-onednn-isa"
    if args.worker:
        print(json.dumps(measure(args.worker, workdir, int(args.threads), args.quick)))
        return
    workdir.mkdir(parents=True, exist_ok=True)
    best: dict[tuple[str, int, str, str], float] = {}
    thread_counts = [int(t) for t in args.threads.split(",")]
    models = args.models.split(",")
    for round_number, model_name, threads in itertools.product(range(args.rounds), models, thread_counts):
        for setting, isa in SETTINGS.items():
            env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")}
            if isa:
                env["ONEDNN_MAX_CPU_ISA"] = isa
            print(f"{model_name}, {threads} threads, oneDNN {setting} (round {round_number + 1})...", file=sys.stderr)
            command = [sys.executable, "-m", "benchmarks.onednn_isa", "--worker", model_name, "--workdir", str(workdir),
                       "--threads", str(threads)] + (["--quick"] if args.quick else [])
            out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
            for row, value in json.loads(out.strip().splitlines()[-1]).items():
                key = (model_name, threads, row, setting)
                higher_is_better = row.endswith("tokens/s")
                if key not in best or (value > best[key]) == higher_is_better:
                    best[key] = value
    rows = []
    print(f"best of {args.rounds} alternating rounds; ONEDNN_MAX_CPU_ISA unset (default) against AVX2\n")
    print("| model | threads | measure | default | AVX2 | AVX2 / default |")
    print("|---|---:|---|---:|---:|---:|")
    for model_name, threads in itertools.product(models, thread_counts):
        for row in dict.fromkeys(r for m, t, r, _ in best if (m, t) == (model_name, threads)):
            default, avx2 = best[(model_name, threads, row, "default")], best[(model_name, threads, row, "AVX2")]
            print(f"| {model_name} | {threads} | {row} | {default:.1f} | {avx2:.1f} | {avx2 / default:.2f}x |")
            rows.append({"model": model_name, "threads": threads, "measure": row, "default": default, "avx2": avx2})
    write_json(args.json, "onednn_isa", rows, args)


if __name__ == "__main__":
    main()
