"""Property-based tests of HPACK handling in the native gRPC transport (`HeaderDecoder`): random and malicious
encodings are a COMPRESSION_ERROR (or a malformed request, a stream error), never a crash; blocks a real encoder
made decode as the reference decoder does, whatever its dynamic table went through, the reuse of decoded heads
included; and a bad block sent on a connection ends it with GOAWAY COMPRESSION_ERROR."""

from __future__ import annotations

import struct
from collections.abc import Iterator

import pytest
from hpack import Decoder, Encoder, HPACKError
from hypothesis import given
from hypothesis import strategies as st
from support.fuzzing import FakeTransport, Loop, h2_connection, h2_frames, settle
from support.h2client import request_headers

from transerve.frontends.grpc.http2 import frames as h2
from transerve.frontends.grpc.http2.frames import H2ConnectionError, H2StreamError
from transerve.frontends.grpc.http2.headers import HeaderDecoder, RequestHead, _request_head
from transerve.frontends.grpc.http2.stream import Stream

MAX_LIST = 1 << 12


def _outcome(decoder: HeaderDecoder, block: bytes) -> object:
    """A request head, or the error it earned: anything else escapes and fails the test."""
    try:
        return decoder.request_head(block)
    except H2StreamError as exc:
        return ("stream", exc.code)
    except H2ConnectionError as exc:
        assert exc.code == h2.COMPRESSION_ERROR, exc
        return ("connection", exc.code)


# ---- HPACK instructions, valid in form, hostile in content ---------------------------------------------------


def _integer(value: int, prefix: int, first: int) -> bytes:
    """RFC 7541 section 5.1: `value` in a `prefix`-bit integer whose first byte starts with `first`."""
    limit = (1 << prefix) - 1
    if value < limit:
        return bytes([first | value])
    out, value = [first | limit], value - limit
    while value >= 128:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_INTEGERS = st.one_of(st.integers(0, 70), st.sampled_from([61, 62, 127, 4096, 65536, 2**31, 2**63, 2**200]))


@st.composite
def _string(draw: st.DrawFn) -> bytes:
    data = draw(st.one_of(st.binary(max_size=20), st.sampled_from([b":path", b":method", b"POST", b"te"])))
    huffman = draw(st.booleans())
    length = draw(st.one_of(st.just(len(data)), _INTEGERS))  # a length that may lie
    return _integer(length, 7, 0x80 if huffman else 0) + data


@st.composite
def instruction(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["indexed", "incremental", "without", "never", "size"]))
    if kind == "indexed":
        return _integer(draw(_INTEGERS), 7, 0x80)
    if kind == "size":
        return _integer(draw(_INTEGERS), 5, 0x20)
    prefix, first = {"incremental": (6, 0x40), "without": (4, 0x00), "never": (4, 0x10)}[kind]
    name_index = draw(_INTEGERS)
    name = draw(_string()) if name_index == 0 else b""
    return _integer(name_index, prefix, first) + name + draw(_string())


_BLOCKS = st.one_of(st.binary(max_size=80), st.lists(instruction(), max_size=8).map(b"".join))


# ---- valid header lists --------------------------------------------------------------------------------------

_NAMES = st.one_of(st.sampled_from([":method", ":scheme", ":path", ":authority", "content-type", "te", "grpc-timeout",
                                    "grpc-encoding", "user-agent", "X-Upper", "connection"]),
                   st.text("abcdefghijklmnopqrstuvwxyz-_", min_size=1, max_size=10))
_VALUES = st.one_of(st.sampled_from(["POST", "GET", "http", "/s/M", "/s/N", "application/grpc", "trailers", "1S",
                                     "100m", "99999999n", "gzip", "identity", ""]),
                    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=20))
_REQUEST = request_headers("/s/M", authority="h")
_HEADER_LISTS = st.one_of(
    st.lists(st.tuples(_NAMES, _VALUES), max_size=8),
    st.lists(st.tuples(_NAMES, _VALUES), max_size=3).map(lambda extra: _REQUEST + extra),
    st.just(_REQUEST),
)


