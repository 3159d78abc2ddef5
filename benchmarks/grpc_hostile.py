"""Hostile HTTP/2 clients against transerve's gRPC listener, on both transports: what each flood costs the server.

    unshare -n sh -c 'ip link set lo up; python -m benchmarks.grpc_hostile'      # every probe, both transports
    python -m benchmarks.grpc_hostile --transports native --probes ping,settings --seconds 5

Each probe of issue 19's table runs, in turn, against one server per transport while a bystander calls ModelInfer
(add_sub) every 10 ms on a connection of its own:

- rapid_reset: HEADERS + DATA + RST_STREAM, as fast as the client can, reconnecting whenever cut, for --rr-seconds;
- ping / settings: PINGs or SETTINGS as fast as the client can write, never reading a byte;
- window_closed: 200 calls with 1 MiB answers (identity) on a client that never opens its window past 64 KiB;
- continuation: one HEADERS then 10 million zero-length CONTINUATION frames;
- streams_before_ack: 10,000 streams opened before the client acknowledges the server's SETTINGS.

Columns: the server process's RSS growth at its peak during the probe and after it (MB), the bystander's p99
latency and its errors, and how long after the client crossed its budget the server cut the flooding connection
(for window_closed: after the stall timeout; "-" where it never was within the probe). Bounds (issue 19): RSS growth
< 100 MB, p99 < 100 ms, 0 errors, cut < 1 s. Run it in a network namespace of its own: it floods loopback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common.machine import rss_bytes
from benchmarks.common.results import write_json

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0, 1, 3, 4, 6, 7, 8, 9
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1
HEAD = struct.Struct(">IBI")
INFER = "/inference.GRPCInferenceService/ModelInfer"
STALL_TIMEOUT = 30.0  # transerve's default --grpc-stall-timeout-secs


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return HEAD.pack(len(payload) << 8 | kind, flags, stream) + payload


def grpc_message(body: bytes) -> bytes:
    return b"\x00" + len(body).to_bytes(4, "big") + body


def request_blocks() -> tuple[bytes, bytes]:
    """A ModelInfer request's header block as a client sends it first (filling the dynamic table) and then (reading
    only the table, so that every later stream can reuse the same bytes)."""
    from hpack import Encoder

    encoder = Encoder()
    fields = [(":method", "POST"), (":scheme", "http"), (":path", INFER), (":authority", "localhost"),
              ("content-type", "application/grpc"), ("te", "trailers")]
    first = encoder.encode(fields)
    return first, encoder.encode(fields)


def add_sub_request() -> bytes:
    import numpy as np
    from tritonclient.grpc import service_pb2

    message = service_pb2.ModelInferRequest(model_name="add_sub")
    for name in ("INPUT0", "INPUT1"):
        message.inputs.add(name=name, datatype="FP32", shape=[1, 4])
        message.raw_input_contents.append(np.ones(4, np.float32).tobytes())
    return message.SerializeToString()


def identity_request(size: int) -> bytes:
    from tritonclient.grpc import service_pb2

    message = service_pb2.ModelInferRequest(model_name="identity")
    message.inputs.add(name="INPUT_UINT8", datatype="UINT8", shape=[1, size])
    message.raw_input_contents.append(bytes(size))
    return message.SerializeToString()


# ---- what is measured around a probe ----------------------------------------------------------------------------


class RssSampler(threading.Thread):
    """The server process's resident memory, every 20 ms."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self._pid = pid
        self.peak = self.now()
        self._done = threading.Event()

    def now(self) -> int:
        return rss_bytes(self._pid)

    def run(self) -> None:
        while not self._done.wait(0.02):
            with contextlib.suppress(OSError):
                self.peak = max(self.peak, self.now())

    def stop(self) -> None:
        self._done.set()
        self.join()


