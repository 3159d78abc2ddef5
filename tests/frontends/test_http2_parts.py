"""The native gRPC transport's parts in process: request heads from HPACK blocks (and their reuse while the dynamic
table stays the same), grpc-timeout, grpc-message encoding, gRPC message framing across DATA frames, and when a
connection gives window back: as the calls take their messages, the next one as it arrives."""

from __future__ import annotations

import asyncio

import pytest
from hpack import Decoder, Encoder
from support.h2client import request_headers

from transerve.frontends.grpc.http2.connection import MAX_FRAME, Http2Connection
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
from transerve.frontends.grpc.limits import CONNECTION_WINDOW, STREAM_WINDOW, Http2Limits


def request(path: str = "/s/M", *extra: tuple[str, str], method: str = "POST") -> list[tuple[str, str]]:
    return request_headers(path, *extra, method=method, authority="h")


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
        self.reading = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

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

    def call_opened(self, connection: Http2Connection, stream: Stream) -> bool:
        self.streams.append(stream)
        return False

    def call_ended(self, connection: Http2Connection, stream: Stream) -> bool:
        return False

    def call_closed(self, connection: Http2Connection, stream: Stream) -> None:
        pass

    def call_cancelled(self, connection: Http2Connection, stream: Stream) -> None:
        pass


def _window_updates(out: bytes, stream_id: int) -> list[int]:
    updates, offset = [], 0
    while offset < len(out):
        length, kind = int.from_bytes(out[offset:offset + 3], "big"), out[offset + 3]
        if kind == WINDOW_UPDATE and int.from_bytes(out[offset + 5:offset + 9], "big") == stream_id:
            updates.append(int.from_bytes(out[offset + 9:offset + 13], "big"))
        offset += 9 + length
    return updates


def _open(calls: _Calls) -> tuple[Http2Connection, _Transport]:
    transport = _Transport()
    connection = Http2Connection(calls, Http2Limits(), lambda _: None)
    connection.connection_made(transport)  # type: ignore[arg-type]
    connection.data_received(PREFACE + frame(SETTINGS, 0, 0) + frame(HEADERS, 0x4, 1, Encoder().encode(request())))
    return connection, transport


def test_messages_queued_behind_the_next_one_get_window_only_as_the_reader_takes_them() -> None:
    async def run() -> None:
        calls = _Calls()
        connection, transport = _open(calls)
        message = _framed(b"m" * (128 * 1024 - 5))  # 128 KiB on the wire
        count = STREAM_WINDOW // len(message)  # the whole stream window
        connection.data_received(b"".join(frame(DATA, 0, 1, message) for _ in range(count)))
        await asyncio.sleep(0)
        stream = calls.streams[0]
        assert len(stream.messages) == count
        # Only the message the reader takes next was given back: the client is held back.
        assert sum(_window_updates(bytes(transport.out), 1)) < STREAM_WINDOW // 2
        for _ in range(count // 2):
            connection.take(stream)
        await asyncio.sleep(0)
        assert sum(_window_updates(bytes(transport.out), 1)) >= STREAM_WINDOW // 4  # enough to go on sending
        while stream.messages:
            connection.take(stream)
        connection.data_received(frame(DATA, 0, 1, message))  # the client may send a window's worth again
        assert len(stream.messages) == 1

    asyncio.run(run())


def test_a_message_larger_than_the_windows_gets_window_as_it_arrives() -> None:
    async def run() -> None:
        calls = _Calls()
        connection, transport = _open(calls)
        body = _framed(b"x" * (CONNECTION_WINDOW + STREAM_WINDOW))
        await asyncio.sleep(0)
        sent = 0
        for start in range(0, len(body), MAX_FRAME):  # as a client would: only within the windows it was given
            window = min(STREAM_WINDOW + sum(_window_updates(bytes(transport.out), 1)),
                         65535 + sum(_window_updates(bytes(transport.out), 0))) - sent
            chunk = body[start:start + MAX_FRAME]
            assert len(chunk) <= window, "the server stopped giving window"
            connection.data_received(frame(DATA, 0, 1, chunk))
            sent += len(chunk)
            await asyncio.sleep(0)
        assert len(calls.streams[0].messages) == 1

    asyncio.run(run())


def test_a_connection_is_not_read_while_its_writes_are_paused() -> None:
    async def run() -> None:
        calls = _Calls()
        connection, transport = _open(calls)
        connection.pause_writing()
        assert not transport.reading  # a client that does not read gets nothing more read, PINGs included
        connection.resume_writing()
        assert transport.reading

    asyncio.run(run())
