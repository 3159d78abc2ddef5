"""What every scheduler does when the client of a request goes away (the request's future is cancelled), and when
a running request's `timeout` expires.

Still queued, the request is dropped when the scheduler reaches it and counted as a CANCELED failure, as Triton's
dynamic batcher drops and counts the cancelled requests it holds. Running, its instance hears of it if it can act on it
(`BackendInstance.cancellable`: a python model's `is_cancelled()` turns True), the execution goes on, and the
request is counted by how it ended, as Triton counts what its backend reports: nobody awaits its future any more
to count it.

A request's `timeout` (microseconds, counted from its arrival) is the queue policy's business while it waits, as in
Triton (REJECT, DELAY, or nothing without `allow_timeout_override`). If it starts running before its deadline, the
deadline holds there too: when it passes, the client is answered UNAVAILABLE "Request timeout expired" (Triton's words
for a request its queue timed out), the instance is told as of a client gone away (`is_cancelled()`), and the result,
when it comes, is dropped. A request that starts after its deadline (its queue policy chose to run it anyway) runs to
its end. Decoupled requests answer through their stream and are not timed here.
"""

from __future__ import annotations

import asyncio
import time

from transerve.backends.base import BackendInstance
from transerve.core.errors import ErrorCode, ServerError
from transerve.core.stats import ModelStats
from transerve.core.types import InferRequest, InferResponse

#: Triton's words (and code, UNAVAILABLE) for a request whose timeout expired.
TIMEOUT_MESSAGE = "Request timeout expired"


class Watcher:
    """What `watch` put on a running request: the done callback that tells its instance of a cancellation, and the
    timer of its deadline; `settle` takes both off."""

    __slots__ = ("instance", "request", "timer")

    def __init__(self, instance: BackendInstance, request: InferRequest) -> None:
        self.instance = instance
        self.request = request
        self.timer: asyncio.TimerHandle | None = None

    def __call__(self, future: asyncio.Future[InferResponse]) -> None:
        if future.cancelled():
            self.instance.cancel(self.request)

    def expire(self, future: asyncio.Future[InferResponse]) -> None:
        """The deadline passed while the request runs: answer it now, and tell the instance as of a client gone."""
        self.timer = None
        if not future.done():
            future.remove_done_callback(self)
            future.set_exception(ServerError(ErrorCode.UNAVAILABLE, TIMEOUT_MESSAGE))
            self.instance.expired(self.request)


def dropped(stats: ModelStats, request: InferRequest) -> None:
    """Count a request whose client went away while it was queued, as the scheduler drops it."""
    stats.record_failure(ErrorCode.CANCELLED, time.monotonic_ns() - request.arrival_ns)


def watch(
    instance: BackendInstance, request: InferRequest, future: asyncio.Future[InferResponse]
) -> Watcher | None:
    """Have `instance`, about to run `request`, told if its client goes away, and the request answered at its
    deadline; None when there is nothing to watch."""
    timed = request.timeout_us and request.response_stream is None
    if not (instance.cancellable or timed):
        return None
    watcher = Watcher(instance, request)
    if timed:
        delay_ns = request.arrival_ns + request.timeout_us * 1000 - time.monotonic_ns()
        if delay_ns > 0:
            watcher.timer = future.get_loop().call_later(delay_ns / 1e9, watcher.expire, future)
        elif not instance.cancellable:
            return None
    if instance.cancellable:
        future.add_done_callback(watcher)
    return watcher


def settle(
    stats: ModelStats,
    request: InferRequest,
    future: asyncio.Future[InferResponse],
    outcome: InferResponse | ServerError | None,
    watcher: Watcher | None,
) -> bool:
    """Resolve the future of a request that ran with its outcome; False if its client went away meanwhile (the
    request is then counted here; a request whose deadline passed was counted as its client was answered). Taking the
    watcher off first spares the loop a callback per request."""
    if watcher is not None and watcher.timer is not None:
        watcher.timer.cancel()
    if future.done():
        if future.cancelled():
            code = outcome.code if isinstance(outcome, ServerError) else None
            stats.record_outcome(code, time.monotonic_ns() - request.arrival_ns)
        return False
    if watcher is not None:
        future.remove_done_callback(watcher)
    if isinstance(outcome, ServerError):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
    return True


