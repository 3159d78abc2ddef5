"""One client connection: HTTP/2 framing and flow control (RFC 9113) as an `asyncio.Protocol`, gRPC calls on its
streams. What a call does is the `CallHandler`'s business; this module only moves frames and messages, and keeps
what a client can make the connection cost bounded (see `limits.py` and docs/security.md).

Its life is one `Phase` (preface, settings, open, draining, closed), changed in one place along `MOVES`. Reading:
the windows (`windows.py`) give the client window as the calls take their messages, so a message larger than the
windows still flows and whatever queues behind it waits for its reader; a connection holds at most `held_limit`
bytes of such messages, and nothing else it buffers exceeds its window. Reading stops while the socket's writes are
paused (a client that does not read its answers, PING ACKs included, stops being read), and unary calls wait to
start while more than `BACKLOG_HIGH` bytes of answers wait for the client. Writing: DATA goes out only within the
peer's windows and while the socket's buffer is below its high-water mark; what cannot go waits on its stream, for
at most the stall timeout. Frames written in one turn of the event loop leave in one write. A call's work (its
task, its deadline) is the handler's: the connection tells it when a stream closes or its call must stop.

Its sections read top to bottom in the order a connection lives: asyncio's callbacks, reading frames, answering
calls, timeouts, the connection as a whole. The frame codecs (`frames.py`), header blocks (`headers.py`), a
stream's own state (`stream.py`), the windows (`windows.py`) and the budgets (`limits.py`) are apart.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Protocol

from transerve.frontends.grpc.http2 import frames as h2
from transerve.frontends.grpc.http2.frames import HEAD, H2ConnectionError, H2StreamError
from transerve.frontends.grpc.http2.headers import (
    OK,
    OK_TRAILERS,
    RESOURCE_EXHAUSTED,
    RESPONSE_HEADERS,
    TABLE_SIZE_ZERO,
    HeaderDecoder,
    http_status,
    trailers,
)
from transerve.frontends.grpc.http2.stream import CallRefused, Stream
from transerve.frontends.grpc.http2.windows import ReceiveWindows, SendWindows
from transerve.frontends.grpc.limits import (
    EMPTY_FRAMES,
    MAX_CONCURRENT_STREAMS,
    MAX_CONTINUATIONS,
    MAX_HEADER_LIST,
    MAX_SETTINGS,
    RESETS,
    SETTINGS_FRAMES,
    STREAM_WINDOW,
    Http2Limits,
    PingPolicy,
    TokenBucket,
)

log = logging.getLogger("transerve.grpc")

#: Frames may be up to 1 MiB so that a big message is few frames (the other settings are in limits.py).
MAX_FRAME = 1 << 20
#: Bytes of messages given window ahead of their call taking them, per connection, at least (`held_limit`).
HELD_LIMIT = 1 << 30
#: Queued response bytes of a stream past which its writer waits (`drained`).
OUTBOX_HIGH = 1 << 20
#: Queued response bytes of a connection past which its unary calls wait to start.
BACKLOG_HIGH = 1 << 23
#: Seconds a connection that ended in error waits for its GOAWAY to leave before it is cut.
FAIL_LINGER = 0.5
#: Frames handled per turn of the event loop before the rest of what was read waits for the next turn, so that a
#: connection flooding frames cannot hold the loop from everyone else's.
FRAMES_PER_TURN = 300

_HEADERS_END = h2.END_HEADERS | h2.END_STREAM
#: Messages shorter than this are copied behind their prefix; longer ones go out as they are.
_JOIN_BELOW = 1 << 16


class Phase(enum.Enum):
    """Where a connection is in its life. It changes in one place, `Http2Connection._move`, along `MOVES`."""

    PREFACE = "preface"  # the client's connection preface has not all arrived
    SETTINGS = "settings"  # its first frame, which must be SETTINGS, has not
    OPEN = "open"  # streams open and close
    DRAINING = "draining"  # GOAWAY sent: no new streams; the open ones are answered, then the connection closes
    CLOSED = "closed"  # closing or gone: nothing more is read, and nothing more is written past what is buffered


#: Each phase's legal next phases. A connection can drain or close from any phase before; one that has not yet read
#: its client's SETTINGS has no streams, so draining closes it at once.
MOVES: dict[Phase, frozenset[Phase]] = {
    Phase.PREFACE: frozenset({Phase.SETTINGS, Phase.DRAINING, Phase.CLOSED}),
    Phase.SETTINGS: frozenset({Phase.OPEN, Phase.DRAINING, Phase.CLOSED}),
    Phase.OPEN: frozenset({Phase.DRAINING, Phase.CLOSED}),
    Phase.DRAINING: frozenset({Phase.CLOSED}),
    Phase.CLOSED: frozenset(),
}


class CallHandler(Protocol):
    """What runs the calls: told when a call's request headers arrive and when the client has sent all of it (each
    answers whether it started the call's work then), when its stream closes, and when its work must stop (the
    client reset it, its request was refused, the connection is gone). The work is the handler's: the connection
    never touches it."""

    def call_opened(self, connection: Http2Connection, stream: Stream) -> bool: ...

    def call_ended(self, connection: Http2Connection, stream: Stream) -> bool: ...

    def call_closed(self, connection: Http2Connection, stream: Stream) -> None: ...

    def call_cancelled(self, connection: Http2Connection, stream: Stream) -> None: ...


class Http2Connection(asyncio.Protocol):
    """The server side of one HTTP/2 connection. A bad frame ends it with GOAWAY and the matching error code."""

    def __init__(self, handler: CallHandler, limits: Http2Limits, on_lost: Callable[[Http2Connection], None]) -> None:
        self._handler = handler
        self._limits = limits
        self._max_message = limits.max_message
        self._on_lost = on_lost
        # Kept rather than looked up per call: CPython's get_running_loop() costs a getpid() syscall.
        self.loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._need = len(h2.PREFACE)
        self.phase = Phase.PREFACE
        self._decoder = HeaderDecoder(MAX_HEADER_LIST)
        self._continuation: tuple[int, int, bytearray] | None = None  # stream, END_STREAM flag, block so far
        self._continuations = 0  # CONTINUATION frames of the block in `_continuation`
        self.streams: dict[int, Stream] = {}
        self._last_stream = 0
        self._acked = False  # the client acknowledged our SETTINGS
        self._recv = ReceiveWindows(self._write, max(HELD_LIMIT, limits.max_message + 5))
        self._send = SendWindows()
        self._table_update = False  # the next header block must say our dynamic table is empty
        self._blocked: dict[int, Stream] = {}  # streams with DATA waiting for window or a drained socket
        self._backlog = 0  # bytes of answers queued on streams
        self._backlogged = False  # the backlog went past BACKLOG_HIGH: calls wait, and so does their requests' window
        self._deferred: deque[Stream] = deque()  # unary calls complete but not started while backlogged
        self._turn_full = False  # FRAMES_PER_TURN frames were handled in this turn
        self._write_paused = False
        self._out: list[bytes | memoryview] = []
        self._flush_scheduled = False
        self._tls = False  # the transport encrypts: see `_flush`
        self.closed: asyncio.Future[None] = self.loop.create_future()
        now = self.loop.time()
        self._resets = TokenBucket(RESETS, now)
        self._settings_frames = TokenBucket(SETTINGS_FRAMES, now)
        self._empty_frames = TokenBucket(EMPTY_FRAMES, now)
        self._pings = PingPolicy(limits)
        self._answered = False  # HEADERS or DATA sent since the last PING (which forgives the next one)
        self._born = now
        self._idle_since = now  # when the last stream closed
        self._paused_since = 0.0  # when writes were paused
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    # ---- asyncio.Protocol ---------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._tls = transport.get_extra_info("sslcontext") is not None
        self._write(h2.settings({
            h2.MAX_CONCURRENT_STREAMS: MAX_CONCURRENT_STREAMS,
            h2.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
            h2.MAX_FRAME_SIZE: MAX_FRAME,
            h2.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST,
        }) + self._recv.opening_update())
        self._arm(self._born + self._limits.handshake_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._move(Phase.CLOSED)
        for stream in list(self.streams.values()):
            self._close(stream, cancel=True)
        self._deferred.clear()
        self._out.clear()
        if self._timer is not None:
            self._timer.cancel()
        if not self.closed.done():
            self.closed.set_result(None)
        self._on_lost(self)

    def pause_writing(self) -> None:
        """The client is not reading: read nothing more from it (each PING or SETTINGS it sends asks for an answer)."""
        self._write_paused = True
        self._paused_since = self.loop.time()
        self._arm(self._paused_since + self._limits.stall_timeout)
        if self._transport is not None and not self._transport.is_closing():
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._transport is not None and not self._transport.is_closing():
            self._transport.resume_reading()
        self._pump_blocked()

    def data_received(self, data: bytes) -> None:
        if self.phase is Phase.CLOSED:
            return
        buffer = self._buffer
        if buffer:
            buffer += data
            if len(buffer) < self._need:
                return
            data = bytes(buffer)
            buffer.clear()
        try:
            if self.phase is Phase.PREFACE:
                data = self._read_preface(data)
            offset = self._frames(data)
        except H2ConnectionError as exc:
            self.fail(exc.code, str(exc))
            return
        except Exception:  # a bug here must cost one connection, not the server's loop
            log.exception("unhandled error reading a gRPC connection")
            self.fail(h2.INTERNAL_ERROR, "internal error")
            return
        if offset < len(data) and self.phase is not Phase.CLOSED:
            buffer += memoryview(data)[offset:]
            if self._turn_full:  # the rest in a later turn; nothing more is read meanwhile
                self._turn_full = False
                self._need = 0
                assert self._transport is not None
                self._transport.pause_reading()
                self.loop.call_soon(self._next_turn)
                return
            self._need = h2.HEAD_SIZE + (HEAD.unpack_from(buffer)[0] >> 8 if len(buffer) >= h2.HEAD_SIZE else 0)

    def _next_turn(self) -> None:
        if self.phase is Phase.CLOSED:
            return
        if not self._write_paused:
            assert self._transport is not None
            self._transport.resume_reading()
        self.data_received(b"")

    def _read_preface(self, data: bytes) -> bytes:
        size = len(h2.PREFACE)
        if len(data) < size:
            if not h2.PREFACE.startswith(data):
                raise H2ConnectionError(h2.PROTOCOL_ERROR, "not an HTTP/2 connection preface")
            self._buffer += data
            return b""
        if not data.startswith(h2.PREFACE):
            raise H2ConnectionError(h2.PROTOCOL_ERROR, "not an HTTP/2 connection preface")
        self._move(Phase.SETTINGS)
        return data[size:]

    def _spend(self, bucket: TokenBucket, what: str) -> None:
        """One more frame of a budgeted kind; past the budget, the connection ends with ENHANCE_YOUR_CALM."""
        if not bucket.take(self.loop.time()):
            raise H2ConnectionError(h2.ENHANCE_YOUR_CALM, f"too many {what}")

    # ---- reading frames -------------------------------------------------------------------------------------

    def _frames(self, data: bytes) -> int:
        """Handle every whole frame in `data`; return where the first incomplete one starts."""
        view = memoryview(data)
        size = len(data)
        offset = 0
        turn = FRAMES_PER_TURN
        while size - offset >= h2.HEAD_SIZE and self.phase is not Phase.CLOSED:
            turn -= 1
            if turn < 0:
                self._turn_full = True
                break
            head, flags, stream_id = HEAD.unpack_from(data, offset)
            length = head >> 8
            if length > MAX_FRAME:
                raise H2ConnectionError(h2.FRAME_SIZE_ERROR, f"frame of {length} bytes exceeds SETTINGS_MAX_FRAME_SIZE")
            end = offset + h2.HEAD_SIZE + length
            if end > size:
                break
            kind = head & 0xFF
            stream_id &= 0x7FFFFFFF
            payload = view[offset + h2.HEAD_SIZE:end]
            offset = end
            if self.phase is Phase.SETTINGS:
                if kind != h2.SETTINGS or flags & h2.ACK:
                    raise H2ConnectionError(h2.PROTOCOL_ERROR, "the first frame must be SETTINGS")
                self._move(Phase.OPEN)
            if self._continuation is not None and kind != h2.CONTINUATION:
                raise H2ConnectionError(h2.PROTOCOL_ERROR, "a header block was interrupted")
            try:
                if kind == h2.DATA:
                    self._on_data(flags, stream_id, payload)
                elif kind == h2.HEADERS:
                    self._on_headers(flags, stream_id, payload)
                elif kind == h2.CONTINUATION:
                    self._on_continuation(flags, stream_id, payload)
                elif kind == h2.WINDOW_UPDATE:
                    self._on_window_update(stream_id, payload)
                elif kind == h2.RST_STREAM:
                    self._on_rst_stream(stream_id, payload)
                elif kind == h2.SETTINGS:
                    self._on_settings(flags, stream_id, payload)
                elif kind == h2.PING:
                    self._on_ping(flags, stream_id, payload)
                elif kind == h2.GOAWAY:
                    self._on_goaway(stream_id, payload)
                elif kind == h2.PRIORITY:
                    self._on_priority(stream_id, payload)
                elif kind == h2.PUSH_PROMISE:
                    raise H2ConnectionError(h2.PROTOCOL_ERROR, "a client must not send PUSH_PROMISE")
                else:  # frames of unknown types are ignored (section 5.5), within the budget of frames that do nothing
                    self._spend(self._empty_frames, "frames that do nothing")
            except H2StreamError as exc:
                self.reset(stream_id, exc.code)
                self._spend(self._resets, "streams refused or reset")
        return offset

    def _on_data(self, flags: int, stream_id: int, payload: memoryview) -> None:
        length = len(payload)
        if stream_id == 0:
            raise H2ConnectionError(h2.PROTOCOL_ERROR, "DATA on stream 0")
        self._recv.receive(length)
        stream = self.streams.get(stream_id)
        if stream is None or stream.remote_closed or length > stream.recv_window:
            self._recv.give_back(length)  # nothing holds these bytes
            if stream is None:
                if stream_id > self._last_stream:
                    raise H2ConnectionError(h2.PROTOCOL_ERROR, "DATA on an idle stream")
                return  # a stream we reset or answered already: its window no longer matters
            if stream.remote_closed:
                raise H2StreamError(h2.STREAM_CLOSED, "DATA after END_STREAM")
            raise H2StreamError(h2.FLOW_CONTROL_ERROR, "DATA beyond the stream window")
        stream.recv_window -= length
        if flags & h2.PADDED:
            if not length or payload[0] >= length:
                raise H2ConnectionError(h2.PROTOCOL_ERROR, "padding exceeds the DATA frame")
            self._recv.credit(stream, payload[0] + 1)  # padding holds no memory
            payload = payload[1:length - payload[0]]
        if payload:
            stream.received += len(payload)
            try:
                stream.feed(payload, self._max_message)
            except CallRefused as exc:
                self.finish(stream, exc.status, exc.message, discard=True)
                self._handler.call_cancelled(self, stream)
                return
            stream.wake()
        elif not flags & h2.END_STREAM:
            self._spend(self._empty_frames, "empty DATA frames")
        if flags & h2.END_STREAM:
            self._end_remote(stream)
        self._advance(stream)

    def _advance(self, stream: Stream) -> None:
        """Give window for the message the stream's reader takes next, as far as it has arrived (windows.py)."""
        if stream.closed or (self._backlogged and not stream.running):
            return  # a call not started while answers pile up for this client gets no window (see `_relieve`)
        grant = self._recv.wanted(stream)
        if grant > 0 and not self._recv.hold(stream, grant):
            self.finish(stream, RESOURCE_EXHAUSTED, f"the connection's request messages in progress exceed "
                        f"{self._recv.held_limit} bytes", discard=True)
            self._handler.call_cancelled(self, stream)

    def take(self, stream: Stream) -> bytes | bytearray | memoryview:
        """The stream's next request message, for its call; its window then goes to the message after it."""
        message = stream.messages.popleft()
        if not stream.closed:
            self._recv.taken(stream, len(message))
            self._advance(stream)
        return message

    def _on_headers(self, flags: int, stream_id: int, payload: memoryview) -> None:
        if stream_id == 0:
            raise H2ConnectionError(h2.PROTOCOL_ERROR, "HEADERS on stream 0")
        start, stop = 0, len(payload)
        if flags & h2.PADDED:
            if not stop:
                raise H2ConnectionError(h2.PROTOCOL_ERROR, "PADDED HEADERS without a pad length")
            start, stop = 1, stop - payload[0]
        depends_on_itself = False
        if flags & h2.PRIORITY_FLAG:
            if stop - start < 5:
                raise H2ConnectionError(h2.FRAME_SIZE_ERROR, "HEADERS too short for its priority")
            depends_on_itself = h2.u31(payload, start) == stream_id
            start += 5
        if stop < start:
            raise H2ConnectionError(h2.PROTOCOL_ERROR, "padding exceeds the HEADERS frame")
        fragment = payload[start:stop]
        if len(fragment) > MAX_HEADER_LIST:
            raise H2ConnectionError(h2.ENHANCE_YOUR_CALM, "header block too large")
        if flags & h2.END_HEADERS:
            self._on_block(stream_id, flags & h2.END_STREAM, bytes(fragment), depends_on_itself)
        else:
            if not fragment:
                self._spend(self._empty_frames, "empty HEADERS frames")
            self._continuation = (stream_id, flags & h2.END_STREAM, bytearray(fragment))
            self._continuations = 0

    def _on_continuation(self, flags: int, stream_id: int, payload: memoryview) -> None:
        if self._continuation is None or self._continuation[0] != stream_id:
            raise H2ConnectionError(h2.PROTOCOL_ERROR, "CONTINUATION without a header block to continue")
        self._continuations += 1
        if self._continuations > MAX_CONTINUATIONS:
            raise H2ConnectionError(h2.ENHANCE_YOUR_CALM, f"a header block of more than {MAX_CONTINUATIONS} "
                                                          "CONTINUATION frames")
        if not payload and not flags & h2.END_HEADERS:
            self._spend(self._empty_frames, "empty CONTINUATION frames")
        block = self._continuation[2]
        block += payload
        if len(block) > MAX_HEADER_LIST:
            raise H2ConnectionError(h2.ENHANCE_YOUR_CALM, "header block too large")
        if flags & h2.END_HEADERS:
            end_stream = self._continuation[1]
            self._continuation = None
            self._on_block(stream_id, end_stream, bytes(block), False)

    def _on_block(self, stream_id: int, end_stream: int, block: bytes, depends_on_itself: bool) -> None:
        stream = self.streams.get(stream_id)
        if stream is not None:  # trailers: gRPC clients send none, but HTTP/2 allows them to end the request
            self._decoder.decode(block)
            if stream.remote_closed:
                raise H2StreamError(h2.STREAM_CLOSED, "HEADERS after END_STREAM")
            if not end_stream:
                raise H2StreamError(h2.PROTOCOL_ERROR, "trailers without END_STREAM")
            self._end_remote(stream)
            return
        if stream_id % 2 == 0 or stream_id <= self._last_stream:
            raise H2ConnectionError(h2.PROTOCOL_ERROR, f"HEADERS opening stream {stream_id} out of order")
        self._last_stream = stream_id
        head = self._decoder.request_head(block)  # decoded even for a stream refused below
        if depends_on_itself:
            raise H2StreamError(h2.PROTOCOL_ERROR, "a stream cannot depend on itself")
        # The limit holds from the first frame: a client that has not yet acknowledged our SETTINGS is refused too
        # (REFUSED_STREAM, which it may retry), and one that goes on opening streams runs out of its reset budget.
        if self.phase is Phase.DRAINING or len(self.streams) >= MAX_CONCURRENT_STREAMS:
            raise H2StreamError(h2.REFUSED_STREAM, "stream refused")
        stream = Stream(stream_id, head, STREAM_WINDOW, self._send.initial)
        self.streams[stream_id] = stream
        stream.remote_closed = bool(end_stream)
        stream.running = self._handler.call_opened(self, stream)
        if end_stream and not stream.closed:
            self._call_ended(stream)

    def _end_remote(self, stream: Stream) -> None:
        stream.remote_closed = True
        stream.wake()
        if not stream.closed:
            self._call_ended(stream)

    def _call_ended(self, stream: Stream) -> None:
        """The client sent all of the call: start it, unless answers already wait for this client (then later)."""
        if self._backlogged:
            self._deferred.append(stream)
        elif self._handler.call_ended(self, stream):
            stream.running = True

    def _relieve(self) -> None:
        """The backlog is below BACKLOG_HIGH again: start the calls that waited, give their requests window."""
        self._backlogged = False
        deferred = self._deferred
        while deferred:
            stream = deferred.popleft()
            if not stream.closed and self._handler.call_ended(self, stream):
                stream.running = True
        for stream in list(self.streams.values()):
            if not stream.running:
                self._advance(stream)

    def _on_window_update(self, stream_id: int, payload: memoryview) -> None:
        if len(payload) != 4:
            raise H2ConnectionError(h2.FRAME_SIZE_ERROR, "WINDOW_UPDATE of a size other than 4")
        increment = h2.u31(payload)
        if stream_id == 0:
            if not increment:
                raise H2ConnectionError(h2.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self._send.grow(increment)
            self._pump_blocked()
            return
        stream = self.streams.get(stream_id)
        if stream is None:
            if stream_id > self._last_stream:
                raise H2ConnectionError(h2.PROTOCOL_ERROR, "WINDOW_UPDATE on an idle stream")
            return
        if not increment:
            raise H2StreamError(h2.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
        self._send.grow_stream(stream, increment)
        self._pump(stream)

    def _on_rst_stream(self, stream_id: int, payload: memoryview) -> None:
        if len(payload) != 4:
            raise H2ConnectionError(h2.FRAME_SIZE_ERROR, "RST_STREAM of a size other than 4")
        if stream_id == 0 or stream_id > self._last_stream:
            raise H2ConnectionError(h2.PROTOCOL_ERROR, "RST_STREAM on stream 0 or an idle stream")
        self._spend(self._resets, "streams reset (RST_STREAM)")
        stream = self.streams.get(stream_id)
        if stream is not None:
            self._close(stream, cancel=True)

    def _on_settings(self, flags: int, stream_id: int, payload: memoryview) -> None:
        if stream_id:
            raise H2ConnectionError(h2.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & h2.ACK:
            if payload:
                raise H2ConnectionError(h2.FRAME_SIZE_ERROR, "SETTINGS acknowledgment with a payload")
            if self._acked:  # we sent one SETTINGS: more acknowledgments do nothing
                self._spend(self._empty_frames, "frames that do nothing")
            self._acked = True
            return
        if len(payload) % 6:
            raise H2ConnectionError(h2.FRAME_SIZE_ERROR, "SETTINGS of a size not a multiple of 6")
        if len(payload) > 6 * MAX_SETTINGS:
            raise H2ConnectionError(h2.ENHANCE_YOUR_CALM, f"SETTINGS with more than {MAX_SETTINGS} entries")
        self._spend(self._settings_frames, "SETTINGS frames")
        for key, value in h2.parse_settings(payload):
            if key == h2.INITIAL_WINDOW_SIZE:
                self._send.set_initial(value, list(self.streams.values()))
            elif key == h2.MAX_FRAME_SIZE:
                if not h2.DEFAULT_MAX_FRAME <= value <= h2.MAX_FRAME_LIMIT:
                    raise H2ConnectionError(h2.PROTOCOL_ERROR, "SETTINGS_MAX_FRAME_SIZE out of range")
                self._send.max_frame = value
            elif key == h2.ENABLE_PUSH:
                if value > 1:
                    raise H2ConnectionError(h2.PROTOCOL_ERROR, "SETTINGS_ENABLE_PUSH other than 0 or 1")
            elif key == h2.HEADER_TABLE_SIZE:
                self._table_update = True
        self._write(h2.frame(h2.SETTINGS, h2.ACK, 0))
        self._pump_blocked()

    def _on_ping(self, flags: int, stream_id: int, payload: memoryview) -> None:
        if stream_id:
            raise H2ConnectionError(h2.PROTOCOL_ERROR, "PING on a stream")
        if len(payload) != 8:
            raise H2ConnectionError(h2.FRAME_SIZE_ERROR, "PING of a size other than 8")
        if flags & h2.ACK:  # we send no PING, so this answers nothing
            self._spend(self._empty_frames, "frames that do nothing")
            return
        if self._answered:
            self._answered = False
            self._pings.forgive()
        if self._pings.received(self.loop.time(), bool(self.streams)):
            raise H2ConnectionError(h2.ENHANCE_YOUR_CALM, "too_many_pings")  # grpc-core's words, which its clients know
        self._write(h2.frame(h2.PING, h2.ACK, 0, bytes(payload)))

    def _on_goaway(self, stream_id: int, payload: memoryview) -> None:
        if stream_id:
            raise H2ConnectionError(h2.PROTOCOL_ERROR, "GOAWAY on a stream")
        if len(payload) < 8:
            raise H2ConnectionError(h2.FRAME_SIZE_ERROR, "GOAWAY shorter than 8 bytes")
        self.goaway()  # the client opens no more streams; those open are answered, then the connection closes

    def _on_priority(self, stream_id: int, payload: memoryview) -> None:
        if stream_id == 0:
            raise H2ConnectionError(h2.PROTOCOL_ERROR, "PRIORITY on stream 0")
        if len(payload) == 5 and h2.u31(payload) == stream_id:  # section 5.3.1; one not open cannot be reset
            error = H2StreamError if stream_id in self.streams else H2ConnectionError  # (as nghttp2 does)
            raise error(h2.PROTOCOL_ERROR, "a stream cannot depend on itself")
        if len(payload) != 5:
            raise H2StreamError(h2.FRAME_SIZE_ERROR, "PRIORITY of a size other than 5")
        self._spend(self._empty_frames, "frames that do nothing")  # priorities are deprecated and ignored

    # ---- answering calls ------------------------------------------------------------------------------------

    def respond(self, stream: Stream, message: bytes) -> None:
        """A unary call's answer: headers, the one message and OK trailers, in one write when the windows allow."""
        if stream.closed:
            return
        size = len(message) + 5
        if not self._send.fits(stream, size) or stream.headers_sent or self._write_paused or self._table_update:
            self.send_message(stream, message)
            self.finish(stream, OK)
            return
        self._send.spend(stream, size)
        stream_id = stream.id
        self._answered = True
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
        self._backlog += len(message) + 5
        if self._backlog > BACKLOG_HIGH:
            self._backlogged = True
        self._pump(stream)
        return stream.outbox_bytes < OUTBOX_HIGH

    def drained(self, stream: Stream) -> Awaitable[None]:
        """Resolves when the stream's queued messages are mostly sent (or the stream is gone)."""
        waiter = stream.drain_waiter = self.loop.create_future()
        if stream.closed or stream.outbox_bytes < OUTBOX_HIGH:
            waiter.set_result(None)
        return waiter

    def finish(self, stream: Stream, status: int, message: str = "", discard: bool = False) -> None:
        """End the call with a gRPC status, after its queued messages (dropped if `discard`)."""
        if stream.closed or stream.trailers is not None:
            return
        if discard:
            self._drop_outbox(stream)
        if not stream.headers_sent:  # Trailers-Only: one HEADERS frame with the status and all
            stream.headers_sent = True
            self._write(self._headers(stream.id, trailers(status, message, trailers_only=True), h2.END_STREAM))
            self._ended(stream)
            return
        stream.trailers = OK_TRAILERS if status == OK and not message else trailers(status, message)
        self._pump(stream)

    def reply_http(self, stream: Stream, status: int) -> None:
        """A plain HTTP answer to a request that is not gRPC."""
        if not stream.closed:
            self._write(self._headers(stream.id, http_status(status), h2.END_STREAM))
            self._ended(stream)

    def _headers(self, stream_id: int, block: bytes, flags: int) -> bytes:
        """HEADERS (and CONTINUATIONs past the peer's frame size) carrying one block."""
        self._answered = True
        if self._table_update:
            self._table_update = False
            block = TABLE_SIZE_ZERO + block
        limit = self._send.max_frame
        if len(block) <= limit:
            return HEAD.pack(len(block) << 8 | h2.HEADERS, flags | h2.END_HEADERS, stream_id) + block
        parts = [block[i:i + limit] for i in range(0, len(block), limit)]
        out = [h2.frame(h2.HEADERS, flags, stream_id, parts[0])]
        out += [h2.frame(h2.CONTINUATION, 0, stream_id, part) for part in parts[1:-1]]
        out.append(h2.frame(h2.CONTINUATION, h2.END_HEADERS, stream_id, parts[-1]))
        return b"".join(out)

    def _pump(self, stream: Stream) -> None:
        """Send what the windows allow of a stream's queue, then its trailers once the queue is empty."""
        outbox = stream.outbox
        sent = 0
        while outbox:
            room = self._send.room(stream)
            if room <= 0 or self._write_paused:
                if stream.id not in self._blocked:
                    self._blocked[stream.id] = stream
                    stream.stalled_since = self.loop.time()
                    self._arm(stream.stalled_since + self._limits.stall_timeout)
                elif sent:
                    stream.stalled_since = self.loop.time()
                break
            chunk = outbox[0]
            if len(chunk) <= room:
                outbox.popleft()
            else:
                chunk, outbox[0] = chunk[:room], chunk[room:]
            size = len(chunk)
            self._send.spend(stream, size)
            sent += size
            self._write(HEAD.pack(size << 8 | h2.DATA, 0, stream.id))
            self._write(chunk)
        if sent:
            self._answered = True
            stream.outbox_bytes -= sent
            self._backlog -= sent
            if self._backlogged and self._backlog <= BACKLOG_HIGH:
                self._relieve()
        if outbox:
            return
        self._blocked.pop(stream.id, None)
        if stream.drain_waiter is not None and stream.outbox_bytes < OUTBOX_HIGH:
            if not stream.drain_waiter.done():
                stream.drain_waiter.set_result(None)
            stream.drain_waiter = None
        if stream.trailers is not None:
            self._write(self._headers(stream.id, stream.trailers, h2.END_STREAM))
            self._ended(stream)

    def _pump_blocked(self) -> None:
        for stream in list(self._blocked.values()):
            if self._send.window <= 0 or self._write_paused:
                return
            self._pump(stream)

    def _drop_outbox(self, stream: Stream) -> None:
        if stream.outbox_bytes:
            self._backlog -= stream.outbox_bytes
            stream.outbox_bytes = 0
            stream.outbox.clear()
            if self._backlogged and self._backlog <= BACKLOG_HIGH and self.phase is not Phase.CLOSED:
                self._relieve()

    def _ended(self, stream: Stream) -> None:
        """We sent END_STREAM. A client still sending is asked to stop (RST_STREAM NO_ERROR, section 8.1)."""
        if not stream.remote_closed:
            self._write(h2.rst_stream(stream.id, h2.NO_ERROR))
        self._close(stream, cancel=False)

    def reset(self, stream_id: int, code: int) -> None:
        """End one stream with RST_STREAM; the connection goes on."""
        self._write(h2.rst_stream(stream_id, code))
        stream = self.streams.get(stream_id)
        if stream is not None:
            self._close(stream, cancel=True)

    def _close(self, stream: Stream, cancel: bool) -> None:
        stream.closed = True
        self.streams.pop(stream.id, None)
        self._blocked.pop(stream.id, None)
        self._recv.release(stream)  # what the stream still holds is freed: its window goes back to the connection
        self._drop_outbox(stream)
        self._handler.call_closed(self, stream)
        stream.wake()
        if stream.drain_waiter is not None and not stream.drain_waiter.done():
            stream.drain_waiter.set_result(None)
        if cancel:
            self._handler.call_cancelled(self, stream)
        if not self.streams:
            self._idle_since = self.loop.time()
            if self.phase is Phase.DRAINING:
                self.close()
            elif self._timer is None:  # the last check found calls open and armed nothing: the idle timeout starts
                self._arm(self._idle_since + self._limits.idle_timeout)

    # ---- timeouts ----------------------------------------------------------------------------------------------

    def _arm(self, when: float) -> None:
        """Check the connection's timeouts at `when` (or sooner, if a check is already due sooner)."""
        if self._timer is not None:
            if self._timer_at <= when:
                return
            self._timer.cancel()
        if self.phase is not Phase.CLOSED:
            self._timer_at = when
            self._timer = self.loop.call_at(when, self._check)

    def _check(self) -> None:
        """The handshake, idle and stall timeouts; each check arms the next."""
        self._timer = None
        if self.phase is Phase.CLOSED:
            return
        limits, now = self._limits, self.loop.time()
        due = float("inf")
        if not self._acked:
            if now >= self._born + limits.handshake_timeout:
                self.fail(h2.SETTINGS_TIMEOUT, "no connection preface or SETTINGS acknowledgment in time")
                return
            due = self._born + limits.handshake_timeout
        if self._write_paused:
            if now >= self._paused_since + limits.stall_timeout:
                self.fail(h2.ENHANCE_YOUR_CALM, "the client does not read its answers")
                return
            due = min(due, self._paused_since + limits.stall_timeout)
        else:
            stalled = 0
            for stream in list(self._blocked.values()):
                if now < stream.stalled_since + limits.stall_timeout:
                    due = min(due, stream.stalled_since + limits.stall_timeout)
                elif self._send.window <= 0:  # the connection's window, not the stream's, is shut: all are stuck
                    self.fail(h2.ENHANCE_YOUR_CALM, "the client does not read its answers")
                    return
                else:
                    stalled += 1
                    self.reset(stream.id, h2.CANCEL)
            if stalled:
                log.info("reset %d gRPC stream(s) whose answers waited %.0f s for the client's window", stalled,
                         limits.stall_timeout)
        if not self.streams and self._acked:
            if now >= self._idle_since + limits.idle_timeout:
                self.goaway()
                return
            due = min(due, self._idle_since + limits.idle_timeout)
        if due != float("inf"):
            self._arm(due)

    # ---- the connection as a whole -------------------------------------------------------------------------------

    def _move(self, phase: Phase) -> None:
        """The one place the phase changes; a move `MOVES` does not list is a bug here, not the client's doing."""
        if phase is self.phase:
            return
        if phase not in MOVES[self.phase]:
            raise RuntimeError(f"an HTTP/2 connection cannot move from {self.phase.value} to {phase.value}")
        self.phase = phase

    def goaway(self) -> None:
        """Refuse new streams (GOAWAY NO_ERROR); close once the open ones are done."""
        if self.phase in (Phase.DRAINING, Phase.CLOSED):
            return
        self._move(Phase.DRAINING)
        self._write(h2.goaway(self._last_stream, h2.NO_ERROR))
        if not self.streams:
            self.close()

    def abort(self, status: int, message: str) -> None:
        """End every open call with `status` and close the connection."""
        self.goaway()
        for stream in list(self.streams.values()):
            self.finish(stream, status, message, discard=True)
            if not stream.closed:  # its trailers wait for window the client will not give: reset it instead
                self.reset(stream.id, h2.CANCEL)
            else:
                self._handler.call_cancelled(self, stream)
        self.close()

    def fail(self, code: int, message: str) -> None:
        """A connection error: GOAWAY with its code, and close; a client that does not read is cut soon after."""
        if self.phase is Phase.CLOSED:
            return
        log.info("closing a gRPC connection: %s", message)
        self._write(h2.goaway(self._last_stream, code, message.encode()[:256]))
        self.close(linger=0.0 if self._write_paused else FAIL_LINGER)
        for stream in list(self.streams.values()):
            self._close(stream, cancel=True)

    def close(self, linger: float | None = None) -> None:
        """Close after what is written so far has gone out, or after `linger` seconds (default: the stall timeout)
        whatever has not."""
        if self.phase is Phase.CLOSED:
            return
        self._move(Phase.CLOSED)
        self._flush()
        transport = self._transport
        if transport is not None:
            transport.close()
            if transport.get_write_buffer_size():
                linger = self._limits.stall_timeout if linger is None else linger
                if linger <= 0:
                    transport.abort()
                else:
                    self.loop.call_later(linger, _cut, transport)

    def _write(self, data: bytes | memoryview) -> None:
        self._out.append(data)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._out and self._transport is not None and not self._transport.is_closing():
            if self._tls:
                # The SSL transport makes each piece a TLS record of its own; joined, a turn's frames are one, which
                # seals and opens far cheaper (benchmarks/README.md, "Figures behind the code"). A turn's bytes are
                # bounded by the windows and the write buffer's high-water mark, so the copy is too.
                self._transport.write(b"".join(self._out))
            else:
                self._transport.writelines(self._out)
        self._out = []


def _cut(transport: asyncio.Transport) -> None:
    """A closing connection whose last bytes the client has not read in time is cut."""
    transport.abort()  # nothing, if it has closed since
