"""The native gRPC transport's parts in process: request heads from HPACK blocks (and their reuse while the dynamic
table stays the same), grpc-timeout, grpc-message encoding, gRPC message framing across DATA frames, and when a
connection gives a stream's window back."""

from __future__ import annotations

import asyncio

import pytest
from hpack import Decoder, Encoder

from transerve.frontends.grpc.http2.connection import MAX_FRAME, QUEUED_MESSAGES, STREAM_WINDOW, Http2Connection
from transerve.frontends.grpc.http2.frames import (
    COMPRESSION_ERROR,
    DATA,
    HEADERS,
    PREFACE,
    SETTINGS,
    WINDOW_UPDATE,
    H2ConnectionError,
    H2StreamError,
    frame,
)
from transerve.frontends.grpc.http2.headers import (
    INTERNAL,
    RESOURCE_EXHAUSTED,
    UNIMPLEMENTED,
    HeaderDecoder,
    percent_encode,
)
from transerve.frontends.grpc.http2.stream import CallRefused, Stream


def request(path: str = "/s/M", *extra: tuple[str, str], method: str = "POST") -> list[tuple[str, str]]:
    return [(":method", method), (":scheme", "http"), (":path", path), (":authority", "h"),
            ("content-type", "application/grpc"), ("te", "trailers"), *extra]


def test_a_block_that_reads_the_table_is_reused_only_while_the_table_is_unchanged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    encoder, reference, decoder = Encoder(), Decoder(), HeaderDecoder(1 << 16)
    blocks = [encoder.encode(request("/s/A")), encoder.encode(request("/s/A")), encoder.encode(request("/s/B"))]
    for block in blocks[:2]:
        reference.decode(block)
        assert decoder.request_head(block).path == b"/s/A"
    with monkeypatch.context() as patch:  # blocks[1] only reads the table: its head comes from the cache
        patch.setattr(decoder._decoder, "decode", lambda *args, **kwargs: pytest.fail("decoded again"))
        assert decoder.request_head(blocks[1]).path == b"/s/A"
    reference.decode(blocks[2])
    assert decoder.request_head(blocks[2]).path == b"/s/B"
    # blocks[2] changed the table, so replayed now blocks[1] means something else: here :path (now /s/B) comes
    # after the regular headers, which is malformed. The head cached from before must not answer for it.
    replay = reference.decode(blocks[1])
    assert replay != request("/s/A") and (":path", "/s/B") in replay
    with pytest.raises(H2StreamError):
        decoder.request_head(blocks[1])


@pytest.mark.parametrize(
    ("extra", "timeout", "refusal"),
    [
        ((), None, None),
        ((("grpc-timeout", "200m"),), 0.2, None),
        ((("grpc-timeout", "3S"),), 3.0, None),
        ((("grpc-timeout", "99999999n"),), 0.099999999, None),
        ((("grpc-timeout", "123456789S"),), None, INTERNAL),  # at most 8 digits
        ((("grpc-timeout", "5X"),), None, INTERNAL),
        ((("grpc-encoding", "identity"),), None, None),
        ((("grpc-encoding", "gzip"),), None, UNIMPLEMENTED),
    ],
)
def test_grpc_headers(extra: tuple[tuple[str, str], ...], timeout: float | None, refusal: int | None) -> None:
    head = HeaderDecoder(1 << 16).request_head(Encoder().encode(request("/s/M", *extra)))
    assert head.path == b"/s/M" and head.http_status == 200
    assert head.timeout == pytest.approx(timeout)
    assert (head.refusal[0] if head.refusal else None) == refusal


def test_not_grpc_gets_an_http_status() -> None:
    assert HeaderDecoder(1 << 16).request_head(Encoder().encode(request(method="GET"))).http_status == 405
    fields = [f for f in request() if f[0] != "content-type"] + [("content-type", "application/json")]
    assert HeaderDecoder(1 << 16).request_head(Encoder().encode(fields)).http_status == 415


@pytest.mark.parametrize(
    "fields",
    [
        [(":method", "POST"), (":scheme", "http"), ("content-type", "application/grpc")],  # no :path
        request("/s/M", ("X-Upper", "1")),
        request("/s/M", ("connection", "close")),
        request("/s/M", ("te", "gzip")),
        [("content-type", "application/grpc"), *request()],  # a pseudo-header after a regular one
        [*request(), (":path", "/again")],
        [(":status", "200"), *request()],
    ],
    ids=["no_path", "uppercase", "connection", "te", "pseudo_after_regular", "duplicate_path", "response_pseudo"],
)
def test_malformed_requests_are_stream_errors(fields: list[tuple[str, str]]) -> None:
    with pytest.raises(H2StreamError):
        HeaderDecoder(1 << 16).request_head(Encoder().encode(fields))


def test_a_bad_block_is_a_compression_error() -> None:
    with pytest.raises(H2ConnectionError) as caught:
        HeaderDecoder(1 << 16).request_head(b"\xff\xff\xff\xff\xff")
    assert caught.value.code == COMPRESSION_ERROR


