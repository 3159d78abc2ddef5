"""The add_sub load generator: closed-loop HTTP/1.1 and gRPC clients cheap enough not to be the bottleneck.

The client speaks raw HTTP/1.1 over keep-alive connections with a minimal asyncio.Protocol on uvloop, with request
bytes built once: measured on the 2-core development machine against Triton at concurrency 16, that costs about
26 us of client CPU per request, where tritonclient.http.aio costs about 170 us (asyncio streams were within noise
of the protocol, at 27 us). Connections can be spread over several client processes, and a run reports the busiest
client process's CPU use so a reader can see when the client, not the server, was saturated.

gRPC is measured the same way, with unary ModelInfer calls carrying raw contents. gRPC's own Python clients are
too heavy for this: measured against Triton on the 2-core machine, a grpc.aio channel sending pre-serialized
bytes costs 150-230 us of client CPU per call, tritonclient.grpc.aio 130-260 us and grpcio's sync futures
170-210 us. So the client speaks just enough HTTP/2 itself (GrpcConnection): a constant header block and
message built once, all of a client process's calls multiplexed as streams on one connection (as gRPC
clients do, tritonclient's shared channel included).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import multiprocessing
import ssl
import struct
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

if TYPE_CHECKING:
    from multiprocessing.queues import Queue
    from multiprocessing.synchronize import Barrier

MODEL_PATH = "/v2/models/add_sub/infer"
GRPC_PATH = "/inference.GRPCInferenceService/ModelInfer"
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


def grpc_message(host: str) -> bytes:
    """A ModelInferRequest with raw contents, as a length-prefixed gRPC message (the header block is per connection)."""
    from tritonclient.grpc import service_pb2

    message = service_pb2.ModelInferRequest(model_name="add_sub")
    for name, values in (("INPUT0", INPUT0), ("INPUT1", INPUT1)):
        message.inputs.add(name=name, datatype="FP32", shape=[1, 4])
        message.raw_input_contents.append(struct.pack("<4f", *values))
    encoded = message.SerializeToString()
    return b"\x00" + len(encoded).to_bytes(4, "big") + encoded


PROTOCOLS = {"json": json_request, "binary": binary_request, "grpc": grpc_message}


def client_context(ca: str | None, alpn: str) -> ssl.SSLContext | None:
    """The client's TLS context when the server's certificate is signed by `ca`; None for plaintext."""
    if ca is None:
        return None
    context = ssl.create_default_context(cafile=ca)
    context.set_alpn_protocols([alpn])
    return context


def check_answer(host: str, port: int, protocol: str, ca: str | None = None) -> None:
    """One request with a full parse of the answer, so that a benchmark never measures a fast wrong answer."""
    if protocol == "grpc":
        check_grpc_answer(host, port, ca)
        return
    request = PROTOCOLS[protocol](f"{host}:{port}")
    head, body = request.split(b"\r\n\r\n", 1)
    headers = dict(line.split(": ", 1) for line in head.decode().split("\r\n")[1:])
    context = client_context(ca, "http/1.1")
    conn = (http.client.HTTPConnection(host, port, timeout=30) if context is None
            else http.client.HTTPSConnection(host, port, timeout=30, context=context))
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


def check_grpc_answer(host: str, port: int, ca: str | None = None) -> None:
    """The benchmark's own request bytes, sent with grpcio and its answer parsed in full."""
    import grpc
    from tritonclient.grpc import service_pb2

    target = f"{host}:{port}"
    with (grpc.insecure_channel(target) if ca is None else
          grpc.secure_channel(target, grpc.ssl_channel_credentials(Path(ca).read_bytes()))) as channel:
        call = channel.unary_unary(GRPC_PATH, response_deserializer=service_pb2.ModelInferResponse.FromString)
        try:
            response = call(grpc_message(host)[5:], timeout=30)
        except grpc.RpcError as exc:
            raise SystemExit(f"{host}:{port} grpc: {exc.code().name}: {exc.details()}") from None
    outputs = {o.name: list(struct.unpack("<4f", raw))
               for o, raw in zip(response.outputs, response.raw_output_contents, strict=True)}
    expected = [a + b for a, b in zip(INPUT0, INPUT1, strict=True)]
    if outputs.get("OUTPUT0") != expected:
        raise SystemExit(f"{host}:{port} grpc: wrong OUTPUT0 {outputs.get('OUTPUT0')}, expected {expected}")


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


_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_H2_FRAME = struct.Struct(">I B I")  # length (24 bits, shifted into the first 4 bytes with the type), flags, stream
_H2_MAX_WINDOW = 2**31 - 1
_DATA, _HEADERS, _RST_STREAM, _SETTINGS, _PING, _GOAWAY, _WINDOW_UPDATE = 0, 1, 3, 4, 6, 7, 8
_END_STREAM, _ACK, _END_HEADERS = 0x1, 0x1, 0x4


def h2_frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return _H2_FRAME.pack(len(payload) << 8 | kind, flags, stream) + payload