class Bystander(threading.Thread):
    """A well-behaved client on its own connection: one ModelInfer every 10 ms, latencies and errors counted."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        import grpc

        self._channel = grpc.insecure_channel(url)
        self._call = self._channel.unary_unary(INFER)
        self._request = add_sub_request()
        self.latencies: list[float] = []
        self.errors = 0
        self._done = threading.Event()
        self._call(self._request, timeout=30)  # connected before the probe starts

    def run(self) -> None:
        while not self._done.wait(0.01):
            started = time.perf_counter()
            try:
                self._call(self._request, timeout=10)
            except Exception:
                self.errors += 1
            else:
                self.latencies.append(time.perf_counter() - started)

    def stop(self) -> None:
        self._done.set()
        self.join()
        self._channel.close()

    def p99(self) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] if ordered else float("nan")


@dataclass
class Cut:
    """When the client crossed its budget and when the server cut the connection (None: it never did)."""

    crossed: float
    cut: float | None
    note: str = ""

    def delay(self) -> float | None:
        return None if self.cut is None else max(0.0, self.cut - self.crossed)


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def send_until_cut(sock: socket.socket, batches: Callable[[int], bytes | None], seconds: float) -> float | None:
    """Send batch after batch (None ends them) without reading; when the server cuts the connection, or None."""
    deadline = time.monotonic() + seconds
    sock.settimeout(0.5)
    index = 0
    pending = b""
    while time.monotonic() < deadline:
        if not pending:
            batch = batches(index)
            index += 1
            if batch is None:
                break
            pending = batch
        try:
            sent = sock.send(pending)
        except TimeoutError:
            continue  # the server stopped reading: go on trying until the probe's time is up
        except OSError:
            return time.monotonic()
        pending = pending[sent:]
    return wait_closed(sock, max(0.0, deadline - time.monotonic()) + 2.0)


def wait_closed(sock: socket.socket, seconds: float) -> float | None:
    """Read (and drop) until the server closes; when it did, or None."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            if not sock.recv(1 << 20):
                return time.monotonic()
        except TimeoutError:
            return None
        except OSError:
            return time.monotonic()
    return None


# ---- the probes ---------------------------------------------------------------------------------------------------


def rapid_reset(port: int, seconds: float) -> Cut:
    """HEADERS + DATA + RST_STREAM in a loop; a cut connection is replaced at once. Reports the slowest cut."""
    first, block = request_blocks()
    body = grpc_message(add_sub_request())
    deadline = time.monotonic() + seconds
    delays: list[float] = []
    connections = streams = 0
    while time.monotonic() < deadline:
        sock = connect(port)
        connections += 1
        closed: list[float] = []
        reader = threading.Thread(target=lambda s=sock, c=closed: c.append(wait_closed(s, seconds + 5) or 0.0),
                                  daemon=True)
        reader.start()
        crossed = None
        sent_resets = 0
        try:
            sock.sendall(PREFACE + frame(SETTINGS, 0, 0))
            stream = 1
            while time.monotonic() < deadline and not closed:
                batch = []
                for _ in range(100):
                    header = first if stream == 1 else block
                    batch += [frame(HEADERS, END_HEADERS, stream, header), frame(DATA, END_STREAM, stream, body),
                              frame(RST_STREAM, 0, stream, b"\x00\x00\x00\x08")]
                    stream += 2
                if sent_resets < 1000 <= sent_resets + 100:
                    crossed = time.monotonic()
                sock.sendall(b"".join(batch))
                sent_resets += 100
                streams += 100
        except OSError:
            pass
        reader.join(timeout=max(0.0, deadline - time.monotonic()) + 5)
        sock.close()
        if closed and closed[0] and crossed is not None:
            delays.append(closed[0] - crossed)
        elif crossed is not None:
            return Cut(crossed, None, f"{streams} streams sent on {connections} connection(s)")
    worst = max(delays) if delays else None
    return Cut(0.0, worst, f"{streams} streams sent on {connections} connection(s)")


def ping_flood(port: int, seconds: float) -> Cut:
    sock = connect(port)
    ping = frame(PING, 0, 0, b"\x00" * 8) * 4096
    crossed = time.monotonic()
    cut = send_until_cut(sock, lambda i: PREFACE + frame(SETTINGS, 0, 0) + ping if i == 0 else ping, seconds)
    sock.close()
    return Cut(crossed, cut)


def settings_flood(port: int, seconds: float) -> Cut:
    sock = connect(port)
    flood = frame(SETTINGS, 0, 0, struct.pack(">HI", 0x4, 65535)) * 4096
    crossed = time.monotonic()
    cut = send_until_cut(sock, lambda i: PREFACE + frame(SETTINGS, 0, 0) + flood if i == 0 else flood, seconds)
    sock.close()
    return Cut(crossed, cut)


