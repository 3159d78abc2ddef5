"""One client connection: HTTP/2 framing and flow control (RFC 9113) as an `asyncio.Protocol`, gRPC calls on its
streams. What a call does is the `CallHandler`'s business; this module only moves frames and messages.

Reading: the connection and every stream announce large windows, and bytes received are given back as they arrive
(in WINDOW_UPDATEs of half a window, so a small call costs none), except while a streaming call holds more than
`QUEUED_MESSAGES` unread requests: then its window closes and the client waits. Writing: DATA goes out only within
the peer's connection and stream windows and while the socket's buffer is below its high-water mark; what cannot
go waits on its stream. Frames written in one turn of the event loop leave in one write.
"""

from __future__ import annotations

import asyncio
import logging
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

log = logging.getLogger("transerve.grpc")

#: Our settings. Streams and the connection get large windows so that big tensors flow without waiting on
#: WINDOW_UPDATE round trips; frames may be up to 1 MiB so that a big message is few frames.
STREAM_WINDOW = 1 << 24
CONNECTION_WINDOW = 1 << 30
MAX_FRAME = 1 << 20
MAX_CONCURRENT_STREAMS = 4096
MAX_HEADER_LIST = 1 << 16
#: Unread requests of a streaming call past which its window stops being given back.
QUEUED_MESSAGES = 64
#: Queued response bytes of a stream past which its writer waits (`drained`).
OUTBOX_HIGH = 1 << 20

_HEADERS_END = h2.END_HEADERS | h2.END_STREAM
#: Messages shorter than this are copied behind their prefix; longer ones go out as they are.
_JOIN_BELOW = 1 << 16


class CallHandler(Protocol):
    """What runs the calls: told when a call's request headers arrive and when the client has sent all of it."""

    def call_opened(self, connection: Http2Connection, stream: Stream) -> None: ...

    def call_ended(self, connection: Http2Connection, stream: Stream) -> None: ...


