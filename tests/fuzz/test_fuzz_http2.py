"""Property-based tests of the native gRPC transport's HTTP/2 frame layer, in process on a fake transport: whatever
frames (or bytes) a client sends, however they are split, nothing escapes the connection, what it writes is
well-formed HTTP/2, it either goes on or ends with GOAWAY carrying a protocol error code (never INTERNAL_ERROR,
which would be a bug of ours), and what it holds for the client stays bounded."""

from __future__ import annotations

import struct
from collections.abc import Iterator

import pytest
from hpack import Encoder
from hypothesis import given
from hypothesis import strategies as st
from support.fuzzing import FakeTransport, Loop, cut, h2_connection, h2_frames, settle
from support.h2client import request_headers

from transerve.frontends.grpc.http2 import frames as h2
from transerve.frontends.grpc.http2.connection import MAX_FRAME, MAX_HEADER_LIST, Http2Connection
from transerve.frontends.grpc.http2.stream import Stream

#: What a GOAWAY may carry for what a client did; INTERNAL_ERROR would mean our own code failed.
CLIENT_FAULTS = {h2.NO_ERROR, h2.PROTOCOL_ERROR, h2.FLOW_CONTROL_ERROR, h2.STREAM_CLOSED, h2.FRAME_SIZE_ERROR,
                 h2.COMPRESSION_ERROR, h2.ENHANCE_YOUR_CALM}
RESET_CODES = CLIENT_FAULTS | {h2.REFUSED_STREAM, h2.CANCEL}


@pytest.fixture(scope="module")
def loop() -> Iterator[Loop]:
    with Loop() as loop:
        yield loop


class _Answer:
    """Answers each call once its request has all arrived, as a unary gRPC method would."""

    def call_opened(self, connection: Http2Connection, stream: Stream) -> bool:
        return False

    def call_ended(self, connection: Http2Connection, stream: Stream) -> bool:
        if stream.head.http_status != 200:
            connection.reply_http(stream, stream.head.http_status)
        else:
            connection.respond(stream, b"".join(bytes(message) for message in stream.messages) or b"empty")
        return False

    def call_closed(self, connection: Http2Connection, stream: Stream) -> None:
        pass

    def call_cancelled(self, connection: Http2Connection, stream: Stream) -> None:
        pass


async def _drive(chunks: list[bytes]) -> tuple[FakeTransport, Http2Connection]:
    transport = FakeTransport()
    connection = h2_connection(_Answer())
    connection.connection_made(transport)
    for chunk in chunks:
        if transport.closed:
            break
        connection.data_received(chunk)
        await settle(3)
        _assert_bounded(connection)
    await settle(3)
    if not transport.closed:
        connection.connection_lost(None)
    await settle(2)
    return transport, connection


def _assert_bounded(connection: Http2Connection) -> None:
    """What a client makes the connection hold: at most one frame unparsed, one header block being collected."""
    assert len(connection._buffer) <= h2.HEAD_SIZE + MAX_FRAME
    if connection._blocks.pending is not None:
        assert len(connection._blocks.pending[2]) <= MAX_HEADER_LIST


def _check_answer(transport: FakeTransport) -> list[tuple[int, int, int, bytes]]:
    frames = h2_frames(bytes(transport.out))
    assert frames and frames[0][0] == h2.SETTINGS, "the server's preface is its SETTINGS"
    goaways = [payload for kind, _, _, payload in frames if kind == h2.GOAWAY]
    for payload in goaways:
        assert len(payload) >= 8 and struct.unpack_from(">I", payload, 4)[0] in CLIENT_FAULTS, payload
    for kind, _, stream_id, payload in frames:
        if kind == h2.RST_STREAM:
            assert stream_id and struct.unpack(">I", payload)[0] in RESET_CODES
        assert kind in (h2.DATA, h2.HEADERS, h2.RST_STREAM, h2.SETTINGS, h2.PING, h2.GOAWAY, h2.WINDOW_UPDATE,
                        h2.CONTINUATION)
    if transport.closed:
        assert goaways, "the connection closed without GOAWAY"
    return frames


# ---- inputs -----------------------------------------------------------------------------------------------------

_ENCODER = Encoder()
_REQUEST = request_headers("/s/M", authority="h")
#: Blocks that decode on a fresh connection: they never add to the dynamic table.
_BLOCKS = [Encoder().encode(_REQUEST), Encoder().encode(_REQUEST[:2]), Encoder().encode([(":method", "GET")] +
                                                                                          _REQUEST[1:])]
_STREAM_IDS = st.one_of(st.sampled_from([0, 1, 1, 3, 3, 5, 2, 0x7FFFFFFF, 0x80000001]), st.integers(0, 2**32 - 1))
_U32 = st.one_of(st.sampled_from([0, 1, 65535, 2**31 - 1, 2**31, 2**32 - 1]), st.integers(0, 2**32 - 1))


def _setting(key: int, value: int) -> bytes:
    return struct.pack(">HI", key, value)


