"""The worker's end of its socket, shared by the main thread and any thread the model starts.

Messages arrive in one stream but belong to different waiters: the server's calls (execute, ...)
to the main thread, BLS answers to whichever thread or coroutine made the call, cancellations to
whoever asks `is_cancelled()`. There is no reader thread: whoever needs a message and finds nobody
reading becomes the reader, reads and dispatches until its own message has come, then hands over
(a leader/follower scheme). On the fast path (a sync model between two executes) the main thread
reads its next execute itself, as if the socket were its alone, with no thread hop.

A model whose `execute` is a coroutine runs on an event loop that holds the reader role for good
(`hold_for_loop`): the loop reads whenever the socket is readable, and threads that wait are woken
by it.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from transerve.backends.python.ipc import (
    OP_BLS_CALL,
    OP_BLS_RESPONSE,
    OP_CANCEL,
    OP_RESPONSE,
    Endpoint,
    receive_datagram,
    send_datagram,
)
from transerve.backends.python.shm import Entry

#: A server call for the main thread: (op, id, body, tensors per group), or None once the server is gone.
Call = tuple[int, int, Any, list[list[Entry]]] | None
#: The answer a BLS call gets once the server is gone: (final, error, parameters).
_GONE = (True, ("UNAVAILABLE", "the server closed the connection to this model instance"), None)


class BlsCall:
    """The answers to one BLS request as they arrive: (body, tensors) items, the last one final.

    A thread waits for them through `Channel.wait_until`; a coroutine on the loop that reads the
    socket awaits `wait()` (only that loop's thread delivers then, so no cross-thread wake-up).
    """

    __slots__ = ("items", "abandoned", "_waker")

    def __init__(self) -> None:
        self.items: deque[tuple[Any, list[Entry]]] = deque()
        #: The model dropped its response iterator early: later answers are discarded.
        self.abandoned = False
        self._waker: asyncio.Future[None] | None = None

    def _deliver(self, body: Any, tensors: list[Entry]) -> None:
        if self.abandoned:
            return
        self.items.append((body, tensors))
        waker = self._waker
        if waker is not None and not waker.done():
            waker.set_result(None)

    async def wait(self) -> None:
        """Until an item is waiting."""
        while not self.items:
            self._waker = asyncio.get_running_loop().create_future()
            try:
                await self._waker
            finally:
                self._waker = None


class Channel:
    """Sends from any thread; reads by whoever needs a message (see the module docstring)."""

    def __init__(self, sock: socket.socket, endpoint: Endpoint) -> None:
        self._sock = sock
        self._endpoint = endpoint
        #: Guards the endpoint's arena and keeps each message's send whole; the reader queues the
        #: blocks the server released on `_released` instead of taking it.
        self._io = threading.Lock()
        self._released: deque[Sequence[int]] = deque()
        self._main = threading.get_ident()
        #: Guards the reader role, the waiting calls and BLS answers; `_state` waits on it.
        self._lock = threading.Lock()
        self._state = threading.Condition(self._lock)
        #: The thread reading the socket, if any.
        self._reader: int | None = None
        self._waiters = 0
        self._calls: deque[Call] = deque()
        self._bls: dict[int, BlsCall] = {}
        self._next_bls = 0
        #: Tokens of decoupled requests still open, and those of them the server cancelled.
        self.open: set[int] = set()
        self.cancelled: set[int] = set()
        self._highest_token = 0
        #: The event loop holding the reader role, for a model whose `execute` is a coroutine.
        self.loop: asyncio.AbstractEventLoop | None = None
        self._on_call: Callable[[], None] | None = None
        self.gone = False
        #: Messages that finalizers queue (the cancellation of a BLS call whose response iterator was dropped, the
        #: deletion of a custom metric): (op, id, body), sent before the next message (a finalizer may run while
        #: this thread holds `_io`).
        self.later: deque[tuple[int, int, Any]] = deque()

    # ---- sending ----------------------------------------------------------------------------------

    def send(self, op: int, call_id: int, body: Any, groups: Sequence[Sequence[Entry]] = ()) -> None:
        """Send one message (tensors into our arena), from any thread."""
        with self._io:
            endpoint = self._endpoint
            self._before_send()
            data, fds = endpoint.encode(op, call_id, body, endpoint.place(groups) if groups else None)
            send_datagram(self._sock, data, fds)

    def send_encoded(self, build: Callable[[Endpoint], tuple[bytes, list[int]]]) -> None:
        """Send a message `build` encodes with the endpoint (it may place tensors and time that)."""
        with self._io:
            self._before_send()
            data, fds = build(self._endpoint)
            send_datagram(self._sock, data, fds)

    def _before_send(self) -> None:
        """Under `_io`: hand the server the blocks it may reuse, and send what finalizers queued since."""
        if self._released:
            self._endpoint.release(self._released)
        while self.later:
            data, fds = self._endpoint.encode(*self.later.popleft(), None)
            send_datagram(self._sock, data, fds)

    def cancel_bls(self, call_id: int) -> None:
        """Ask the server to cancel a BLS call: its final answer then comes at once, with a CANCELLED error."""
        self.send(OP_CANCEL, call_id, None)

    def open_tokens(self, tokens: list[int]) -> None:
        """Decoupled requests the worker received: their senders may send until final."""
        with self._io:
            self.open.update(tokens)
            self._highest_token = max(self._highest_token, *tokens)

    def close_tokens(self, tokens: list[int]) -> None:
        """Decoupled requests whose execute failed: the server ended their streams."""
        with self._io:
            self.open.difference_update(tokens)
            self.cancelled.difference_update(tokens)

    def send_response(self, token: int, final: bool, body: Any, entries: list[Entry]) -> bool:
        """Send one response of the decoupled request `token`; False if its final one was sent."""
        with self._io:
            if token not in self.open:
                return False
            if final:
                self.open.discard(token)
                self.cancelled.discard(token)
            endpoint = self._endpoint
            if self._released:
                endpoint.release(self._released)
            data, fds = endpoint.encode(OP_RESPONSE, token, body, endpoint.place([entries]) if entries else None)
            send_datagram(self._sock, data, fds)
        return True

    def start_bls(self, body: Any, inputs: list[Entry], op: int = OP_BLS_CALL) -> tuple[int, BlsCall]:
        """Register a BLS call (or another call to the server, e.g. OP_MODEL_CONTROL) and send it; its answers
        arrive in the returned BlsCall."""
        call = BlsCall()
        with self._state:
            self._next_bls += 1
            call_id = self._next_bls
            self._bls[call_id] = call
            if self.gone:
                call._deliver(_GONE, [])
                return call_id, call
        self.send(op, call_id, body, [inputs] if inputs else ())
        return call_id, call

    def finish_bls(self, call_id: int) -> None:
        with self._state:
            self._bls.pop(call_id, None)

    # ---- receiving ----------------------------------------------------------------------------------

    def next_call(self) -> Call:
        """The server's next call for the main thread, reading the socket until one comes.

        The fast path: nobody else reads, so this thread reads and takes the call it receives
        directly, with one lock round trip to claim and one to release the reader role.
        """
        with self._lock:
            if self._calls:
                return self._calls.popleft()
            claimed = self._reader is None
            if claimed:
                self._reader = self._main
        if not claimed:
            self.wait_until(lambda: bool(self._calls))
            with self._lock:
                return self._calls.popleft()
        try:
            while True:
                call = self._receive(0, True)
                if call is not None:
                    return call
                with self._lock:
                    if self._calls:
                        return self._calls.popleft()
        finally:
            with self._lock:
                self._reader = None
                if self._waiters:
                    self._state.notify_all()

    def take_calls(self) -> list[Call]:
        """Calls that have arrived (the reader loop starts them)."""
        with self._state:
            calls = list(self._calls)
            self._calls.clear()
        return calls

    def wait_until(self, ready: Callable[[], bool]) -> None:
        """Block until `ready()` (checked under the state lock), reading the socket if nobody is."""
        me = threading.get_ident()
        state = self._state
        with state:
            while not ready():
                if self._reader is None or self._reader == me:
                    break
                self._waiters += 1
                try:
                    state.wait()
                finally:
                    self._waiters -= 1
            else:
                return
            nested = self._reader == me
            self._reader = me
        try:
            while True:
                if self.gone:
                    raise ConnectionError("the server closed the connection to this model instance")
                self._receive(0)
                with state:
                    if ready():
                        return
        finally:
            if not nested:
                self._release()

    def poll(self) -> None:
        """Handle what is waiting on the socket without blocking, unless another thread is reading
        (it handles it then). `is_cancelled()` calls this, so a busy model still hears cancellations."""
        me = threading.get_ident()
        with self._state:
            if self._reader is not None and self._reader != me:
                return
            nested = self._reader == me
            self._reader = me
        try:
            while self._receive(socket.MSG_DONTWAIT):
                pass
        finally:
            if not nested:
                self._release()

    def hold_for_loop(self, loop: asyncio.AbstractEventLoop, on_call: Callable[[], None]) -> None:
        """Make this thread, about to run `loop`, the reader for good (see the module docstring);
        `on_call` runs (on that thread) whenever a server call arrives."""
        me = threading.get_ident()
        state = self._state
        with state:
            while self._reader not in (None, me):
                self._waiters += 1
                try:
                    state.wait()
                finally:
                    self._waiters -= 1
            self._reader = me
        self.loop = loop
        self._on_call = on_call

    def fileno(self) -> int:
        return self._sock.fileno()

    def _release(self) -> None:
        with self._lock:
            self._reader = None
            if self._waiters:
                self._state.notify_all()

    def _receive(self, flags: int, for_main: bool = False) -> Any:
        """Read and dispatch one message. Returns whether one was read (False: none was waiting, for
        non-blocking reads), or with `for_main` a server call itself instead of queueing it."""
        if self.gone:
            return None if for_main else False
        try:
            received = receive_datagram(self._sock, self._endpoint.buffer, flags)
        except BlockingIOError:
            return False
        except OSError:
            received = None
        if received is None:
            self._server_gone()
            return None if for_main else False
        data, fds = received
        op, call_id, body, groups = self._endpoint.decode(data, fds, self._released)
        if op == OP_CANCEL:
            with self._io:
                # Tokens rise in the order the server sends executes: a higher one than any opened
                # belongs to an execute still waiting here; a lower one that is not open has ended.
                if call_id in self.open or call_id > self._highest_token:
                    self.cancelled.add(call_id)
            return None if for_main else True
        if op != OP_BLS_RESPONSE and for_main:
            return op, call_id, body, groups
        with self._lock:
            if op == OP_BLS_RESPONSE:
                call = self._bls.get(call_id)
                if call is not None:
                    call._deliver(body, groups[0] if groups else [])
                    if call.abandoned and body[0]:
                        del self._bls[call_id]
            else:
                self._calls.append((op, call_id, body, groups))
                if self._on_call is not None:
                    self._on_call()
            if self._waiters:
                self._state.notify_all()
        return None if for_main else True

    def _server_gone(self) -> None:
        """The server's end closed: wake every waiter; pending BLS calls get an error answer."""
        with self._state:
            self.gone = True
            self._calls.append(None)
            for call in self._bls.values():
                call._deliver(_GONE, [])
            self._state.notify_all()
