"""What an idle TorchScript model's instance thread costs a busy one in the same server, and what ending idle
instance threads (`IdleEndingExecutor`) gives back.

torch's OpenMP runtime keeps a pool of worker threads for each thread that has computed in parallel, while that
thread lives; with more such threads in the process than cores, every pool stops spinning between parallel
regions, and waking its workers costs each region time. The repository: two copies of a random-weight BERT of
all-MiniLM-L6-v2's shape (6 layers, hidden 384), traced to TorchScript. transerve serves it; `busy` is measured
under `--clients` closed-loop HTTP clients (requests of one 32-token sequence) twice: before `idle` has run
anything, and after `idle` answered one request (then sat idle for `--settle` seconds). Each revision gets a
server of its own; rounds alternate the revisions.

    python benchmarks/idle_threads.py --compare-with HEAD~1     # this checkout against the revision before
    python benchmarks/idle_threads.py --quick                   # short windows: checks the script
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
REPO_ROOT = BENCHMARKS.parent
sys.path.insert(0, str(BENCHMARKS))
sys.path.insert(0, str(REPO_ROOT / "tests"))

from inflight_vs_request import source_tree  # noqa: E402

SEQUENCE = 32
CONFIG = """
    name: "{name}"
    platform: "pytorch_libtorch"
    max_batch_size: 8
    input [ {{ name: "INPUT__0" data_type: TYPE_INT64 dims: [ -1 ] }},
            {{ name: "INPUT__1" data_type: TYPE_INT64 dims: [ -1 ] }} ]
    output [ {{ name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ -1, 384 ] }},
             {{ name: "OUTPUT__1" data_type: TYPE_FP32 dims: [ 384 ] }} ]
    instance_group [ {{ kind: KIND_CPU count: 1 }} ]
    parameters {{ key: "DISABLE_OPTIMIZED_EXECUTION" value: {{ string_value: "true" }} }}
"""


def build_repository(workdir: Path) -> Path:
    """`busy` and `idle`: the same traced random-weight BERT (built once per workdir)."""
    import torch
    import transformers

    repository = workdir / "repository"
    if (repository / "idle" / "1" / "model.pt").is_file():
        return repository
    config = transformers.BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                                     intermediate_size=1536, torchscript=True)
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    ids = torch.randint(1000, 2000, (1, SEQUENCE))
    with torch.no_grad():
        traced = torch.jit.trace(model, (ids, torch.ones_like(ids)), strict=False)
    for name in ("busy", "idle"):
        (repository / name / "1").mkdir(parents=True, exist_ok=True)
        traced.save(str(repository / name / "1" / "model.pt"))
        (repository / name / "config.pbtxt").write_text(textwrap.dedent(CONFIG.format(name=name)))
    return repository


def body() -> bytes:
    ids = list(range(1000, 1000 + SEQUENCE))
    return json.dumps({"inputs": [
        {"name": "INPUT__0", "shape": [1, SEQUENCE], "datatype": "INT64", "data": ids},
        {"name": "INPUT__1", "shape": [1, SEQUENCE], "datatype": "INT64", "data": [1] * SEQUENCE},
    ], "outputs": [{"name": "OUTPUT__1"}]}).encode()


async def load(url: str, clients: int, warmup: float, duration: float) -> float:
    """Requests per second of `clients` closed-loop clients, counted inside the window after `warmup`."""
    import aiohttp

    payload, headers = body(), {"Content-Type": "application/json"}
    loop = asyncio.get_running_loop()
    start = loop.time() + warmup
    end = start + duration
    done = [0]
    async with aiohttp.ClientSession() as session:

        async def client() -> None:
            while loop.time() < end:
                async with session.post(url, data=payload, headers=headers) as response:
                    await response.read()
                    if response.status != 200:
                        raise RuntimeError(f"HTTP {response.status}")
                if start <= loop.time() <= end:
                    done[0] += 1

        await asyncio.gather(*(client() for _ in range(clients)))
    return done[0] / duration


def measure(source: Path, repository: Path, args: argparse.Namespace) -> dict[str, float]:
    """`busy`'s requests per second in one server of `source`: alone, then after `idle` answered a request."""
    import aiohttp  # noqa: F401  (fail before starting the server when missing)
    from support import start_transerve

    rates = {}
    with start_transerve(repository, source=source, ready_timeout=300.0) as server:
        busy, idle = (f"{server.base_url}/v2/models/{name}/infer" for name in ("busy", "idle"))
        rates["alone"] = asyncio.run(load(busy, args.clients, args.warmup, args.duration))
        asyncio.run(load(idle, 1, 0.0, 0.5))  # the idle model computes once...
        time.sleep(args.settle)  # ...and then sits idle
        rates["after idle ran"] = asyncio.run(load(busy, args.clients, args.warmup, args.duration))
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare-with", action="append", default=[], help="also measure this git revision")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--settle", type=float, default=3.0, help="seconds the idle model sits idle before")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "transerve-idle-threads")
    parser.add_argument("--quick", action="store_true", help="short windows, one round")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.warmup, args.duration = 1, 1.0, 3.0
    args.workdir.mkdir(parents=True, exist_ok=True)
    repository = build_repository(args.workdir)
    sources = {"this checkout": REPO_ROOT / "src"}
    sources |= {revision: source_tree(revision, args.workdir) for revision in args.compare_with}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in sources}
    print(f"busy: TorchScript BERT (6 layers, hidden 384), 1 x {SEQUENCE} tokens per request, {args.clients} "
          f"clients, {args.duration:.0f} s windows after {args.warmup:.0f} s; requests/s")
    print("| round | transerve | busy alone | busy after idle ran | ratio |")
    print("|---:|---|---:|---:|---:|")
    for round_number in range(1, args.rounds + 1):
        for name, source in sources.items():
            rates = measure(source, repository, args)
            results[name].append(rates)
            print(f"| {round_number} | {name} | {rates['alone']:.1f} | {rates['after idle ran']:.1f} | "
                  f"{rates['after idle ran'] / rates['alone']:.2f}x |", flush=True)
    for name, rounds in results.items():
        ratios = [r["after idle ran"] / r["alone"] for r in rounds]
        print(f"{name}: busy after idle ran / alone, median of {len(ratios)} rounds: {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
