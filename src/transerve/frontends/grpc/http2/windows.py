"""An HTTP/2 connection's flow-control windows (RFC 9113, section 5.2) both ways, apart from its frames: what the
client may still send and when to give it more (WINDOW_UPDATE), and what we may still send it.

Receiving, window is given as the calls take their messages: a stream's reader gets window for the message it
takes next, as far as that message has arrived, so a message larger than the windows still flows while whatever
queues behind it waits for its reader. Bytes given window that no call has taken yet are `held`, bounded over the
connection (`held_limit`). Updates go out in WINDOW_UPDATEs of at least half a window, unless a window runs low.
"""

from __future__ import annotations

from collections.abc import Callable

from transerve.frontends.grpc.http2 import frames as h2
from transerve.frontends.grpc.http2.frames import H2ConnectionError, H2StreamError
from transerve.frontends.grpc.http2.stream import Stream
from transerve.frontends.grpc.limits import CONNECTION_WINDOW, STREAM_WINDOW

#: A gRPC message's prefix (compressed flag, 32-bit length), counted in the windows as its bytes are.
_PREFIX = 5


class ReceiveWindows:
    """What the client may send: the connection's window here, each stream's on the stream (`recv_window`, with
    the counts `received` >= `credited` >= `taken`)."""

    __slots__ = ("window", "_unacked", "held", "held_limit", "_write")

    def __init__(self, write: Callable[[bytes], None], held_limit: int) -> None:
        self.window = h2.DEFAULT_WINDOW
        self._unacked = 0  # bytes given back and not yet announced
        #: Bytes given window before their call took them, over all streams.
        self.held = 0
        self.held_limit = held_limit
        self._write = write

    def opening_update(self) -> bytes:
        """The WINDOW_UPDATE that raises the connection's window to CONNECTION_WINDOW, for the first write."""
        self.window = CONNECTION_WINDOW
        return h2.window_update(0, CONNECTION_WINDOW - h2.DEFAULT_WINDOW)

    def receive(self, length: int) -> None:
        if length > self.window:
            raise H2ConnectionError(h2.FLOW_CONTROL_ERROR, "DATA beyond the connection window")
        self.window -= length

    def give_back(self, size: int) -> None:
        """Connection window for bytes that no stream holds (any more)."""
        if size:
            unacked = self._unacked = self._unacked + size
            if unacked >= CONNECTION_WINDOW // 2 or self.window < CONNECTION_WINDOW // 4:
                self._write(h2.window_update(0, unacked))
                self.window += unacked
                self._unacked = 0

    def credit(self, stream: Stream, size: int) -> None:
        """Give `size` bytes of window back to the client, on the connection and on the stream."""
        self.give_back(size)
        if not stream.remote_closed:
            unacked = stream.recv_unacked = stream.recv_unacked + size
            if unacked >= STREAM_WINDOW // 2 or stream.recv_window < STREAM_WINDOW // 4:
                self._write(h2.window_update(stream.id, unacked))
                stream.recv_window += unacked
                stream.recv_unacked = 0

    def wanted(self, stream: Stream) -> int:
        """The window the stream's reader needs now: for its next message, as far as that has arrived."""
        messages = stream.messages
        target = min(stream.received, stream.taken + (len(messages[0]) + _PREFIX if messages else stream.need))
        return target - stream.credited

    def hold(self, stream: Stream, grant: int) -> bool:
        """Give the stream `grant` more; False, giving nothing, when the connection would hold past its limit."""
        if self.held + grant > self.held_limit:
            return False
        stream.credited += grant
        self.held += grant
        self.credit(stream, grant)
        return True

    def taken(self, stream: Stream, message: int) -> None:
        """The stream's call took a message of `message` bytes."""
        size = message + _PREFIX
        stream.taken += size
        self.held -= size

    def release(self, stream: Stream) -> None:
        """The stream closed: what it held, and what it received beyond that, goes back to the connection."""
        self.held -= stream.credited - stream.taken
        self.give_back(stream.received - stream.credited)
        stream.taken = stream.credited = stream.received


class SendWindows:
    """What we may send: the connection's window, each stream's (`send_window`, opened at the client's
    SETTINGS_INITIAL_WINDOW_SIZE), and the client's largest frame."""

    __slots__ = ("window", "initial", "max_frame")

    def __init__(self) -> None:
        self.window = h2.DEFAULT_WINDOW
        self.initial = h2.DEFAULT_WINDOW
        self.max_frame = h2.DEFAULT_MAX_FRAME

    def fits(self, stream: Stream, size: int) -> bool:
        """Whether one frame of `size` bytes may go on the stream now."""
        return size <= self.max_frame and size <= self.window and size <= stream.send_window

    def room(self, stream: Stream) -> int:
        """The largest DATA frame the stream may send now."""
        return min(self.window, stream.send_window, self.max_frame)

    def spend(self, stream: Stream, size: int) -> None:
        self.window -= size
        stream.send_window -= size

    def grow(self, increment: int) -> None:
        """A WINDOW_UPDATE on stream 0."""
        self.window += increment
        if self.window > h2.MAX_WINDOW:
            raise H2ConnectionError(h2.FLOW_CONTROL_ERROR, "connection window above 2^31-1")

    def grow_stream(self, stream: Stream, increment: int) -> None:
        stream.send_window += increment
        if stream.send_window > h2.MAX_WINDOW:
            raise H2StreamError(h2.FLOW_CONTROL_ERROR, "stream window above 2^31-1")

    def set_initial(self, value: int, streams: list[Stream]) -> None:
        """SETTINGS_INITIAL_WINDOW_SIZE: every open stream's window moves by the change (section 6.9.2)."""
        if value > h2.MAX_WINDOW:
            raise H2ConnectionError(h2.FLOW_CONTROL_ERROR, "SETTINGS_INITIAL_WINDOW_SIZE above 2^31-1")
        delta, self.initial = value - self.initial, value
        for stream in streams:
            stream.send_window += delta
            if stream.send_window > h2.MAX_WINDOW:
                raise H2ConnectionError(h2.FLOW_CONTROL_ERROR, "a stream window above 2^31-1")
