"""Issue 22's GPU check in one command: the GPU tests, then text generation on the GPU against transformers'
`generate`, both model shapes, fp16, printed as the issue's table with its goals. Under 8 minutes on one H100:
414 s with 5 s rows and 1.5 s warm-ups, the GPU tests 150 s of them (benchmarks/README.md, "GPU check").

    pip install -e '.[bench,test,gpu]'
    python -m benchmarks.gpu_check                  # on a machine with an NVIDIA GPU
    python -m benchmarks.gpu_check --skip-tests     # the benchmark alone
    python -m benchmarks.gpu_check --dry-run        # on the CPU: tiny models, float32, a second per run, the tests
                                                    # only collected: every code path once (tests/benchmarks)

What runs, for each model (`--models t5,gpt2`: random weights of t5-small and GPT-2 small shape, their end id
silenced as in benchmarks/generation.py, so every request decodes exactly the tokens it asks for), on the mixed
load of benchmarks/generation.py (prompts 8-64 ids, 8-128 new tokens, seeded):

- served by one transerve (KIND_GPU instances), `--clients` closed-loop HTTP clients: the torch engine in-flight
  with `max_batch_rows` `--rows` and with the default rows (sized from free GPU memory), `scheduling: static` with
  `--rows`; CTranslate2 float16 and int8_float16 with `--rows` where they load (a model that does not is reported
  with its reason from the repository index); time to first token at concurrency 1 over gRPC streaming (torch);
- the torch engine alone (no server), in-flight (its steps recorded as CUDA graphs, and eager ones to compare)
  and static, `--rows` rows and as many sequences in a closed loop; then a short run of its own that records
  which of torch's attention kernels each kind of call can take and why not the fused ones
  (`common/attention_kernels.py`: to stderr and the JSON, not a row);
- transformers' `generate`: static batches of `--rows` sorted by length (with cuDNN's attention on and off: the
  baseline is the faster), static batches of 16, and per request from `--baseline-threads` threads;
- CTranslate2's `generate_batch`/`translate_batch` called directly at batch `--rows`, float16 and int8_float16.

Throughput counts the tokens of requests completed inside the measured window (served and engine alone: each
request's asked tokens, checked; transformers per request: the tokens produced inside the window); static
batches count every token produced, padding included, over the whole pass. The transformers and CTranslate2 rows
run before the engine alone, since loading a torch engine onto a GPU turns cuDNN's attention off for the process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common.attention_kernels import attention_calls
from benchmarks.common.generation_models import (
    QUICK_SHAPES,
    SHAPES,
    FirstToken,
    Measured,
    Model,
    Request,
    ceiling_ct2,
    make_load,
    set_parameter,
    silence_token,
)
from benchmarks.common.results import add_json_option, commit, write_json
from benchmarks.common.servers import REPO_ROOT

#: The issue's rows, in its order; `{rows}`, `{clients}`, `{small}`, `{threads}` are this run's numbers.
ROWS = (
    ("served_inflight_rows", "served, torch engine, in-flight, `max_batch_rows` {rows}, {clients} HTTP clients"),
    ("served_inflight_default", "served, torch engine, in-flight, default rows (sized from free memory), {clients} "
                                "clients"),
    ("served_static_rows", "served, torch engine, `scheduling: static`, {rows} rows, {clients} clients"),
    ("engine_inflight", "engine alone (no server), in-flight, {rows} sequences in a closed loop"),
    ("engine_inflight_eager", "  (eager steps, no CUDA graphs: `cuda_graphs` false)"),
    ("engine_static", "engine alone, static, {rows} sequences"),
    ("generate_rows", "transformers `generate`, static batches of {rows} sorted by length (the faster SDPA setting)"),
    ("generate_rows_cudnn", "  (cuDNN's attention on)"),
    ("generate_rows_no_cudnn", "  (cuDNN's attention off)"),
    ("generate_small", "transformers `generate`, static batches of {small}"),
    ("per_request", "transformers `generate` per request from {threads} threads"),
    ("served_ct2_float16", "served, CTranslate2 float16, {rows} rows, {clients} clients"),
    ("served_ct2_int8_float16", "served, CTranslate2 int8_float16, {rows} rows, {clients} clients"),
    ("direct_ct2_float16", "CTranslate2 called directly, float16, batch {rows}"),
    ("direct_ct2_int8_float16", "CTranslate2 called directly, int8_float16, batch {rows}"),
)
CT2_TYPES = ("float16", "int8_float16")


@dataclass(frozen=True)
class Served:
    """A served configuration: the conversion it is made from and the config parameters it sets."""

    engine: str
    quantization: str
    parameters: tuple[tuple[str, str], ...]
    decoupled: bool = False


def served_configs(rows: int, dtype: str) -> dict[str, Served]:
    """By row key (the streaming one for time to first token: `torch_stream`)."""
    fixed = (("max_batch_rows", str(rows)),)
    return {
        "served_inflight_rows": Served("torch", dtype, fixed),
        "served_inflight_default": Served("torch", dtype, ()),
        "served_static_rows": Served("torch", dtype, (*fixed, ("scheduling", "static"))),
        "served_ct2_float16": Served("ctranslate2", "float16", fixed),
        "served_ct2_int8_float16": Served("ctranslate2", "int8_float16", fixed),
        "torch_stream": Served("torch", dtype, (), decoupled=True),
    }


def installed(configs: dict[str, Served]) -> dict[str, Served]:
    """`configs` without those whose engine is not installed: the GPU machine lacks CTranslate2 unless its wheel is
    carried there, and the torch rows are still worth their run."""
    missing = {served.engine for served in configs.values() if importlib.util.find_spec(served.engine) is None}
    for engine in sorted(missing):
        print(f"{engine} is not installed: no {engine} rows", file=sys.stderr)
    return {key: served for key, served in configs.items() if served.engine not in missing}


# ------------------------------------------------------------------------------------------------- tests


def gpu_tests(dry_run: bool, timeout: float) -> str:
    """`pytest -m gpu` over the test files that hold GPU tests (only collected in a dry run); its summary line."""
    files = sorted(str(path.relative_to(REPO_ROOT)) for path in (REPO_ROOT / "tests").rglob("test_*.py")
                   if "mark.gpu" in path.read_text(encoding="utf-8"))
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", *files]
    if dry_run:
        command.append("--collect-only")
    print(f"GPU tests: {' '.join(command[1:])}", file=sys.stderr)
    try:
        result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return f"pytest -m gpu did not finish within {timeout:.0f} s"
    output = (result.stdout + result.stderr).strip().splitlines()
    if result.returncode not in (0, 5):  # 5: nothing collected
        print("\n".join(output[-60:]), file=sys.stderr)
    return f"{output[-1] if output else 'no output'} (exit status {result.returncode})"


# ------------------------------------------------------------------------------------------------ models


def prepare(name: str, shape: Any, workdir: Path, configs: dict[str, Served], on_gpu: bool) -> Model:
    """The random-weight model (end id silenced) and its served configurations, KIND_GPU on a GPU."""
    import transformers
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    from tests.support.generation_models import build_generation_model
    from transerve.convert.command import convert

    folder = workdir / name
    hf_dir, repository = folder / "hf", folder / "repository"
    shutil.rmtree(folder, ignore_errors=True)
    print(f"building {shape.title} in {folder}...", file=sys.stderr)
    build_generation_model(shape.architecture, hf_dir, d_model=shape.sizes["d_model"], layers=shape.sizes["layers"],
                           vocab_size=shape.sizes["vocab_size"], config=shape.config)
    end_id = shape.sizes["vocab_size"] - 1
    silence_token(hf_dir, end_id)
    config = transformers.AutoConfig.from_pretrained(hf_dir)
    for key, served in configs.items():
        model_name = served_name(name, key)
        with contextlib.redirect_stdout(sys.stderr):  # its progress: stdout is the report's
            written = convert(hf_dir, repository, served.engine, served.quantization, model_name, max_batch_size=8,
                              decoupled=served.decoupled)
        for extra in written[1:]:  # the tokenizer, detokenizer and text ensemble: not measured here
            shutil.rmtree(repository / extra)
        path = repository / model_name / "config.pbtxt"
        for parameter, value in served.parameters:
            set_parameter(path, parameter, value)
        model_config = text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
        del model_config.instance_group[:]
        group = model_config.instance_group.add(count=1)
        kinds = model_config_pb2.ModelInstanceGroup
        group.kind = kinds.KIND_GPU if on_gpu else kinds.KIND_CPU
        if on_gpu:
            group.gpus.append(0)
        path.write_text(text_format.MessageToString(model_config))
    pad = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
    return Model(name, shape, hf_dir, repository, bool(config.is_encoder_decoder), eos_id=int(config.eos_token_id),
                 pad_id=int(pad), end_id=end_id)


def served_name(model: str, key: str) -> str:
    """`t5_ct2_float16` for `served_ct2_float16`: also where `ceiling_ct2` finds the converted model."""
    return f"{model}_{key.removeprefix('served_')}"


# ----------------------------------------------------------------------------------------------- engines


def engine_alone(model: Model, requests: list[Request], scheduling: str, rows: int, device: str, dtype: str,
                 warmup: float, duration: float, profile: bool = False, graphs: bool = True) -> Measured:
    """The torch engine in process, `rows` rows and as many sequences in a closed loop; the asked tokens of
    sequences completed inside the window count (a short one is an error). `profile`: the window's decoding
    steps run under torch's profiler (`profiled`), whose tables go to stderr: where a step's time goes, not a row
    to report. `graphs`: the engine's default steps (CUDA graphs on a GPU), else eager ones."""
    from transerve.backends.generation.engine import DecodingOptions, GenerationRequest
    from transerve.backends.generation.torch.engine import TorchEngine
    from transerve.backends.generation.torch.static_scheduling import scheduling_named

    engine = TorchEngine(model.hf_dir, device=device, compute_type=dtype, max_batch_rows=rows,
                         scheduling=scheduling_named(scheduling) if scheduling != "inflight" else None,
                         static_steps=None if graphs else False)
    suffix = "" if graphs else "_eager"
    measured = Measured(model.name, f"engine_{scheduling}{suffix}", f"engine alone, {scheduling}{suffix}")
    lock = threading.Lock()
    stop = threading.Event()
    window: list[float] = []
    order = iter(requests * 1000)

    def start() -> None:
        with lock:
            request = next(order)
        options = DecodingOptions(max_new_tokens=request.new_tokens, end_ids=[])
        sent = time.perf_counter()
        engine.submit(GenerationRequest(list(request.prompt), options), None,
                      lambda result: done(result, request.new_tokens, sent))

    def done(result: Any, asked: int, sent: float) -> None:
        ended = time.perf_counter()
        with lock:
            if window and window[0] <= ended <= window[1]:
                produced = len(result.hypotheses[0].token_ids) if hasattr(result, "hypotheses") else -1
                measured.errors += int(produced != asked)
                measured.tokens += max(produced, 0)
                measured.latencies_ms.append((ended - sent) * 1000)
                measured.lengths.append(asked)
        if not stop.is_set():
            start()

    try:
        for _ in range(rows):
            start()
        time.sleep(warmup)
        with lock:
            window[:] = [time.perf_counter(), time.perf_counter() + duration]
        with profiled(profile, device, f"{model.name}, engine alone, {scheduling}, {rows} rows, {duration:g} s"):
            time.sleep(duration)
        stop.set()
        measured.seconds = duration
        steps = engine.runner.forward.graphs
        if steps is not None:
            print(f"  steps: {len(steps.graphs)} shapes kept"
                  f"{', recorded as CUDA graphs' if steps.capture else ', eager'}"
                  f"{'; turned off: ' + steps.off if steps.off else ''}", file=sys.stderr)
    finally:
        stop.set()
        engine.close()
        engine.join(30)
    return measured


