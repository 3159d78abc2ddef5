"""The transport between the server and a python-backend worker process.

Control messages travel on an AF_UNIX SOCK_SEQPACKET socketpair: one pickled tuple per datagram,
so there is no framing, and the kernel wakes the reader once per message. Tensor bytes never go
through the socket: each direction has a shared-memory arena (a memfd mapped by both processes),
and a message only names where its tensors lie.

Placing tensors in the arenas, and reading them back, is `shm.py`'s job; this module frames the messages, moves
them over the socket and matches calls with their answers.

Calls go both ways and are matched by id, not by order: the server calls the worker (load, execute,
...) and the worker answers with OP_REPLY under the same id; the worker calls the server for BLS
(OP_BLS_CALL, answered by one or more OP_BLS_RESPONSE), and some messages expect no answer at all
(a decoupled model's OP_RESPONSE, OP_CANCEL either way).
"""

from __future__ import annotations

import array
import asyncio
import os
import pickle
import socket
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from transerve.backends.python.shm import (
    _NOTHING_PLACED,
    INLINE,
    INLINE_TENSOR_LIMIT,
    Descriptor,
    Entry,
    Placed,
    Region,
    ShmReader,
    ShmWriter,
)

#: Control messages larger than this are spilled into shared memory.
INLINE_LIMIT = 64 * 1024
#: Descriptors one datagram may carry: one overflow region for tensors, one for a spilled message.
MAX_FDS = 4
_ANCILLARY_BYTES = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
_TRUNCATED = int(socket.MSG_TRUNC | socket.MSG_CTRUNC)  # an int: enum arithmetic would cost every message
_PICKLE = pickle.HIGHEST_PROTOCOL

#: Message ops. Lifecycle replies are (None, value), or ((error code name, one-line message), None).
OP_SPILLED = 0  # an envelope whose real message was spilled into shared memory
# server -> worker calls, each answered by an OP_REPLY with the call's id
OP_LOAD = 1
OP_AUTO_COMPLETE = 2
OP_INITIALIZE = 3
OP_EXECUTE = 4
OP_IS_READY = 5
OP_FINALIZE = 6
OP_REPLY = 7
# server -> worker: the request with this token was cancelled; worker -> server: cancel the BLS call with this
# id (no answer either way)
OP_CANCEL = 8
# worker -> server: one response of a decoupled request; the id is the request's token (no answer)
OP_RESPONSE = 9
# worker -> server: a BLS request; the server answers with OP_BLS_RESPONSE messages under the same id
OP_BLS_CALL = 10
OP_BLS_RESPONSE = 11
# worker -> server: the one response of a non-decoupled request, sent after its execute's reply, under the id the
# reply gave it (no answer)
OP_LATE_RESPONSE = 12
# worker -> server: load, unload or ask the readiness of a model (pb_utils.load_model, ...); answered by one
# OP_BLS_RESPONSE (final, error, value)
OP_MODEL_CONTROL = 13
# worker -> server: a custom metric operation (pb_utils.MetricFamily, Metric); answered by one OP_BLS_RESPONSE
# (final, error, value), except a deletion, which is not answered
OP_METRIC = 14

#: Execute results other than (None, None, parameters) and (error code name, message, None): a non-decoupled
#: response that follows with OP_LATE_RESPONSE under the id in the message's place, and a request to run again.
PENDING = "PENDING"
RESCHEDULED = "RESCHEDULED"


class ConnectionLost(Exception):
    """The worker's end of the socket closed: the process exited or is exiting."""


