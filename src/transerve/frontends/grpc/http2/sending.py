"""A connection's answers: the calls' response headers, messages and trailers, sent within the client's windows.

DATA goes out only within the peer's windows (`SendWindows`) and while the socket's writes are not paused; what
cannot go waits on its stream's outbox (the connection resets a stream stuck so past the stall timeout). The bytes
queued over all streams are the connection's backlog: past `BACKLOG_HIGH` it is `backlogged`, and the connection
holds back new unary calls until the backlog is below it again (`relieved`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable

from transerve.frontends.grpc.http2 import frames as h2
from transerve.frontends.grpc.http2.frames import HEAD, H2ConnectionError
from transerve.frontends.grpc.http2.headers import (
    OK,
    OK_TRAILERS,
    RESOURCE_EXHAUSTED,
    RESPONSE_HEADERS,
    TABLE_SIZE_ZERO,
    http_status,
    trailers,
)
from transerve.frontends.grpc.http2.stream import Stream
from transerve.frontends.grpc.http2.windows import SendWindows

#: Queued response bytes of a stream past which its writer waits (`drained`).
OUTBOX_HIGH = 1 << 20
#: Queued response bytes of a connection past which its unary calls wait to start.
BACKLOG_HIGH = 1 << 23

_HEADERS_END = h2.END_HEADERS | h2.END_STREAM
#: Messages shorter than this are copied behind their prefix; longer ones go out as they are.
_JOIN_BELOW = 1 << 16


class Sender:
    """The sending side of one connection. It tells the connection when a stream's END_STREAM went out (`ended`),
    when the backlog fell below `BACKLOG_HIGH` (`relieved`), and when a stream's answer started waiting (`arm`)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        write: Callable[[bytes | memoryview], None],
        stall_timeout: float,
        arm: Callable[[float], None],
        ended: Callable[[Stream], None],
        relieved: Callable[[], None],
    ) -> None:
        self._loop = loop
        self._write = write
        self._stall_timeout = stall_timeout
        self._arm = arm
        self._ended = ended
        self._relieved = relieved
        self.windows = SendWindows()
        self.blocked: dict[int, Stream] = {}  # streams with DATA waiting for window or a drained socket
        self.backlog = 0  # bytes of answers queued on streams
        self.backlogged = False  # the backlog went past BACKLOG_HIGH: calls wait, and so does their requests' window
        self.paused = False  # the socket's writes are paused: the client is not reading
        self.answered = False  # HEADERS or DATA sent since the last PING (which forgives the next one)
        self.table_update = False  # the next header block must say our dynamic table is empty

    def respond(self, stream: Stream, message: bytes) -> None:
        """A unary call's answer: headers, the one message and OK trailers, in one write when the windows allow."""
        if stream.closed:
            return
        size = len(message) + 5
        if not self.windows.fits(stream, size) or stream.headers_sent or self.paused or self.table_update:
            self.send_message(stream, message)
            self.finish(stream, OK)
            return
        self.windows.spend(stream, size)
        stream_id = stream.id
        self.answered = True
        self._write(b"".join((
            HEAD.pack(len(RESPONSE_HEADERS) << 8 | h2.HEADERS, h2.END_HEADERS, stream_id), RESPONSE_HEADERS,
            HEAD.pack(size << 8 | h2.DATA, 0, stream_id), b"\x00", (size - 5).to_bytes(4, "big"), message,
            HEAD.pack(len(OK_TRAILERS) << 8 | h2.HEADERS, _HEADERS_END, stream_id), OK_TRAILERS,
        )))
        self._ended(stream)

    def send_message(self, stream: Stream, message: bytes) -> bool:
        """Queue one message; False when the stream's queue is long and its writer should await `drained`."""
        if stream.closed:
            return True
        if len(message) > h2.MAX_WINDOW:  # gRPC's length prefix has 32 bits; Triton sends up to INT32_MAX
            self.finish(stream, RESOURCE_EXHAUSTED, f"sent message larger than max ({len(message)} vs. "
                                                    f"{h2.MAX_WINDOW})")
            return True
        if not stream.headers_sent:
            stream.headers_sent = True
            self._write(self._headers(stream.id, RESPONSE_HEADERS, 0))
        prefix = b"\x00" + len(message).to_bytes(4, "big")
        if len(message) < _JOIN_BELOW:  # one DATA frame rather than a 5-byte one and the rest
            stream.outbox.append(memoryview(prefix + message))
        else:
            stream.outbox.append(memoryview(prefix))
            stream.outbox.append(memoryview(message))
        stream.outbox_bytes += len(message) + 5
        self.backlog += len(message) + 5
        if self.backlog > BACKLOG_HIGH:
            self.backlogged = True
        self.pump(stream)
        return stream.outbox_bytes < OUTBOX_HIGH

    def drained(self, stream: Stream) -> Awaitable[None]:
        """Resolves when the stream's queued messages are mostly sent (or the stream is gone)."""
        waiter = stream.drain_waiter = self._loop.create_future()
        if stream.closed or stream.outbox_bytes < OUTBOX_HIGH:
            waiter.set_result(None)
        return waiter

    def finish(self, stream: Stream, status: int, message: str = "", discard: bool = False) -> None:
        """End the call with a gRPC status, after its queued messages (dropped if `discard`)."""
        if stream.closed or stream.trailers is not None:
            return
        if discard:
            self.drop(stream)
        if not stream.headers_sent:  # Trailers-Only: one HEADERS frame with the status and all
            stream.headers_sent = True
            self._write(self._headers(stream.id, trailers(status, message, trailers_only=True), h2.END_STREAM))
            self._ended(stream)
            return
        stream.trailers = OK_TRAILERS if status == OK and not message else trailers(status, message)
        self.pump(stream)

    def reply_http(self, stream: Stream, status: int) -> None:
        """A plain HTTP answer to a request that is not gRPC."""
        if not stream.closed:
            self._write(self._headers(stream.id, http_status(status), h2.END_STREAM))
            self._ended(stream)

    def apply_settings(self, settings: Iterable[tuple[int, int]], streams: list[Stream]) -> None:
        """The client's SETTINGS, which all bound what we send it: windows, frame size, push, header table."""
        for key, value in settings:
            if key == h2.INITIAL_WINDOW_SIZE:
                self.windows.set_initial(value, streams)
            elif key == h2.MAX_FRAME_SIZE:
                if not h2.DEFAULT_MAX_FRAME <= value <= h2.MAX_FRAME_LIMIT:
                    raise H2ConnectionError(h2.PROTOCOL_ERROR, "SETTINGS_MAX_FRAME_SIZE out of range")
                self.windows.max_frame = value
            elif key == h2.ENABLE_PUSH:
                if value > 1:
                    raise H2ConnectionError(h2.PROTOCOL_ERROR, "SETTINGS_ENABLE_PUSH other than 0 or 1")
            elif key == h2.HEADER_TABLE_SIZE:
                self.table_update = True

    def _headers(self, stream_id: int, block: bytes, flags: int) -> bytes:
        """HEADERS (and CONTINUATIONs past the peer's frame size) carrying one block."""
        self.answered = True
        if self.table_update:
            self.table_update = False
            block = TABLE_SIZE_ZERO + block
        limit = self.windows.max_frame
        if len(block) <= limit:
            return HEAD.pack(len(block) << 8 | h2.HEADERS, flags | h2.END_HEADERS, stream_id) + block
        parts = [block[i:i + limit] for i in range(0, len(block), limit)]
        out = [h2.frame(h2.HEADERS, flags, stream_id, parts[0])]
        out += [h2.frame(h2.CONTINUATION, 0, stream_id, part) for part in parts[1:-1]]
        out.append(h2.frame(h2.CONTINUATION, h2.END_HEADERS, stream_id, parts[-1]))
        return b"".join(out)

    def pump(self, stream: Stream) -> None:
        """Send what the windows allow of a stream's queue, then its trailers once the queue is empty."""
        outbox = stream.outbox
        windows = self.windows
        sent = 0
        while outbox:
            room = windows.room(stream)
            if room <= 0 or self.paused:
                if stream.id not in self.blocked:
                    self.blocked[stream.id] = stream
                    stream.stalled_since = self._loop.time()
                    self._arm(stream.stalled_since + self._stall_timeout)
                elif sent:
                    stream.stalled_since = self._loop.time()
                break
            chunk = outbox[0]
            if len(chunk) <= room:
                outbox.popleft()
            else:
                chunk, outbox[0] = chunk[:room], chunk[room:]
            size = len(chunk)
            windows.spend(stream, size)
            sent += size
            self._write(HEAD.pack(size << 8 | h2.DATA, 0, stream.id))
            self._write(chunk)
        if sent:
            self.answered = True
            stream.outbox_bytes -= sent
            self.backlog -= sent
            if self.backlogged and self.backlog <= BACKLOG_HIGH:
                self._relieve()
        if outbox:
            return
        self.blocked.pop(stream.id, None)
        if stream.drain_waiter is not None and stream.outbox_bytes < OUTBOX_HIGH:
            if not stream.drain_waiter.done():
                stream.drain_waiter.set_result(None)
            stream.drain_waiter = None
        if stream.trailers is not None:
            self._write(self._headers(stream.id, stream.trailers, h2.END_STREAM))
            self._ended(stream)

    def pump_blocked(self) -> None:
        """Window opened or the socket drained: send what waited, while there is room."""
        for stream in list(self.blocked.values()):
            if self.windows.window <= 0 or self.paused:
                return
            self.pump(stream)

    def drop(self, stream: Stream) -> None:
        """Forget what the stream has queued (a discarded answer, or a closed stream)."""
        if stream.outbox_bytes:
            self.backlog -= stream.outbox_bytes
            stream.outbox_bytes = 0
            stream.outbox.clear()
            if self.backlogged and self.backlog <= BACKLOG_HIGH:
                self._relieve()

    def forget(self, stream: Stream) -> None:
        """The stream closed: nothing of it waits any more."""
        self.blocked.pop(stream.id, None)
        self.drop(stream)

    def _relieve(self) -> None:
        self.backlogged = False
        self._relieved()
