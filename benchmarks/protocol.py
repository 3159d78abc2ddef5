"""HTTP protocol overhead: add_sub over KServe v2 JSON and binary, transerve against the real Triton.

    python benchmarks/protocol.py                        # starts both servers, 5 s per run, concurrency 1,16,64
    python benchmarks/protocol.py --duration 10 --rounds 3 --protocols binary
    python benchmarks/protocol.py --transerve-url 127.0.0.1:8000 --triton-url 127.0.0.1:18000

add_sub does almost no work, so what is measured is the server's request path: HTTP parsing, decoding,
validation, scheduling, the trip to the python-backend worker and back, encoding.

The load generator must not be the bottleneck. It speaks raw HTTP/1.1 over keep-alive connections with a
minimal asyncio.Protocol on uvloop, with request bytes built once: measured on the 2-core development machine
against Triton at concurrency 16, that costs about 26 us of client CPU per request, where tritonclient.http.aio
costs about 170 us (asyncio streams were within noise of the protocol, at 27 us). Connections can be spread over
several client processes (--client-processes), and the table reports the busiest client process's CPU use so
a reader can see when the client, not the server, was saturated.

Fairness: both servers serve the same repository on the same machine, and runs alternate (A/B/A/B...) so
that drift in the machine's load spreads over both. Every run has a warm-up that is not counted, and every
response's status is checked (non-200 answers are counted as errors, never as throughput).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import multiprocessing
import struct
import sys
import time
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from multiprocessing.queues import Queue
    from multiprocessing.synchronize import Barrier

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL_PATH = "/v2/models/add_sub/infer"
INPUT0 = [1.0, 2.0, 3.0, 4.0]
INPUT1 = [0.5, 0.5, 0.5, 0.5]
RUN_GRACE_S = 30.0
"""How long past its planned end a run may take before it is abandoned (a hung server must not hang the benchmark)."""


# ------------------------------------------------------------------------------------------------ requests


def json_request(host: str) -> bytes:
    body = json.dumps({"inputs": [
        {"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": INPUT0},
        {"name": "INPUT1", "shape": [1, 4], "datatype": "FP32", "data": INPUT1},
    ]}).encode()
    return http_request(host, body, {"Content-Type": "application/json"})


def binary_request(host: str) -> bytes:
    """Binary tensors in, binary tensors out (binary_data_output), as tritonclient sends by default."""
    header = json.dumps({
        "inputs": [
            {"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "parameters": {"binary_data_size": 16}},
            {"name": "INPUT1", "shape": [1, 4], "datatype": "FP32", "parameters": {"binary_data_size": 16}},
        ],
        "parameters": {"binary_data_output": True},
    }).encode()
    body = header + struct.pack("<4f", *INPUT0) + struct.pack("<4f", *INPUT1)
    return http_request(host, body, {
        "Content-Type": "application/octet-stream",
        "Inference-Header-Content-Length": str(len(header)),
    })


def http_request(host: str, body: bytes, headers: dict[str, str]) -> bytes:
    lines = [f"POST {MODEL_PATH} HTTP/1.1", f"Host: {host}", f"Content-Length: {len(body)}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


PROTOCOLS = {"json": json_request, "binary": binary_request}


def check_answer(host: str, port: int, protocol: str) -> None:
    """One request with a full parse of the answer, so that a benchmark never measures a fast wrong answer."""
    request = PROTOCOLS[protocol](f"{host}:{port}")
    head, body = request.split(b"\r\n\r\n", 1)
    headers = dict(line.split(": ", 1) for line in head.decode().split("\r\n")[1:])
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        conn.request("POST", MODEL_PATH, body=body, headers=headers)
        response = conn.getresponse()
        payload = response.read()
        header_length = response.getheader("Inference-Header-Content-Length")
    finally:
        conn.close()
    if response.status != 200:
        raise SystemExit(f"{host}:{port} {protocol}: HTTP {response.status}: {payload[:300]!r}")
    expected = [a + b for a, b in zip(INPUT0, INPUT1, strict=True)]
    if header_length is None:
        outputs = {o["name"]: o["data"] for o in json.loads(payload)["outputs"]}
    else:
        outputs, offset = {}, int(header_length)
        for output in json.loads(payload[:offset])["outputs"]:
            size = output["parameters"]["binary_data_size"]
            outputs[output["name"]] = list(struct.unpack(f"<{size // 4}f", payload[offset:offset + size]))
            offset += size
    if outputs.get("OUTPUT0") != expected:
        raise SystemExit(f"{host}:{port} {protocol}: wrong OUTPUT0 {outputs.get('OUTPUT0')}, expected {expected}")


# ------------------------------------------------------------------------------------------------- client


class Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection with at most one request in flight; reads only status and length.

    Responses are framed by Content-Length, which both servers send; anything else is a protocol error here.
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.waiter: asyncio.Future[int] | None = None
        self.response_end: int | None = None
        self.status = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.response_end is None:
            head_end = self.buffer.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = bytes(self.buffer[:head_end]).lower()
            start = head.find(b"\r\ncontent-length:")
            if start < 0:
                self._fail(ConnectionError(f"response without Content-Length: {head[:200]!r}"))
                return
            start += len(b"\r\ncontent-length:")
            stop = head.find(b"\r\n", start)
            length = int(head[start:stop if stop >= 0 else len(head)])
            self.status = int(head[9:12])
            self.response_end = head_end + 4 + length
        if len(self.buffer) >= self.response_end:
            del self.buffer[:self.response_end]
            self.response_end = None
            if self.waiter is not None and not self.waiter.done():
                self.waiter.set_result(self.status)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(exc or ConnectionError("connection closed by the server"))

    def _fail(self, exc: Exception) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)

    async def send(self, request: bytes) -> int:
        """Send one request and return the response's status code."""
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return await self.waiter


