"""One client connection: HTTP/2 framing and flow control (RFC 9113) as an `asyncio.Protocol`, gRPC calls on its
streams. What a call does is the `CallHandler`'s business; this module only moves frames and messages, and keeps
what a client can make the connection cost bounded (see `limits.py` and docs/security.md).

Its life is one `Phase` (`phase.py`: preface, settings, open, draining, closed), changed in one place. Reading: the
windows (`windows.py`) give the client window as the calls take their messages, so a message larger than the
windows still flows and whatever queues behind it waits for its reader; a connection holds at most `held_limit`
bytes of such messages, and nothing else it buffers exceeds its window. Reading stops while the socket's writes are
paused (a client that does not read its answers, PING ACKs included, stops being read), and unary calls wait to
start while the answers waiting for the client are `backlogged`. Writing is the `Sender`'s (`sending.py`): DATA
within the peer's windows and while the socket is not paused; what cannot go waits on its stream, for at most the
stall timeout. Frames written in one turn of the event loop leave in one write (`writer.py`). A call's work (its
task, its deadline) is the handler's: the connection tells it when a stream closes or its call must stop.

Its sections read top to bottom in the order a connection lives: asyncio's callbacks, reading frames (a call's
HEADERS and DATA here, the control frames in `control.py`), the stream table, timeouts, the connection as a whole.
The frame codecs (`frames.py`), header blocks (`headers.py`, `header_blocks.py`), a stream's own state
(`stream.py`) and the budgets' sizes (`limits.py`) are apart.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Protocol

from transerve.frontends.grpc.http2 import frames as h2
from transerve.frontends.grpc.http2.control import ControlFrames, FrameBudgets
from transerve.frontends.grpc.http2.frames import HEAD, H2ConnectionError, H2StreamError
from transerve.frontends.grpc.http2.header_blocks import HeaderBlocks
from transerve.frontends.grpc.http2.headers import RESOURCE_EXHAUSTED, HeaderDecoder
from transerve.frontends.grpc.http2.phase import MOVES, Phase
from transerve.frontends.grpc.http2.sending import Sender
from transerve.frontends.grpc.http2.stream import CallRefused, Stream
from transerve.frontends.grpc.http2.windows import ReceiveWindows
from transerve.frontends.grpc.http2.writer import FrameWriter
from transerve.frontends.grpc.limits import MAX_CONCURRENT_STREAMS, MAX_HEADER_LIST, STREAM_WINDOW, Http2Limits

log = logging.getLogger("transerve.grpc")

#: Frames may be up to 1 MiB so that a big message is few frames (the other settings are in limits.py).
MAX_FRAME = 1 << 20
#: Bytes of messages given window ahead of their call taking them, per connection, at least (`held_limit`).
HELD_LIMIT = 1 << 30
#: Seconds a connection that ended in error waits for its GOAWAY to leave before it is cut.
FAIL_LINGER = 0.5
#: Frames handled per turn of the event loop before the rest of what was read waits for the next turn, so that a
#: connection flooding frames cannot hold the loop from everyone else's.
FRAMES_PER_TURN = 300


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
    """The server side of one HTTP/2 connection. A bad frame ends it with GOAWAY and the matching error code.
    Calls answer through `respond`, `send_message`, `drained`, `finish` and `reply_http`, the `Sender`'s."""

    def __init__(self, handler: CallHandler, limits: Http2Limits, on_lost: Callable[[Http2Connection], None]) -> None:
        self._handler = handler
        self._limits = limits
        self._max_message = limits.max_message
        self._on_lost = on_lost
        # Kept rather than looked up per call: CPython's get_running_loop() costs a getpid() syscall.
        self.loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._writer = FrameWriter(self.loop)
        self._write = self._writer.write
        self._buffer = bytearray()
        self._need = len(h2.PREFACE)
        self.phase = Phase.PREFACE
        self._decoder = HeaderDecoder(MAX_HEADER_LIST)
        self.streams: dict[int, Stream] = {}
        self.last_stream = 0
        self._recv = ReceiveWindows(self._write, max(HELD_LIMIT, limits.max_message + 5))
        self._sender = sender = Sender(self.loop, self._write, limits.stall_timeout, self._arm, self._ended,
                                       self._relieve)
        self.respond, self.send_message, self.drained = sender.respond, sender.send_message, sender.drained
        self.finish, self.reply_http = sender.finish, sender.reply_http
        self._deferred: deque[Stream] = deque()  # unary calls complete but not started while backlogged
        self._turn_full = False  # FRAMES_PER_TURN frames were handled in this turn
        self.closed: asyncio.Future[None] = self.loop.create_future()
        now = self.loop.time()
        self._budgets = budgets = FrameBudgets(self.loop)
        self._blocks = HeaderBlocks(budgets.nothing)
        self._control = ControlFrames(self, sender, self._write, budgets, limits)
        self._born = now
        self._idle_since = now  # when the last stream closed
        self._paused_since = 0.0  # when writes were paused
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    # ---- asyncio.Protocol ---------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._writer.attach(self._transport)  # type: ignore[arg-type]
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
            self.close_stream(stream, cancel=True)
        self._deferred.clear()
        self._writer.discard()
        if self._timer is not None:
            self._timer.cancel()
        if not self.closed.done():
            self.closed.set_result(None)
        self._on_lost(self)

    def pause_writing(self) -> None:
        """The client is not reading: read nothing more from it (each PING or SETTINGS it sends asks for an answer)."""
        self._sender.paused = True
        self._paused_since = self.loop.time()
        self._arm(self._paused_since + self._limits.stall_timeout)
        if self._transport is not None and not self._transport.is_closing():
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        self._sender.paused = False
        if self._transport is not None and not self._transport.is_closing():
            self._transport.resume_reading()
        self._sender.pump_blocked()

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
        if not self._sender.paused:
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
            if self._blocks.pending is not None and kind != h2.CONTINUATION:
                raise H2ConnectionError(h2.PROTOCOL_ERROR, "a header block was interrupted")
            try:
                if kind == h2.DATA:
                    self._on_data(flags, stream_id, payload)
                elif kind == h2.HEADERS:
                    block = self._blocks.headers(flags, stream_id, payload)
                    if block is not None:
                        self._on_block(stream_id, *block)
                elif kind == h2.CONTINUATION:
                    ended = self._blocks.continuation(flags, stream_id, payload)
                    if ended is not None:
                        self._on_block(stream_id, *ended, False)
                elif kind == h2.WINDOW_UPDATE:
                    self._control.window_update(stream_id, payload)
                elif kind == h2.RST_STREAM:
                    self._control.rst_stream(stream_id, payload)
                elif kind == h2.SETTINGS:
                    self._control.settings(flags, stream_id, payload)
                elif kind == h2.PING:
                    self._control.ping(flags, stream_id, payload)
                elif kind == h2.GOAWAY:
                    self._control.goaway(stream_id, payload)
                elif kind == h2.PRIORITY:
                    self._control.priority(stream_id, payload)
                elif kind == h2.PUSH_PROMISE:
                    raise H2ConnectionError(h2.PROTOCOL_ERROR, "a client must not send PUSH_PROMISE")
                else:  # frames of unknown types are ignored (section 5.5), within the budget of frames that do nothing
                    self._budgets.nothing("frames that do nothing")
            except H2StreamError as exc:
                self.reset(stream_id, exc.code)
                self._budgets.reset("streams refused or reset")
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
                if stream_id > self.last_stream:
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
            self._budgets.nothing("empty DATA frames")
        if flags & h2.END_STREAM:
            self._end_remote(stream)
        self._advance(stream)

    def _advance(self, stream: Stream) -> None:
        """Give window for the message the stream's reader takes next, as far as it has arrived (windows.py)."""
        if stream.closed or (self._sender.backlogged and not stream.running):
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
        if stream_id % 2 == 0 or stream_id <= self.last_stream:
            raise H2ConnectionError(h2.PROTOCOL_ERROR, f"HEADERS opening stream {stream_id} out of order")
        self.last_stream = stream_id
        head = self._decoder.request_head(block)  # decoded even for a stream refused below
        if depends_on_itself:
            raise H2StreamError(h2.PROTOCOL_ERROR, "a stream cannot depend on itself")
        # The limit holds from the first frame: a client that has not yet acknowledged our SETTINGS is refused too
        # (REFUSED_STREAM, which it may retry), and one that goes on opening streams runs out of its reset budget.
        if self.phase is Phase.DRAINING or len(self.streams) >= MAX_CONCURRENT_STREAMS:
            raise H2StreamError(h2.REFUSED_STREAM, "stream refused")
        stream = Stream(stream_id, head, STREAM_WINDOW, self._sender.windows.initial)
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
        if self._sender.backlogged:
            self._deferred.append(stream)
        elif self._handler.call_ended(self, stream):
            stream.running = True

    def _relieve(self) -> None:
        """The answers are no longer backlogged: start the calls that waited, give their requests window (not once
        the connection is closing: its streams are being closed)."""
        if self.phase is Phase.CLOSED:
            return
        deferred = self._deferred
        while deferred:
            stream = deferred.popleft()
            if not stream.closed and self._handler.call_ended(self, stream):
                stream.running = True
        for stream in list(self.streams.values()):
            if not stream.running:
                self._advance(stream)

    # ---- the stream table ------------------------------------------------------------------------------------

    def _ended(self, stream: Stream) -> None:
        """We sent END_STREAM. A client still sending is asked to stop (RST_STREAM NO_ERROR, section 8.1)."""
        if not stream.remote_closed:
            self._write(h2.rst_stream(stream.id, h2.NO_ERROR))
        self.close_stream(stream, cancel=False)

    def reset(self, stream_id: int, code: int) -> None:
        """End one stream with RST_STREAM; the connection goes on."""
        self._write(h2.rst_stream(stream_id, code))
        stream = self.streams.get(stream_id)
        if stream is not None:
            self.close_stream(stream, cancel=True)

    def close_stream(self, stream: Stream, cancel: bool) -> None:
        """The stream is done: its window goes back, what it queued is dropped, its handler is told."""
        stream.closed = True
        self.streams.pop(stream.id, None)
        self._recv.release(stream)  # what the stream still holds is freed: its window goes back to the connection
        self._sender.forget(stream)
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
        if not self._control.acked:
            if now >= self._born + limits.handshake_timeout:
                self.fail(h2.SETTINGS_TIMEOUT, "no connection preface or SETTINGS acknowledgment in time")
                return
            due = self._born + limits.handshake_timeout
        if self._sender.paused:
            if now >= self._paused_since + limits.stall_timeout:
                self.fail(h2.ENHANCE_YOUR_CALM, "the client does not read its answers")
                return
            due = min(due, self._paused_since + limits.stall_timeout)
        else:
            stalled = 0
            for stream in list(self._sender.blocked.values()):
                if now < stream.stalled_since + limits.stall_timeout:
                    due = min(due, stream.stalled_since + limits.stall_timeout)
                elif self._sender.windows.window <= 0:  # the connection's window, not the stream's, is shut: all stuck
                    self.fail(h2.ENHANCE_YOUR_CALM, "the client does not read its answers")
                    return
                else:
                    stalled += 1
                    self.reset(stream.id, h2.CANCEL)
            if stalled:
                log.info("reset %d gRPC stream(s) whose answers waited %.0f s for the client's window", stalled,
                         limits.stall_timeout)
        if not self.streams and self._control.acked:
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
        self._write(h2.goaway(self.last_stream, h2.NO_ERROR))
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
        self._write(h2.goaway(self.last_stream, code, message.encode()[:256]))
        self.close(linger=0.0 if self._sender.paused else FAIL_LINGER)
        for stream in list(self.streams.values()):
            self.close_stream(stream, cancel=True)

    def close(self, linger: float | None = None) -> None:
        """Close after what is written so far has gone out, or after `linger` seconds (default: the stall timeout)
        whatever has not."""
        if self.phase is Phase.CLOSED:
            return
        self._move(Phase.CLOSED)
        self._writer.flush()
        transport = self._transport
        if transport is not None:
            transport.close()
            if transport.get_write_buffer_size():
                linger = self._limits.stall_timeout if linger is None else linger
                if linger <= 0:
                    transport.abort()
                else:
                    self.loop.call_later(linger, _cut, transport)


def _cut(transport: asyncio.Transport) -> None:
    """A closing connection whose last bytes the client has not read in time is cut."""
    transport.abort()  # nothing, if it has closed since