class Endpoint:
    """One side of a worker connection: encodes outgoing messages (tensors into our arena) and
    decodes incoming ones (tensors out of the peer's), carrying the releases between the two.

    A message is (op, id, releases, frees, body, descriptors): `id` pairs a call with its answers;
    `releases` are blocks of the receiver's arena the sender is done with; `frees` are blocks of the
    sender's arena the receiver must give back once it has read the message; `body` is the op's own
    metadata.
    """

    __slots__ = ("_writer", "_reader", "buffer")

    def __init__(self, outgoing: Region, incoming: Region) -> None:
        self._writer = ShmWriter(outgoing)
        self._reader = ShmReader(incoming)
        self.buffer = bytearray(INLINE_LIMIT)

    @property
    def live_blocks(self) -> int:
        """Blocks of our arena the peer has not released yet (for tests and diagnostics)."""
        return self._writer.live_blocks

    def place(self, groups: Sequence[Sequence[Entry]]) -> Placed:
        """Write a message's tensors into shared memory, before its body is final (the worker
        times this step and reports the time in the body). Messages whose tensors are all tiny and
        numeric (the common small request) take a short path that never touches the arena."""
        descriptors: list[list[Descriptor]] = []
        for group in groups:
            placed: list[Descriptor] = []
            for name, datatype, data in group:
                if datatype == "BYTES" or data.nbytes > INLINE_TENSOR_LIMIT:
                    return self._writer.write(groups)
                placed.append((name, datatype, data.shape, INLINE, bytearray(data.tobytes()), data.nbytes, False))
            descriptors.append(placed)
        return (descriptors, [], []) if descriptors else _NOTHING_PLACED

    def encode(self, op: int, call_id: int, body: Any, placed: Placed | None = None) -> tuple[bytes, list[int]]:
        """The datagram for a message and the descriptors to pass with it (owned by the caller)."""
        descriptors, frees, fds = placed or _NOTHING_PLACED
        data = pickle.dumps((op, call_id, self._reader.take_releases(), frees, body, descriptors), _PICKLE)
        if len(data) <= INLINE_LIMIT:
            return data, fds
        spilled = [[("", "UINT8", np.frombuffer(data, np.uint8))]]
        spill_descriptors, spill_frees, spill_fds = self._writer.write(spilled, first_fd=len(fds))
        envelope = pickle.dumps((OP_SPILLED, 0, [], spill_frees, None, spill_descriptors), _PICKLE)
        return envelope, fds + spill_fds

    def decode(
        self, data: memoryview, fds: Sequence[int], released: deque[Sequence[int]] | None = None
    ) -> tuple[int, int, Any, list[list[Entry]]]:
        """(op, id, body, tensors per group) of a received datagram; maps and closes its descriptors.

        The blocks of our arena the peer released are freed at once, or, when a thread other than
        the sender's decodes, queued on `released` for `release` under the sender's lock.
        """
        regions = [Region.attach(fd) for fd in fds] if fds else ()
        op, call_id, releases, frees, body, descriptors = pickle.loads(data)
        if op == OP_SPILLED:
            (((_, _, spilled),),) = self._reader.read(descriptors, frees, regions)
            op, call_id, releases, frees, body, descriptors = pickle.loads(spilled)
        if releases:
            if released is None:
                self._writer.release(releases)
            else:
                released.append(releases)
        return op, call_id, body, self._reader.read(descriptors, frees, regions) if descriptors else []

    def release(self, released: deque[Sequence[int]]) -> None:
        """Free blocks `decode` queued (call it where tensors are placed, under the same lock)."""
        while released:
            self._writer.release(released.popleft())


def socket_pair() -> tuple[socket.socket, socket.socket]:
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def send_datagram(sock: socket.socket, data: bytes, fds: list[int]) -> None:
    """Send one message; the descriptors are closed once sent, as the peer now holds them."""
    try:
        if fds:
            sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        else:
            sock.send(data)
    except BlockingIOError:
        raise
    except BaseException:
        _close_all(fds)
        raise
    _close_all(fds)


def receive_datagram(
    sock: socket.socket, buffer: bytearray, flags: int = 0
) -> tuple[memoryview, list[int]] | None:
    """One message and the descriptors that came with it; None at end of stream.

    With `flags=socket.MSG_DONTWAIT` it raises BlockingIOError when no message is waiting.
    """
    nbytes, ancillary, message_flags, _ = sock.recvmsg_into([buffer], _ANCILLARY_BYTES, flags)
    fds: list[int] = []
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            received = array.array("i")
            received.frombytes(payload[: len(payload) - len(payload) % received.itemsize])
            fds.extend(received)
    if message_flags & _TRUNCATED:
        _close_all(fds)
        raise ConnectionLost("a message from the peer was truncated")
    if nbytes == 0:
        _close_all(fds)
        return None
    return memoryview(buffer)[:nbytes], fds


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


#: Receives a reply's (body, tensors per group), in the reader callback; it must not raise.
ReplyHandler = Callable[[Any, list[list[Entry]]], None]
#: Receives a message the worker sent unasked: (op, id, body, tensors per group).
MessageHandler = Callable[[int, int, Any, list[list[Entry]]], None]