@dataclass
class WorkerResult:
    latencies: array = field(default_factory=lambda: array("d"))
    """Seconds, for each request started inside the measured window."""
    errors: int = 0
    cpu_fraction: float = 0.0
    """This process's CPU time over the measured window's wall time: near 1.0 means the client was saturated."""


async def drive(host: str, port: int, request: bytes, connections: int, warmup: float, duration: float,
                barrier: Barrier) -> WorkerResult:
    """Keep `connections` requests in flight, back to back; record those started within the measured window."""
    loop = asyncio.get_running_loop()
    protocols: list[Connection] = []
    for _ in range(connections):
        _, protocol = await loop.create_connection(Connection, host, port)
        protocols.append(protocol)
    barrier.wait()  # all client processes start their clocks together
    measure_from = time.perf_counter() + warmup
    end = measure_from + duration
    result = WorkerResult()
    cpu_window: list[float] = []

    async def sample_cpu() -> None:
        await asyncio.sleep(measure_from - time.perf_counter())
        cpu_window.append(time.process_time())
        await asyncio.sleep(end - time.perf_counter())
        cpu_window.append(time.process_time())

    async def run(protocol: Connection) -> None:
        while True:
            started = time.perf_counter()
            if started >= end:
                return
            try:
                status = await protocol.send(request)
            except ConnectionError:
                result.errors += 1
                _, protocol = await loop.create_connection(Connection, host, port)
                continue
            if started >= measure_from:
                result.latencies.append(time.perf_counter() - started)
                if status != 200:
                    result.errors += 1

    await asyncio.wait_for(asyncio.gather(sample_cpu(), *(run(p) for p in protocols)), warmup + duration + RUN_GRACE_S)
    for protocol in protocols:
        if protocol.transport is not None:
            protocol.transport.close()
    result.cpu_fraction = (cpu_window[1] - cpu_window[0]) / duration
    return result


def worker_main(host: str, port: int, request: bytes, connections: int, warmup: float, duration: float,
                barrier: Barrier, results: Queue) -> None:
    """Entry point of one client process: uvloop when available, as it is cheaper per request than asyncio's loop.

    A failure is sent back as text, so the parent reports it instead of waiting for a result that never comes.
    """
    try:
        import uvloop
    except ImportError:
        runner = asyncio.run
    else:
        runner = uvloop.run
    try:
        results.put(runner(drive(host, port, request, connections, warmup, duration, barrier)))
    except Exception as exc:  # noqa: BLE001 - any failure must reach the parent
        barrier.abort()
        results.put(f"client process failed: {type(exc).__name__}: {exc}")


# --------------------------------------------------------------------------------------------- one run


@dataclass
class RunResult:
    server: str
    protocol: str
    concurrency: int
    duration: float
    latencies: list[float]
    errors: int
    client_cpu: float


def run_once(server: str, address: tuple[str, int], protocol: str, concurrency: int, processes: int,
             warmup: float, duration: float) -> RunResult:
    """One timed run: `concurrency` connections spread over up to `processes` client processes."""
    host, port = address
    request = PROTOCOLS[protocol](f"{host}:{port}")
    processes = max(1, min(processes, concurrency))
    shares = [concurrency // processes + (1 if i < concurrency % processes else 0) for i in range(processes)]
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(processes)
    results = context.Queue()
    workers = [
        context.Process(target=worker_main, args=(host, port, request, share, warmup, duration, barrier, results))
        for share in shares
    ]
    for worker in workers:
        worker.start()
    collected: list[WorkerResult] = []
    try:
        for _ in workers:
            result = results.get(timeout=warmup + duration + 2 * RUN_GRACE_S)
            if isinstance(result, str):
                raise SystemExit(f"{server} {protocol} c={concurrency}: {result}")
            collected.append(result)
    finally:
        for worker in workers:
            worker.join(timeout=RUN_GRACE_S)
            if worker.is_alive():
                worker.kill()
    latencies = sorted(latency for result in collected for latency in result.latencies)
    return RunResult(server, protocol, concurrency, duration, latencies, sum(r.errors for r in collected),
                     max(r.cpu_fraction for r in collected))


# ---------------------------------------------------------------------------------------------- report


def percentile(sorted_values: list[float], fraction: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(fraction * len(sorted_values)))]


