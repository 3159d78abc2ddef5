"""The quick hot-path regression check: run it before merging a change to the request path.

    python -m benchmarks.regression                  # measure, compare with regression_baseline.json, exit 1 past it
    python -m benchmarks.regression --update         # measure and write the baseline (commit it with the change)
    python -m benchmarks.regression --cases grpc,ensemble_step --rounds 5
    python -m benchmarks.regression --against HEAD~1   # this tree against another commit, side by side

The check before merging a change to a request path is `--against` the commit before it: both versions serve at
once from the same repository, each case alternates between them round by round (A B, B A, ...), and each case's
verdict is the median of its rounds' CPU-per-request ratios, new over old, failing past `--margin` (default 10%).
A noisy machine moves both versions alike, which a stored baseline cannot follow.

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
import os
import statistics
import subprocess
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
DEFAULT_MARGIN = 0.10
"""How far above the other commit's CPU per request a case may be with `--against`."""
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


def python_ipc_at(source: Path, seconds: float) -> float:
    """`python_ipc_us` with transerve imported from `source`, in a process of its own (each version its own)."""
    code = f"from benchmarks.regression import python_ipc_us; print(python_ipc_us({seconds!r}))"
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join([str(source), str(REPO_ROOT)]))
    result = subprocess.run([sys.executable, "-c", code], env=environment, cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=120 + 10 * seconds)
    if result.returncode:
        raise SystemExit(f"python_ipc at {source}: {result.stderr.strip().splitlines()[-1:]}")
    return float(result.stdout.split()[-1])


def measure_against(cases: list[str], rounds: int, seconds: float, ref: str) -> dict[str, dict[str, list[float]]]:
    """Each case's CPU us per request for this tree ("new") and for commit `ref` ("old"), both served at once,
    alternating which goes first round by round."""
    from benchmarks.common.servers import start_transerve, transerve_source_at

    per: dict[str, dict[str, list[float]]] = {"new": {case: [] for case in cases}, "old": {case: [] for case in cases}}
    with tempfile.TemporaryDirectory(prefix="regression-against-") as tmp:
        sources = {"new": REPO_ROOT / "src", "old": transerve_source_at(ref, Path(tmp) / "ref")}
        repository = Path(tmp) / "models"
        write_chain_repository(repository)
        (repository / "add_sub").symlink_to(REPO_ROOT / "examples" / "model_repository" / "add_sub")
        with contextlib.ExitStack() as stack:
            servers = {label: stack.enter_context(start_transerve(repository, source=source))
                       for label, source in sources.items()} if set(cases) - {"python_ipc"} else {}

            def work(case: str, label: str) -> float:
                if case == "python_ipc":
                    return python_ipc_at(sources[label], seconds)
                server = servers[label]
                if case == "ensemble_step":
                    address = f"127.0.0.1:{server.http_port}"
                    return (served_us(server, "json", seconds, request_bytes(address, "chain"))
                            - served_us(server, "json", seconds, request_bytes(address, "pass_1"))) / STEPS
                return served_us(server, {"http_json": "json", "http_binary": "binary", "grpc": "grpc"}[case],
                                 seconds)

            for round_number in range(rounds):
                order = ("new", "old") if round_number % 2 == 0 else ("old", "new")
                for case in cases:
                    for label in order:
                        per[label][case].append(work(case, label))
                print(f"round {round_number + 1}/{rounds}: " + ", ".join(
                    f"{case} {per['new'][case][-1] / per['old'][case][-1]:.2f}" for case in cases), file=sys.stderr)
    return per


def compare_against(per: dict[str, dict[str, list[float]]], ref: str, margin: float) -> tuple[str, bool]:
    """A Markdown table of each case, this tree against `ref`, and whether every case is within the margin."""
    lines = [f"| case | us per request (this tree) | us per request ({ref}) | new / old (median of rounds) | verdict |",
             "|---|---:|---:|---:|---|"]
    ok = True
    for case, new in per["new"].items():
        old = per["old"][case]
        ratio = statistics.median(a / b for a, b in zip(new, old, strict=True))
        within = ratio <= 1 + margin
        verdict = "ok" if within else f"SLOWER by more than {margin:.0%}"
        ok = ok and within
        lines.append(f"| {case} | {statistics.median(new):.1f} | {statistics.median(old):.1f} | {ratio:.3f} | "
                     f"{verdict} |")
    return "\n".join(lines), ok


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
    parser.add_argument("--against", metavar="REF",
                        help="compare with git commit REF side by side instead of with the baseline")
    parser.add_argument("--margin", type=float, default=DEFAULT_MARGIN,
                        help=f"with --against: allowed rise of CPU per request (default {DEFAULT_MARGIN})")
    add_json_option(parser)
    args = parser.parse_args(argv)
    unknown = set(args.cases) - set(CASES)
    if unknown:
        parser.error(f"unknown cases: {', '.join(sorted(unknown))}")
    if args.against:
        if args.update:
            parser.error("--update writes the baseline; it does not go with --against")
        per = measure_against(args.cases, args.rounds, args.seconds, args.against)
        table, ok = compare_against(per, args.against, args.margin)
        print(table)
        write_json(args.json, "regression", {"against": args.against, **per}, args)
        if not ok:
            print(f"\na hot path got slower than at {args.against}: see docs/architecture.md, Performance rules",
                  file=sys.stderr)
        return 0 if ok else 1
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
