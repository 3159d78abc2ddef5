"""Text generation: transerve's generation backend (CTranslate2 and torch engines) against the engine called
directly (the ceiling) and against transformers' `generate` called per request from a thread pool (the baseline),
on random-weight models of t5-small shape (d_model 512, 6+6 layers, vocab 32128) and GPT-2 small shape.

    pip install -e '.[bench,test]'                         # torch, transformers, ctranslate2, aiohttp, matplotlib
    python -m benchmarks.generation --plot benchmarks/generation.png
    python -m benchmarks.generation --quick                # tiny models, short runs: checks the script in a minute

Parts (`--parts`, all by default), each for every model (`--models t5,gpt2`), in one run:

- `ceiling`: CTranslate2's `translate_batch`/`generate_batch` called directly, batch 16, float32 and int8, on the
  models `transerve convert` wrote; and transformers' `generate` at batch 16, the torch engine's counterpart.
- `baseline`: transformers' `generate` called per request (batch 1) from a pool of threads (`--baseline-threads`).
- `served`: transerve serving the converted models, CTranslate2 float32 and int8, the torch engine with in-flight
  and with request-level scheduling two ways (finished rows leave the batch at once, or decode on until the batch
  ends as FasterTransformer's backend and transformers' `generate` do), under `--concurrency` closed-loop HTTP
  clients.
- `ttft`: time to first token at concurrency 1 over gRPC ModelStreamInfer on decoupled copies of the configs.

The load: `--requests` prompts of 8 to 64 token ids (seeded), each asking for 8 to 128 new tokens (uniform,
seeded). Every request must get exactly what it asked for, so the end token of every request (`end_id`, and
`eos_token_id` for transformers) is an id the model never picks: the benchmark scales that vocabulary entry's
output row down to nearly zero, so its logit is about 0 while the best of the others is far above. That keeps
end-of-sequence out without `min_length` (which CTranslate2 takes per call, so requests asking for different
minimums could not share a batch). Every response's length is checked; a short one counts as an error.

The ceiling decodes the requests sorted by length in batches of 16, each batch as long as its longest request,
and counts every token produced (the engine's own rate, padding included); the served rows count the tokens
asked for, from requests that completed inside the measured window. The baseline counts the tokens transformers
produced inside the window (a logits processor timestamps each step), so its long requests count too.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.util
import itertools
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common.generation_models import (
    NEW_TOKENS,
    PROMPT_LENGTHS,
    QUICK_SHAPES,
    SERVED,
    SHAPES,
    STREAMED,
    FirstToken,
    Measured,
    Model,
    Request,
    batches,
    best_of,
    ceiling_ct2,
    make_load,
    prepare_model,
    set_parameter,
    ttft_direct_ct2,
)
from benchmarks.common.machine import OtherWork, wait_for_quiet
from benchmarks.common.results import add_json_option, commit, write_json
from transerve.backends.generation.ctranslate2.engine import threads_per_call

PARTS = ("ceiling", "baseline", "served", "ttft")
LABELS = {
    "ct2_float32": "served: CTranslate2 float32",
    "ct2_int8": "served: CTranslate2 int8",
    "torch_inflight": "served: torch, in-flight batching",
    "torch_request": "served: torch, request-level batching (finished rows leave)",
    "torch_static": "served: torch, request-level batching (finished rows decode on, as FT and generate)",
    "ct2_float32_stream": "CTranslate2 float32",
    "ct2_int8_stream": "CTranslate2 int8",
    "torch_inflight_stream": "torch, in-flight",
}
def ceiling_transformers(model: Model, requests: list[Request], batch: int, rounds: int, quiet: float,
                         patience: float, device: str = "cpu", dtype: str = "float32") -> Measured:
    """transformers' generate on the same batches (T5 padded right, GPT-2 left, with attention masks), on `device`
    in `dtype` (benchmarks.gpu_check runs it on a GPU)."""
    import torch

    hf = load_transformers(model, device, dtype)
    groups = []
    for group in batches(requests, batch):
        width = max(len(r.prompt) for r in group)
        pads = [[model.pad_id] * (width - len(r.prompt)) for r in group]
        rows = [list(r.prompt) + pad if model.encoder_decoder else pad + list(r.prompt) for r, pad in
                zip(group, pads, strict=True)]
        mask = [[int(i < len(r.prompt)) if model.encoder_decoder else int(i >= width - len(r.prompt))
                 for i in range(width)] for r in group]
        groups.append((torch.tensor(rows, device=device), torch.tensor(mask, device=device),
                       max(r.new_tokens for r in group)))

    def decode(ids: Any, mask: Any, length: int) -> int:
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=length, do_sample=False,
                              num_beams=1, eos_token_id=model.end_id, pad_token_id=model.pad_id)
        produced = out.shape[1] - (1 if model.encoder_decoder else ids.shape[1])
        return produced * ids.shape[0]

    decode(groups[0][0][:2], groups[0][1][:2], 4)
    return best_of(rounds, quiet, patience, model, "ceiling_transformers", f"transformers generate, batch {batch}",
                   lambda: sum(decode(*group) for group in groups),
                   sum(group[0].shape[0] * group[2] for group in groups))

def load_transformers(model: Model, device: str = "cpu", dtype: str = "float32") -> Any:
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    auto = transformers.AutoModelForSeq2SeqLM if model.encoder_decoder else transformers.AutoModelForCausalLM
    return auto.from_pretrained(model.hf_dir, dtype=getattr(torch, dtype)).to(device).eval()


# ---------------------------------------------------------------------------------------------- baseline


def baseline(model: Model, requests: list[Request], threads: int, torch_threads: int, warmup: float,
             duration: float, device: str = "cpu", dtype: str = "float32") -> Measured:
    """transformers' generate per request (batch 1) from `threads` threads in a closed loop, torch running
    `torch_threads` intra-op threads; the tokens produced inside the window count (each decoding step is
    timestamped), and requests completed inside it give latencies."""
    import torch
    import transformers

    torch.set_num_threads(torch_threads)
    hf = load_transformers(model, device, dtype)
    steps: list[float] = []
    stop = threading.Event()

    class Count(transformers.LogitsProcessor):
        def __call__(self, input_ids: Any, scores: Any) -> Any:
            steps.append(time.perf_counter())  # one new token for a batch of one
            return scores

    class Stop(transformers.StoppingCriteria):
        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            return torch.full((input_ids.shape[0],), stop.is_set(), dtype=torch.bool, device=input_ids.device)

    processors = transformers.LogitsProcessorList([Count()])
    criteria = transformers.StoppingCriteriaList([Stop()])
    lock = threading.Lock()
    order = itertools.cycle(requests)
    finished: list[tuple[float, float, int, int]] = []  # (end, latency s, asked, produced)

    def worker() -> None:
        while not stop.is_set():
            with lock:
                request = next(order)
            ids = torch.tensor([request.prompt], device=device)
            started = time.perf_counter()
            with torch.inference_mode():
                out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=request.new_tokens,
                                  do_sample=False, num_beams=1, eos_token_id=model.end_id, pad_token_id=model.pad_id,
                                  logits_processor=processors, stopping_criteria=criteria)
            ended = time.perf_counter()
            produced = out.shape[1] - (1 if model.encoder_decoder else ids.shape[1])
            finished.append((ended, ended - started, request.new_tokens, produced))

    hf.generate(input_ids=torch.tensor([requests[0].prompt], device=device), max_new_tokens=2,
                eos_token_id=model.end_id, pad_token_id=model.pad_id)  # warm-up
    pool = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
    begin = time.perf_counter()
    for thread in pool:
        thread.start()
    start, end = begin + warmup, begin + warmup + duration
    time.sleep(max(0.0, end - time.perf_counter()))
    stop.set()
    for thread in pool:
        thread.join()
    result = Measured(model.name, f"baseline_{threads}x{torch_threads}",
                      f"transformers generate per request, {threads} threads x {torch_threads} torch threads")
    result.tokens = sum(1 for t in steps if start <= t <= end)
    result.seconds = duration
    for ended, latency, asked, produced in finished:
        if start <= ended - latency and ended <= end:
            result.latencies_ms.append(latency * 1000)
            result.lengths.append(asked)
            result.errors += int(produced != asked)
    return result


# ------------------------------------------------------------------------------------------------ served


def infer_body(request: Request, end_id: int) -> bytes:
    return json.dumps({
        "inputs": [
            {"name": "input_ids", "shape": [1, len(request.prompt)], "datatype": "UINT32",
             "data": list(request.prompt)},
            {"name": "sequence_length", "shape": [1, 1], "datatype": "UINT32", "data": [len(request.prompt)]},
        ],
        "parameters": {"max_new_tokens": request.new_tokens, "end_id": end_id},
        "outputs": [{"name": "output_ids"}, {"name": "sequence_length"}, {"name": "prefix_length"}],
    }).encode()


def new_tokens(response: dict[str, Any]) -> int:
    """Tokens generated: the output length less what the client already had (the prompt, for GPT-2)."""
    outputs = {output["name"]: output["data"] for output in response["outputs"]}
    return int(outputs["sequence_length"][0]) - int(outputs["prefix_length"][0])


async def drive(url: str, requests: list[Request], end_id: int, concurrency: int, warmup: float, duration: float,
                result: Measured) -> None:
    """`concurrency` closed-loop clients; requests completed inside the window count (their tokens and latency)."""
    import aiohttp

    bodies = [(infer_body(r, end_id), r.new_tokens) for r in requests]
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=900)
    headers = {"Content-Type": "application/json"}
    loop = asyncio.get_running_loop()
    start = loop.time() + warmup
    end = start + duration
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def client(offset: int) -> None:
            index = offset
            while (sent := loop.time()) < end:
                body, asked = bodies[index % len(bodies)]
                index += concurrency
                async with session.post(url, data=body, headers=headers) as response:
                    data = await response.read()
                    status = response.status
                done = loop.time()
                if not start <= done <= end:
                    continue
                if status != 200:
                    result.errors += 1
                    if result.errors == 1:
                        print(f"  HTTP {status}: {data[:300]!r}", file=sys.stderr)
                    continue
                produced = new_tokens(json.loads(data))
                result.errors += int(produced != asked)
                result.tokens += produced
                result.latencies_ms.append((done - sent) * 1000)
                result.lengths.append(asked)

        await asyncio.gather(*(client(i * 7919 % len(bodies)) for i in range(concurrency)))
    result.seconds = duration


async def time_to_first_token(grpc_url: str, model_name: str, requests: list[Request], end_id: int, new: int,
                              result: FirstToken) -> None:
    """Requests one after another on one ModelStreamInfer stream, `new` tokens each: the time from sending a
    request to its first response with a token, and per token after that. The first request is not counted (it
    opens the stream)."""
    import tritonclient.grpc.aio as grpcclient

    queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

    async def outgoing():
        while (item := await queue.get()) is not None:
            yield item

    client = grpcclient.InferenceServerClient(grpc_url)
    try:
        responses = client.stream_infer(outgoing()).__aiter__()
        for index, request in enumerate(requests):
            ids = np.array([request.prompt], dtype=np.uint32)
            inputs = [grpcclient.InferInput("input_ids", list(ids.shape), "UINT32"),
                      grpcclient.InferInput("sequence_length", [1, 1], "UINT32")]
            inputs[0].set_data_from_numpy(ids)
            inputs[1].set_data_from_numpy(np.array([[ids.shape[1]]], dtype=np.uint32))
            outputs = [grpcclient.InferRequestedOutput(name) for name in ("sequence_length", "prefix_length")]
            request_id = f"ttft-{index}"
            sent = time.perf_counter()
            await queue.put({"model_name": model_name, "inputs": inputs, "outputs": outputs, "request_id": request_id,
                             "parameters": {"max_new_tokens": new, "end_id": end_id, "stream": True}})
            got, first = 0, None
            while got < new:
                answer, error = await responses.__anext__()
                if error is not None:
                    raise SystemExit(f"{model_name}: stream error: {error}")
                if answer.get_response().id != request_id:
                    continue  # a trailing empty final response of the previous request
                got += int(answer.as_numpy("sequence_length").reshape(-1)[0]) - int(
                    answer.as_numpy("prefix_length").reshape(-1)[0])
                if got and first is None:
                    first = time.perf_counter()
            last = time.perf_counter()
            if index:
                result.ttft_ms.append((first - sent) * 1000)
                result.per_token_ms.append((last - first) * 1000 / max(new - 1, 1))
        await queue.put(None)
    finally:
        await client.close()

# ------------------------------------------------------------------------------------------------ report


def precision_of(key: str) -> str:
    return "int8" if "int8" in key else "float32"


def best_ceiling(rows: list[Measured], precision: str, calls: str = "t") -> float:
    """The fastest CTranslate2 ceiling at `precision`: of one call at a time (the issue's ceiling, `calls` "t": the
    best of its thread settings), or of several calls at once (`calls` "c")."""
    return max((r.rate for r in rows if r.key.startswith(f"ceiling_{precision}_{calls}")), default=0.0)


def throughput_table(model: Model, rows: list[Measured]) -> str:
    baselines = [r.rate for r in rows if r.key.startswith("baseline_")]
    best_baseline = max(baselines, default=0.0)
    lines = [
        "| configuration | tokens/s | p50 ms | p99 ms | vs CT2 ceiling | vs baseline | errors | other work |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        precision = precision_of(row.key)
        ceiling = best_ceiling(rows, precision)
        own = row.key.startswith(("ceiling_float32", "ceiling_int8"))
        vs_ceiling = f"{row.rate / ceiling:.0%} of {precision}" if ceiling and not own else ""
        several = best_ceiling(rows, precision, "c")
        if several and row.key.startswith("ct2_"):
            vs_ceiling += f"; {row.rate / several:.0%} of calls at once"
        vs_baseline = f"{row.rate / best_baseline:.2f}x" if best_baseline and not row.key.startswith("baseline") \
            else ""
        latency = (f"{row.percentile(50):.0f} | {row.percentile(99):.0f}" if row.latencies_ms else " | ")
        lines.append(f"| {row.label} | {row.rate:.1f} | {latency} | {vs_ceiling} | {vs_baseline} | {row.errors} | "
                     f"{row.background:.2f} cores |")
    return "\n".join(lines)


def ttft_table(rows: list[FirstToken]) -> str:
    lines = ["| model | configuration | TTFT p50 ms | TTFT p99 ms | ms per later token (p50) | requests |",
             "|---|---|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row.model} | {row.label} | {row.percentile(50):.1f} | {row.percentile(99):.1f} | "
                     f"{np.percentile(row.per_token_ms, 50):.1f} | {len(row.ttft_ms)} |")
    return "\n".join(lines)


def goals(results: dict[str, dict[str, Measured]], ttft: list[FirstToken]) -> str:
    lines = ["| goal | model | measured | met |", "|---|---|---:|---|"]

    def add(goal: str, model: str, value: float | None, target: float, text: str, higher: bool = True) -> None:
        if value is None:
            return
        met = value >= target if higher else value < target
        lines.append(f"| {goal} | {model} | {text} | {'yes' if met else 'no'} |")

    for model, rows in results.items():
        def rate(key: str, rows: dict[str, Measured] = rows) -> float | None:
            return rows[key].rate if key in rows and rows[key].rate else None

        for precision in ("float32", "int8"):
            served, ceiling = rate(f"ct2_{precision}"), best_ceiling(list(rows.values()), precision)
            if served and ceiling:
                add(f"served CT2 {precision} >= 90% of the CT2 {precision} ceiling", model, served / ceiling, 0.9,
                    f"{served / ceiling:.0%}")
            several = best_ceiling(list(rows.values()), precision, "c")
            if served and several:
                add(f"(stricter) served CT2 {precision} >= 90% of CT2 {precision} calls at once", model,
                    served / several, 0.9, f"{served / several:.0%}")
        baseline = max((r.rate for k, r in rows.items() if k.startswith("baseline_")), default=0.0)
        for key in ("ct2_float32", "ct2_int8", "torch_inflight"):
            if rate(key) and baseline:
                add(f"{LABELS[key]} >= 3x the transformers per-request baseline", model, rate(key) / baseline, 3.0,
                    f"{rate(key) / baseline:.2f}x")
        inflight = rate("torch_inflight")
        for key, kind in (("torch_static", "as FT and generate run it"), ("torch_request", "finished rows leave")):
            if inflight and rate(key):
                add(f"torch in-flight >= 1.5x request-level throughput ({kind})", model, inflight / rate(key), 1.5,
                    f"{inflight / rate(key):.2f}x")
    for row in ttft:
        if row.key.startswith("direct_"):
            continue
        add(f"TTFT p50 < 100 ms at concurrency 1 ({row.label})", row.model, row.percentile(50), 100.0,
            f"{row.percentile(50):.1f} ms", higher=False)
    return "\n".join(lines)


def plot(results: dict[str, dict[str, Measured]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(results)
    figure, axes = plt.subplots(len(models), 2, figsize=(13, 4.2 * len(models)), squeeze=False)
    colours = {"ceiling": "tab:grey", "baseline": "tab:red", "ct2": "tab:blue", "torch": "tab:green"}
    for (left, right), model in zip(axes, models, strict=True):
        rows = list(results[model].values())
        names = [r.label for r in rows]
        left.barh(names, [r.rate for r in rows],
                  color=[colours[next(k for k in colours if r.key.startswith(k))] for r in rows])
        for index, row in enumerate(rows):
            left.text(row.rate, index, f" {row.rate:.0f}", va="center", fontsize=8)
        left.invert_yaxis()
        left.set_xlabel("generated tokens / s")
        left.set_title(model, fontsize=10)
        left.tick_params(axis="y", labelsize=8)
        left.grid(True, axis="x", alpha=0.3)
        edges = [*range(NEW_TOKENS[0], NEW_TOKENS[1], 24), NEW_TOKENS[1] + 1]  # the last bin holds the longest
        for row in rows:
            if not row.key.startswith(("ct2", "torch")) or not row.latencies_ms:
                continue
            lengths, latencies = np.array(row.lengths), np.array(row.latencies_ms) / 1000
            centres, medians = [], []
            for low, high in itertools.pairwise(edges):
                chosen = latencies[(lengths >= low) & (lengths < high)]
                if chosen.size:
                    centres.append((low + high) / 2)
                    medians.append(float(np.median(chosen)))
            right.plot(centres, medians, marker="o", label=row.label.removeprefix("served: "),
                       linestyle="--" if row.key in ("torch_request", "torch_static") else "-")
        right.set_xlabel("new tokens asked for (bins of 24)")
        right.set_ylabel("median request latency (s)")
        right.set_title(f"{model}: latency against output length", fontsize=10)
        right.grid(True, alpha=0.3)
        right.legend(fontsize=8)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


# -------------------------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"what to measure, of {', '.join(PARTS)}")
    parser.add_argument("--models", default="t5,gpt2")
    parser.add_argument("--quick", action="store_true", help="tiny models and short runs: a check of the script")
    parser.add_argument("--duration", type=float, default=30.0, help="measured seconds per served run")
    parser.add_argument("--baseline-duration", type=float, default=20.0, help="measured seconds per baseline run")
    parser.add_argument("--warmup", type=float, default=10.0, help="uncounted seconds before each run")
    parser.add_argument("--rounds", type=int, default=1, help="served and baseline runs per configuration, pooled")
    parser.add_argument("--ceiling-rounds", type=int, default=2, help="passes of the ceilings; the best counts")
    parser.add_argument("--requests", type=int, default=256, help="requests in the load (seeded)")
    parser.add_argument("--ceiling-requests", type=int, default=64, help="of those, how many the ceilings decode")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--batch", type=int, default=16, help="batch size of the ceilings")
    parser.add_argument("--concurrency", type=int, default=32, help="closed-loop clients of the served runs")
    parser.add_argument("--configs", default=",".join(suffix for suffix, *_ in SERVED),
                        help="served configurations (their decoupled copies give the time to first token)")
    parser.add_argument("--baseline-threads", default="4,32", help="thread pool sizes of the baseline")
    parser.add_argument("--engine-threads", default="0,1",
                        help="CTranslate2 intra_threads of the ceiling, one row each (0: its default)")
    parser.add_argument("--baseline-torch-threads", default="0",
                        help="torch intra-op threads of the baseline, one run each (0: torch's default)")
    parser.add_argument("--ct2-threads", type=int, default=0,
                        help="intra_op_threads of the served CTranslate2 configs (0: the engine's default, the cores "
                             "divided among its --ct2-calls calls)")
    parser.add_argument("--ceiling-calls", type=int, default=2,
                        help="also a CTranslate2 ceiling with this many calls at once, the cores divided among them "
                             "(0 or 1: none)")
    parser.add_argument("--ct2-calls", type=int, default=2,
                        help="max_concurrent_calls of the served CTranslate2 configs (1: one call at a time)")
    parser.add_argument("--torch-threads", type=int, default=0,
                        help="intra_op_threads of the served torch configs (0: the engine's default; as above)")
    parser.add_argument("--ttft-requests", type=int, default=20)
    parser.add_argument("--ttft-tokens", type=int, default=16, help="new tokens per time-to-first-token request")
    parser.add_argument("--quiet", type=float, default=0.3,
                        help="before each run, wait until other processes use at most this many cores...")
    parser.add_argument("--patience", type=float, default=60.0, help="...but no longer than this many seconds")
    parser.add_argument("--workdir", type=Path, help="keep the built and converted models here for the next run")
    parser.add_argument("--plot", type=Path, help="save a PNG of throughput and latency against length here")
    add_json_option(parser)
    if "--quick" in sys.argv[1:]:  # smaller defaults; options given explicitly still win
        parser.set_defaults(duration=4.0, baseline_duration=4.0, warmup=2.0, requests=48, ceiling_requests=16,
                            ceiling_rounds=1, ttft_requests=3, baseline_threads="2", patience=5.0)
    args = parser.parse_args()
    missing = [name for name in ("torch", "transformers", "ctranslate2", "aiohttp", "matplotlib", "psutil")
               if importlib.util.find_spec(name) is None]
    if missing:
        raise SystemExit(f"missing {', '.join(missing)}: run  pip install -e '.[bench,test]'  first")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, stopping the server this started
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise SystemExit(f"unknown parts {sorted(unknown)}: choose from {', '.join(PARTS)}")
    shapes = QUICK_SHAPES if args.quick else SHAPES
    import torch

    torch_default = torch.get_num_threads()
    started = datetime.datetime.now(datetime.timezone.utc)
    load_before = os.getloadavg()[0]
    with ExitStack() as stack:
        workdir = args.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="generation-bench-")))
        workdir.mkdir(parents=True, exist_ok=True)
        models = [prepare_model(name, shapes[name], workdir) for name in args.models.split(",") if name]
        loads = {m.name: make_load(args.requests, args.seed, m) for m in models}
        results: dict[str, dict[str, Measured]] = {m.name: {} for m in models}

        def record(measured: Measured) -> None:
            rows = results[measured.model]
            if measured.key in rows:
                rows[measured.key].merge(measured)
            else:
                rows[measured.key] = measured

        for model in models:
            subset = loads[model.name][:args.ceiling_requests]
            if "ceiling" in parts:
                print(f"{model.name}: ceilings on {len(subset)} requests...", file=sys.stderr)
                torch.set_num_threads(torch_default)
                for precision in ("float32", "int8"):
                    for threads in [int(t) for t in args.engine_threads.split(",")]:
                        record(ceiling_ct2(model, precision, subset, args.batch, threads, args.ceiling_rounds,
                                           args.quiet, args.patience))
                    if args.ceiling_calls > 1:
                        record(ceiling_ct2(model, precision, subset, args.batch, threads_per_call(args.ceiling_calls),
                                           args.ceiling_rounds, args.quiet, args.patience, args.ceiling_calls))
                record(ceiling_transformers(model, subset, args.batch, args.ceiling_rounds, args.quiet,
                                            args.patience))
            if "baseline" in parts:
                pools = [int(t) for t in args.baseline_threads.split(",")]
                intra = [int(t) or torch_default for t in args.baseline_torch_threads.split(",")]
                for round_number, threads, torch_threads in itertools.product(range(args.rounds), pools, intra):
                    before = wait_for_quiet(args.quiet, args.patience)
                    print(f"{model.name}: transformers per request, {threads} threads x {torch_threads} torch "
                          f"threads (round {round_number + 1}), other work {before:.2f} cores...", file=sys.stderr)
                    with OtherWork([]) as other:
                        measured = baseline(model, loads[model.name], threads, torch_threads, args.warmup,
                                            args.baseline_duration)
                    measured.background = other.cores
                    print(f"  {measured.rate:.1f} tokens/s, p50 {measured.percentile(50):.0f} ms, errors "
                          f"{measured.errors}", file=sys.stderr)
                    record(measured)
        ttft: list[FirstToken] = []
        failed = ""
        if {"served", "ttft"} & set(parts):
            failed = serve_parts(args, parts, models, loads, record, ttft, workdir)
    finished = datetime.datetime.now(datetime.timezone.utc)
    report(args, models, results, ttft, failed, started, finished, load_before)


def serve_parts(args: argparse.Namespace, parts: list[str], models: list[Model], loads: dict[str, list[Request]],
                record: Any, ttft: list[FirstToken], workdir: Path) -> str:
    """Serve every model's configs from one transerve; return what failed ("" when nothing did)."""
    import aiohttp

    from benchmarks.common.servers import start_transerve

    repository = workdir / "served"
    shutil.rmtree(repository, ignore_errors=True)
    repository.mkdir()
    configs = [c for c in args.configs.split(",") if c]
    served = [suffix for suffix, *_ in SERVED if "served" in parts and suffix in configs]
    streamed = [suffix for suffix, *_ in STREAMED if "ttft" in parts and suffix.removesuffix("_stream") in configs]
    wanted = served + streamed
    threads = {"ctranslate2": args.ct2_threads, "torch": args.torch_threads}
    engines = {suffix: engine for suffix, engine, *_ in SERVED + STREAMED}
    for model in models:
        for suffix in wanted:  # links: one repository for the server, the models converted once per workdir
            source = model.repository / f"{model.name}_{suffix}"
            set_parameter(source / "config.pbtxt", "intra_op_threads", str(threads[engines[suffix]]))
            if engines[suffix] == "ctranslate2":
                set_parameter(source / "config.pbtxt", "max_concurrent_calls", str(args.ct2_calls))
            (repository / source.name).symlink_to(source)
    print(f"starting transerve with {len(models) * len(wanted)} models...", file=sys.stderr)
    with start_transerve(repository, ready_timeout=600.0) as process:  # loading every model takes a while
        for round_number, model in itertools.product(range(args.rounds), models):
            for suffix in served:
                name = f"{model.name}_{suffix}"
                measured = Measured(model.name, suffix, LABELS[suffix])
                before = wait_for_quiet(args.quiet, args.patience)
                print(f"{name}: {args.concurrency} clients (round {round_number + 1}), other work {before:.2f} "
                      "cores...", file=sys.stderr)
                try:
                    with OtherWork([process.process.pid]) as other:
                        asyncio.run(drive(f"{process.base_url}/v2/models/{name}/infer", loads[model.name],
                                          model.end_id, args.concurrency, args.warmup, args.duration, measured))
                except (OSError, asyncio.TimeoutError, aiohttp.ClientError) as exc:
                    failed = f"{name} failed: {exc!r}"
                    print(failed + "\n" + process.log_tail(40), file=sys.stderr)
                    return failed
                measured.background = other.cores
                print(f"  {measured.rate:.1f} tokens/s, p50 {measured.percentile(50):.0f} ms, p99 "
                      f"{measured.percentile(99):.0f} ms, errors {measured.errors}, other work "
                      f"{measured.background:.2f} cores", file=sys.stderr)
                record(measured)
        for model in models:
            if "ttft" in parts:  # the engine's own floor, with the served engine's threads and with all cores
                for precision in [p for p in ("float32", "int8") if f"ct2_{p}" in configs]:
                    served_threads = args.ct2_threads or threads_per_call(args.ct2_calls)
                    for threads in sorted({served_threads, threads_per_call(1)}):
                        wait_for_quiet(args.quiet, args.patience)
                        measured = ttft_direct_ct2(model, precision, loads[model.name][:args.ttft_requests + 1],
                                                   args.ttft_tokens, threads)
                        print(f"{model.name} {measured.label}: time to first token p50 "
                              f"{measured.percentile(50):.1f} ms", file=sys.stderr)
                        ttft.append(measured)
            for suffix in streamed:
                name = f"{model.name}_{suffix}"
                wait_for_quiet(args.quiet, args.patience)
                print(f"{name}: time to first token, {args.ttft_requests} requests...", file=sys.stderr)
                measured = FirstToken(model.name, suffix, LABELS[suffix])
                asyncio.run(time_to_first_token(process.grpc_url, name, loads[model.name][:args.ttft_requests + 1],
                                                model.end_id, args.ttft_tokens, measured))
                print(f"  p50 {measured.percentile(50):.1f} ms, p99 {measured.percentile(99):.1f} ms",
                      file=sys.stderr)
                ttft.append(measured)
    return ""


