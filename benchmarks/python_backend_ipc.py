"""Round-trip cost of the python backend's worker IPC, measured on the `add_sub` example model.

Loads the model through `PythonBackend` (no HTTP) and drives one instance with 1, 2, 4 and 8
concurrent callers (the instance queues up to `max_inflight`, 4 by default, in the worker's socket),
then with several requests per execute call, and prints per request: throughput, wall time, CPU of
the server process (including this driver's own coroutines) and CPU of the worker process. Run:

    python -m benchmarks.python_backend_ipc [--requests 20000] [--no-uvloop] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import psutil

from benchmarks.common.models import add_sub_request, example_context
from benchmarks.common.results import add_json_option, write_json
from transerve.backends.python.backend import PythonBackend, PythonInstance


async def drive(instance: PythonInstance, callers: int, calls: int, requests_per_call: int) -> None:
    """`callers` coroutines each making `calls // callers` execute calls of `requests_per_call` requests."""
    requests = [add_sub_request() for _ in range(requests_per_call)]

    async def caller() -> None:
        for _ in range(calls // callers):
            result = await instance.execute(requests)
            assert not isinstance(result.results[0], Exception), result.results[0]

    await asyncio.gather(*(caller() for _ in range(callers)))


async def measure(instance: PythonInstance, worker: psutil.Process, callers: int, requests: int,
                  per_call: int) -> dict[str, float]:
    calls = max(requests // per_call, callers)
    await drive(instance, callers, calls // 10 or 1, per_call)  # warm up
    server = psutil.Process()
    server_cpu, worker_cpu = sum(server.cpu_times()[:2]), sum(worker.cpu_times()[:2])
    started = time.perf_counter()
    await drive(instance, callers, calls, per_call)
    wall = time.perf_counter() - started
    total = calls // callers * callers * per_call
    server_us = (sum(server.cpu_times()[:2]) - server_cpu) / total * 1e6
    worker_us = (sum(worker.cpu_times()[:2]) - worker_cpu) / total * 1e6
    return {"callers": callers, "requests_per_call": per_call, "req_per_s": total / wall,
            "wall_us_per_req": wall / total * 1e6, "server_cpu_us_per_req": server_us,
            "worker_cpu_us_per_req": worker_us}


def row(result: dict[str, float]) -> str:
    return (f"| {result['callers']:>7} | {result['requests_per_call']:>8} | {result['req_per_s']:>10,.0f} "
            f"| {result['wall_us_per_req']:>11.1f} | {result['server_cpu_us_per_req']:>17.1f} "
            f"| {result['worker_cpu_us_per_req']:>17.1f} |")


async def main(requests: int) -> list[dict[str, float]]:
    model = await PythonBackend().load(example_context("add_sub"))
    instance = model.instances[0]
    assert isinstance(instance, PythonInstance)
    worker = psutil.Process(instance._worker.process.pid)
    print("| callers | req/call |    req/s   | wall µs/req | server CPU µs/req | worker CPU µs/req |")
    print("|--------:|---------:|-----------:|------------:|------------------:|------------------:|")
    results = []
    for callers, per_call in ((1, 1), (2, 1), (4, 1), (8, 1), (4, 8), (4, 64)):
        results.append(await measure(instance, worker, callers, requests, per_call))
        print(row(results[-1]), flush=True)
    await model.unload()
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--no-uvloop", action="store_true", help="use asyncio's default event loop")
    add_json_option(parser)
    args = parser.parse_args()
    if args.no_uvloop:
        measured = asyncio.run(main(args.requests))
    else:
        import uvloop

        measured = uvloop.run(main(args.requests))
    write_json(args.json, "python_backend_ipc", measured, args)
