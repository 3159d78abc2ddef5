"""The frames that govern a connection rather than carry a call's headers or messages: SETTINGS, PING, GOAWAY,
WINDOW_UPDATE, RST_STREAM and PRIORITY, each checked as RFC 9113 section 6 says, and the budgets of frames that
cost the server work but carry no call (`FrameBudgets`: past one, the connection ends with ENHANCE_YOUR_CALM)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from transerve.frontends.grpc.http2 import frames as h2
from transerve.frontends.grpc.http2.frames import H2ConnectionError, H2StreamError
from transerve.frontends.grpc.http2.sending import Sender
from transerve.frontends.grpc.limits import (
    EMPTY_FRAMES,
    MAX_SETTINGS,
    RESETS,
    SETTINGS_FRAMES,
    Http2Limits,
    PingPolicy,
    TokenBucket,
)

if TYPE_CHECKING:
    from transerve.frontends.grpc.http2.connection import Http2Connection


class FrameBudgets:
    """Token buckets for resets, SETTINGS frames and frames that do nothing (limits.py has their sizes)."""

    __slots__ = ("_loop", "_resets", "_settings", "_empty")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        now = loop.time()
        self._resets = TokenBucket(RESETS, now)
        self._settings = TokenBucket(SETTINGS_FRAMES, now)
        self._empty = TokenBucket(EMPTY_FRAMES, now)

    def reset(self, what: str) -> None:
        """A stream refused or reset."""
        self._spend(self._resets, what)

    def settings(self) -> None:
        self._spend(self._settings, "SETTINGS frames")

    def nothing(self, what: str) -> None:
        """A frame that does nothing: empty, ignored, or of a kind not known."""
        self._spend(self._empty, what)

    def _spend(self, bucket: TokenBucket, what: str) -> None:
        if not bucket.take(self._loop.time()):
            raise H2ConnectionError(h2.ENHANCE_YOUR_CALM, f"too many {what}")


class ControlFrames:
    """One connection's control frames; `acked` says whether the client has acknowledged our SETTINGS."""

    def __init__(self, connection: Http2Connection, sender: Sender, write: Callable[[bytes], None],
                 budgets: FrameBudgets, limits: Http2Limits) -> None:
        self._connection = connection
        self._sender = sender
        self._write = write
        self._budgets = budgets
        self._pings = PingPolicy(limits)
        self.acked = False

    def window_update(self, stream_id: int, payload: memoryview) -> None:
        if len(payload) != 4:
            raise H2ConnectionError(h2.FRAME_SIZE_ERROR, "WINDOW_UPDATE of a size other than 4")
        increment = h2.u31(payload)
        sender = self._sender
        if stream_id == 0:
            if not increment:
                raise H2ConnectionError(h2.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            sender.windows.grow(increment)
            sender.pump_blocked()
            return
        stream = self._connection.streams.get(stream_id)
        if stream is None:
            if stream_id > self._connection.last_stream:
                raise H2ConnectionError(h2.PROTOCOL_ERROR, "WINDOW_UPDATE on an idle stream")
            return
        if not increment:
            raise H2StreamError(h2.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
        sender.windows.grow_stream(stream, increment)
        sender.pump(stream)

    def rst_stream(self, stream_id: int, payload: memoryview) -> None:
        if len(payload) != 4:
            raise H2ConnectionError(h2.FRAME_SIZE_ERROR, "RST_STREAM of a size other than 4")
        connection = self._connection
        if stream_id == 0 or stream_id > connection.last_stream:
            raise H2ConnectionError(h2.PROTOCOL_ERROR, "RST_STREAM on stream 0 or an idle stream")
        self._budgets.reset("streams reset (RST_STREAM)")
        stream = connection.streams.get(stream_id)
        if stream is not None:
            connection.close_stream(stream, cancel=True)

    def settings(self, flags: int, stream_id: int, payload: memoryview) -> None:
        if stream_id:
            raise H2ConnectionError(h2.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & h2.ACK:
            if payload:
                raise H2ConnectionError(h2.FRAME_SIZE_ERROR, "SETTINGS acknowledgment with a payload")
            if self.acked:  # we sent one SETTINGS: more acknowledgments do nothing
                self._budgets.nothing("frames that do nothing")
            self.acked = True
            return
        if len(payload) % 6:
            raise H2ConnectionError(h2.FRAME_SIZE_ERROR, "SETTINGS of a size not a multiple of 6")
        if len(payload) > 6 * MAX_SETTINGS:
            raise H2ConnectionError(h2.ENHANCE_YOUR_CALM, f"SETTINGS with more than {MAX_SETTINGS} entries")
        self._budgets.settings()
        self._sender.apply_settings(h2.parse_settings(payload), list(self._connection.streams.values()))
        self._write(h2.frame(h2.SETTINGS, h2.ACK, 0))
        self._sender.pump_blocked()

    def ping(self, flags: int, stream_id: int, payload: memoryview) -> None:
        if stream_id:
            raise H2ConnectionError(h2.PROTOCOL_ERROR, "PING on a stream")
        if len(payload) != 8:
            raise H2ConnectionError(h2.FRAME_SIZE_ERROR, "PING of a size other than 8")
        if flags & h2.ACK:  # we send no PING, so this answers nothing
            self._budgets.nothing("frames that do nothing")
            return
        if self._sender.answered:
            self._sender.answered = False
            self._pings.forgive()
        connection = self._connection
        if self._pings.received(connection.loop.time(), bool(connection.streams)):
            raise H2ConnectionError(h2.ENHANCE_YOUR_CALM, "too_many_pings")  # grpc-core's words, which its clients know
        self._write(h2.frame(h2.PING, h2.ACK, 0, bytes(payload)))

    def goaway(self, stream_id: int, payload: memoryview) -> None:
        if stream_id:
            raise H2ConnectionError(h2.PROTOCOL_ERROR, "GOAWAY on a stream")
        if len(payload) < 8:
            raise H2ConnectionError(h2.FRAME_SIZE_ERROR, "GOAWAY shorter than 8 bytes")
        self._connection.goaway()  # the client opens no more streams; those open are answered, then it closes

    def priority(self, stream_id: int, payload: memoryview) -> None:
        if stream_id == 0:
            raise H2ConnectionError(h2.PROTOCOL_ERROR, "PRIORITY on stream 0")
        if len(payload) == 5 and h2.u31(payload) == stream_id:  # section 5.3.1; one not open cannot be reset
            error = H2StreamError if stream_id in self._connection.streams else H2ConnectionError  # (as nghttp2)
            raise error(h2.PROTOCOL_ERROR, "a stream cannot depend on itself")
        if len(payload) != 5:
            raise H2StreamError(h2.FRAME_SIZE_ERROR, "PRIORITY of a size other than 5")
        self._budgets.nothing("frames that do nothing")  # priorities are deprecated and ignored
