"""Hostile HTTP/1.1 clients against a real transerve: what each costs the server, and a bystander meanwhile.

    unshare -n sh -c 'ip link set lo up; python -m benchmarks.http_hostile --json out.json'
    python -m benchmarks.http_hostile --probes long_url,connect,slowloris --slowloris 2000

Run it in a network namespace of its own (`unshare -n`, as above), so that ten thousand connections disturb no
one else's servers. The probes are issue 19's for HTTP/1.1, run in turn against one server started with the default
limits (plus --server-args): pipelining without ever reading an answer, a 16 MiB header line, 100,000 headers, a
70 KB URL, CONNECT, 10,000 slowloris connections (a header line every 2 s, never the end of the head), a body
shorter than its Content-Length, `Expect: 100-continue` with a 20 MB body (by hand and with curl), and a gzip bomb.

Meanwhile two bystander processes call add_sub 50 times a second each, one over a keep-alive HTTP connection opened
before the probes, one over gRPC. A row says what the server answered the probe, when it closed the probe's
connection(s) (measured from the probe's first byte, or for pipelining from when the client stopped reading), the
growth of the server process's resident memory (its peak during the probe, and what was left 2 s after), and the
bystanders' p99 latency and errors during the probe, and the issue's bounds that apply to it, met or not (the exit
status is 1 when one is not). All the probes take about 4 minutes. The client and the server each need a file per
slowloris connection: where the hard open-file limit is below about 11,000, raise it with `ulimit -n` in the
namespace (the script and the server raise their soft limits to it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import http.client
import json
import multiprocessing
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from benchmarks.common.machine import rss_bytes
from benchmarks.common.results import add_json_option, commit, write_json

ADD_SUB = json.dumps({"inputs": [
    {"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]},
    {"name": "INPUT1", "shape": [1, 4], "datatype": "FP32", "data": [1, 1, 1, 1]},
]}).encode()
TCP_ESTABLISHED = 1
BYSTANDER_INTERVAL_S = 0.02


#: What a probe returns: the server's answer, when the probe's connection(s) closed, and numbers for the bounds.
Outcome = tuple[str, str, dict[str, float]]


@dataclass
class Row:
    probe: str
    answer: str
    closed: str
    rss_peak_mb: float = 0.0
    rss_after_mb: float = 0.0
    window: tuple[float, float] = (0.0, 0.0)
    bystanders: dict[str, tuple[float, int, int]] = field(default_factory=dict)
    measures: dict[str, float] = field(default_factory=dict)
    bound: str = ""


# ------------------------------------------------------------------------------------------------ measuring


class RssSampler:
    """The server process's resident memory, sampled every 50 ms in a thread: a probe's peak above its baseline."""

    def __init__(self, pid: int) -> None:
        self._pid = pid
        self._peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def now(self) -> int:
        return rss_bytes(self._pid)

    @contextlib.contextmanager
    def probe(self, row: Row) -> Iterator[None]:
        baseline = self.now()
        self._peak = baseline
        start = time.monotonic()
        try:
            yield
        finally:
            row.window = (start, time.monotonic())
            row.rss_peak_mb = (self._peak - baseline) / 2**20
            time.sleep(2.0)
            row.rss_after_mb = (self.now() - baseline) / 2**20

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            with contextlib.suppress(OSError):
                self._peak = max(self._peak, self.now())


def http_bystander(port: int, stop: Callable[[], bool], out: multiprocessing.Queue) -> None:
    """add_sub over one keep-alive connection (a new one after an error), every BYSTANDER_INTERVAL_S."""
    records = []
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    while not stop():
        start = time.monotonic()
        try:
            connection.request("POST", "/v2/models/add_sub/infer", ADD_SUB, {"Content-Type": "application/json"})
            response = connection.getresponse()
            response.read()
            ok = response.status == 200
        except (OSError, http.client.HTTPException):
            ok = False
            connection.close()
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        records.append((start, time.monotonic() - start, ok))
        time.sleep(max(0.0, BYSTANDER_INTERVAL_S - (time.monotonic() - start)))
    out.put(("http", records))


def grpc_bystander(port: int, stop: Callable[[], bool], out: multiprocessing.Queue) -> None:
    import numpy as np
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        tensor = grpcclient.InferInput(name, [1, 4], "FP32")
        tensor.set_data_from_numpy(np.ones((1, 4), np.float32))
        inputs.append(tensor)
    records = []
    while not stop():
        start = time.monotonic()
        try:
            client.infer("add_sub", inputs, client_timeout=10)
            ok = True
        except Exception:  # noqa: BLE001 - any failure is an error of the bystander's
            ok = False
        records.append((start, time.monotonic() - start, ok))
        time.sleep(max(0.0, BYSTANDER_INTERVAL_S - (time.monotonic() - start)))
    out.put(("grpc", records))


def _bystander_main(kind: str, port: int, stop_event: multiprocessing.Event, out: multiprocessing.Queue) -> None:
    (http_bystander if kind == "http" else grpc_bystander)(port, stop_event.is_set, out)


def p99_ms(latencies: list[float]) -> float:
    if not latencies:
        return float("nan")
    ordered = sorted(latencies)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000


# ------------------------------------------------------------------------------------------------ probe helpers


def tcp_state(sock: socket.socket) -> int:
    """The kernel's TCP state of our end: it leaves ESTABLISHED when the server sends FIN or RST, even while
    answers are still unread in our receive buffer."""
    try:
        return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
    except OSError:
        return 0


@dataclass
class Exchange:
    status: str = "no answer"
    answered_s: float | None = None
    closed_s: float | None = None
    sent: int = 0


def send_and_watch(port: int, payload: bytes, wait_s: float, then: bytes = b"") -> Exchange:
    """Send `payload` from a thread (the server may stop reading it) while reading the answer; `then` is sent once
    the payload is (as the rest of a body after `Expect: 100-continue`)."""
    result = Exchange()
    sock = socket.create_connection(("127.0.0.1", port))
    start = time.monotonic()

    def send() -> None:
        for data in (payload, then):
            view = memoryview(data)
            while view:
                try:
                    count = sock.send(view[:1 << 20])
                except OSError:
                    return
                result.sent += count
                view = view[count:]

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    received = b""
    sock.settimeout(0.2)
    deadline = start + wait_s
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except OSError:
            chunk = b""
        if received == b"" and chunk:
            result.answered_s = time.monotonic() - start
        received += chunk[: max(0, 4096 - len(received))]
        if not chunk:
            result.closed_s = time.monotonic() - start
            break
    sock.close()
    lines = [line for line in received.split(b"\r\n") if line.startswith(b"HTTP/1.1 ")]
    if lines:
        result.status = " then ".join(line[9:].decode("latin-1") for line in lines)
    return result


def describe(exchange: Exchange) -> Outcome:
    answer = exchange.status
    if exchange.answered_s is not None:
        answer += f" after {exchange.answered_s:.2f} s"
    closed = f"{exchange.closed_s:.2f} s" if exchange.closed_s is not None else "not closed"
    return answer, closed, {"closed_s": exchange.closed_s if exchange.closed_s is not None else float("inf")}


# ------------------------------------------------------------------------------------------------ probes


def probe_pipelining(port: int, args: argparse.Namespace) -> Outcome:
    """Connections that pipeline add_sub requests for `--pipeline-secs` and never read an answer."""
    request = (b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(ADD_SUB), ADD_SUB)) * 256
    socks = []
    for _ in range(args.pipeline_connections):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setblocking(False)
        socks.append(sock)
    sent = [0] * len(socks)
    start = time.monotonic()
    while time.monotonic() - start < args.pipeline_secs:
        progressed = False
        for index, sock in enumerate(socks):
            with contextlib.suppress(BlockingIOError, InterruptedError, OSError):
                sent[index] += sock.send(request)
                progressed = True
        if not progressed:
            time.sleep(0.05)
    closed_at: list[float | None] = [None] * len(socks)
    deadline = start + args.pipeline_secs + args.send_timeout + 10
    while time.monotonic() < deadline and None in closed_at:
        for index, sock in enumerate(socks):
            if closed_at[index] is None and tcp_state(sock) != TCP_ESTABLISHED:
                closed_at[index] = time.monotonic() - start
        time.sleep(0.1)
    for sock in socks:
        sock.close()
    requests = sum(sent) / len(request) * 256
    answer = f"{len(socks)} x {args.pipeline_secs:g} s: the server took {requests / len(socks):,.0f} requests a " \
             "connection, then stopped reading"
    closed = ", ".join(f"{value:.1f} s" if value is not None else "not closed" for value in closed_at)
    return answer, closed, {"connections": len(socks)}


def probe_header_line(port: int, args: argparse.Namespace) -> Outcome:
    payload = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * (16 << 20) + b"\r\n\r\n"
    exchange = send_and_watch(port, payload, 20)
    answer, closed, measures = describe(exchange)
    return f"{answer} (read {exchange.sent / 2**20:.1f} MiB of 16)", closed, measures


def probe_many_headers(port: int, args: argparse.Namespace) -> Outcome:
    payload = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n" + b"".join(
        b"X-%d: v\r\n" % index for index in range(100_000)) + b"\r\n"
    return describe(send_and_watch(port, payload, 20))


def probe_long_url(port: int, args: argparse.Namespace) -> Outcome:
    return describe(send_and_watch(port, b"GET /v2/" + b"a" * 70_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 20))


def probe_connect(port: int, args: argparse.Namespace) -> Outcome:
    return describe(send_and_watch(port, b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n", 20))


def probe_short_body(port: int, args: argparse.Namespace) -> Outcome:
    head = b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
    return describe(send_and_watch(port, head + ADD_SUB[:100], args.body_timeout + 15))


def _big_request(megabytes: int) -> tuple[bytes, bytes]:
    """An identity request of `megabytes` of binary FP32 data; its JSON header and its whole body."""
    count = megabytes * 1_000_000 // 4
    header = json.dumps({"inputs": [{"name": "INPUT_FP32", "shape": [1, count], "datatype": "FP32",
                                     "parameters": {"binary_data_size": count * 4}}],
                         "outputs": [{"name": "OUTPUT_FP32", "parameters": {"binary_data": True}}]}).encode()
    return header, header + bytes(count * 4)


def probe_expect(port: int, args: argparse.Namespace) -> Outcome:
    header, body = _big_request(20)
    head = (b"POST /v2/models/identity/infer HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
            b"Inference-Header-Content-Length: %d\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
            % (len(header), len(body)))
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    start = time.monotonic()
    sock.sendall(head)
    first = sock.recv(4096)
    continued = time.monotonic() - start
    sock.sendall(body)
    received = first
    while chunk := sock.recv(1 << 20):
        received += chunk
    total = time.monotonic() - start
    sock.close()
    statuses = [line[9:].decode() for line in received.split(b"\r\n") if line.startswith(b"HTTP/1.1 ")]
    answer = f"{' then '.join(statuses)}; 100 after {continued * 1000:.1f} ms, answer after {total:.2f} s"
    if shutil.which("curl"):
        with tempfile.NamedTemporaryFile() as file:
            file.write(body)
            file.flush()
            timing = subprocess.run(
                ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code} %{time_total}", "--data-binary",
                 f"@{file.name}", "-H", f"Inference-Header-Content-Length: {len(header)}",
                 "-H", "Content-Type: application/octet-stream",
                 f"http://127.0.0.1:{port}/v2/models/identity/infer"], capture_output=True, text=True, check=False)
        code, seconds = (timing.stdout.split() + ["?", "?"])[:2]
        answer += f"; curl (which sends Expect itself): {code} in {seconds} s"
    return answer, "after the answer (Connection: close)", {}


def probe_gzip_bomb(port: int, args: argparse.Namespace) -> Outcome:
    """20 bodies that inflate to just past the default --http-max-input-size."""
    bomb = gzip.compress(b"\0" * (64 * 2**20 + 1), compresslevel=9)
    statuses = []
    start = time.monotonic()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    for _ in range(20):
        connection.request("POST", "/v2/models/add_sub/infer", bomb, {"Content-Encoding": "gzip"})
        response = connection.getresponse()
        response.read()
        statuses.append(response.status)
    connection.close()
    each = (time.monotonic() - start) / 20
    return (f"{len(bomb) // 1024} KiB each: {sorted(set(statuses))} ({each * 1000:.0f} ms per request)",
            "kept alive", {})


def probe_slowloris(port: int, args: argparse.Namespace) -> Outcome:
    return asyncio.run(_slowloris(port, args.slowloris, args.header_timeout))


async def _slowloris(port: int, count: int, header_timeout: float) -> Outcome:
    """`count` connections that send a request line, then a header line every 2 s, never ending the head."""
    outcomes: list[tuple[str, float | None]] = []
    opened = 0
    failed = 0
    gate = asyncio.Semaphore(256)

    async def one(index: int) -> None:
        nonlocal opened, failed
        async with gate:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                failed += 1
                return
        opened += 1
        start = time.monotonic()
        writer.write(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n")
        status, closed = "no answer", None
        deadline = start + header_timeout + 20
        while time.monotonic() < deadline:
            try:
                data = await asyncio.wait_for(reader.read(4096), 2.0)
            except TimeoutError:
                with contextlib.suppress(OSError):
                    writer.write(b"X-%d: a\r\n" % index)
                continue
            except OSError:
                data = b""
            if data.startswith(b"HTTP/1.1 "):
                status = data[9:12].decode()
            if not data:
                closed = time.monotonic() - start
                break
        writer.close()
        outcomes.append((status, closed))

    await asyncio.gather(*(one(index) for index in range(count)))
    statuses: dict[str, int] = {}
    for status, _ in outcomes:
        statuses[status] = statuses.get(status, 0) + 1
    closed = [value for _, value in outcomes if value is not None]
    answer = f"{opened:,} opened ({failed} failed to connect): " + ", ".join(
        f"{number:,} answered {status}" for status, number in sorted(statuses.items()))
    measures = {"opened": opened, "closed": len(closed), "closed_max_s": max(closed, default=float("inf"))}
    if not closed:
        return answer, "none closed", measures
    return answer, f"{len(closed):,} closed, after {max(closed):.1f} s at most", measures


PROBES: dict[str, Callable[[int, argparse.Namespace], Outcome]] = {
    "pipelining": probe_pipelining,
    "header_line": probe_header_line,
    "many_headers": probe_many_headers,
    "long_url": probe_long_url,
    "connect": probe_connect,
    "slowloris": probe_slowloris,
    "short_body": probe_short_body,
    "expect": probe_expect,
    "gzip_bomb": probe_gzip_bomb,
}


# ------------------------------------------------------------------------------------------------ main


def raise_file_limit() -> int:
    """The client needs a file per slowloris connection: raise the soft limit to the hard one (raise the hard one
    with `ulimit -n` in the namespace); the server, a child, inherits it and raises its own likewise."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


