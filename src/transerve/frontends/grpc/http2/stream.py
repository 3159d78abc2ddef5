"""One HTTP/2 stream carrying one gRPC call: its state, windows, and the messages going each way."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

from transerve.frontends.grpc.http2.headers import INTERNAL, RESOURCE_EXHAUSTED, UNIMPLEMENTED, RequestHead

_PREFIX = 5  # a gRPC message's compressed flag and 32-bit big-endian length


class CallRefused(Exception):
    """A request message the call cannot take: the call ends with this gRPC status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Stream:
    """A call's HTTP/2 stream. `route`, `task` and `timer` belong to the handler that runs the call; `running` is
    the connection's note of whether the handler has started it."""

    __slots__ = (
        "id", "head", "route", "task", "timer", "running", "remote_closed", "closed", "recv_window", "recv_unacked",
        "inbox", "need", "messages", "waiter", "send_window", "headers_sent", "outbox", "outbox_bytes", "trailers",
        "drain_waiter", "received", "credited", "taken", "stalled_since",
    )

    def __init__(self, stream_id: int, head: RequestHead, recv_window: int, send_window: int) -> None:
        self.id = stream_id
        self.head = head
        self.route: Any = None
        self.task: asyncio.Task[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.running = False  # the handler started the call's work (a unary call waits for its whole request)
        self.remote_closed = False  # the client sent END_STREAM
        self.closed = False  # nothing more goes out: trailers sent, or the stream was reset
        self.recv_window = recv_window
        self.recv_unacked = 0  # bytes received and not yet given back with WINDOW_UPDATE
        self.inbox = bytearray()  # the start of a message whose end has not arrived
        self.need = _PREFIX  # bytes `inbox` must hold before a message can be taken from it
        self.messages: deque[bytes | bytearray | memoryview] = deque()
        self.waiter: asyncio.Future[None] | None = None  # a reader waiting for a message or the end
        self.send_window = send_window
        self.headers_sent = False
        self.outbox: deque[memoryview] = deque()  # DATA payload waiting for flow-control window
        self.outbox_bytes = 0
        self.trailers: bytes | None = None  # to send once `outbox` is empty
        self.drain_waiter: asyncio.Future[None] | None = None
        # Flow control counts the request's bytes: received, given back to the client as window, taken by the call
        # (each of them a count from the start of the stream; the connection keeps taken <= credited <= received).
        self.received = 0
        self.credited = 0
        self.taken = 0
        self.stalled_since = 0.0  # when its answer last had to wait for the client's window

    def feed(self, data: memoryview, limit: int) -> None:
        """Split DATA payload into gRPC messages; CallRefused for a compressed or oversized one."""
        inbox = self.inbox
        if inbox:
            inbox += data
            if len(inbox) < self.need:
                return
            data = memoryview(bytes(inbox))
            inbox.clear()
        size = len(data)
        offset = 0
        while size - offset >= _PREFIX:
            length = _check_prefix(data, offset, limit)
            end = offset + _PREFIX + length
            if end > size:
                self.need = _PREFIX + length
                break
            message = data[offset + _PREFIX:end]
            # One that waits behind another is copied, so as not to keep the whole read it came in alive.
            self.messages.append(bytes(message) if self.messages else message)
            offset = end
        else:
            self.need = _PREFIX
        if offset < size:
            inbox += data[offset:]

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)


def _check_prefix(data: memoryview, offset: int, limit: int) -> int:
    flag = data[offset]
    if flag == 1:
        raise CallRefused(UNIMPLEMENTED, "compressed messages are not supported, send identity (uncompressed) ones")
    if flag != 0:
        raise CallRefused(INTERNAL, f"malformed message: compressed flag {flag}")
    length = int.from_bytes(data[offset + 1:offset + _PREFIX], "big")
    if length > limit:
        raise CallRefused(RESOURCE_EXHAUSTED, f"received message larger than max ({length} vs. {limit})")
    return length