_PAYLOADS = {
    h2.DATA: st.one_of(st.binary(max_size=64),
                       st.binary(max_size=40).map(lambda body: b"\0" + len(body).to_bytes(4, "big") + body)),
    h2.HEADERS: st.one_of(st.sampled_from(_BLOCKS), st.binary(max_size=40)),
    h2.PRIORITY: st.binary(min_size=4, max_size=6),
    h2.RST_STREAM: st.one_of(_U32.map(lambda code: struct.pack(">I", code)), st.binary(max_size=6)),
    h2.SETTINGS: st.one_of(
        st.lists(st.tuples(st.integers(0, 8), _U32), max_size=4).map(
            lambda pairs: b"".join(_setting(key, value) for key, value in pairs)),
        st.binary(max_size=13)),
    h2.PUSH_PROMISE: st.binary(max_size=8),
    h2.PING: st.one_of(st.binary(min_size=8, max_size=8), st.binary(max_size=10)),
    h2.GOAWAY: st.one_of(st.tuples(_U32, _U32).map(lambda pair: struct.pack(">II", *pair)), st.binary(max_size=12)),
    h2.WINDOW_UPDATE: st.one_of(_U32.map(lambda value: struct.pack(">I", value)), st.binary(max_size=5)),
    h2.CONTINUATION: st.one_of(st.sampled_from(_BLOCKS), st.binary(max_size=20)),
}


@st.composite
def a_frame(draw: st.DrawFn) -> bytes:
    kind = draw(st.one_of(st.sampled_from(list(_PAYLOADS)), st.integers(0, 255)))
    payload = draw(_PAYLOADS.get(kind, st.binary(max_size=20)))
    flags = draw(st.one_of(st.sampled_from([0, h2.END_STREAM, h2.END_HEADERS, h2.END_HEADERS | h2.END_STREAM,
                                            h2.PADDED, h2.PRIORITY_FLAG | h2.END_HEADERS]), st.integers(0, 255)))
    if flags & h2.PADDED and kind in (h2.DATA, h2.HEADERS) and draw(st.booleans()):
        pad = draw(st.integers(0, 12))
        payload = bytes([pad]) + payload + b"\0" * draw(st.integers(0, pad + 1))
    if flags & h2.PRIORITY_FLAG and kind == h2.HEADERS and draw(st.booleans()):
        payload = draw(st.binary(min_size=5, max_size=5)) + payload
    return h2.frame(kind, flags, draw(_STREAM_IDS), payload)


@st.composite
def a_call(draw: st.DrawFn) -> bytes:
    """A well-formed unary call on the next stream id: HEADERS, then its message in DATA frames."""
    stream_id = draw(st.sampled_from([1, 3, 5, 7, 9]))
    body = draw(st.binary(max_size=100))
    message = b"\0" + len(body).to_bytes(4, "big") + body
    parts = cut(message, draw(st.lists(st.integers(0, 200), max_size=3)))
    return (h2.frame(h2.HEADERS, h2.END_HEADERS, stream_id, _BLOCKS[0])
            + b"".join(h2.frame(h2.DATA, h2.END_STREAM if i == len(parts) - 1 else 0, stream_id, part)
                       for i, part in enumerate(parts)))


_HANDSHAKE = h2.PREFACE + h2.frame(h2.SETTINGS, 0, 0)
_SPLITS = st.lists(st.integers(0, 1 << 16), max_size=12)


# ---- properties -------------------------------------------------------------------------------------------------


@given(frames=st.lists(st.one_of(a_frame(), a_call()), max_size=12), handshake=st.booleans(), points=_SPLITS)
def test_any_frames_end_in_goaway_with_a_protocol_code_or_go_on(
    loop: Loop, frames: list[bytes], handshake: bool, points: list[int]
) -> None:
    data = (_HANDSHAKE if handshake else h2.PREFACE) + b"".join(frames)
    transport, _ = loop.run(_drive(cut(data, points)))  # type: ignore[misc]
    loop.check()
    _check_answer(transport)


@given(data=st.one_of(st.binary(max_size=300), st.binary(max_size=300).map(lambda tail: _HANDSHAKE + tail)),
       points=_SPLITS)
def test_any_bytes_end_in_goaway_with_a_protocol_code_or_go_on(loop: Loop, data: bytes, points: list[int]) -> None:
    transport, _ = loop.run(_drive(cut(data, points)))  # type: ignore[misc]
    loop.check()
    _check_answer(transport)


@given(frames=st.lists(st.one_of(a_frame(), a_call()), max_size=12), points=_SPLITS)
def test_frames_are_answered_the_same_however_they_are_split(loop: Loop, frames: list[bytes],
                                                             points: list[int]) -> None:
    data = _HANDSHAKE + b"".join(frames)
    whole, _ = loop.run(_drive([data]))  # type: ignore[misc]
    split, _ = loop.run(_drive(cut(data, points)))  # type: ignore[misc]
    loop.check()
    assert split.out == whole.out


@given(calls=st.lists(a_call(), min_size=1, max_size=4), points=_SPLITS)
def test_well_formed_calls_are_answered(loop: Loop, calls: list[bytes], points: list[int]) -> None:
    ids = {struct.unpack_from(">I", call, 5)[0] for call in calls}
    data = _HANDSHAKE + b"".join(calls)
    transport, _ = loop.run(_drive(cut(data, points)))  # type: ignore[misc]
    loop.check()
    frames = _check_answer(transport)
    ended = {stream_id for kind, flags, stream_id, _ in frames if kind == h2.HEADERS and flags & h2.END_STREAM}
    if not transport.closed:  # ids going down end the connection (PROTOCOL_ERROR); otherwise every call is answered
        assert ended == ids