@contextlib.contextmanager
def profiled(enabled: bool, device: str, title: str) -> Any:
    """When `enabled`, the engine thread's decoding steps during the block run under torch's profiler (it records
    the thread it starts on, so it starts and stops inside `BatchRunner.step`, on the engine thread): the ops by
    their own CPU time and by device time, and the share of the profiled steps' wall time the device computed (on
    a GPU, the idle share is what per-step CPU work costs). Joining work on the joining thread is left out of the
    CPU table; its kernels count in the device's."""
    if not enabled:
        yield
        return
    import torch
    from torch.profiler import ProfilerActivity

    from transerve.backends.generation.torch.batch_runner import BatchRunner

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    original = BatchRunner.step
    state: dict[str, Any] = {"profiler": None, "started": 0.0, "stop": False, "wall": 0.0}
    finished = threading.Event()

    def step(runner: BatchRunner, plan: Any) -> Any:
        if state["profiler"] is None and not finished.is_set():
            state["profiler"] = torch.profiler.profile(activities=activities)
            state["profiler"].__enter__()
            state["started"] = time.perf_counter()
        result = original(runner, plan)
        if state["stop"] and state["profiler"] is not None and not finished.is_set():
            if device == "cuda":
                torch.cuda.synchronize()
            state["wall"] = time.perf_counter() - state["started"]
            state["profiler"].__exit__(None, None, None)
            finished.set()
        return result

    BatchRunner.step = step  # type: ignore[method-assign]
    try:
        yield
        state["stop"] = True
        finished.wait(60)
    finally:
        BatchRunner.step = original  # type: ignore[method-assign]
    if not finished.is_set():
        print(f"profile: {title}: no decoding step ran", file=sys.stderr)
        return
    averages = state["profiler"].key_averages()
    print(f"\nprofile: {title}", file=sys.stderr)
    print(averages.table(sort_by="self_cpu_time_total", row_limit=25), file=sys.stderr)
    if device == "cuda":
        print(averages.table(sort_by="self_device_time_total", row_limit=15), file=sys.stderr)
        busy = sum(event.self_device_time_total for event in averages) / 1e6
        print(f"device busy {busy:.3f} s of {state['wall']:.3f} s ({100 * busy / state['wall']:.0f}%)",
              file=sys.stderr)