def hpack_literal(name: str, value: str) -> bytes:
    """A header as an HPACK literal without indexing (no Huffman), so the block is the same for every request."""
    encoded_name, encoded_value = name.encode(), value.encode()
    assert len(encoded_name) < 127 and len(encoded_value) < 127
    return bytes([0, len(encoded_name)]) + encoded_name + bytes([len(encoded_value)]) + encoded_value


class GrpcConnection(asyncio.Protocol):
    """Unary gRPC calls as HTTP/2 streams over one connection (cleartext, or TLS), any number in flight at once.

    Just enough HTTP/2 for a load generator: the client's windows are opened wide once, the server's connection
    window is respected, SETTINGS and PING are acknowledged. Response headers are never decoded (a decoder that
    never reads values needs no HPACK state): a call succeeded when its answer carried a message, since a gRPC
    server answers an error with trailers only; `send` reports that as 200, anything else as 500.
    """

    def __init__(self, authority: str, scheme: str = "http") -> None:
        self.loop = asyncio.get_running_loop()  # once, not per call: it costs a getpid() syscall in CPython 3.11
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.headers = b"".join(hpack_literal(name, value) for name, value in [
            (":method", "POST"), (":scheme", scheme), (":path", GRPC_PATH), (":authority", authority),
            ("content-type", "application/grpc"), ("te", "trailers"),
        ])
        self.next_stream = 1
        self.calls: dict[int, list] = {}  # stream -> [future, answer carried a message]
        self.send_window = 65535  # the server's connection window for our DATA
        self.blocked: list[tuple[bytes, int]] = []  # frames (and their DATA size) waiting for the server's window
        self.received = 0  # DATA bytes not yet returned to the server's window
        self.closed: Exception | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        settings = struct.pack(">HI", 0x2, 0) + struct.pack(">HI", 0x4, _H2_MAX_WINDOW)  # no push, widest window
        transport.write(_H2_PREFACE + h2_frame(_SETTINGS, 0, 0, settings)  # type: ignore[attr-defined]
                        + h2_frame(_WINDOW_UPDATE, 0, 0, (_H2_MAX_WINDOW - 65535).to_bytes(4, "big")))

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer
        buffer += data
        offset = 0
        while len(buffer) - offset >= 9:
            head, flags, stream = _H2_FRAME.unpack_from(buffer, offset)
            length, kind = head >> 8, head & 0xFF
            end = offset + 9 + length
            if end > len(buffer):
                break
            stream &= 0x7FFFFFFF
            if kind == _DATA:
                self.received += length
                call = self.calls.get(stream)
                if call is not None and length:
                    call[1] = True
                if flags & _END_STREAM:
                    self._finish(stream)
            elif kind == _HEADERS:
                if flags & _END_STREAM:
                    self._finish(stream)
            elif kind == _RST_STREAM:
                self._finish(stream, failed=True)
            elif kind == _SETTINGS and not flags & _ACK:
                self.transport.write(h2_frame(_SETTINGS, _ACK, 0, b""))  # type: ignore[union-attr]
            elif kind == _PING and not flags & _ACK:
                self.transport.write(h2_frame(_PING, _ACK, 0, bytes(buffer[offset + 9:end])))  # type: ignore[union-attr]
            elif kind == _WINDOW_UPDATE and stream == 0:
                self.send_window += int.from_bytes(buffer[offset + 9:end], "big") & 0x7FFFFFFF
                self._unblock()
            elif kind == _GOAWAY:
                self._fail(ConnectionError("the server sent GOAWAY"))
            offset = end
        del buffer[:offset]
        if self.received > 1 << 20:
            self.transport.write(h2_frame(_WINDOW_UPDATE, 0, 0, self.received.to_bytes(4, "big")))  # type: ignore
            self.received = 0

    def _finish(self, stream: int, failed: bool = False) -> None:
        call = self.calls.pop(stream, None)
        if call is not None and not call[0].done():
            call[0].set_result(200 if call[1] and not failed else 500)

    def _unblock(self) -> None:
        while self.blocked and self.send_window >= self.blocked[0][1]:
            frames, size = self.blocked.pop(0)
            self.send_window -= size
            self.transport.write(frames)  # type: ignore[union-attr]

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(exc or ConnectionError("connection closed by the server"))

    def _fail(self, exc: Exception) -> None:
        self.closed = exc
        for future, _ in self.calls.values():
            if not future.done():
                future.set_exception(exc)
        self.calls.clear()

    async def send(self, message: bytes) -> int:
        """Call ModelInfer with one length-prefixed message; 200 when a message came back, else 500."""
        if self.closed is not None:
            raise ConnectionError(str(self.closed))
        stream = self.next_stream
        self.next_stream += 2
        future = self.loop.create_future()
        self.calls[stream] = [future, False]
        frames = (h2_frame(_HEADERS, _END_HEADERS, stream, self.headers)
                  + h2_frame(_DATA, _END_STREAM, stream, message))
        if self.blocked or self.send_window < len(message):  # only DATA payloads count against the window
            self.blocked.append((frames, len(message)))
        else:
            self.send_window -= len(message)
            self.transport.write(frames)  # type: ignore[union-attr]
        return await future