#: The issue's bounds for every flood, and beyond them per probe.
RSS_BOUND_MB = 100.0
PIPELINING_BOUND_MB = 50.0
#: The timer that ends connections past their deadline runs twice a second; the client notices the close later still
#: when ten thousand of its connections are open in one process.
SWEEP_SLACK_S = 1.0


def judge(row: Row, args: argparse.Namespace, alive: bool) -> str:
    """The issue's bounds as they apply to this row: each one, and whether it was met."""
    checks: list[tuple[str, bool]] = []
    errors = sum(errors for _, errors, _ in row.bystanders.values())
    checks.append(("bystanders without errors", errors == 0))
    if row.probe == "pipelining":
        per_connection = row.rss_peak_mb / max(1, row.measures.get("connections", 1))
        checks.append((f"RSS {per_connection:+.1f} MB a connection < {PIPELINING_BOUND_MB:g}",
                       per_connection < PIPELINING_BOUND_MB))
    elif row.probe == "slowloris":
        limit = args.header_timeout + SWEEP_SLACK_S
        checks.append((f"all closed within {limit:g} s", row.measures.get("closed") == row.measures.get("opened")
                       and row.measures.get("closed_max_s", float("inf")) <= limit))
        checks.append((f"RSS < {RSS_BOUND_MB:g} MB", row.rss_peak_mb < RSS_BOUND_MB))
    elif row.probe in ("header_line", "many_headers", "long_url", "connect"):
        checks.append(("refused and closed at once", row.measures.get("closed_s", float("inf")) < 1.0))
    elif row.probe == "short_body":
        limit = args.body_timeout + SWEEP_SLACK_S
        checks.append((f"closed within {limit:g} s", row.measures.get("closed_s", float("inf")) <= limit))
    checks.append(("server alive", alive))
    return "; ".join(f"{name}: {'met' if ok else 'NOT MET'}" for name, ok in checks)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--probes", default=",".join(PROBES), help="comma-separated, from: " + ", ".join(PROBES))
    parser.add_argument("--slowloris", type=int, default=10_000, help="slowloris connections (default 10000)")
    parser.add_argument("--pipeline-connections", type=int, default=2)
    parser.add_argument("--pipeline-secs", type=float, default=15.0)
    parser.add_argument("--server-args", default="", help="more `transerve serve` flags, space-separated")
    add_json_option(parser)
    args = parser.parse_args()
    probes = [name.strip() for name in args.probes.split(",") if name.strip()]
    unknown = set(probes) - set(PROBES)
    if unknown:
        parser.error(f"unknown probes: {', '.join(sorted(unknown))}")
    server_args = args.server_args.split()
    # The probes wait as long as the server's timeouts (the defaults, unless --server-args changes them).
    defaults = {"--http-header-timeout-secs": 10.0, "--http-body-timeout-secs": 60.0, "--http-send-timeout-secs": 60.0}
    for flag in defaults:
        for item in server_args:
            if item.startswith(flag + "="):
                defaults[flag] = float(item.split("=", 1)[1])
    args.header_timeout = defaults["--http-header-timeout-secs"]
    args.body_timeout = defaults["--http-body-timeout-secs"]
    args.send_timeout = defaults["--http-send-timeout-secs"]
    file_limit = raise_file_limit()
    from benchmarks.common.servers import EXAMPLE_REPOSITORY, start_transerve

    rows: list[Row] = []
    context = multiprocessing.get_context("spawn")
    with start_transerve(EXAMPLE_REPOSITORY, *server_args) as server:
        print(f"transerve pid {server.process.pid} on {server.http_url}; bystanders starting", file=sys.stderr)
        stop, out = context.Event(), context.Queue()
        bystanders = [context.Process(target=_bystander_main, args=(kind, port, stop, out))
                      for kind, port in (("http", server.http_port), ("grpc", server.grpc_port))]
        for process in bystanders:
            process.start()
        time.sleep(3.0)
        sampler = RssSampler(server.process.pid)
        try:
            for name in probes:
                print(f"probe {name}", file=sys.stderr)
                row = Row(name, "", "")
                with sampler.probe(row):
                    row.answer, row.closed, row.measures = PROBES[name](server.http_port, args)
                rows.append(row)
        finally:
            sampler.stop()
            stop.set()
            records = dict(out.get(timeout=60) for _ in bystanders)
            for process in bystanders:
                process.join(timeout=30)
        alive = server.alive()
    for row in rows:
        for kind, samples in records.items():
            window = [(latency, ok) for start, latency, ok in samples if row.window[0] <= start <= row.window[1]]
            row.bystanders[kind] = (p99_ms([latency for latency, ok in window if ok]),
                                    sum(1 for _, ok in window if not ok), len(window))
        row.bound = judge(row, args, alive)
    setting = (f"commit {commit()}, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, open-file limit "
               f"{file_limit}, server flags: {args.server_args or 'the defaults'}")
    print(setting)
    print("| probe | server's answer | probe connection closed | server RSS growth, peak / after (MB) | "
          "bystander HTTP p99 ms (errors / calls) | bystander gRPC p99 ms (errors / calls) | issue's bounds |")
    print("|---|---|---|---:|---:|---:|---|")
    for row in rows:
        cells = [f"{p99:.1f} ({errors} / {calls})" if calls else "(no call)" for p99, errors, calls in
                 (row.bystanders.get(kind, (float("nan"), 0, 0)) for kind in ("http", "grpc"))]
        print(f"| {row.probe} | {row.answer} | {row.closed} | {row.rss_peak_mb:+.1f} / {row.rss_after_mb:+.1f} | "
              f"{cells[0]} | {cells[1]} | {row.bound} |")
    print(f"\nserver still serving at the end: {alive}", file=sys.stderr)
    if args.json:
        document = {"setting": setting, "server_alive": alive, "rows": [
            {"probe": row.probe, "answer": row.answer, "closed": row.closed, "rss_peak_mb": row.rss_peak_mb,
             "rss_after_mb": row.rss_after_mb, "measures": row.measures, "bounds": row.bound,
             "bystanders": {kind: {"p99_ms": p99 if calls else None, "errors": errors, "calls": calls}
                            for kind, (p99, errors, calls) in row.bystanders.items()}} for row in rows]}
        write_json(args.json, "http_hostile", document, args)
    return 0 if alive and all("NOT MET" not in row.bound for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
