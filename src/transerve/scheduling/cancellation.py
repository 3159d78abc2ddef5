"""What every scheduler does when the client of a request goes away (the request's future is cancelled).

Still queued, the request is dropped when the scheduler reaches it and counted as a CANCELED failure, as Triton's
dynamic batcher drops and counts the cancelled requests it holds. Running, its instance hears of it if it can act on it
(`BackendInstance.cancellable`: a python model's `is_cancelled()` turns True), the execution goes on, and the
request is counted by how it ended, as Triton counts what its backend reports: nobody awaits its future any more
to count it.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable

from transerve.backends.base import BackendInstance
from transerve.core.errors import ErrorCode, ServerError
from transerve.core.stats import ModelStats
from transerve.core.types import InferRequest, InferResponse

#: The done callback `watch` put on a future, for `settle` to take off.
Watcher = Callable[["asyncio.Future[InferResponse]"], None]


def dropped(stats: ModelStats, request: InferRequest) -> None:
    """Count a request whose client went away while it was queued, as the scheduler drops it."""
    stats.record_failure(ErrorCode.CANCELLED, time.monotonic_ns() - request.arrival_ns)


def watch(
    instance: BackendInstance, request: InferRequest, future: asyncio.Future[InferResponse]
) -> Watcher | None:
    """Have `instance`, about to run `request`, told if its client goes away; None when it cannot act on it."""
    if not instance.cancellable:
        return None
    watcher = functools.partial(_tell, instance, request)
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
    request is then counted here). Taking the watcher off first spares the loop a callback per request."""
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


def _tell(instance: BackendInstance, request: InferRequest, future: asyncio.Future[InferResponse]) -> None:
    if future.cancelled():
        instance.cancel(request)
