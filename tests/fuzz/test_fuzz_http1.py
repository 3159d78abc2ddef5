"""Property-based tests of the HTTP/1.1 request path (httptools under `HttpConnection`), in process on a fake
transport: whatever bytes arrive, however they are split, nothing escapes the protocol, nothing is answered 500,
and a refusal is a 4xx that closes the connection; well-formed pipelined requests are answered the same way
however their bytes are split."""

from __future__ import annotations

from collections.abc import Iterator

import httptools
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.fuzzing import FakeTransport, Loop, cut, settle

from transerve.frontends.http.protocol import Connections, HttpConnection, HttpLimits, HttpRequest, HttpResponse

MAX_BODY = 4096

_TOKEN = st.text("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789!#$%&'*+-.^_`|~", min_size=1,
                 max_size=12)
_VISIBLE = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=30).map(str.strip)
_PATH = st.text("abcdefghijklmnopqrstuvwxyz0123456789/-._~%", max_size=40).map(lambda path: "/" + path)


@pytest.fixture(scope="module")
def loop() -> Iterator[Loop]:
    with Loop() as loop:
        yield loop


async def _echo(request: HttpRequest) -> HttpResponse:
    """Everything the protocol parsed, as the answer: splitting must not change a byte of it."""
    return HttpResponse(200, orjson.dumps([request.method, request.path, sorted(request.headers.items()),
                                           request.body.decode("latin-1")]))


def _error(status: int, message: str) -> HttpResponse:
    return HttpResponse(status, orjson.dumps({"error": message}))


def _connection() -> HttpConnection:
    """Limits small enough for the examples to cross them (414, 431)."""
    limits = HttpLimits(max_url=2048, max_header_size=2048, max_headers=6)
    return HttpConnection(_echo, MAX_BODY, _error, connections=Connections(limits))


async def _drive(chunks: list[bytes]) -> FakeTransport:
    transport = FakeTransport()
    connection = _connection()
    connection.connection_made(transport)
    for chunk in chunks:
        if transport.closed:
            break
        connection.data_received(chunk)
        await settle()
    await settle()
    connection.connection_lost(None)
    await settle(2)
    return transport


class _Responses:
    """Answers parsed back with httptools' response parser."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.statuses: list[int] = []
        self.bodies: list[bytes] = []
        self._body = bytearray()

    def on_message_begin(self) -> None:
        self._body = bytearray()

    def on_body(self, body: bytes) -> None:
        self._body += body

    def on_message_complete(self) -> None:
        self.statuses.append(self.parser.get_status_code())
        self.bodies.append(bytes(self._body))


def _responses(out: bytes) -> _Responses:
    responses = _Responses()
    responses.parser.feed_data(out)  # what the server writes must itself be well-formed HTTP/1.1
    return responses


def _assert_refused_properly(transport: FakeTransport) -> _Responses:
    responses = _responses(bytes(transport.out))
    for index, status in enumerate(responses.statuses):
        assert status in (100, 200) or 400 <= status < 500, (status, responses.bodies[index])
        if status >= 400:
            assert index == len(responses.statuses) - 1, "an answer after a refusal"
            assert transport.closed, "a refusal left the connection open"
    return responses


# ---- inputs -----------------------------------------------------------------------------------------------------

_METHODS = st.one_of(st.sampled_from(["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "CONNECT", "PRI", "TRACE",
                                      "get", "G\x00T", "POST ", ""]), _TOKEN)
_TARGETS = st.one_of(_PATH, st.sampled_from(["*", "http://h/v2", "h:80", "//", "/v2?x=1#f", "/%zz", "/\x7f",
                                             "/a b", "", "/" + "a" * 9000]),
                     st.text(st.characters(max_codepoint=0xFF), max_size=30))
_VERSIONS = st.sampled_from(["HTTP/1.1", "HTTP/1.0", "HTTP/2.0", "HTTP/1.1x", "HTTP/0.9", "http/1.1", ""])
_LENGTHS = st.one_of(st.integers(-2, MAX_BODY * 2).map(str),
                     st.sampled_from(["", " 5", "5 ", "+5", "0x10", "1e3", "5, 5", "5,6", "18446744073709551617"]))
_HEADERS = st.one_of(
    st.tuples(_TOKEN, _VISIBLE),
    st.tuples(st.just("Content-Length"), _LENGTHS),
    st.tuples(st.sampled_from(["Transfer-Encoding", "transfer-encoding"]),
              st.sampled_from(["chunked", "gzip, chunked", "chunked, gzip", "identity", " chunked", "xchunked"])),
    st.tuples(st.sampled_from(["Connection", "Expect", "Upgrade", "Host", "Content-Encoding"]),
              st.sampled_from(["close", "keep-alive", "Upgrade", "100-continue", "h2c", "websocket", "gzip", ""])),
    st.tuples(st.text(st.characters(max_codepoint=0xFF), max_size=10), st.text(st.characters(max_codepoint=0xFF),
                                                                                  max_size=20)),
)
_EOL = st.sampled_from(["\r\n", "\n", "\r"])
#: Chunked bodies whose sizes may lie about their chunks (each carries three bytes) or not parse at all.
_CHUNKED = st.lists(st.one_of(st.integers(0, 40).map(lambda n: f"{n:x}"),
                              st.sampled_from(["-1", "fffffffffffffffff", "1;ext=1", "z", ""])), max_size=4).map(
    lambda sizes: b"".join(f"{size}\r\nxxx\r\n".encode() for size in sizes) + b"0\r\n\r\n")


@st.composite
def request_like(draw: st.DrawFn) -> bytes:
    """Something shaped like a request, any part of which may be wrong."""
    eol = draw(_EOL)
    head = f"{draw(_METHODS)} {draw(_TARGETS)} {draw(_VERSIONS)}{eol}"
    head += "".join(f"{name}: {value}{draw(_EOL)}" for name, value in draw(st.lists(_HEADERS, max_size=8)))
    body = draw(st.one_of(st.binary(max_size=300), _CHUNKED))
    return (head + eol).encode("latin-1") + body


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A well-formed pipeline with bytes replaced, inserted or deleted."""
    data = bytearray(b"".join(draw(st.lists(valid_request(), min_size=1, max_size=3))))
    for _ in range(draw(st.integers(1, 6))):
        at = draw(st.integers(0, len(data)))
        action = draw(st.sampled_from(["replace", "insert", "delete"]))
        if action == "delete":
            del data[at:at + draw(st.integers(1, 8))]
        elif action == "insert" or at == len(data):
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        else:
            data[at] = draw(st.integers(0, 255))
    return bytes(data)