@dataclass
class WorkerResult:
    latencies: array = field(default_factory=lambda: array("d"))
    """Seconds, for each request started inside the measured window."""
    errors: int = 0
    cpu_fraction: float = 0.0
    """This process's CPU time over the measured window's wall time: near 1.0 means the client was saturated."""
    answered: int = 0
    """Every answer, warm-up included: what the server's CPU time over the whole run is divided by."""


async def drive(host: str, port: int, protocol_name: str, request: bytes, connections: int, warmup: float,
                duration: float, barrier: Barrier, ca: str | None = None) -> WorkerResult:
    """Keep `connections` requests in flight, back to back; record those started within the measured window.

    Over HTTP each request in flight has its own connection; over gRPC they are streams of one connection. With
    `ca`, connections speak TLS to a server whose certificate that CA signed for localhost.
    """
    loop = asyncio.get_running_loop()
    grpc = protocol_name == "grpc"
    context = client_context(ca, "h2" if grpc else "http/1.1")
    tls = {"ssl": context, "server_hostname": "localhost"} if context is not None else {}

    def factory() -> asyncio.Protocol:
        return GrpcConnection(f"{host}:{port}", "https" if context else "http") if grpc else Connection()

    protocols: list[Connection | GrpcConnection] = []
    for _ in range(1 if grpc else connections):
        _, protocol = await loop.create_connection(factory, host, port, **tls)
        protocols.append(protocol)
    protocols = [protocols[i % len(protocols)] for i in range(connections)]
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

    async def run(protocol: Connection | GrpcConnection) -> None:
        while True:
            started = time.perf_counter()
            if started >= end:
                return
            try:
                status = await protocol.send(request)
            except ConnectionError:
                result.errors += 1
                _, protocol = await loop.create_connection(factory, host, port, **tls)
                continue
            result.answered += 1
            if started >= measure_from:
                result.latencies.append(time.perf_counter() - started)
                if status != 200:
                    result.errors += 1

    await asyncio.wait_for(asyncio.gather(sample_cpu(), *(run(p) for p in protocols)), warmup + duration + RUN_GRACE_S)
    for protocol in set(protocols):
        if protocol.transport is not None:
            protocol.transport.close()
    result.cpu_fraction = (cpu_window[1] - cpu_window[0]) / duration
    return result


def worker_main(host: str, port: int, protocol: str, request: bytes, connections: int, warmup: float,
                duration: float, barrier: Barrier, results: Queue, ca: str | None = None) -> None:
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
        results.put(runner(drive(host, port, protocol, request, connections, warmup, duration, barrier, ca)))
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
    server_cpu: float | None = None
    """The server's main process's CPU seconds per answer (warm-up included), when its pid is known."""
    answered: int = 0
    """Requests answered, warm-up included (`latencies` holds the measured window's)."""

    def summary(self) -> dict[str, object]:
        """The run's numbers for JSON output: rates and percentiles, not every latency."""
        latencies = sorted(self.latencies)
        return {"server": self.server, "protocol": self.protocol, "concurrency": self.concurrency,
                "seconds": self.duration, "req_per_s": len(latencies) / self.duration,
                "p50_ms": percentile(latencies, 0.5) * 1e3, "p99_ms": percentile(latencies, 0.99) * 1e3,
                "errors": self.errors, "client_cpu": self.client_cpu,
                "server_us_per_req": None if self.server_cpu is None else self.server_cpu * 1e6}


def run_once(server: str, address: tuple[str, int], protocol: str, concurrency: int, processes: int,
             warmup: float, duration: float, request: bytes | None = None, ca: str | None = None,
             server_pid: int | None = None) -> RunResult:
    """One timed run: `concurrency` connections spread over up to `processes` client processes.

    `request` replaces the protocol's add_sub request with prepared bytes (other benchmarks reuse this driver);
    `ca` makes the connections TLS, trusting that CA; with `server_pid` the server's CPU time per answer is measured.
    """
    host, port = address
    request = request if request is not None else PROTOCOLS[protocol](f"{host}:{port}")
    processes = max(1, min(processes, concurrency))
    shares = [concurrency // processes + (1 if i < concurrency % processes else 0) for i in range(processes)]
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(processes)
    results = context.Queue()
    workers = [
        context.Process(target=worker_main,
                        args=(host, port, protocol, request, share, warmup, duration, barrier, results, ca))
        for share in shares
    ]
    server_process = psutil.Process(server_pid) if server_pid is not None else None
    server_cpu_before = sum(server_process.cpu_times()[:2]) if server_process is not None else 0.0
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
    answered = sum(r.answered for r in collected)
    server_cpu = ((sum(server_process.cpu_times()[:2]) - server_cpu_before) / answered
                  if server_process is not None and answered else None)
    return RunResult(server, protocol, concurrency, duration, latencies, sum(r.errors for r in collected),
                     max(r.cpu_fraction for r in collected), server_cpu, answered)



def percentile(sorted_values: list[float], fraction: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(fraction * len(sorted_values)))]