def test_percent_encoding() -> None:
    assert percent_encode("plain text: ok") == "plain text: ok"
    assert percent_encode("héllo 100%\n") == "h%C3%A9llo 100%25%0A"


def _stream() -> Stream:
    return Stream(1, HeaderDecoder(1 << 16).request_head(Encoder().encode(request())), 1 << 20, 65535)


def _framed(body: bytes, flag: int = 0) -> bytes:
    return bytes([flag]) + len(body).to_bytes(4, "big") + body


def test_messages_split_anywhere_across_frames() -> None:
    wire = _framed(b"first") + _framed(b"") + _framed(b"x" * 1000) + _framed(b"last")
    for cut in (1, 3, 5, 7, 20, 999):
        stream = _stream()
        for start in range(0, len(wire), cut):
            stream.feed(memoryview(wire[start:start + cut]), 1 << 20)
        assert [bytes(m) for m in stream.messages] == [b"first", b"", b"x" * 1000, b"last"]
        assert not stream.inbox


@pytest.mark.parametrize(("wire", "status"), [(_framed(b"zz", 1), UNIMPLEMENTED), (_framed(b"zz", 2), INTERNAL),
                                              (_framed(b"z" * 101), RESOURCE_EXHAUSTED)])
def test_refused_messages(wire: bytes, status: int) -> None:
    with pytest.raises(CallRefused) as caught:
        _stream().feed(memoryview(wire), 100)
    assert caught.value.status == status


# ---- flow control of a connection, driven in process -----------------------------------------------------------


class _Transport:
    """Collects what the connection writes."""

    def __init__(self) -> None:
        self.out = bytearray()

    def writelines(self, parts: list[bytes]) -> None:
        for part in parts:
            self.out += part

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default  # a plain socket: no "sslcontext"


class _Calls:
    """A handler that starts nothing, so that messages stay queued as if their reader were busy."""

    def __init__(self) -> None:
        self.streams: list[Stream] = []

    def call_opened(self, connection: Http2Connection, stream: Stream) -> None:
        self.streams.append(stream)

    def call_ended(self, connection: Http2Connection, stream: Stream) -> None:
        pass


def _stream_window_updates(out: bytes) -> list[int]:
    updates, offset = [], 0
    while offset < len(out):
        length, kind = int.from_bytes(out[offset:offset + 3], "big"), out[offset + 3]
        if kind == WINDOW_UPDATE and int.from_bytes(out[offset + 5:offset + 9], "big"):
            updates.append(int.from_bytes(out[offset + 9:offset + 13], "big"))
        offset += 9 + length
    return updates


def test_a_streaming_call_whose_reader_is_behind_gets_no_window_until_it_reads() -> None:
    async def run() -> None:
        calls, transport = _Calls(), _Transport()
        connection = Http2Connection(calls, 1 << 31, lambda _: None)
        connection.connection_made(transport)  # type: ignore[arg-type]
        message = _framed(b"m" * (128 * 1024 - 5))  # 128 KiB on the wire
        count = QUEUED_MESSAGES + 6  # more than the queue limit, and more than half a window in bytes
        assert count * len(message) > STREAM_WINDOW // 2
        connection.data_received(PREFACE + frame(SETTINGS, 0, 0) + frame(HEADERS, 0x4, 1, Encoder().encode(request()))
                                 + b"".join(frame(DATA, 0, 1, message) for _ in range(count)))
        await asyncio.sleep(0)
        stream = calls.streams[0]
        assert len(stream.messages) == count
        assert _stream_window_updates(bytes(transport.out)) == []  # the client is held back
        while len(stream.messages) >= QUEUED_MESSAGES:
            stream.messages.popleft()
            connection.consumed(stream)
        await asyncio.sleep(0)
        assert _stream_window_updates(bytes(transport.out)) == [count * len(message)]

    asyncio.run(run())


def test_a_message_larger_than_half_a_window_gets_window_as_it_arrives() -> None:
    async def run() -> None:
        calls, transport = _Calls(), _Transport()
        connection = Http2Connection(calls, 1 << 31, lambda _: None)
        connection.connection_made(transport)  # type: ignore[arg-type]
        body = _framed(b"x" * (STREAM_WINDOW - 5))  # needs the whole window: the rest of it must be given back
        frames = [frame(DATA, 0, 1, body[i:i + MAX_FRAME]) for i in range(0, len(body), MAX_FRAME)]
        connection.data_received(PREFACE + frame(SETTINGS, 0, 0) + frame(HEADERS, 0x4, 1, Encoder().encode(request()))
                                 + b"".join(frames))
        await asyncio.sleep(0)
        assert calls.streams[0].messages and sum(_stream_window_updates(bytes(transport.out))) >= STREAM_WINDOW // 2

    asyncio.run(run())
