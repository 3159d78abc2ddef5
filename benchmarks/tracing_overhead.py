"""What request tracing costs: the server's CPU per add_sub request, this checkout against another transerve source
(tracing off: the cost of the checks it adds to the request path) or against itself with trace flags.

    python benchmarks/tracing_overhead.py --baseline-src ../main/src                 # tracing off, both
    python benchmarks/tracing_overhead.py --baseline-src src -- --trace-config triton,file=/tmp/t.json \
        --trace-config level=TIMESTAMPS --trace-config rate=1 --trace-config triton,log-frequency=1000

Throughput on a shared 2-core machine moves by a fifth between runs, so the measure is the CPU time of the server's
main process (the event loop, where tracing lives; not the python-backend worker) per request, read from
/proc around each run of `protocol.py`'s load generator; the two servers run alternately (A/B/A/B) and the table
gives each row's median.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import psutil

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "tests"))
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))

from protocol import comma_list, run_once  # noqa: E402
from support import EXAMPLE_REPOSITORY, start_transerve  # noqa: E402


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-src", type=Path, required=True, help="the `src` folder of the transerve to compare")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--duration", type=float, default=3.0, help="measured seconds per run")
    parser.add_argument("--protocols", type=comma_list, default=["json", "binary", "grpc"])
    parser.add_argument("--concurrency", type=lambda s: [int(c) for c in comma_list(s)], default=[1, 16])
    parser.add_argument("flags", nargs="*", help="transerve flags for this checkout's server (after --)")
    args = parser.parse_args()
    with start_transerve(EXAMPLE_REPOSITORY, source=args.baseline_src.resolve()) as baseline, \
            start_transerve(EXAMPLE_REPOSITORY, *args.flags) as checkout:
        servers = {"baseline": baseline, "checkout": checkout}
        samples: dict[tuple[str, int, str], list[tuple[float, float]]] = {}
        for protocol in args.protocols:
            for concurrency in args.concurrency:
                for _ in range(args.rounds):
                    for name, server in servers.items():
                        port = server.grpc_port if protocol == "grpc" else server.http_port
                        process = psutil.Process(server.process.pid)
                        before = cpu_seconds(process)
                        run = run_once(name, ("127.0.0.1", port), protocol, concurrency, 1, 0.5, args.duration)
                        used = cpu_seconds(process) - before
                        samples.setdefault((protocol, concurrency, name), []).append(
                            (used / len(run.latencies) * 1e6, len(run.latencies) / run.duration))
    print("| protocol | concurrency | baseline µs CPU/request | checkout µs CPU/request | baseline req/s | "
          "checkout req/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for protocol in args.protocols:
        for concurrency in args.concurrency:
            cpu = [statistics.median(s[0] for s in samples[(protocol, concurrency, n)]) for n in servers]
            rate = [statistics.median(s[1] for s in samples[(protocol, concurrency, n)]) for n in servers]
            print(f"| {protocol} | {concurrency} | {cpu[0]:.1f} | {cpu[1]:.1f} | {rate[0]:.0f} | {rate[1]:.0f} |")


if __name__ == "__main__":
    main()