def continuation_flood(port: int, seconds: float, count: int = 10_000_000) -> Cut:
    sock = connect(port)
    first, _ = request_blocks()
    per_batch = 100_000
    batch = frame(CONTINUATION, 0, 1) * per_batch
    opening = PREFACE + frame(SETTINGS, 0, 0) + frame(HEADERS, 0, 1, first[:4])
    crossed = time.monotonic()
    cut = send_until_cut(sock, lambda i: (opening + batch if i == 0 else batch) if i * per_batch < count else None,
                         seconds)
    sock.close()
    return Cut(crossed, cut)


def streams_before_ack(port: int, seconds: float, count: int = 10_000) -> Cut:
    """Streams opened (HEADERS without END_STREAM) by a client that reads but never acknowledges SETTINGS."""
    first, block = request_blocks()
    sock = connect(port)
    frames = [frame(HEADERS, END_HEADERS, 2 * index + 1, first if index == 0 else block) for index in range(count)]
    closed: list[float] = []
    reader = threading.Thread(target=lambda: closed.append(wait_closed(sock, seconds + 5) or 0.0), daemon=True)
    reader.start()
    crossed = time.monotonic()
    with contextlib.suppress(OSError):
        sock.sendall(PREFACE + frame(SETTINGS, 0, 0))
        for start in range(0, count, 500):
            if start <= 4096 + 1000 < start + 500:
                crossed = time.monotonic()
            sock.sendall(b"".join(frames[start:start + 500]))
    reader.join(seconds + 5)
    sock.close()
    return Cut(crossed, closed[0] if closed and closed[0] else None)


def window_closed(port: int, seconds: float, calls: int = 200, size: int = 1 << 20) -> Cut:
    """200 calls whose 1 MiB answers the client never gives window for; the cut is the last stream's reset (or the
    connection's end), counted from the stall timeout after the first answer stalled."""
    from h2.config import H2Configuration
    from h2.connection import H2Connection
    from h2.events import ConnectionTerminated, DataReceived, StreamEnded, StreamReset

    sock = connect(port)
    conn = H2Connection(H2Configuration(client_side=True, header_encoding="utf-8"))
    conn.initiate_connection()
    sock.sendall(conn.data_to_send())
    headers = [(":method", "POST"), (":scheme", "http"), (":path", INFER), (":authority", "localhost"),
               ("content-type", "application/grpc"), ("te", "trailers")]
    body = grpc_message(identity_request(size))
    pending = {}
    for _ in range(calls):
        stream = conn.get_next_available_stream_id()
        conn.send_headers(stream, headers)
        pending[stream] = memoryview(body)
    deadline = time.monotonic() + seconds
    first_data: float | None = None
    ended: set[int] = set()
    cut: float | None = None
    why = ""
    while time.monotonic() < deadline and cut is None:
        for stream, rest in list(pending.items()):  # send what the server's windows allow
            room = min(conn.local_flow_control_window(stream), conn.max_outbound_frame_size, len(rest))
            if room > 0:
                conn.send_data(stream, rest[:room].tobytes(), end_stream=room == len(rest))
                pending[stream] = rest[room:]
                if room == len(rest):
                    del pending[stream]
        sock.settimeout(10)
        try:
            sock.sendall(conn.data_to_send())
        except OSError:
            cut = time.monotonic()
            break
        sock.settimeout(0.05)
        try:
            data = sock.recv(1 << 20)
        except TimeoutError:
            continue
        except OSError:
            cut = time.monotonic()
            break
        if not data:
            cut = time.monotonic()
            break
        for event in conn.receive_data(data):
            if isinstance(event, DataReceived) and first_data is None:
                first_data = time.monotonic()
            elif isinstance(event, StreamReset | StreamEnded):
                ended.add(event.stream_id)
            elif isinstance(event, ConnectionTerminated):
                cut = time.monotonic()
                why = f", GOAWAY {event.error_code!s} {event.additional_data!r}"
        if len(ended) == calls:
            cut = time.monotonic()
    sock.close()
    crossed = (first_data or time.monotonic()) + STALL_TIMEOUT
    return Cut(crossed, cut, f"{len(ended)} of {calls} calls ended{why}")


