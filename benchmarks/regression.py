"""The quick hot-path regression check: run it before merging a change to the request path.

    python -m benchmarks.regression                  # measure, compare with regression_baseline.json, exit 1 past it
    python -m benchmarks.regression --update         # measure and write the baseline (commit it with the change)
    python -m benchmarks.regression --cases grpc,ensemble_step --rounds 5

Each case measures CPU time per request of one hot path (the CPU of every process doing the work, read from /proc,
which a shared machine disturbs less than wall time) and divides it by a reference timed just before and just after
it: a fixed pure-Python workload in this process, so that the speed of the machine at the time cancels out of the
ratio. Each case's ratio is the median of its rounds, compared with the committed baseline; a case fails when it
exceeds the baseline by more than the tolerance.

The cases, each guarding rules named in docs/architecture.md ("Performance rules"):
- `python_ipc`: the python backend's worker round trip in process (add_sub, 4 callers): shared-memory messages,
  settling calls by callback, the cached event loop.
- `http_json`, `http_binary`: add_sub over HTTP/1.1 (4 keep-alive connections), the server's main process and its
  worker: the httptools protocol, one deadline sweep per listener, the JSON and binary codecs.
- `grpc`: add_sub over gRPC (4 streams on one connection): the native HTTP/2 transport and the hand-written
  protobuf wire format.
- `ensemble_step`: what one step of a three-step ensemble of identity models adds over one call of one of them:
  the callback walk (`execute_then` / `on_done`) that sends the next step without an event-loop turn.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from benchmarks.common.load import run_once
from benchmarks.common.models import STEPS, add_sub_request, example_context, request_bytes, write_chain_repository
from benchmarks.common.results import REPO_ROOT, add_json_option, comma_list, write_json

if TYPE_CHECKING:
    from benchmarks.common.servers import ServerProcess

BASELINE = Path(__file__).with_name("regression_baseline.json")
CASES = ("python_ipc", "http_json", "http_binary", "grpc", "ensemble_step")
DEFAULT_TOLERANCE = 0.25
"""How far above its baseline ratio a case may be; noise on the shared 2-core development machine stays within it."""
CONCURRENCY = 4
REFERENCE_PAYLOAD = {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1.0, 2.0, 3.0, 4.0]},
                                {"name": "INPUT1", "shape": [1, 4], "datatype": "FP32", "data": [0.5, 0.5, 0.5, 0.5]}]}


def reference_us(repeats: int = 10000) -> float:
    """CPU microseconds of a fixed pure-Python workload (JSON, dicts, small calls), like a request path's mix."""

    def touch(entry: dict) -> tuple:
        return entry["name"], tuple(entry["shape"]), len(entry["data"])

    started = time.process_time()
    for _ in range(repeats):
        document = json.loads(json.dumps(REFERENCE_PAYLOAD))
        [touch(entry) for entry in document["inputs"]]
        {f"{key}-{index}": index for index, key in enumerate(("a", "b", "c", "d"))}
    return (time.process_time() - started) / repeats * 1e6