class AsyncConnection:
    """The server's side of a worker socket, driven by the event loop without ever blocking it.

    Each reply goes to the handler of the call with its id. A reply is decoded in the reader callback
    (not by an awaiting coroutine), so its blocks are released even when the caller gave up, and the
    handler can build the final result there and hand it on: no task, not even a future, per call
    (`request` wraps a call in a future for callers that await). Messages the worker sends unasked
    (decoupled responses, BLS calls) go to `on_message`. Sends that meet a full socket wait in an outbox.
    """

    def __init__(self, sock: socket.socket, endpoint: Endpoint, loop: asyncio.AbstractEventLoop) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._endpoint = endpoint
        self._loop = loop
        #: Per call id: its reply handler, and what to call if the worker is lost first.
        self._waiting: dict[int, tuple[ReplyHandler, Callable[[], None]]] = {}
        self._next_id = 0
        self._outbox: deque[tuple[bytes, list[int]]] = deque()
        self.closed = False
        self.on_message: MessageHandler | None = None
        #: Decoupled requests and BLS calls in progress: their messages arrive unasked, so while any
        #: is open the reader empties the socket instead of stopping at the last awaited reply.
        self.open_streams = 0
        loop.add_reader(sock.fileno(), self.read_ready)

    @property
    def live_blocks(self) -> int:
        return self._endpoint.live_blocks

    @property
    def busy(self) -> bool:
        """Whether a call (an execute, a finalize, ...) awaits its reply."""
        return bool(self._waiting)

    def request(self, op: int, body: Any, groups: Sequence[Sequence[Entry]] = ()) -> asyncio.Future[Any]:
        """Send a call; the future resolves to the reply's (body, groups), or raises ConnectionLost."""
        future = self._loop.create_future()

        def replied(body: Any, groups: list[list[Entry]]) -> None:
            if not future.done():
                future.set_result((body, groups))

        def lost() -> None:
            if not future.done():
                future.set_exception(ConnectionLost())

        self.call(op, body, groups, replied, lost)
        return future

    def call(
        self, op: int, body: Any, groups: Sequence[Sequence[Entry]], on_reply: ReplyHandler, on_lost: Callable[[], None]
    ) -> None:
        """Send a call: `on_reply(body, groups)` runs in the reader callback that decodes its reply, or
        `on_lost()` if the worker is lost first."""
        if self.closed:
            on_lost()
            return
        self._next_id += 1
        self._waiting[self._next_id] = (on_reply, on_lost)
        self._send(op, self._next_id, body, groups)

    def notify(self, op: int, call_id: int, body: Any, groups: Sequence[Sequence[Entry]] = ()) -> None:
        """Send a message that expects no reply (a cancellation, a BLS response); dropped once closed."""
        if not self.closed:
            self._send(op, call_id, body, groups)

    def _send(self, op: int, call_id: int, body: Any, groups: Sequence[Sequence[Entry]]) -> None:
        data, fds = self._endpoint.encode(op, call_id, body, self._endpoint.place(groups))
        if self._outbox:
            self._outbox.append((data, fds))
            return
        try:
            send_datagram(self._sock, data, fds)
        except BlockingIOError:
            self._outbox.append((data, fds))
            self._loop.add_writer(self._sock.fileno(), self._flush)
        except OSError:
            self.lose()

    def _flush(self) -> None:
        while self._outbox:
            data, fds = self._outbox[0]
            try:
                send_datagram(self._sock, data, fds)
            except BlockingIOError:
                return
            except OSError:
                self.lose()
                return
            self._outbox.popleft()
        self._loop.remove_writer(self._sock.fileno())

    def read_ready(self, drain: bool = False) -> None:
        """Handle the messages waiting on the socket (`drain`: all of them, before closing).

        Stops once no reply is outstanding and no stream is open rather than on EAGAIN, which saves
        a syscall per wake-up; a message left behind wakes the loop again.
        """
        endpoint = self._endpoint
        while not self.closed:
            try:
                received = receive_datagram(self._sock, endpoint.buffer)
            except BlockingIOError:
                return
            except (OSError, ConnectionLost):
                received = None
            if received is None:
                self.lose()
                return
            try:
                op, call_id, body, groups = endpoint.decode(*received)
            except Exception:
                self.lose()
                raise
            if op == OP_REPLY:
                self._waiting.pop(call_id)[0](body, groups)
            elif self.on_message is not None:
                self.on_message(op, call_id, body, groups)
            if not (drain or self._waiting or self.open_streams):
                return

    def lose(self) -> None:
        """Close the connection and settle every waiting request as lost."""
        if self.closed:
            return
        self.closed = True
        fileno = self._sock.fileno()
        self._loop.remove_reader(fileno)
        if self._outbox:
            self._loop.remove_writer(fileno)
            for _, fds in self._outbox:
                _close_all(fds)
            self._outbox.clear()
        self._sock.close()
        waiting = list(self._waiting.values())
        self._waiting.clear()
        for _, on_lost in waiting:
            on_lost()