class Http2Connection(asyncio.Protocol):
    """The server side of one HTTP/2 connection. A bad frame ends it with GOAWAY and the matching error code."""

    def __init__(self, handler: CallHandler, max_message: int, on_lost: Callable[[Http2Connection], None]) -> None:
        self._handler = handler
        self._max_message = max_message
        self._on_lost = on_lost
        # Kept rather than looked up per call: CPython's get_running_loop() costs a getpid() syscall.
        self.loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._need = len(h2.PREFACE)
        self._preface = False  # the client's preface has arrived
        self._settings = False  # ... and its first SETTINGS
        self._decoder = HeaderDecoder(MAX_HEADER_LIST)
        self._continuation: tuple[int, int, bytearray] | None = None  # stream, END_STREAM flag, block so far
        self.streams: dict[int, Stream] = {}
        self._last_stream = 0
        self._acked = False  # the client acknowledged our SETTINGS
        self._recv_window = h2.DEFAULT_WINDOW
        self._recv_unacked = 0
        self._send_window = h2.DEFAULT_WINDOW
        self._peer_window = h2.DEFAULT_WINDOW  # SETTINGS_INITIAL_WINDOW_SIZE of the client
        self._peer_frame = h2.DEFAULT_MAX_FRAME
        self._table_update = False  # the next header block must say our dynamic table is empty
        self._blocked: dict[int, Stream] = {}  # streams with DATA waiting for window or a drained socket
        self._write_paused = False
        self._out: list[bytes | memoryview] = []
        self._flush_scheduled = False
        self._tls = False  # the transport encrypts: see `_flush`
        self.goaway_sent = False
        self._closing = False
        self.closed: asyncio.Future[None] = self.loop.create_future()

    # ---- asyncio.Protocol ---------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._tls = transport.get_extra_info("sslcontext") is not None
        self._write(h2.settings({
            h2.MAX_CONCURRENT_STREAMS: MAX_CONCURRENT_STREAMS,
            h2.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
            h2.MAX_FRAME_SIZE: MAX_FRAME,
            h2.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST,
        }) + h2.window_update(0, CONNECTION_WINDOW - h2.DEFAULT_WINDOW))
        self._recv_window = CONNECTION_WINDOW

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        for stream in list(self.streams.values()):
            self._close(stream, cancel=True)
        self._out.clear()
        if not self.closed.done():
            self.closed.set_result(None)
        self._on_lost(self)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._pump_blocked()

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        if buffer:
            buffer += data
            if len(buffer) < self._need:
                return
            data = bytes(buffer)
            buffer.clear()
        try:
            if not self._preface:
                data = self._read_preface(data)
            offset = self._frames(data)
        except H2ConnectionError as exc:
            self.fail(exc.code, str(exc))
            return
        except Exception:  # a bug here must cost one connection, not the server's loop
            log.exception("unhandled error reading a gRPC connection")
            self.fail(h2.INTERNAL_ERROR, "internal error")
            return
        if offset < len(data) and not self._closing:
            buffer += memoryview(data)[offset:]
            self._need = h2.HEAD_SIZE + (HEAD.unpack_from(buffer)[0] >> 8 if len(buffer) >= h2.HEAD_SIZE else 0)

    def _read_preface(self, data: bytes) -> bytes:
        size = len(h2.PREFACE)
        if len(data) < size:
            if not h2.PREFACE.startswith(data):
                raise H2ConnectionError(h2.PROTOCOL_ERROR, "not an HTTP/2 connection preface")
            self._buffer += data
            return b""
        if not data.startswith(h2.PREFACE):
            raise H2ConnectionError(h2.PROTOCOL_ERROR, "not an HTTP/2 connection preface")
        self._preface = True
        return data[size:]

    # ---- reading frames -------------------------------------------------------------------------------------

    def _frames(self, data: bytes) -> int:
        """Handle every whole frame in `data`; return where the first incomplete one starts."""
        view = memoryview(data)
        size = len(data)
        offset = 0
        while size - offset >= h2.HEAD_SIZE and not self._closing:
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
            if not self._settings:
                if kind != h2.SETTINGS or flags & h2.ACK:
                    raise H2ConnectionError(h2.PROTOCOL_ERROR, "the first frame must be SETTINGS")
                self._settings = True
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
                # frames of unknown types are ignored (section 5.5)
            except H2StreamError as exc:
                self.reset(stream_id, exc.code)
        return offset

    def _on_data(self, flags: int, stream_id: int, payload: memoryview) -> None:
        length = len(payload)
        if stream_id == 0:
            raise H2ConnectionError(h2.PROTOCOL_ERROR, "DATA on stream 0")
        if length > self._recv_window:
            raise H2ConnectionError(h2.FLOW_CONTROL_ERROR, "DATA beyond the connection window")
        self._recv_window -= length
        self._recv_unacked += length
        if self._recv_unacked >= CONNECTION_WINDOW // 2:
            self._write(h2.window_update(0, self._recv_unacked))
            self._recv_window += self._recv_unacked
            self._recv_unacked = 0
        stream = self.streams.get(stream_id)
        if stream is None:
            if stream_id > self._last_stream:
                raise H2ConnectionError(h2.PROTOCOL_ERROR, "DATA on an idle stream")
            return  # a stream we reset or answered already: its window no longer matters
        if stream.remote_closed:
            raise H2StreamError(h2.STREAM_CLOSED, "DATA after END_STREAM")
        if length > stream.recv_window:
            raise H2StreamError(h2.FLOW_CONTROL_ERROR, "DATA beyond the stream window")
        stream.recv_window -= length
        if flags & h2.PADDED:
            if not length or payload[0] >= length:
                raise H2ConnectionError(h2.PROTOCOL_ERROR, "padding exceeds the DATA frame")
            payload = payload[1:length - payload[0]]
        if payload:
            try:
                stream.feed(payload, self._max_message)
            except CallRefused as exc:
                self.finish(stream, exc.status, exc.message, discard=True)
                if stream.task is not None:
                    stream.task.cancel()
                return
            stream.wake()
        if flags & h2.END_STREAM:
            self._end_remote(stream)
        else:
            stream.recv_unacked += length
            self._credit(stream)

    def _credit(self, stream: Stream) -> None:
        """Give a stream's window back, unless its reader is behind (see QUEUED_MESSAGES)."""
        if stream.recv_unacked >= STREAM_WINDOW // 2 and len(stream.messages) < QUEUED_MESSAGES:
            self._write(h2.window_update(stream.id, stream.recv_unacked))
            stream.recv_window += stream.recv_unacked
            stream.recv_unacked = 0

    def consumed(self, stream: Stream) -> None:
        """A streaming call's reader took a message: the window may open again."""
        if stream.recv_unacked and not stream.remote_closed and not stream.closed:
            self._credit(stream)

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
            self._continuation = (stream_id, flags & h2.END_STREAM, bytearray(fragment))

    def _on_continuation(self, flags: int, stream_id: int, payload: memoryview) -> None:
        if self._continuation is None or self._continuation[0] != stream_id:
            raise H2ConnectionError(h2.PROTOCOL_ERROR, "CONTINUATION without a header block to continue")
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
        if self.goaway_sent or (self._acked and len(self.streams) >= MAX_CONCURRENT_STREAMS):
            raise H2StreamError(h2.REFUSED_STREAM, "stream refused")
        stream = Stream(stream_id, head, STREAM_WINDOW, self._peer_window)
        self.streams[stream_id] = stream
        stream.remote_closed = bool(end_stream)
        self._handler.call_opened(self, stream)
        if end_stream and not stream.closed:
            self._handler.call_ended(self, stream)

    def _end_remote(self, stream: Stream) -> None:
        stream.remote_closed = True
        stream.wake()
        if not stream.closed:
            self._handler.call_ended(self, stream)

    def _on_window_update(self, stream_id: int, payload: memoryview) -> None:
        if len(payload) != 4:
            raise H2ConnectionError(h2.FRAME_SIZE_ERROR, "WINDOW_UPDATE of a size other than 4")
        increment = h2.u31(payload)
        if stream_id == 0:
            if not increment:
                raise H2ConnectionError(h2.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self._send_window += increment
            if self._send_window > h2.MAX_WINDOW:
                raise H2ConnectionError(h2.FLOW_CONTROL_ERROR, "connection window above 2^31-1")
            self._pump_blocked()
            return
        stream = self.streams.get(stream_id)
        if stream is None:
            if stream_id > self._last_stream:
                raise H2ConnectionError(h2.PROTOCOL_ERROR, "WINDOW_UPDATE on an idle stream")
            return
        if not increment:
            raise H2StreamError(h2.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
        stream.send_window += increment
        if stream.send_window > h2.MAX_WINDOW:
            raise H2StreamError(h2.FLOW_CONTROL_ERROR, "stream window above 2^31-1")
        self._pump(stream)

    def _on_rst_stream(self, stream_id: int, payload: memoryview) -> None:
        if len(payload) != 4:
            raise H2ConnectionError(h2.FRAME_SIZE_ERROR, "RST_STREAM of a size other than 4")
        if stream_id == 0 or stream_id > self._last_stream:
            raise H2ConnectionError(h2.PROTOCOL_ERROR, "RST_STREAM on stream 0 or an idle stream")
        stream = self.streams.get(stream_id)
        if stream is not None:
            self._close(stream, cancel=True)

    def _on_settings(self, flags: int, stream_id: int, payload: memoryview) -> None:
        if stream_id:
            raise H2ConnectionError(h2.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & h2.ACK:
            if payload:
                raise H2ConnectionError(h2.FRAME_SIZE_ERROR, "SETTINGS acknowledgment with a payload")
            self._acked = True
            return
        if len(payload) % 6:
            raise H2ConnectionError(h2.FRAME_SIZE_ERROR, "SETTINGS of a size not a multiple of 6")
        for key, value in h2.parse_settings(payload):
            if key == h2.INITIAL_WINDOW_SIZE:
                if value > h2.MAX_WINDOW:
                    raise H2ConnectionError(h2.FLOW_CONTROL_ERROR, "SETTINGS_INITIAL_WINDOW_SIZE above 2^31-1")
                delta, self._peer_window = value - self._peer_window, value
                for stream in self.streams.values():
                    stream.send_window += delta
                    if stream.send_window > h2.MAX_WINDOW:
                        raise H2ConnectionError(h2.FLOW_CONTROL_ERROR, "a stream window above 2^31-1")
            elif key == h2.MAX_FRAME_SIZE:
                if not h2.DEFAULT_MAX_FRAME <= value <= h2.MAX_FRAME_LIMIT:
                    raise H2ConnectionError(h2.PROTOCOL_ERROR, "SETTINGS_MAX_FRAME_SIZE out of range")
                self._peer_frame = value
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
        if not flags & h2.ACK:
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

    # ---- answering calls ------------------------------------------------------------------------------------

    def respond(self, stream: Stream, message: bytes) -> None:
        """A unary call's answer: headers, the one message and OK trailers, in one write when the windows allow."""
        if stream.closed:
            return
        size = len(message) + 5
        if (size > self._peer_frame or size > self._send_window or size > stream.send_window or stream.headers_sent
                or self._write_paused or self._table_update or size - 5 > self._max_message):
            self.send_message(stream, message)
            self.finish(stream, OK)
            return
        self._send_window -= size
        stream.send_window -= size
        stream_id = stream.id
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
        if len(message) > self._max_message:
            self.finish(stream, RESOURCE_EXHAUSTED,
                        f"sent message larger than max ({len(message)} vs. {self._max_message})")
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
            stream.outbox.clear()
            stream.outbox_bytes = 0
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
        if self._table_update:
            self._table_update = False
            block = TABLE_SIZE_ZERO + block
        limit = self._peer_frame
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
        while outbox:
            room = min(self._send_window, stream.send_window, self._peer_frame)
            if room <= 0 or self._write_paused:
                self._blocked[stream.id] = stream
                return
            chunk = outbox[0]
            if len(chunk) <= room:
                outbox.popleft()
            else:
                chunk, outbox[0] = chunk[:room], chunk[room:]
            size = len(chunk)
            self._send_window -= size
            stream.send_window -= size
            stream.outbox_bytes -= size
            self._write(HEAD.pack(size << 8 | h2.DATA, 0, stream.id))
            self._write(chunk)
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
            if self._send_window <= 0 or self._write_paused:
                return
            self._pump(stream)

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
        if stream.timer is not None:
            stream.timer.cancel()
        stream.wake()
        if stream.drain_waiter is not None and not stream.drain_waiter.done():
            stream.drain_waiter.set_result(None)
        if cancel and stream.task is not None:
            stream.task.cancel()
        if self.goaway_sent and not self.streams:
            self.close()

    # ---- the connection as a whole -------------------------------------------------------------------------------

    def goaway(self) -> None:
        """Refuse new streams (GOAWAY NO_ERROR); close once the open ones are done."""
        if self._closing or self.goaway_sent:
            return
        self.goaway_sent = True
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
            elif stream.task is not None:
                stream.task.cancel()
        self.close()

    def fail(self, code: int, message: str) -> None:
        """A connection error: GOAWAY with its code, and close."""
        if self._closing:
            return
        log.info("closing a gRPC connection: %s", message)
        self._write(h2.goaway(self._last_stream, code, message.encode()[:256]))
        self.goaway_sent = True
        for stream in list(self.streams.values()):
            self._close(stream, cancel=True)
        self.close()

    def close(self) -> None:
        """Close after what is written so far has gone out."""
        if self._closing:
            return
        self._closing = True
        self._flush()
        if self._transport is not None:
            self._transport.close()

    def _write(self, data: bytes | memoryview) -> None:
        self._out.append(data)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._out and self._transport is not None and not self._transport.is_closing():
            if self._tls:
                # The SSL transport makes each piece a TLS record of its own; joined, a turn's frames are one. 16
                # small frames, sealed and opened again: 38 us as records, 5 us joined. A turn's bytes are bounded
                # by the windows and the write buffer's high-water mark, so the copy is too.
                self._transport.write(b"".join(self._out))
            else:
                self._transport.writelines(self._out)
        self._out = []