def cpu_seconds(processes: list[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def family(pid: int) -> list[psutil.Process]:
    """A server process and its children (python-backend workers): whoever does a request's work."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


# ------------------------------------------------------------------------------------------------ the cases


def python_ipc_us(seconds: float) -> float:
    """CPU us per add_sub request through `PythonInstance.execute` in process: this process and the worker."""
    import uvloop

    from transerve.backends.python.backend import PythonBackend

    async def run() -> float:
        model = await PythonBackend().load(example_context("add_sub"))
        instance = model.instances[0]
        processes = [psutil.Process(), psutil.Process(instance._worker.process.pid)]
        request = [add_sub_request()]
        done = 0
        stop_at = 0.0

        async def caller() -> None:
            nonlocal done
            while time.perf_counter() < stop_at:
                result = await instance.execute(request)
                assert not isinstance(result.results[0], Exception), result.results[0]
                done += 1

        try:
            stop_at = time.perf_counter() + 0.3  # warm-up
            await asyncio.gather(*(caller() for _ in range(CONCURRENCY)))
            done, before = 0, cpu_seconds(processes)
            stop_at = time.perf_counter() + seconds
            await asyncio.gather(*(caller() for _ in range(CONCURRENCY)))
            return (cpu_seconds(processes) - before) / done * 1e6
        finally:
            await model.unload()

    return uvloop.run(run())


def served_us(server: ServerProcess, protocol: str, seconds: float, request: bytes | None = None) -> float:
    """CPU us per request of the server's processes (main and workers) under `CONCURRENCY` closed-loop clients."""
    port = server.grpc_port if protocol == "grpc" else server.http_port
    processes = family(server.process.pid)
    before = cpu_seconds(processes)
    run = run_once("transerve", ("127.0.0.1", port), protocol, CONCURRENCY, 1, 0.3, seconds, request)
    if run.errors:
        raise SystemExit(f"{protocol}: {run.errors} errors")
    return (cpu_seconds(processes) - before) / run.answered * 1e6  # the warm-up's requests cost CPU too


def measure(cases: list[str], rounds: int, seconds: float) -> dict[str, dict[str, float | list[float]]]:
    """Each case's CPU us per request and its ratio to the reference timed around it: medians of `rounds` rounds."""
    from benchmarks.common.servers import start_transerve

    samples: dict[str, list[float]] = {case: [] for case in ["reference", *cases]}
    ratios: dict[str, list[float]] = {case: [] for case in cases}
    served = [case for case in cases if case != "python_ipc"]
    with tempfile.TemporaryDirectory(prefix="regression-") as tmp:
        repository = Path(tmp) / "models"
        write_chain_repository(repository)
        (repository / "add_sub").symlink_to(REPO_ROOT / "examples" / "model_repository" / "add_sub")
        with contextlib.ExitStack() as stack:
            server = stack.enter_context(start_transerve(repository)) if served else None
            address = f"127.0.0.1:{server.http_port}" if server is not None else ""
            work: dict[str, Callable[[], float]] = {
                "python_ipc": lambda: python_ipc_us(seconds),
                "http_json": lambda: served_us(server, "json", seconds),
                "http_binary": lambda: served_us(server, "binary", seconds),
                "grpc": lambda: served_us(server, "grpc", seconds),
                "ensemble_step": lambda: (served_us(server, "json", seconds, request_bytes(address, "chain"))
                                          - served_us(server, "json", seconds, request_bytes(address, "pass_1")))
                / STEPS,
            }
            for round_number in range(rounds):
                for case in cases:
                    # The reference just before and just after the case: the machine's state at the time it ran.
                    before = reference_us()
                    value = work[case]()
                    reference = (before + reference_us()) / 2
                    samples["reference"].append(reference)
                    samples[case].append(value)
                    ratios[case].append(value / reference)
                print(f"round {round_number + 1}/{rounds}: "
                      + ", ".join(f"{case} {ratios[case][-1]:.2f}" for case in cases), file=sys.stderr)
    measured: dict[str, dict[str, float | list[float]]] = {
        "reference": {"us": statistics.median(samples["reference"]), "ratio": 1.0}}
    for case in cases:
        measured[case] = {"us": statistics.median(samples[case]), "ratio": statistics.median(ratios[case]),
                          "ratios": ratios[case]}
    return measured


def compare(measured: dict, baseline: dict, tolerance: float) -> tuple[str, bool]:
    """A Markdown table of each case against its baseline ratio, and whether every case is within the tolerance."""
    lines = ["| case | us per request | ratio to reference | baseline ratio | change | verdict |",
             "|---|---:|---:|---:|---:|---|"]
    ok = True
    for case, result in measured.items():
        if case == "reference":
            lines.append(f"| reference | {result['us']:.2f} | 1 | | | |")
            continue
        base = baseline.get("cases", {}).get(case, {}).get("ratio")
        if base is None:
            lines.append(f"| {case} | {result['us']:.1f} | {result['ratio']:.2f} | | | no baseline |")
            continue
        change = result["ratio"] / base - 1
        verdict = "ok" if change <= tolerance else f"SLOWER by more than {tolerance:.0%}"
        ok = ok and change <= tolerance
        lines.append(f"| {case} | {result['us']:.1f} | {result['ratio']:.2f} | {base:.2f} | {change:+.0%} | "
                     f"{verdict} |")
    return "\n".join(lines), ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=comma_list, default=list(CASES), help=",".join(CASES))
    parser.add_argument("--rounds", type=int, default=5, help="rounds of every case; medians count (default 5)")
    parser.add_argument("--seconds", type=float, default=1.0, help="measured seconds per case and round")
    parser.add_argument("--baseline", type=Path, default=BASELINE, help="the committed baseline (JSON)")
    parser.add_argument("--tolerance", type=float,
                        help=f"allowed rise of a ratio over its baseline (default: the baseline's, else "
                             f"{DEFAULT_TOLERANCE})")
    parser.add_argument("--update", action="store_true", help="write the measured ratios as the new baseline")
    add_json_option(parser)
    args = parser.parse_args(argv)
    unknown = set(args.cases) - set(CASES)
    if unknown:
        parser.error(f"unknown cases: {', '.join(sorted(unknown))}")
    baseline = json.loads(args.baseline.read_text()) if args.baseline.is_file() else {}
    tolerance = args.tolerance if args.tolerance is not None else baseline.get("tolerance", DEFAULT_TOLERANCE)
    measured = measure(args.cases, args.rounds, args.seconds)
    table, ok = compare(measured, baseline, tolerance)
    print(table)
    write_json(args.json, "regression", measured, args)
    if args.update:
        from benchmarks.common.results import commit

        cases = {**baseline.get("cases", {}),
                 **{case: {"ratio": round(result["ratio"], 3), "us": round(result["us"], 1)}
                    for case, result in measured.items() if case != "reference"}}
        args.baseline.write_text(json.dumps({
            **baseline, "commit": commit(), "measured": f"--update, {args.rounds} rounds, {time.strftime('%Y-%m-%d')}",
            "tolerance": tolerance, "reference_us": round(measured["reference"]["us"], 2), "cases": cases,
        }, indent=1) + "\n")
        print(f"baseline written to {args.baseline}", file=sys.stderr)
        return 0
    if not ok:
        print("\na hot path got slower than its baseline: see docs/architecture.md, Performance rules", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
