"""A request's responses as they are produced: zero or more, then a final flag.

Decoupled models answer through one of these: the backend side calls `send`/`close`/`fail`,
a frontend iterates it. Cancelling it (the client went away) is what `is_cancelled()` reports
to the model, and callbacks let a backend pass the news on to where the model runs.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from transerve.core.errors import ServerError
from transerve.core.types import InferResponse


class ResponseStream:
    """An async iterator of InferResponse fed by callbacks on the event loop thread."""

    __slots__ = ("_loop", "_items", "_waiter", "_closed", "_error", "cancelled", "_on_cancel", "final_sent")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: deque[InferResponse] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False
        self._error: ServerError | None = None
        self.cancelled = False
        self._on_cancel: list[Callable[[], None]] = []
        #: Whether the model marked a response (or an empty message) as the last one.
        self.final_sent = False

    # ---- producer side (backends) ------------------------------------------------------------------

    def send(self, response: InferResponse, final: bool = False) -> None:
        """One response; `final` ends the stream after it."""
        if self._closed:
            return
        self._items.append(response)
        if final:
            self.final_sent = True
            self._closed = True
        self._wake()

    def close(self) -> None:
        """The final flag alone: no more responses."""
        if not self._closed:
            self.final_sent = True
            self._closed = True
            self._wake()

    def fail(self, error: ServerError) -> None:
        """End the stream with an error, after the responses already sent."""
        if not self._closed:
            self._error = error
            self._closed = True
            self._wake()

    @property
    def closed(self) -> bool:
        return self._closed

    # ---- consumer side (frontends) -----------------------------------------------------------------

    def cancel(self) -> None:
        """The client is gone: tell the producer, drop what is still queued."""
        if self.cancelled:
            return
        self.cancelled = True
        self._items.clear()
        for callback in self._on_cancel:
            callback()
        self._on_cancel.clear()

    def on_cancel(self, callback: Callable[[], None]) -> None:
        """Run `callback` when the consumer cancels (at once if it already has)."""
        if self.cancelled:
            callback()
        else:
            self._on_cancel.append(callback)

    def __aiter__(self) -> ResponseStream:
        return self

    async def __anext__(self) -> InferResponse:
        while not self._items:
            if self._closed:
                if self._error is not None:
                    error, self._error = self._error, None
                    raise error
                raise StopAsyncIteration
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
