"""A small HTTP/1.1 server on asyncio and httptools: keep-alive, pipelining, size limits.

It knows nothing of KServe: it parses requests, hands each to an async handler, and writes
the responses back in request order. Bodies over the size limit are refused as soon as
their declared length is seen, before they are read. Bodies may come chunked; a request that
declares both `Transfer-Encoding: chunked` and a `Content-Length` (as `requests` sends a body the
caller chunked by hand) is read by its chunks, as RFC 9112 section 6.3 says, and its connection is
closed after the answer so that nothing smuggled after it can be read as another request.
"""

from __future__ import annotations

import asyncio
import gzip
import logging
import zlib
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import httptools

log = logging.getLogger("transerve.http")

_REASONS = {
    200: "OK", 400: "Bad Request", 403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed",
    413: "Payload Too Large", 500: "Internal Server Error", 501: "Not Implemented", 503: "Service Unavailable",
}


@dataclass(slots=True)
class HttpRequest:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    #: Every header with its name as sent, when the connection keeps them (for header forwarding).
    raw_headers: list[tuple[str, str]] | None = None


@dataclass(slots=True)
class HttpResponse:
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    headers: list[tuple[str, str]] = field(default_factory=list)
    #: A streamed body (e.g. server-sent events), sent with chunked transfer encoding instead of `body`.
    stream: AsyncIterator[bytes] | None = None


Handler = Callable[[HttpRequest], Awaitable[HttpResponse]]


class RequestRejected(Exception):
    """A request refused before its body was read; the connection closes after the answer."""

    def __init__(self, response: HttpResponse) -> None:
        super().__init__(response.body)
        self.response = response


class HttpConnection(asyncio.Protocol):
    """One client connection: parse, dispatch, answer in order."""

    __slots__ = (
        "_handler", "_max_body", "_error_response", "_transport", "_parser", "_url", "_headers", "_body",
        "_body_size", "_queue", "_busy", "_closing", "_paused", "_loop", "_task", "_framed_twice", "_raw_headers",
    )

    def __init__(self, handler: Handler, max_body: int, error_response: Callable[[int, str], HttpResponse],
                 keep_header_names: bool = False):
        self._handler = handler
        self._max_body = max_body
        self._error_response = error_response
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._parser.set_dangerous_leniencies(lenient_chunked_length=True)
        self._framed_twice = False
        self._url = b""
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._body_size = 0
        self._queue: deque[tuple[HttpRequest, bool]] = deque()
        self._busy = False
        self._closing = False
        self._paused = False
        # Kept rather than looked up per request: CPython's get_running_loop() costs a getpid() syscall.
        self._loop = asyncio.get_running_loop()
        #: The task answering this connection's requests; cancelled when the client goes away, which drops
        #: its queued request and tells a streaming model to stop.
        self._task: asyncio.Task | None = None
        #: Headers as sent, kept only when asked (names are otherwise lowercased into a dict).
        self._raw_headers: list[tuple[str, str]] | None = [] if keep_header_names else None

    # ---- asyncio.Protocol -------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self._queue.clear()
        if self._task is not None and not self._task.done():
            self._task.cancel()

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            # httptools wraps what a callback raises; a refusal from on_headers_complete/on_body is ours.
            cause = exc.__context__
            if isinstance(cause, RequestRejected):
                self._reject(cause.response)
            else:
                log.error("HTTP parser callback failed: %r", cause)
                self._reject(self._error_response(500, "internal error while reading the request"))
        except httptools.HttpParserUpgrade:
            self._reject(self._error_response(400, "protocol upgrades are not supported"))
        except httptools.HttpParserError as exc:
            self._reject(self._error_response(400, f"malformed HTTP request: {exc}"))

    # ---- httptools callbacks ----------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = {}
        self._body = []
        self._body_size = 0
        self._framed_twice = False
        if self._raw_headers is not None:
            self._raw_headers = []

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        key, text = name.decode("latin-1"), value.decode("latin-1")
        self._headers[key.lower()] = text
        if self._raw_headers is not None:
            self._raw_headers.append((key, text))

    def on_headers_complete(self) -> None:
        length = self._headers.get("content-length")
        if "transfer-encoding" in self._headers:
            # The chunks frame the body, not the declared length; answer, then close (RFC 9112, 6.3).
            self._framed_twice = length is not None
        elif length is not None and length.isdigit() and int(length) > self._max_body:
            raise RequestRejected(self._error_response(
                413, f"request body of {length} bytes exceeds the limit of {self._max_body} bytes "
                     "(--http-max-input-size)"))

    def on_body(self, body: bytes) -> None:
        self._body_size += len(body)
        if self._body_size > self._max_body:
            raise RequestRejected(self._error_response(
                413, f"request body exceeds the limit of {self._max_body} bytes (--http-max-input-size)"))
        self._body.append(body)

    def on_message_complete(self) -> None:
        parsed = httptools.parse_url(self._url)
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        request = HttpRequest(self._parser.get_method().decode("ascii"), parsed.path.decode("latin-1"),
                              self._headers, body, self._raw_headers)
        self._queue.append((request, self._parser.should_keep_alive() and not self._framed_twice))
        if len(self._queue) > 64 and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()
        if not self._busy:
            self._busy = True
            self._task = self._loop.create_task(self._serve_queue())

    # ---- dispatch ---------------------------------------------------------------------------------

    async def _serve_queue(self) -> None:
        while self._queue:
            request, keep_alive = self._queue.popleft()
            try:
                response = await self._handler(request)
            except Exception:  # a handler bug must not take the connection down silently
                log.exception("unhandled error serving %s %s", request.method, request.path)
                response = self._error_response(500, "internal error")
            if self._closing or self._transport is None:
                return
            if response.stream is not None:
                await self._write_stream(response, keep_alive)
                if self._closing:
                    return
            else:
                self._write(response, keep_alive)
            if not keep_alive:
                self._transport.close()
                self._closing = True
                return
            if self._paused and len(self._queue) < 16:
                self._paused = False
                self._transport.resume_reading()
        self._busy = False

    def _write(self, response: HttpResponse, keep_alive: bool) -> None:
        head = [
            f"HTTP/1.1 {response.status} {_REASONS.get(response.status, 'Unknown')}\r\n",
            f"Content-Type: {response.content_type}\r\n" if response.body or response.status != 200 else "",
            f"Content-Length: {len(response.body)}\r\n",
        ]
        for name, value in response.headers:
            head.append(f"{name}: {value}\r\n")
        if not keep_alive:
            head.append("Connection: close\r\n")
        head.append("\r\n")
        assert self._transport is not None
        self._transport.write("".join(head).encode("latin-1") + response.body)

    async def _write_stream(self, response: HttpResponse, keep_alive: bool) -> None:
        """Headers now, then each piece as it is produced, as an HTTP/1.1 chunk."""
        assert self._transport is not None and response.stream is not None
        head = [f"HTTP/1.1 {response.status} {_REASONS.get(response.status, 'Unknown')}\r\n",
                f"Content-Type: {response.content_type}\r\n", "Transfer-Encoding: chunked\r\n",
                "Cache-Control: no-cache\r\n"]
        head.extend(f"{name}: {value}\r\n" for name, value in response.headers)
        if not keep_alive:
            head.append("Connection: close\r\n")
        self._transport.write(("".join(head) + "\r\n").encode("latin-1"))
        async for piece in response.stream:
            if self._closing:
                break
            if piece:
                self._transport.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        if not self._closing:
            self._transport.write(b"0\r\n\r\n")

    def _reject(self, response: HttpResponse) -> None:
        if self._transport is not None and not self._closing:
            self._closing = True
            self._write(response, keep_alive=False)
            self._transport.close()


