"""A small HTTP/1.1 server on asyncio and httptools: keep-alive, pipelining, and limits on what a client may hold.

It knows nothing of KServe: it parses requests, hands each to an async handler, and writes the responses back in
request order. What a client can make the server hold is bounded (`HttpLimits`, docs/security.md): the request
target (414), the header section and the number of headers (431), the body (413, refused as soon as its declared
length is seen, before it is read), the time a request may take to arrive (408), idle keep-alive time, the number
of connections (503 past it), and the answers waiting for a client that does not read them: while the socket's
write buffer is above its high-water mark the connection neither reads nor answers its next request.

Bodies may come chunked; a request that declares both `Transfer-Encoding: chunked` and a `Content-Length` (as
`requests` sends a body the caller chunked by hand) is read by its chunks, as RFC 9112 section 6.3 says, and its
connection is closed after the answer so that nothing smuggled after it can be read as another request.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import httptools

from transerve.frontends.http.flow_control import FlowControl

log = logging.getLogger("transerve.http")

_REASONS = {
    200: "OK", 400: "Bad Request", 403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed",
    408: "Request Timeout", 413: "Payload Too Large", 414: "URI Too Long", 431: "Request Header Fields Too Large",
    500: "Internal Server Error", 501: "Not Implemented", 503: "Service Unavailable",
}

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"

#: Response heads up to the Content-Length value, by status and content type, made once each: most answers differ
#: only in their length (and a header or two).
_HEADS: dict[tuple[int, str | None], bytes] = {}


def _head(status: int, content_type: str | None) -> bytes:
    head = _HEADS.get((status, content_type))
    if head is None:
        typed = f"Content-Type: {content_type}\r\n" if content_type is not None else ""
        head = f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n{typed}Content-Length: ".encode("latin-1")
        if len(_HEADS) < 256:  # statuses and content types come from the server's own handlers, but stay bounded
            _HEADS[(status, content_type)] = head
    return head

#: Requests read ahead of the one being answered, and their bytes: past either, the connection stops reading until
#: its queue is short again. Answers go out one at a time, so reading further ahead gains nothing.
_PIPELINE_DEPTH = 8
_PIPELINE_BYTES = 1024 * 1024
_RESUME_DEPTH = 2

#: How long a refused connection (past --http-max-connections, or a request refused) is still read, and dropped,
#: after its answer, before it is cut: closing a socket with unread bytes resets it, and the client may then lose
#: the answer (Apache's "lingering close").
_LINGER_S = 2.0


@dataclass(slots=True)
class HttpRequest:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    #: Every header with its name as sent, when the connection keeps them (for header forwarding).
    raw_headers: list[tuple[str, str]] | None = None
    #: Monotonic nanoseconds when the request began to arrive and when it was complete, kept only while the
    #: connection's `timing` switch is on (request tracing).
    received_ns: tuple[int, int] | None = None


@dataclass(slots=True)
class HttpResponse:
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    headers: list[tuple[str, str]] = field(default_factory=list)
    #: A streamed body (e.g. server-sent events), sent with chunked transfer encoding instead of `body`.
    stream: AsyncIterator[bytes] | None = None
    #: Called once the response has been handed to the socket (request tracing's send time).
    on_sent: Callable[[], None] | None = None


Handler = Callable[[HttpRequest], Awaitable[HttpResponse]]


class Switch(Protocol):
    """Something whose `active` flag says whether to note arrival times (the server's tracer)."""

    active: bool


class RequestRejected(Exception):
    """A request refused before its body was read; the connection closes after the answer."""

    def __init__(self, response: HttpResponse) -> None:
        super().__init__(response.body)
        self.response = response


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """What one client may make the server hold, and for how long: the --http-* flags (docs/security.md).

    Sizes as Apache and nginx choose them (an 8 KiB request line, 100 header fields); the header section may hold
    16 KiB, as Node.js allows. Body, keep-alive and send timeouts are nginx's; the header timeout is shorter, as
    HAProxy setups choose it, because a real client sends its whole head at once. A timeout of 0 means none.
    """

    max_url: int = 8 * 1024
    max_header_size: int = 16 * 1024
    max_headers: int = 100
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    keepalive_timeout: float = 75.0
    send_timeout: float = 60.0
    max_connections: int = 8192
    #: A /generate body is JSON read on the event loop, unlike an infer body's binary tensors: bounded on its own.
    max_generate_size: int = 4 * 1024 * 1024


class Phase:
    """Where a connection is, which decides the one timeout that runs (`Connections.timeouts`).

    Plain strings rather than an Enum: a connection looks its phase's timeout up several times per request, and an
    Enum member hashes in Python code, a str by its cached hash."""

    GREETING = "greeting"  # connected, no request begun: the header timeout
    HEAD = "head"  # a request's head is arriving: the header timeout, from its first byte
    BODY = "body"  # its body is arriving: the body timeout, from the last bytes read
    ANSWERING = "answering"  # requests are being answered and reading goes on: none (their models bound them)
    HELD = "held"  # reading paused, requests queued: none (the client cannot move on)
    IDLE = "idle"  # between requests: the keep-alive timeout
    STALLED = "stalled"  # the client does not read its answers: the send timeout
    CLOSING = "closing"  # closing once the answers are written: the send timeout
    LINGERING = "lingering"  # refused, its last bytes read and dropped: _LINGER_S


class Connections:
    """A listener's open connections: their cap, and one timer that ends those past their deadline.

    A connection only writes its deadline (a float) as its phase changes, so the request path pays no timer; the
    timer here visits every connection a few times a second.
    """

    def __init__(self, limits: HttpLimits) -> None:
        self.limits = limits
        self.open: set[HttpConnection] = set()
        #: Connections past the cap, still being answered 503.
        self.refused: set[HttpConnection] = set()
        self.header_timeout = limits.header_timeout or math.inf
        self.body_timeout = limits.body_timeout or math.inf
        self.keepalive_timeout = limits.keepalive_timeout or math.inf
        self.send_timeout = limits.send_timeout or math.inf
        #: Each phase's timeout, counted from when the connection entered it (or made progress in it).
        self.timeouts = {
            Phase.GREETING: self.header_timeout, Phase.HEAD: self.header_timeout, Phase.BODY: self.body_timeout,
            Phase.ANSWERING: math.inf, Phase.HELD: math.inf, Phase.IDLE: self.keepalive_timeout,
            Phase.STALLED: self.send_timeout, Phase.CLOSING: self.send_timeout, Phase.LINGERING: _LINGER_S,
        }
        #: Bytes of a request head on the wire (its request line, header lines and their separators): past this, the
        #: head is refused even while a line of it is still incomplete.
        self.max_head = limits.max_url + limits.max_header_size + 4 * limits.max_headers + 1024
        shortest = min(self.header_timeout, self.body_timeout, self.keepalive_timeout, self.send_timeout)
        self._tick = min(0.5, max(0.05, shortest / 4))
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None

    def admit(self, connection: HttpConnection) -> bool:
        """Track a new connection; False when it is past the cap (it is tracked all the same until it is gone)."""
        admitted = len(self.open) < self.limits.max_connections
        (self.open if admitted else self.refused).add(connection)
        if self._timer is None:
            self._timer = self._loop.call_later(self._tick, self._sweep)
        return admitted

    def discard(self, connection: HttpConnection) -> None:
        self.open.discard(connection)
        self.refused.discard(connection)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _sweep(self) -> None:
        now = self._loop.time()
        for group in (self.open, self.refused):
            for connection in [connection for connection in group if connection.deadline <= now]:
                try:
                    connection.expire()
                except Exception:  # one connection's trouble must not stop the timer of all
                    log.exception("cannot end an HTTP connection past its deadline")
        self._timer = self._loop.call_later(self._tick, self._sweep) if self.open or self.refused else None


class HttpConnection(asyncio.Protocol):
    """One client connection: parse, dispatch, answer in order, within the limits of its `Connections`."""

    __slots__ = (
        "_handler", "_max_body", "_error_response", "_transport", "_parser", "_url", "_headers", "_body",
        "_body_size", "_queue", "_queued_bytes", "_busy", "_closing", "_ended", "_lingering", "_flow", "_loop",
        "_task", "_framed_twice", "_raw_headers", "_timing", "_begin_ns", "_connections", "phase", "deadline",
        "_in_message", "_in_body", "_body_seen", "_unparsed", "_header_count", "_header_bytes", "_continue",
    )

    def __init__(self, handler: Handler, max_body: int, error_response: Callable[[int, str], HttpResponse],
                 keep_header_names: bool = False, timing: Switch | None = None, *, connections: Connections):
        self._handler = handler
        self._max_body = max_body
        self._error_response = error_response
        self._connections = connections
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._parser.set_dangerous_leniencies(lenient_chunked_length=True)
        self._framed_twice = False
        self._url = b""
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._body_size = 0
        self._queue: deque[tuple[HttpRequest | HttpResponse, bool]] = deque()
        self._queued_bytes = 0
        self._busy = False
        #: The transport is closing or gone: nothing more is written.
        self._closing = False
        #: No more requests are read: the last answer due closes the connection.
        self._ended = False
        #: Closing by its writing side only, reading and dropping what the client still sends.
        self._lingering = False
        # Kept rather than looked up per request: CPython's get_running_loop() costs a getpid() syscall.
        self._loop = asyncio.get_running_loop()
        self._flow = FlowControl(self._loop)
        #: The task answering this connection's requests; cancelled when the client goes away, which drops
        #: its queued request and tells a streaming model to stop.
        self._task: asyncio.Task | None = None
        #: Headers as sent, kept only when asked (names are otherwise lowercased into a dict).
        self._raw_headers: list[tuple[str, str]] | None = [] if keep_header_names else None
        #: Whether to note when each request arrives (`HttpRequest.received_ns`); checked once per request.
        self._timing = timing
        self._begin_ns = 0
        #: Where the connection is (`_move` keeps it), and when (loop time) `Connections` ends the connection unless
        #: it moves on: its phase's timeout after it entered it; infinite for never.
        self.phase = Phase.GREETING
        self.deadline = math.inf
        #: A request has begun to arrive and is not complete; and its head is complete (its body is arriving).
        self._in_message = False
        self._in_body = False
        #: Body bytes arrived during the last read; bytes read since the last body bytes or the last request.
        self._body_seen = False
        self._unparsed = 0
        self._header_count = 0
        self._header_bytes = 0
        #: A `100 Continue` is owed once the answers before it have been written.
        self._continue = False

    # ---- asyncio.Protocol -------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = self._flow.transport = transport  # type: ignore[assignment]
        if self._connections.admit(self):
            self._move(restart=True)
            return
        # Past the cap: answered at once, without reading a request, then closed.
        limit = self._connections.limits.max_connections
        self._reject(self._error_response(
            503, f"the server has {limit} HTTP connections open, its limit (--http-max-connections)"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = self._ended = True
        self._connections.discard(self)
        self._queue.clear()
        if self._task is not None and not self._task.done():
            self._task.cancel()

    def data_received(self, data: bytes) -> None:
        if self._ended:  # refused, rejected or closing: what more comes is read and dropped
            return
        self._unparsed += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            # httptools wraps what a callback raises; a refusal from a callback is ours.
            cause = exc.__context__
            if isinstance(cause, RequestRejected):
                self._reject(cause.response)
            else:
                log.warning("cannot read an HTTP request: %r", cause, exc_info=cause)
                self._reject(self._error_response(400, "cannot read the HTTP request"))
            return
        except httptools.HttpParserError as exc:
            self._reject(self._error_response(400, f"malformed HTTP request: {exc}"))
            return
        if self._in_message:
            self._move(progress=Phase.BODY)  # any read of a body is progress; a head has its whole timeout
            if self._body_seen:
                self._body_seen = False
                self._unparsed = 0
            if self._unparsed > self._connections.max_head:  # a head, trailers or chunk framing without end
                self._reject(self._error_response(431, self._headers_too_large()))

    def pause_writing(self) -> None:
        """The transport's buffer is above its high-water mark: a client that does not read gets nothing more
        until it does, and is cut after --http-send-timeout-secs."""
        self._flow.pause_writing()
        self._pause_reading()
        self._move(restart=True)

    def resume_writing(self) -> None:
        self._flow.resume_writing()
        if self._closing:
            self._move(restart=True)  # the client read some: the rest gets the send timeout again
        elif len(self._queue) <= _RESUME_DEPTH:
            self._resume_reading()
        else:
            self._move()

    # ---- httptools callbacks ----------------------------------------------------------------------

    def on_message_begin(self) -> None:
        # Its phase (HEAD) and deadline are set once this read is parsed (`data_received`), or as it completes.
        self._in_message = True
        self._begin_ns = time.monotonic_ns() if self._timing is not None and self._timing.active else 0
        self._url = b""
        self._headers = {}
        self._body = []
        self._body_size = 0
        self._body_seen = False
        self._header_count = self._header_bytes = 0
        self._framed_twice = False
        if self._raw_headers is not None:
            self._raw_headers = []

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > self._connections.limits.max_url:
            raise RequestRejected(self._error_response(
                414, f"the request target is longer than {self._connections.limits.max_url} bytes "
                     "(--http-max-url-size)"))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        self._header_bytes += len(name) + len(value)
        limits = self._connections.limits
        if self._header_bytes > limits.max_header_size:
            raise RequestRejected(self._error_response(431, self._headers_too_large()))
        if self._header_count > limits.max_headers:
            raise RequestRejected(self._error_response(
                431, f"a request may carry at most {limits.max_headers} header fields (--http-max-headers)"))
        key, text = name.decode("latin-1"), value.decode("latin-1")
        self._headers[key.lower()] = text
        if self._raw_headers is not None:
            self._raw_headers.append((key, text))

    def on_headers_complete(self) -> None:
        self._in_body = True
        headers = self._headers
        if self._parser.should_upgrade():  # CONNECT, or Upgrade with Connection: upgrade
            method = self._parser.get_method()
            raise RequestRejected(self._error_response(400, "CONNECT is not supported: this is not a proxy"
                                                       if method == b"CONNECT" else
                                                       "protocol upgrades are not supported"))
        length = headers.get("content-length")
        if "transfer-encoding" in headers:
            # The chunks frame the body, not the declared length; answer, then close (RFC 9112, 6.3).
            self._framed_twice = length is not None
        elif length is not None and length.isdigit() and int(length) > self._max_body:
            raise RequestRejected(self._error_response(
                413, f"request body of {length} bytes exceeds the limit of {self._max_body} bytes "
                     "(--http-max-input-size)"))
        if "expect" in headers and length != "0" and headers["expect"].strip().lower() == "100-continue" \
                and self._parser.get_http_version() == "1.1":
            # The client waits for this before it sends the body (curl: up to a second). Written now unless
            # answers to earlier requests are still due: it must not overtake them.
            if self._busy:
                self._continue = True
            elif self._transport is not None:
                self._transport.write(_CONTINUE)

    def on_body(self, body: bytes) -> None:
        self._body_seen = True
        self._body_size += len(body)
        if self._body_size > self._max_body:
            raise RequestRejected(self._error_response(
                413, f"request body exceeds the limit of {self._max_body} bytes (--http-max-input-size)"))
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._in_message = self._in_body = self._continue = False
        self._unparsed = 0
        try:
            target = httptools.parse_url(self._url)
        except httptools.HttpParserInvalidURLError:
            raise RequestRejected(self._error_response(
                400, f"invalid request target '{self._url[:200].decode('latin-1')}'")) from None
        path = target.path.decode("latin-1") if target.path is not None else "/"
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        request = HttpRequest(self._parser.get_method().decode("ascii"), path, self._headers, body,
                              self._raw_headers)
        if self._begin_ns:
            request.received_ns = (self._begin_ns, time.monotonic_ns())
        self._queue.append((request, self._parser.should_keep_alive() and not self._framed_twice))
        self._queued_bytes += len(body)
        if not self._busy:
            self._busy = True
            self._task = self._loop.create_task(self._serve_queue())
        elif len(self._queue) >= _PIPELINE_DEPTH or self._queued_bytes >= _PIPELINE_BYTES:
            self._pause_reading()
        self._move()

    # ---- dispatch ---------------------------------------------------------------------------------

    async def _serve_queue(self) -> None:
        queue = self._queue
        flow = self._flow
        while queue:
            await flow.drain()  # the client is not reading: answer nothing more until it does
            request, keep_alive = queue.popleft()
            if flow.reading_paused and len(queue) <= _RESUME_DEPTH:
                self._resume_reading()
            if isinstance(request, HttpResponse):  # a refusal, due after the answers before it
                response = request
            else:
                self._queued_bytes -= len(request.body)
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
            if response.on_sent is not None:
                response.on_sent()
            if not keep_alive:
                self._close(linger=isinstance(request, HttpResponse))
                return
        self._busy = False
        if self._continue:
            self._continue = False
            self._transport.write(_CONTINUE)  # type: ignore[union-attr]
        self._move()

    def _write(self, response: HttpResponse, keep_alive: bool) -> None:
        body, status = response.body, response.status
        head = _head(status, response.content_type if body or status != 200 else None)
        if response.headers or not keep_alive:
            extra = "".join([f"{name}: {value}\r\n" for name, value in response.headers])
            if not keep_alive:
                extra += "Connection: close\r\n"
            answer = b"%s%d\r\n%s\r\n%s" % (head, len(body), extra.encode("latin-1"), body)
        else:
            answer = b"%s%d\r\n\r\n%s" % (head, len(body), body)
        assert self._transport is not None
        self._transport.write(answer)

    async def _write_stream(self, response: HttpResponse, keep_alive: bool) -> None:
        """Headers now, then each piece as it is produced, as an HTTP/1.1 chunk; the next piece is taken only
        once the client has read enough of the last ones."""
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
            await self._flow.drain()
        if not self._closing:
            self._transport.write(b"0\r\n\r\n")

    # ---- flow control and endings -----------------------------------------------------------------

    def _move(self, restart: bool = False, progress: str | None = None) -> None:
        """The one deadline rule: the connection's phase (from its state, `_phase`) gets its timeout from when it
        entered that phase; with `restart`, or when it is still in `progress`'s phase, from now."""
        phase = self._phase()
        if restart or phase is not self.phase or phase is progress:
            self.phase = phase
            self.deadline = self._loop.time() + self._connections.timeouts[phase]

    def _phase(self) -> str:
        if self._closing:
            return Phase.LINGERING if self._lingering else Phase.CLOSING
        flow = self._flow
        if flow.write_paused:
            return Phase.STALLED
        if flow.reading_paused:
            return Phase.HELD
        if self._in_message:
            return Phase.BODY if self._in_body else Phase.HEAD
        if self._busy:
            return Phase.ANSWERING
        return Phase.IDLE if self._task is not None else Phase.GREETING

    def _pause_reading(self) -> None:
        """Stop reading; no read timeout runs meanwhile (the client cannot move on), only the send timeout."""
        if not self._closing:
            self._flow.pause_reading()
        self._move()

    def _resume_reading(self) -> None:
        """Read again, unless the client is still not reading its answers; the read timeouts start over."""
        if not self._closing and self._flow.resume_reading():
            self._move()

    def expire(self) -> None:
        """The deadline passed: a request that has not arrived in time is answered 408 (after the answers due
        before it); an idle connection is closed; one that is closing, or whose client does not read, is cut."""
        phase = self._phase()
        self.deadline = math.inf
        if self._transport is None:
            return
        if phase in (Phase.STALLED, Phase.CLOSING, Phase.LINGERING):
            self._closing = self._ended = True
            self._transport.abort()
        elif phase in (Phase.HEAD, Phase.BODY):
            name = "body" if phase is Phase.BODY else "header"
            self._reject(self._error_response(408, f"the request did not arrive in time (--http-{name}-timeout-secs)"))
        elif phase in (Phase.IDLE, Phase.GREETING):
            self._close()

    def _reject(self, response: HttpResponse) -> None:
        """Answer `response` once the answers due before it are written, then close; nothing more is read."""
        if self._ended or self._transport is None:
            return
        self._ended = True
        self._in_message = self._in_body = False
        if self._busy:
            self._queue.append((response, False))
            self._move()  # the answers before it bound the wait
        else:
            self._write(response, keep_alive=False)
            self._close(linger=True)

    def _close(self, linger: bool = False) -> None:
        """Close once the buffered answers are written; cut after the send timeout if they cannot leave. To
        `linger` is to close the writing side only and cut the connection after _LINGER_S, or when the client
        closes its side, reading and dropping what it still sends."""
        self._closing = self._ended = True
        transport = self._transport
        assert transport is not None
        if linger and transport.can_write_eof():
            transport.write_eof()
            self._lingering = True
        else:
            transport.close()
        self._move(restart=True)

    def _headers_too_large(self) -> str:
        return (f"the request's header fields exceed {self._connections.limits.max_header_size} bytes "
                "(--http-max-header-size)")
