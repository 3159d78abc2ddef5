"""What request tracing costs: the server's CPU per add_sub request, this checkout against another transerve source
(tracing off: the cost of the checks it adds to the request path) or against itself with trace flags.

    python -m benchmarks.tracing_overhead --baseline-src ../main/src                 # tracing off, both
    python -m benchmarks.tracing_overhead --baseline-src src -- --trace-config triton,file=/tmp/t.json \
        --trace-config level=TIMESTAMPS --trace-config rate=1 --trace-config triton,log-frequency=1000

Throughput on a shared 2-core machine moves by a fifth between runs, so the measure is the CPU time of the server's
main process (the event loop, where tracing lives; not the python-backend worker) per request, read from /proc
around each run of the add_sub load generator (benchmarks/common/load.py); the two servers run alternately
(A/B/A/B) and the table gives each row's median. Two more paths have clients of their own (`--protocols
stream,generate`): `stream` sends add_sub requests on one gRPC stream, 32 in flight (its rows' concurrency), and
`generate` posts add_sub to `/generate` one at a time.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import requests
import tritonclient.grpc as grpcclient

from benchmarks.common.load import run_once
from benchmarks.common.results import add_json_option, comma_list, int_list, write_json
from benchmarks.common.servers import EXAMPLE_REPOSITORY, ServerProcess, start_transerve

#: Requests a stream keeps in flight.
STREAM_WINDOW = 32


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def stream_requests(server: ServerProcess, duration: float) -> int:
    """add_sub on one gRPC stream for `duration` seconds, STREAM_WINDOW in flight; how many were answered."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    answered = threading.Semaphore(0)
    client.start_stream(callback=lambda result, error: answered.release())
    inputs = [grpcclient.InferInput(name, [1, 4], "FP32") for name in ("INPUT0", "INPUT1")]
    for tensor in inputs:
        tensor.set_data_from_numpy(np.ones((1, 4), np.float32))
    sent, deadline = 0, time.monotonic() + duration
    while time.monotonic() < deadline:
        client.async_stream_infer("add_sub", inputs)
        sent += 1
        if sent > STREAM_WINDOW:
            answered.acquire()
    client.stop_stream()
    client.close()
    return sent


def generate_requests(server: ServerProcess, duration: float) -> int:
    """add_sub over `/generate`, one at a time, for `duration` seconds; how many were answered."""
    count, deadline = 0, time.monotonic() + duration
    with requests.Session() as session:
        while time.monotonic() < deadline:
            session.post(f"{server.base_url}/v2/models/add_sub/generate", timeout=30,
                         json={"INPUT0": [1, 2, 3, 4], "INPUT1": [1, 2, 3, 4]}).raise_for_status()
            count += 1
    return count


def measure(name: str, server: ServerProcess, protocol: str, concurrency: int, duration: float) -> tuple[int, float]:
    """Requests answered in one run, and the run's seconds."""
    if protocol in ("stream", "generate"):
        started = time.monotonic()
        count = (stream_requests if protocol == "stream" else generate_requests)(server, duration)
        return count, time.monotonic() - started
    port = server.grpc_port if protocol == "grpc" else server.http_port
    run = run_once(name, ("127.0.0.1", port), protocol, concurrency, 1, 0.5, duration)
    return len(run.latencies), run.duration


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-src", type=Path, required=True, help="the `src` folder of the transerve to compare")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--duration", type=float, default=3.0, help="measured seconds per run")
    parser.add_argument("--protocols", type=comma_list, default=["json", "binary", "grpc"],
                        help="json, binary, grpc (the add_sub load of benchmarks.protocol), stream, generate")
    parser.add_argument("--concurrency", type=int_list, default=[1, 16])
    parser.add_argument("flags", nargs="*", help="transerve flags for this checkout's server (after --)")
    add_json_option(parser)
    args = parser.parse_args()
    with start_transerve(EXAMPLE_REPOSITORY, source=args.baseline_src.resolve()) as baseline, \
            start_transerve(EXAMPLE_REPOSITORY, *args.flags) as checkout:
        servers = {"baseline": baseline, "checkout": checkout}
        samples: dict[tuple[str, int, str], list[tuple[float, float]]] = {}
        rows = [(protocol, concurrency) for protocol in args.protocols
                for concurrency in ([STREAM_WINDOW] if protocol == "stream" else [1] if protocol == "generate"
                                    else args.concurrency)]
        for protocol, concurrency in rows:
            for _ in range(args.rounds):
                for name, server in servers.items():
                    process = psutil.Process(server.process.pid)
                    before = cpu_seconds(process)
                    count, seconds = measure(name, server, protocol, concurrency, args.duration)
                    used = cpu_seconds(process) - before
                    samples.setdefault((protocol, concurrency, name), []).append(
                        (used / count * 1e6, count / seconds))
    table = []
    print("| protocol | concurrency | baseline µs CPU/request | checkout µs CPU/request | baseline req/s | "
          "checkout req/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for protocol, concurrency in rows:
        cpu = [statistics.median(s[0] for s in samples[(protocol, concurrency, n)]) for n in servers]
        rate = [statistics.median(s[1] for s in samples[(protocol, concurrency, n)]) for n in servers]
        print(f"| {protocol} | {concurrency} | {cpu[0]:.1f} | {cpu[1]:.1f} | {rate[0]:.0f} | {rate[1]:.0f} |")
        table.append({"protocol": protocol, "concurrency": concurrency, "baseline_cpu_us": cpu[0],
                      "checkout_cpu_us": cpu[1], "baseline_req_per_s": rate[0], "checkout_req_per_s": rate[1]})
    write_json(args.json, "tracing_overhead", table, args)


if __name__ == "__main__":
    main()
