"""A request's responses as they are produced: zero or more, then a final flag.

Decoupled models answer through one of these: the backend side calls `send`/`send_error`/`close`/
`fail`, a frontend iterates it. As in Triton, a decoupled model may send a response that carries an
error and keep going (`send_error`); iterating raises that error, and iterating again goes on with
the responses after it. Consumers that forward final flags (gRPC's `triton_final_response`, BLS)
use `receive`, which says which item was the last. Cancelling a stream (the client went away) is
what `is_cancelled()` reports to the model, and callbacks let a backend pass the news on to where
the model runs.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from transerve.core.errors import ServerError
from transerve.core.types import InferResponse

#: One item of a stream: a response, an error response, or None for the final flag alone.
StreamItem = InferResponse | ServerError | None


class ResponseStream:
    """An async iterator of InferResponse fed by callbacks on the event loop thread."""

    __slots__ = ("_loop", "_items", "_waiter", "_closed", "cancelled", "_on_cancel", "final_sent", "shape_response")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: deque[tuple[StreamItem, bool]] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False
        self.cancelled = False
        self._on_cancel: list[Callable[[], None]] = []
        #: Whether the model marked a response (or an empty message) as the last one.
        self.final_sent = False
        #: What the core does to each response before it is queued (classification, shared memory outputs), if any.
        self.shape_response: Callable[[InferResponse], InferResponse] | None = None

    # ---- producer side (backends) ------------------------------------------------------------------

    def send(self, response: InferResponse, final: bool = False) -> None:
        """One response; `final` ends the stream after it."""
        item: StreamItem = response
        if self.shape_response is not None:
            try:
                item = self.shape_response(response)
            except ServerError as exc:
                item = exc
        self._put(item, final, final)

    def send_error(self, error: ServerError, final: bool = False) -> None:
        """A response that carries an error; unless `final`, more responses may follow."""
        self._put(error, final, final)

    def close(self) -> None:
        """The final flag alone: no more responses."""
        self._put(None, True, True)

    def fail(self, error: ServerError) -> None:
        """End the stream with an error, after the responses already sent (the model did not end it)."""
        self._put(error, True, False)

    def _put(self, item: StreamItem, final: bool, final_sent: bool) -> None:
        if self._closed:
            return
        if final:
            self._closed = True
            self.final_sent = final_sent
        if not self.cancelled:
            self._items.append((item, final))
        self._wake()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def ended(self) -> bool:
        """Whether the producer is done and every response was taken: at most the final flag alone is left."""
        return self._closed and all(item is None for item, _ in self._items)

    # ---- consumer side (frontends) -----------------------------------------------------------------

    def cancel(self) -> None:
        """The client is gone: tell the producer, drop what is still queued."""
        if self.cancelled:
            return
        self.cancelled = True
        self._items.clear()
        self._wake()
        for callback in self._on_cancel:
            callback()
        self._on_cancel.clear()

    def on_cancel(self, callback: Callable[[], None]) -> None:
        """Run `callback` when the consumer cancels (at once if it already has)."""
        if self.cancelled:
            callback()
        else:
            self._on_cancel.append(callback)

    async def receive(self) -> tuple[StreamItem, bool]:
        """The next item and whether it is the last; StopAsyncIteration once the last was taken
        (or the stream was cancelled)."""
        while not self._items:
            if self._closed or self.cancelled:
                raise StopAsyncIteration
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()

    def __aiter__(self) -> ResponseStream:
        return self

    async def __anext__(self) -> InferResponse:
        item, _ = await self.receive()
        if item is None:
            raise StopAsyncIteration
        if isinstance(item, ServerError):
            raise item
        return item

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
