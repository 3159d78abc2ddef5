"""What an idle TorchScript model's instance thread costs a busy one in the same process, and what ending idle
instance threads (`IdleEndingExecutor`, the pytorch backend's since 1.0 s without work) gives back.

torch's OpenMP runtime keeps a pool of worker threads for each thread that has computed in parallel, while that
thread lives; with more such threads in the process than cores, every pool stops spinning between parallel
regions, and waking its workers costs each region time. Two copies of a random-weight BERT of
all-MiniLM-L6-v2's shape (6 layers, hidden 384), traced to TorchScript, are loaded by the pytorch backend in one
process, as the server loads them; `busy`'s instance runs requests of one 32-token sequence back to back (two
handed over at once, as the scheduler does) for a window, twice: before `idle` has run anything, and after `idle`
ran one request and sat idle for `--settle` seconds. Once with the backend as it is (idle threads end) and once
with its instance threads living on (`ThreadPoolExecutor`, as before), each in a process of its own, the rounds
alternating. In-process, because served over HTTP on a 2-core machine the clients' and the event loop's share of
the cores made 10-second windows differ by up to 25% with nothing else changed.

    python -m benchmarks.idle_threads            # 3 rounds
    python -m benchmarks.idle_threads --quick    # short windows: checks the script
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

from benchmarks.common.results import add_json_option, write_json

SEQUENCE = 32
CONFIG = """
    name: "{name}"
    platform: "pytorch_libtorch"
    max_batch_size: 8
    input [ {{ name: "INPUT__0" data_type: TYPE_INT64 dims: [ -1 ] }},
            {{ name: "INPUT__1" data_type: TYPE_INT64 dims: [ -1 ] }} ]
    output [ {{ name: "last_hidden_state" data_type: TYPE_FP32 dims: [ -1, 384 ] }},
             {{ name: "pooler_output" data_type: TYPE_FP32 dims: [ 384 ] }} ]
    instance_group [ {{ name: "{name}" kind: KIND_CPU count: 1 }} ]
    parameters {{ key: "DISABLE_OPTIMIZED_EXECUTION" value: {{ string_value: "true" }} }}
"""


def build_repository(workdir: Path) -> Path:
    """`busy` and `idle`: the same traced random-weight BERT (built once per workdir)."""
    import torch
    import transformers

    repository = workdir / "repository"
    for name in ("busy", "idle"):
        (repository / name / "1").mkdir(parents=True, exist_ok=True)
        (repository / name / "config.pbtxt").write_text(textwrap.dedent(CONFIG.format(name=name)))
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
        traced.save(str(repository / name / "1" / "model.pt"))
    return repository


def worker(repository: Path, threads: str, args: argparse.Namespace) -> dict[str, float]:
    """This process: `busy`'s requests per second alone, then after `idle` ran once; `threads` "end" (as the
    backend does) or "live" (instance threads kept, as before)."""
    import numpy as np
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    from transerve.backends.base import ModelContext
    from transerve.backends.pytorch import backend as pytorch_backend
    from transerve.core.types import InferRequest, Tensor

    if threads == "live":
        pytorch_backend.IDLE_SECONDS = None  # open_engines then gives each instance a ThreadPoolExecutor

    async def load(name: str) -> Any:
        config = text_format.Parse((repository / name / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
        path = repository / name
        context = ModelContext(name, "1", path, path / "1", repository, config)
        return (await pytorch_backend.PyTorchBackend().load(context)).instances[0]

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    busy, idle = loop.run_until_complete(load("busy")), loop.run_until_complete(load("idle"))
    ids = np.arange(1000, 1000 + SEQUENCE, dtype=np.int64)[None]
    request = InferRequest("busy", [Tensor("INPUT__0", "INT64", ids), Tensor("INPUT__1", "INT64", np.ones_like(ids))])
    rates = {}

    def window() -> float:
        return loop.run_until_complete(requests_per_second(busy, request, args.warmup, args.duration))

    time.sleep(args.settle)  # the loading threads end (when they do)
    rates["alone"] = window()
    loop.run_until_complete(idle.execute([request]))  # the idle model computes once...
    time.sleep(args.settle)  # ...and then sits idle
    rates["after idle ran"] = window()
    return rates


async def requests_per_second(instance: Any, request: Any, warmup: float, seconds: float) -> float:
    """Requests per second of `instance` kept busy with two executions handed over at once."""
    loop = asyncio.get_running_loop()
    start = loop.time() + warmup
    end = start + seconds
    done = [0]

    async def feeder() -> None:
        while loop.time() < end:
            result = await instance.execute([request])
            if not all(hasattr(r, "outputs") for r in result.results):
                raise RuntimeError(f"the model failed: {result.results}")
            if start <= loop.time() <= end:
                done[0] += 1

    await asyncio.gather(feeder(), feeder())
    return done[0] / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument("--settle", type=float, default=3.0, help="seconds idle before each window")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "transerve-idle-threads")
    parser.add_argument("--quick", action="store_true", help="short windows, one round")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    add_json_option(parser)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.warmup, args.duration, args.settle = 1, 1.0, 3.0, 1.5
    args.workdir.mkdir(parents=True, exist_ok=True)
    repository = build_repository(args.workdir)
    if args.worker:
        print(json.dumps(worker(repository, args.worker, args)), flush=True)
        return
    kinds = {"end": "idle threads end (the backend)", "live": "idle threads live on (before)"}
    results: dict[str, list[float]] = {kind: [] for kind in kinds}
    runs: list[dict[str, Any]] = []
    print(f"busy: TorchScript BERT (6 layers, hidden 384), 1 x {SEQUENCE} tokens per request, two at once, "
          f"{args.duration:.0f} s windows after {args.warmup:.0f} s; requests/s")
    print("| round | instance threads | busy alone | busy after idle ran | ratio |")
    print("|---:|---|---:|---:|---:|")
    for round_number in range(1, args.rounds + 1):
        for kind, label in kinds.items():
            command = [sys.executable, "-m", "benchmarks.idle_threads", "--worker", kind,
                       "--workdir", str(args.workdir),
                       "--warmup", str(args.warmup), "--duration", str(args.duration), "--settle", str(args.settle)]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            rates = json.loads(out.strip().splitlines()[-1])
            ratio = rates["after idle ran"] / rates["alone"]
            results[kind].append(ratio)
            runs.append({"round": round_number, "instance_threads": kind, **rates})
            print(f"| {round_number} | {label} | {rates['alone']:.1f} | {rates['after idle ran']:.1f} | "
                  f"{ratio:.2f}x |", flush=True)
    for kind, label in kinds.items():
        print(f"{label}: busy after idle ran / alone, median of {len(results[kind])}: "
              f"{statistics.median(results[kind]):.2f}x")
    write_json(args.json, "idle_threads", runs, args)


if __name__ == "__main__":
    main()