PROBES: dict[str, tuple[Callable[[int, float], Cut], str]] = {
    "rapid_reset": (rapid_reset, "rapid reset (HEADERS+DATA+RST_STREAM)"),
    "ping": (ping_flood, "PING flood, never read"),
    "settings": (settings_flood, "SETTINGS flood, never read"),
    "window_closed": (window_closed, "200 x 1 MiB answers, window never opened"),
    "continuation": (continuation_flood, "10 million zero-length CONTINUATION"),
    "streams_before_ack": (streams_before_ack, "10,000 streams before SETTINGS ACK"),
}


@dataclass
class Row:
    transport: str
    probe: str
    growth_peak: float
    growth_after: float
    p99_ms: float
    errors: int
    calls: int
    cut: Cut


def run_probe(server, transport: str, name: str, seconds: float) -> Row:  # type: ignore[no-untyped-def]
    probe, _ = PROBES[name]
    bystander = Bystander(server.grpc_url)
    sampler = RssSampler(server.process.pid)
    before = sampler.now()
    sampler.start()
    bystander.start()
    time.sleep(0.5)
    try:
        cut = probe(server.grpc_port, seconds)
    finally:
        time.sleep(1.0)
        bystander.stop()
        sampler.stop()
    after = sampler.now()
    return Row(transport, name, (sampler.peak - before) / 1e6, (after - before) / 1e6, bystander.p99() * 1000,
               bystander.errors, len(bystander.latencies), cut)


def records(rows: list[Row]) -> list[dict]:
    """The rows as a list of objects (times in seconds, memory in MB); None where the connection was never cut."""
    return [{"transport": row.transport, "probe": row.probe, "rss_growth_peak_mb": round(row.growth_peak, 1),
                "rss_growth_after_mb": round(row.growth_after, 1), "bystander_p99_ms": round(row.p99_ms, 2),
                "bystander_errors": row.errors, "bystander_calls": row.calls, "cut_after_budget_s": row.cut.delay(),
                "note": row.cut.note} for row in rows]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transports", default="native,grpcio")
    parser.add_argument("--probes", default=",".join(PROBES))
    parser.add_argument("--seconds", type=float, default=10.0, help="how long each flood may go on (default 10)")
    parser.add_argument("--rr-seconds", type=float, default=20.0, help="how long the rapid reset runs (default 20)")
    parser.add_argument("--server-flags", default="", help="more `transerve serve` flags, e.g. '--grpc-http2-max-"
                        "ping-strikes 0 --grpc-stall-timeout-secs 2' (PINGs bounded by the read pause alone)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH ('-': stdout, no table)")
    args = parser.parse_args(argv)
    from benchmarks.common.servers import EXAMPLE_REPOSITORY, start_transerve

    rows: list[Row] = []
    for transport in args.transports.split(","):
        with start_transerve(EXAMPLE_REPOSITORY, f"--grpc-transport={transport}", *args.server_flags.split()) as server:
            for name in args.probes.split(","):
                seconds = args.rr_seconds if name == "rapid_reset" else (
                    STALL_TIMEOUT + 15 if name == "window_closed" else args.seconds)
                row = run_probe(server, transport, name, seconds)
                rows.append(row)
                print(f"{transport:7} {name:20} done: {row}", file=sys.stderr, flush=True)
                if server.process.poll() is not None:
                    raise SystemExit(f"the {transport} server died during {name}:\n{server.log_tail()}")
    if args.json == "-":
        print(json.dumps(records(rows), indent=2))
        return
    if args.json:
        write_json(Path(args.json), "grpc_hostile", records(rows), args)
    print("| transport | probe | RSS growth, peak / after (MB) | bystander p99 (ms) | bystander errors / calls "
          "| cut after budget (s) | note |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        delay = row.cut.delay()
        print(f"| {row.transport} | {PROBES[row.probe][1]} | {row.growth_peak:.0f} / {row.growth_after:.0f} | "
              f"{row.p99_ms:.1f} | {row.errors} / {row.calls} | {'-' if delay is None else f'{delay:.2f}'} | "
              f"{row.cut.note} |")


if __name__ == "__main__":
    main()