#: The body encodings understood both ways, as Triton names them in its `Accept-Encoding` answer.
ENCODINGS = "gzip, deflate"


class UnsupportedEncoding(ValueError):
    """A `Content-Encoding` other than gzip, deflate or identity."""


def response_encoding(accept_encoding: str) -> str | None:
    """The encoding to compress a response with, chosen from `Accept-Encoding` as Triton chooses: the highest
    `q` among identity, gzip and deflate (the first of equals), none when identity wins or nothing is named.

    Entries that name anything else, or whose weight does not parse, are skipped; a weight of 0 never wins.
    """
    chosen, weight = "identity", 0.0
    for entry in accept_encoding.split(","):
        name, _, parameter = entry.strip().partition(";")
        name = name.strip()
        entry_weight = 1.0
        if parameter:
            key, _, value = parameter.strip().partition("=")
            if key.strip() != "q":
                continue
            try:
                entry_weight = float(value)
            except ValueError:
                continue
        if name in ("identity", "gzip", "deflate") and entry_weight > weight:
            chosen, weight = name, entry_weight
    return None if chosen == "identity" else chosen


def compress_body(body: bytes, encoding: str) -> bytes:
    """`gzip` or `deflate` (zlib format, which clients inflate with zlib), at the fastest level: a response
    is compressed for the wire once, and speed matters more than the last bytes."""
    return gzip.compress(body, compresslevel=1) if encoding == "gzip" else zlib.compress(body, 1)


def decompress_body(body: bytes, encoding: str, limit: int) -> bytes:
    """Undo `Content-Encoding: gzip|deflate`, refusing output past `limit` (a zip bomb stops early)."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding == "gzip":
        wbits = 16 + zlib.MAX_WBITS
    elif encoding == "deflate":
        wbits = zlib.MAX_WBITS
    else:
        raise UnsupportedEncoding(f"Unsupported compression type '{encoding}' (use {ENCODINGS})")
    decompressor = zlib.decompressobj(wbits)
    try:
        data = decompressor.decompress(body, limit + 1)
        if len(data) > limit:
            raise ValueError(f"decompressed request body exceeds the limit of {limit} bytes")
        if encoding == "deflate" and not decompressor.eof and not data:
            raise zlib.error("incomplete deflate stream")
    except zlib.error:
        if encoding == "deflate":  # some clients send raw deflate without the zlib header
            try:
                return _raw_inflate(body, limit)
            except zlib.error as exc:
                raise ValueError(f"cannot decompress the {encoding} request body: {exc}") from None
        raise ValueError(f"cannot decompress the {encoding} request body") from None
    return data


def _raw_inflate(body: bytes, limit: int) -> bytes:
    decompressor = zlib.decompressobj(-zlib.MAX_WBITS)
    data = decompressor.decompress(body, limit + 1)
    if len(data) > limit:
        raise ValueError(f"decompressed request body exceeds the limit of {limit} bytes")
    return data