def report(runs: list[RunResult], servers: list[str], protocols: list[str]) -> str:
    """A Markdown table, one row per server, protocol and concurrency, with every round of a row merged."""
    rows: dict[tuple[str, int, str], list[RunResult]] = {}
    for run in runs:
        rows.setdefault((run.protocol, run.concurrency, run.server), []).append(run)
    throughput = {
        key: sum(len(r.latencies) for r in group) / sum(r.duration for r in group) for key, group in rows.items()
    }
    lines = [
        "| server | protocol | concurrency | req/s | p50 ms | p99 ms | transerve/Triton | errors | client CPU |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for protocol, concurrency, server in sorted(rows, key=lambda k: (protocols.index(k[0]), k[1], servers.index(k[2]))):
        group = rows[(protocol, concurrency, server)]
        latencies = sorted(latency for r in group for latency in r.latencies)
        triton = throughput.get((protocol, concurrency, "triton"))
        transerve = throughput.get((protocol, concurrency, "transerve"))
        ratio = f"{transerve / triton:.2f}" if server == "transerve" and triton and transerve is not None else ""
        lines.append(
            f"| {server} | {protocol} | {concurrency} | {throughput[(protocol, concurrency, server)]:.0f} "
            f"| {percentile(latencies, 0.50) * 1e3:.2f} | {percentile(latencies, 0.99) * 1e3:.2f} | {ratio} "
            f"| {sum(r.errors for r in group)} | {max(r.client_cpu for r in group) * 100:.0f}% |"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- main


def parse_address(url: str) -> tuple[str, int]:
    """Accept host:port or http://host:port."""
    host_port = url.split("://", 1)[-1].rstrip("/")
    host, _, port = host_port.rpartition(":")
    return host or "127.0.0.1", int(port)


def comma_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


@contextlib.contextmanager
def servers_under_test(args: argparse.Namespace) -> Iterator[dict[str, tuple[str, int]]]:
    """The servers' addresses: given by URL, or started here (and stopped on exit) with tests/support."""
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    from support import EXAMPLE_REPOSITORY, TritonUnavailable, start_transerve, start_triton

    urls = {"transerve": args.transerve_url, "triton": args.triton_url}
    with contextlib.ExitStack() as stack:
        addresses = {}
        for name in args.servers:
            if urls[name]:
                addresses[name] = parse_address(urls[name])
                continue
            print(f"starting {name} on {EXAMPLE_REPOSITORY} ...", file=sys.stderr)
            try:
                server = stack.enter_context(
                    start_transerve(EXAMPLE_REPOSITORY) if name == "transerve" else start_triton(EXAMPLE_REPOSITORY)
                )
            except TritonUnavailable as exc:
                raise SystemExit(f"cannot start Triton: {exc}\n(use --servers transerve, or --triton-url)") from exc
            addresses[name] = ("127.0.0.1", server.http_port)
        yield addresses


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds per run (default 5)")
    parser.add_argument("--warmup", type=float, default=1.0, help="uncounted seconds before each run (default 1)")
    parser.add_argument("--rounds", type=int, default=2, help="runs per server and row, alternating (default 2)")
    parser.add_argument("--concurrency", type=lambda s: [int(c) for c in comma_list(s)], default=[1, 16, 64],
                        help="comma-separated connection counts (default 1,16,64)")
    parser.add_argument("--protocols", type=comma_list, default=["json", "binary"], help="json,binary")
    parser.add_argument("--servers", type=comma_list, default=["transerve", "triton"], help="transerve,triton")
    parser.add_argument("--transerve-url", help="use this running transerve (host:port) instead of starting one")
    parser.add_argument("--triton-url", help="use this running Triton (host:port) instead of starting one")
    parser.add_argument("--client-processes", type=int, default=1,
                        help="client processes to spread connections over (default 1; on a 2-core machine a second "
                             "client process takes CPU from the server)")
    args = parser.parse_args(argv)
    for name in args.servers:
        if name not in ("transerve", "triton"):
            parser.error(f"unknown server {name!r}")
    for protocol in args.protocols:
        if protocol not in PROTOCOLS:
            parser.error(f"unknown protocol {protocol!r}")

    runs: list[RunResult] = []
    with servers_under_test(args) as addresses:
        for host, port in addresses.values():
            for protocol in args.protocols:
                check_answer(host, port, protocol)
        for protocol in args.protocols:
            for concurrency in args.concurrency:
                for round_index in range(args.rounds):
                    # One run of each server per round, so the runs go A/B/A/B and machine drift hits both.
                    for name in args.servers:
                        run = run_once(name, addresses[name], protocol, concurrency, args.client_processes,
                                       args.warmup, args.duration)
                        runs.append(run)
                        print(f"round {round_index + 1}/{args.rounds} {name:9s} {protocol:6s} c={concurrency:<3d} "
                              f"{len(run.latencies) / run.duration:8.0f} req/s  errors {run.errors}", file=sys.stderr)
    print(report(runs, args.servers, args.protocols))


if __name__ == "__main__":
    main()