@st.composite
def valid_request(draw: st.DrawFn) -> bytes:
    method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE"]))
    headers = [(f"x-{name}", value) for name, value in draw(st.lists(st.tuples(_TOKEN, _VISIBLE), max_size=4,
                                                                    unique_by=lambda pair: pair[0].lower()))]
    body = draw(st.binary(max_size=200)) if method != "GET" else b""
    if body and draw(st.booleans()):
        headers.append(("Transfer-Encoding", "chunked"))
        sizes = draw(st.lists(st.integers(1, 64), min_size=1, max_size=4))
        chunks, rest = [], body
        for size in sizes:
            piece, rest = rest[:size], rest[size:]
            if piece:
                chunks.append(b"%x\r\n%s\r\n" % (len(piece), piece))
        if rest:
            chunks.append(b"%x\r\n%s\r\n" % (len(rest), rest))
        payload = b"".join(chunks) + b"0\r\n\r\n"
    else:
        headers.append(("Content-Length", str(len(body))))
        payload = body
    head = f"{method} {draw(_PATH)} HTTP/1.1\r\nHost: h\r\n" + "".join(f"{n}: {v}\r\n" for n, v in headers)
    return (head + "\r\n").encode("latin-1") + payload


_SPLITS = st.lists(st.integers(0, 1 << 16), max_size=12)


# ---- properties ------------------------------------------------------------------------------------------------


@given(data=st.one_of(st.binary(max_size=600), request_like(), mutated()), points=_SPLITS)
def test_any_bytes_are_answered_or_refused_with_a_4xx_never_a_500(loop: Loop, data: bytes, points: list[int]) -> None:
    transport = loop.run(_drive(cut(data, points)))
    loop.check()
    _assert_refused_properly(transport)  # type: ignore[arg-type]


@given(requests=st.lists(valid_request(), min_size=1, max_size=5), points=_SPLITS)
def test_pipelined_requests_are_answered_the_same_however_they_are_split(
    loop: Loop, requests: list[bytes], points: list[int]
) -> None:
    data = b"".join(requests)
    whole = loop.run(_drive([data]))
    split = loop.run(_drive(cut(data, points)))
    loop.check()
    assert split.out == whole.out  # type: ignore[union-attr]
    responses = _responses(bytes(whole.out))  # type: ignore[union-attr]
    assert responses.statuses == [200] * len(requests)


@given(requests=st.lists(valid_request(), min_size=1, max_size=3), junk=st.one_of(st.binary(min_size=1, max_size=80),
                                                                                   request_like()),
       points=_SPLITS)
def test_requests_before_garbage_are_answered_before_the_refusal(
    loop: Loop, requests: list[bytes], junk: bytes, points: list[int]
) -> None:
    transport = loop.run(_drive(cut(b"".join(requests) + junk, points)))
    loop.check()
    responses = _assert_refused_properly(transport)  # type: ignore[arg-type]
    assert responses.statuses[:len(requests)] == [200] * len(requests)