def report(args: argparse.Namespace, models: list[Model], results: dict[str, dict[str, Measured]],
           ttft: list[FirstToken], failed: str, started: datetime.datetime, finished: datetime.datetime,
           load_before: float) -> None:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    print(f"\n{started:%Y-%m-%d %H:%M}-{finished:%H:%M} UTC, commit {commit()}, {cpu}, {os.cpu_count()} cores, "
          f"Python {platform.python_version()}; load average {load_before:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end; {args.requests} requests (prompts {PROMPT_LENGTHS[0]}-"
          f"{PROMPT_LENGTHS[1]} tokens, {NEW_TOKENS[0]}-{NEW_TOKENS[1]} new tokens, seed {args.seed}); ceilings: "
          f"{args.ceiling_requests} of them, batch {args.batch}, best of {args.ceiling_rounds}; served: "
          f"{args.concurrency} clients, {args.rounds} x {args.duration:.0f} s after {args.warmup:.0f} s warm-ups, "
          f"intra_op_threads CTranslate2 {args.ct2_threads}, torch {args.torch_threads} (0: the engine's default); "
          f"ONEDNN_MAX_CPU_ISA {os.environ.get('ONEDNN_MAX_CPU_ISA', 'unset')} (benchmarks.onednn_isa); "
          "other work: cores' worth of CPU other processes used during the row's runs")
    for model in models:
        rows = results[model.name]
        keys = sorted(k for k in rows if k.startswith("ceiling_f")) + sorted(k for k in rows if k.startswith(
            "ceiling_i")) + ["ceiling_transformers"] + sorted(k for k in rows if k.startswith("baseline_")) + [
            s for s, *_ in SERVED]
        chosen = [rows[k] for k in keys if k in rows]
        if chosen:
            print(f"\n{model.shape.title}\n")
            print(throughput_table(model, chosen))
    if ttft:
        print(f"\nTime to first token, concurrency 1, gRPC ModelStreamInfer, {args.ttft_tokens} new tokens per request "
              f"(first request of each config not counted)\n")
        print(ttft_table(ttft))
    print("\nGoals (issue 7)\n")
    print(goals(results, ttft))
    if failed:
        print(f"\nINCOMPLETE: {failed}")
    if args.plot and any(results.values()):
        plot(results, args.plot, f"Text generation, {os.cpu_count()}-core CPU, {started:%Y-%m-%d}: throughput "
             f"({args.concurrency} clients, {args.rounds} x {args.duration:.0f} s) and latency by output length")
        print(f"\nplot saved to {args.plot}", file=sys.stderr)
    write_json(args.json, "generation", {
        "started": started.isoformat(), "results": [r for rows in results.values() for r in rows.values()],
        "ttft": ttft}, args)


if __name__ == "__main__":
    main()