def generate_rows(model: Model, requests: list[Request], rows: int, device: str, dtype: str) -> list[Measured]:
    """transformers' static batches of `rows`, with cuDNN's attention on and off; the faster first, as the
    baseline row."""
    import torch

    from benchmarks.generation import ceiling_transformers

    measured = []
    for enabled, key in ((True, "generate_rows_cudnn"), (False, "generate_rows_no_cudnn")):
        torch.backends.cuda.enable_cudnn_sdp(enabled)
        row = ceiling_transformers(model, requests, rows, 1, 0.0, 0.0, device, dtype)
        row.key = key
        measured.append(row)
    best = max(measured, key=lambda row: row.rate)
    faster = Measured(model.name, "generate_rows", best.label, best.tokens, best.seconds, errors=best.errors)
    return [faster, *measured]


# ------------------------------------------------------------------------------------------------ served


def repository_index(base_url: str) -> dict[str, dict[str, str]]:
    request = urllib.request.Request(f"{base_url}/v2/repository/index", data=b"{}", method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        return {entry["name"]: entry for entry in json.loads(response.read())}


def serve(args: argparse.Namespace, models: list[Model], loads: dict[str, list[Request]], configs: dict[str, Served],
          workdir: Path) -> tuple[list[Measured], list[FirstToken], list[str]]:
    """Every model's served configurations from one transerve: their rows, time to first token, and notes (what
    did not load, and why)."""
    from benchmarks.common.servers import start_transerve
    from benchmarks.generation import drive, time_to_first_token

    repository = workdir / "served"
    shutil.rmtree(repository, ignore_errors=True)
    repository.mkdir()
    for model in models:
        for key in configs:
            (repository / served_name(model.name, key)).symlink_to(model.repository / served_name(model.name, key))
    rows: list[Measured] = []
    ttft: list[FirstToken] = []
    notes: list[str] = []
    print(f"starting transerve with {len(models) * len(configs)} models...", file=sys.stderr)
    with start_transerve(repository, "--strict-readiness=false", ready_timeout=600.0) as process:
        index = repository_index(process.base_url)
        for model in models:
            for key in configs:
                name = served_name(model.name, key)
                state = index.get(name, {})
                if state.get("state") != "READY":
                    notes.append(f"{name}: {state.get('state', 'missing')}: {state.get('reason', '')}")
                    continue
                if key == "torch_stream":
                    measured_ttft = FirstToken(model.name, "ttft", "served, torch engine, in-flight, streaming")
                    asyncio.run(time_to_first_token(process.grpc_url, name, loads[model.name][:args.ttft_requests + 1],
                                                    model.end_id, args.ttft_tokens, measured_ttft))
                    print(f"  {name}: time to first token p50 {measured_ttft.percentile(50):.1f} ms", file=sys.stderr)
                    ttft.append(measured_ttft)
                    continue
                measured = Measured(model.name, key, key)
                asyncio.run(drive(f"{process.base_url}/v2/models/{name}/infer", loads[model.name], model.end_id,
                                  args.clients, args.warmup, args.duration, measured))
                print(f"  {name}: {measured.rate:.0f} tokens/s, errors {measured.errors}", file=sys.stderr)
                rows.append(measured)
    return rows, ttft, notes


# ------------------------------------------------------------------------------------------------ report


def table(results: dict[str, dict[str, Measured]], labels: dict[str, str]) -> str:
    models = list(results)
    titles = {"t5": "t5-small shape", "gpt2": "GPT-2 small shape"}
    lines = [f"| | {' | '.join(titles.get(m, m) for m in models)} |", f"|---|{'---:|' * len(models)}"]
    for key, _ in ROWS:
        cells = []
        for model in models:
            row = results[model].get(key)
            cells.append("" if row is None else f"{row.rate:,.0f}" + (f" ({row.errors} errors)" if row.errors else ""))
        if any(cells):
            lines.append(f"| {labels[key]} | {' | '.join(cells)} |")
    return "\n".join(lines)


def goals(results: dict[str, dict[str, Measured]], ttft: list[FirstToken], rows: int) -> str:
    lines = ["| goal | model | measured | met |", "|---|---|---:|---|"]

    def ratio(model: str, top: str, bottom: str) -> float | None:
        upper, lower = results[model].get(top), results[model].get(bottom)
        return upper.rate / lower.rate if upper and lower and lower.rate else None

    checks = (
        (f"served in-flight ({rows} rows) >= 3x transformers' static batch {rows}", "served_inflight_rows",
         "generate_rows", 3.0),
        ("served in-flight >= 1.3x the engine's static scheduling, served", "served_inflight_rows",
         "served_static_rows", 1.3),
        (f"CTranslate2 float16 served >= 90% of generate_batch at batch {rows}", "served_ct2_float16",
         "direct_ct2_float16", 0.9),
    )
    for model in results:
        for goal, top, bottom, target in checks:
            value = ratio(model, top, bottom)
            if value is not None:
                lines.append(f"| {goal} | {model} | {value:.2f}x | {'yes' if value >= target else 'no'} |")
    for row in ttft:
        p50 = row.percentile(50)
        lines.append(f"| time to first token p50 < 15 ms at concurrency 1 | {row.model} | {p50:.1f} ms | "
                     f"{'yes' if p50 < 15 else 'no'} |")
    return "\n".join(lines)


def machine(device: str) -> str:
    import torch

    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "no GPU (dry run on the CPU)"
    versions = ", ".join(f"{package} {_version(package)}" for package in ("torch", "transformers", "ctranslate2"))
    return f"{gpu}; {versions}; Python {platform.python_version()}; commit {commit()}"


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


# -------------------------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true",
                        help="on the CPU: tiny models, float32, short runs, the GPU tests only collected")
    parser.add_argument("--skip-tests", action="store_true", help="the benchmark alone")
    parser.add_argument("--models", default="t5,gpt2")
    parser.add_argument("--rows", type=int, default=64, help="max_batch_rows, static batch and engine sequences")
    parser.add_argument("--small-batch", type=int, default=16, help="the smaller static batch of transformers")
    parser.add_argument("--clients", type=int, default=64, help="closed-loop HTTP clients of the served rows")
    parser.add_argument("--baseline-threads", type=int, default=16, help="threads of transformers per request")
    parser.add_argument("--requests", type=int, default=256, help="requests in the load (seeded)")
    parser.add_argument("--static-requests", type=int, default=128, help="of those, how many the static batches run")
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds of each closed-loop row")
    parser.add_argument("--warmup", type=float, default=1.5, help="uncounted seconds before each closed-loop row")
    parser.add_argument("--ttft-requests", type=int, default=10)
    parser.add_argument("--ttft-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--tests-timeout", type=float, default=240.0)
    parser.add_argument("--workdir", type=Path, help="build the models here (default: a temporary folder)")
    parser.add_argument("--profile", type=float, default=0.0, metavar="SECONDS",
                        help="after the engine-alone rows, profile SECONDS of each model's engine in-flight")
    add_json_option(parser)
    if "--dry-run" in sys.argv[1:]:  # smaller defaults; options given explicitly still win
        parser.set_defaults(rows=8, small_batch=4, clients=8, baseline_threads=2, requests=24, static_requests=16,
                            duration=1.0, warmup=0.5, ttft_requests=2, ttft_tokens=4)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here (torch.cuda.is_available() is False): --dry-run checks the script on the "
                         "CPU")
    dtype = "float32" if args.dry_run else "float16"
    shapes = QUICK_SHAPES if args.dry_run else SHAPES
    started = datetime.datetime.now(datetime.timezone.utc)
    tests = "skipped" if args.skip_tests else gpu_tests(args.dry_run, args.tests_timeout)
    print(f"GPU tests: {tests}", file=sys.stderr)
    configs = installed(served_configs(args.rows, dtype))
    ct2 = any(served.engine == "ctranslate2" for served in configs.values())
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        workdir = args.workdir or Path(scratch)
        models = [prepare(name, shapes[name], workdir, configs, device == "cuda") for name in args.models.split(",")]
        loads = {model.name: make_load(args.requests, args.seed, model) for model in models}
        results: dict[str, dict[str, Measured]] = {model.name: {} for model in models}
        for model in models:  # before any torch engine: loading one turns cuDNN's attention off
            load, static = loads[model.name], loads[model.name][:args.static_requests]
            print(f"{model.name}: transformers and CTranslate2 called directly...", file=sys.stderr)
            for row in generate_rows(model, static, args.rows, device, dtype):
                results[model.name][row.key] = row
            from benchmarks.generation import baseline, ceiling_transformers

            small = ceiling_transformers(model, static, args.small_batch, 1, 0.0, 0.0, device, dtype)
            results[model.name]["generate_small"] = small
            results[model.name]["per_request"] = baseline(model, load, args.baseline_threads, torch.get_num_threads(),
                                                          args.warmup, args.duration, device, dtype)
            for precision in CT2_TYPES if ct2 else ():
                try:
                    row = ceiling_ct2(model, precision, static, args.rows, 0, 1, 0.0, 0.0, device=device)
                except RuntimeError as exc:  # CTranslate2 without its CUDA libraries: the served rows say why too
                    print(f"  CTranslate2 {precision} called directly failed: {exc}", file=sys.stderr)
                    continue
                results[model.name][f"direct_ct2_{precision}"] = row
        attention: dict[str, list[str]] = {}
        for model in models:
            print(f"{model.name}: the torch engine alone...", file=sys.stderr)
            for scheduling, graphs in (("inflight", True), ("inflight", False), ("static", True)):
                row = engine_alone(model, loads[model.name], scheduling, args.rows, device, dtype, args.warmup,
                                   args.duration, graphs=graphs)
                print(f"  {row.key}: {row.rate:.0f} tokens/s, errors {row.errors}", file=sys.stderr)
                results[model.name][row.key] = row
            with attention_calls() as report:  # a short run of its own: the recording costs host time per call
                engine_alone(model, loads[model.name], "inflight", args.rows, device, dtype, 0.5, 1.0)
            attention[model.name] = report.lines()
            print(f"{model.name}: attention kernels by call (engine alone, in-flight, {args.rows} rows)\n  "
                  + "\n  ".join(attention[model.name]), file=sys.stderr)
            if args.profile:
                engine_alone(model, loads[model.name], "inflight", args.rows, device, dtype, args.warmup,
                             args.profile, profile=True)
        served, ttft, notes = serve(args, models, loads, configs, workdir)
    for row in served:
        results[row.model][row.key] = row
    labels = {key: label.format(rows=args.rows, clients=args.clients, small=args.small_batch,
                                threads=args.baseline_threads) for key, label in ROWS}
    finished = datetime.datetime.now(datetime.timezone.utc)
    print(f"\n{started:%Y-%m-%d %H:%M}-{finished:%H:%M} UTC, {machine(device)}; {dtype}; {args.requests} requests "
          f"(static batches: {args.static_requests} of them), closed-loop rows {args.duration:g} s after "
          f"{args.warmup:g} s warm-ups; tokens/s\n")
    print(table(results, labels))
    if ttft:
        print("\nTime to first token at concurrency 1, gRPC streaming, torch engine in-flight: "
              + ", ".join(f"{row.model} p50 {row.percentile(50):.1f} ms" for row in ttft))
    print("\nGoals (issue 22)\n")
    print(goals(results, ttft, args.rows))
    print(f"\nGPU tests: {tests}")
    for note in notes:
        print(f"not served: {note}")
    write_json(args.json, "gpu_check", {"started": started.isoformat(), "machine": machine(device), "tests": tests,
                                        "results": [row for rows in results.values() for row in rows.values()],
                                        "ttft": ttft, "not_served": notes, "attention_kernels": attention}, args)


if __name__ == "__main__":
    main()