# ---- properties ------------------------------------------------------------------------------------------------


@given(blocks=st.lists(_BLOCKS, min_size=1, max_size=6))
def test_hostile_blocks_are_compression_or_stream_errors(blocks: list[bytes]) -> None:
    decoder = HeaderDecoder(MAX_LIST)
    for block in blocks:
        if _outcome(decoder, block) == ("connection", h2.COMPRESSION_ERROR):
            return  # the connection would be gone


@given(lists=st.lists(st.tuples(_HEADER_LISTS, st.booleans(), st.one_of(st.none(), st.integers(0, 8192))),
                      min_size=1, max_size=8))
def test_blocks_decode_as_the_reference_decoder_decodes_them(
    lists: list[tuple[list[tuple[str, str]], bool, int | None]]
) -> None:
    """Over one connection's life, with table size changes: our head (reused or not) is the reference's."""
    encoder, reference, ours = Encoder(), Decoder(MAX_LIST), HeaderDecoder(MAX_LIST)
    for index, (headers, huffman, table_size) in enumerate(lists):
        # Until the first replay the encoder's table is the decoders': a head carries the path that was encoded.
        # A replay adds its block's entries twice; after it, only the two decoders still agree.
        first = index == 0
        if table_size is not None:
            encoder.header_table_size = table_size
        block = encoder.encode(headers, huffman=huffman)
        for replay in (False, True):  # replayed, a block may be answered by a reused head: it must still be right
            try:
                decoded = reference.decode(block, raw=True)
            except HPACKError:
                expected: object = ("connection", h2.COMPRESSION_ERROR)
            else:
                try:
                    expected = _request_head(decoded)  # type: ignore[arg-type]
                except H2StreamError as exc:
                    expected = ("stream", exc.code)
            got = _outcome(ours, block)
            assert got == expected
            if expected == ("connection", h2.COMPRESSION_ERROR):
                return
            if isinstance(got, RequestHead) and first and not replay:
                assert got.path == dict(headers).get(":path", "").encode()


class _Calls:
    def call_opened(self, connection: object, stream: Stream) -> bool:
        return False

    def call_ended(self, connection: object, stream: Stream) -> bool:
        return False

    def call_closed(self, connection: object, stream: Stream) -> None:
        pass

    def call_cancelled(self, connection: object, stream: Stream) -> None:
        pass


@pytest.fixture(scope="module")
def loop() -> Iterator[Loop]:
    with Loop() as loop:
        yield loop


@given(block=_BLOCKS, split=st.integers(0, 80))
def test_a_bad_block_on_a_connection_is_goaway_compression_error(loop: Loop, block: bytes, split: int) -> None:
    async def run() -> FakeTransport:
        transport = FakeTransport()
        connection = h2_connection(_Calls())
        connection.connection_made(transport)
        first, rest = block[:split], block[split:]
        frames = h2.frame(h2.HEADERS, h2.END_STREAM | (0 if rest else h2.END_HEADERS), 1, first)
        if rest:
            frames += h2.frame(h2.CONTINUATION, h2.END_HEADERS, 1, rest)
        connection.data_received(h2.PREFACE + h2.frame(h2.SETTINGS, 0, 0) + frames)
        await settle(3)
        if not transport.closed:
            connection.connection_lost(None)
        return transport

    transport = loop.run(run())
    loop.check()
    expected = _outcome(HeaderDecoder(1 << 16), block)
    goaways = [payload for kind, _, _, payload in h2_frames(bytes(transport.out)) if kind == h2.GOAWAY]  # type: ignore
    if expected == ("connection", h2.COMPRESSION_ERROR):
        assert transport.closed and struct.unpack_from(">I", goaways[-1], 4)[0] == h2.COMPRESSION_ERROR  # type: ignore
    else:
        assert not goaways
