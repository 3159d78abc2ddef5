"""A blocking HTTP/2 client that shows the frames themselves, for tests of a gRPC server's transport: bad frames,
flow control, GOAWAY. Headers are (de)compressed with `hpack`; everything else is spelled out here."""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

from hpack import Decoder, Encoder

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM = ACK = 0x1
END_HEADERS = 0x4
NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, REFUSED_STREAM, COMPRESSION_ERROR = 0, 1, 3, 6, 7, 9
INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE = 0x4, 0x5
HEALTH = "/grpc.health.v1.Health/Check"
INFER = "/inference.GRPCInferenceService/ModelInfer"
_HEAD = struct.Struct(">IBI")


@dataclass
class Frame:
    kind: int
    flags: int
    stream: int
    payload: bytes

    @property
    def error_code(self) -> int:
        """The code of a RST_STREAM or GOAWAY."""
        return struct.unpack_from(">I", self.payload, 4 if self.kind == GOAWAY else 0)[0]


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return _HEAD.pack(len(payload) << 8 | kind, flags, stream) + payload


def settings(values: dict[int, int]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(struct.pack(">HI", key, value) for key, value in values.items()))


def request_headers(path: str = HEALTH, *extra: tuple[str, str], method: str = "POST",
                    authority: str = "localhost") -> list[tuple[str, str]]:
    """A gRPC call's header list, before HPACK."""
    return [(":method", method), (":scheme", "http"), (":path", path), (":authority", authority),
            ("content-type", "application/grpc"), ("te", "trailers"), *extra]


def grpc_message(body: bytes, compressed: bool = False) -> bytes:
    return bytes([compressed]) + len(body).to_bytes(4, "big") + body


class H2Client:
    """One connection. `handshake` sends the preface and settings and waits for the server's SETTINGS."""

    def __init__(self, port: int, timeout: float = 30.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.encoder = Encoder()
        self.decoder = Decoder()
        self.buffer = b""
        self.server_settings: dict[int, int] = {}

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> H2Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def handshake(self, values: dict[int, int] | None = None) -> None:
        self.send(PREFACE + settings(values or {}))
        while True:
            received = self.read_frame()
            assert received is not None, "the server closed the connection during the handshake"
            if received.kind == SETTINGS and not received.flags & ACK:
                for offset in range(0, len(received.payload), 6):
                    key, value = struct.unpack_from(">HI", received.payload, offset)
                    self.server_settings[key] = value
                self.send(frame(SETTINGS, ACK, 0))
                return

    def headers(self, stream: int, path: str, *, end_stream: bool = False,
                extra: list[tuple[str, str]] | None = None, method: str = "POST") -> bytes:
        fields = request_headers(path, *(extra or []), method=method)
        return frame(HEADERS, END_HEADERS | (END_STREAM if end_stream else 0), stream, self.encoder.encode(fields))

    def read_frame(self) -> Frame | None:
        """The next frame, or None when the server closed the connection."""
        while True:
            if len(self.buffer) >= 9:
                head, flags, stream = _HEAD.unpack_from(self.buffer)
                end = 9 + (head >> 8)
                if len(self.buffer) >= end:
                    payload, self.buffer = self.buffer[9:end], self.buffer[end:]
                    return Frame(head & 0xFF, flags, stream & 0x7FFFFFFF, payload)
            try:
                chunk = self.sock.recv(1 << 20)
            except ConnectionResetError:
                return None
            if not chunk:
                return None
            self.buffer += chunk

    def until(self, kind: int, stream: int | None = None) -> Frame | None:
        """Read (answering PINGs and SETTINGS on the way) until a frame of `kind`; None at end of connection."""
        while (received := self.read_frame()) is not None:
            if received.kind == kind and (stream is None or received.stream == stream):
                return received
            if received.kind == SETTINGS and not received.flags & ACK:
                self.send(frame(SETTINGS, ACK, 0))
        return None

    def response(self, stream: int) -> tuple[dict[str, str], bytes, dict[str, str]]:
        """Headers, DATA and trailers of one stream (frames of other streams are dropped)."""
        head: dict[str, str] = {}
        data = b""
        while (received := self.read_frame()) is not None:
            if received.stream != stream:
                continue
            if received.kind == HEADERS:
                fields = dict(self.decoder.decode(received.payload))
                if not head:
                    head = fields
                    if received.flags & END_STREAM:
                        return head, data, head  # Trailers-Only
                else:
                    return head, data, fields
            elif received.kind == DATA:
                data += received.payload
                if received.payload:
                    self.send(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", len(received.payload))))
            elif received.kind == RST_STREAM:
                raise AssertionError(f"stream {stream} reset with code {received.error_code}")
        raise AssertionError(f"the connection closed before stream {stream} ended")
