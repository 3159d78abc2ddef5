"""The default scheduler: a FIFO queue feeding every instance, one request per execution.

Each instance may have up to `max_inflight` executions outstanding, so a worker process
already holds its next request when it finishes the current one.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque

from transerve.backends.base import BackendInstance, ExecutionResult
from transerve.core.errors import internal
from transerve.core.stats import ModelStats
from transerve.core.types import InferRequest, InferResponse
from transerve.scheduling import OnDone, OnIdle
from transerve.scheduling.cancellation import Watcher, dropped, settle, watch

_Pending = tuple[InferRequest, "asyncio.Future[InferResponse]", OnDone | None]


class DirectScheduler:
    """Requests in arrival order, each executed alone on the next free instance slot."""

    def __init__(self, model_name: str, instances: list[BackendInstance], stats: ModelStats, max_batch_size: int):
        self._model_name = model_name
        self._stats = stats
        self._max_batch_size = max_batch_size
        self._queue: deque[_Pending] = deque()
        self._free: deque[BackendInstance] = deque()
        self._add_slots(instances)
        self._running = 0
        #: Retired instances with executions still running: how many, and who hears when none is left.
        self._retiring: dict[BackendInstance, list] = {}
        # Kept rather than looked up per request: CPython's get_running_loop() costs a getpid() syscall.
        self._loop = asyncio.get_running_loop()

    def _add_slots(self, instances: list[BackendInstance]) -> None:
        """Slots interleave instances, so load spreads over instances before it deepens pipelines: the free slots
        are laid out again with the new ones, each instance's first free slot before any second one."""
        free: dict[int, list[BackendInstance]] = {}
        for slot in [*self._free, *(added for added in instances for _ in range(added.max_inflight))]:
            free.setdefault(id(slot), []).append(slot)
        self._free.clear()
        depth = max((len(slots) for slots in free.values()), default=0)
        self._free.extend(slots[level] for level in range(depth) for slots in free.values() if level < len(slots))

    @property
    def pending_count(self) -> int:
        """Requests waiting for an instance (Triton's pending request count)."""
        return len(self._queue)

    def add_instances(self, instances: list[BackendInstance]) -> None:
        self._add_slots(instances)
        self._dispatch()

    def retire(self, instances: list[BackendInstance], on_idle: OnIdle) -> list[BackendInstance]:
        """Take the instances' free slots away; each is idle once its running executions have finished."""
        free = list(self._free)
        self._free.clear()
        self._free.extend(instance for instance in free if all(instance is not gone for gone in instances))
        for instance in instances:
            running = instance.max_inflight - sum(slot is instance for slot in free)
            if running > 0:
                self._retiring[instance] = [running, on_idle]
            else:
                on_idle(instance)
        return []

    def _slot_back(self, instance: BackendInstance) -> None:
        """An execution of a retired instance finished."""
        entry = self._retiring[instance]
        entry[0] -= 1
        if entry[0] == 0:
            del self._retiring[instance]
            entry[1](instance)

    def submit(self, request: InferRequest, on_done: OnDone | None = None) -> asyncio.Future[InferResponse]:
        """Queue a request; the future resolves with its response or raises its ServerError, and `on_done`
        runs right after, in the backend's callback that delivered the result (see `OnDone`)."""
        future: asyncio.Future[InferResponse] = self._loop.create_future()
        self._queue.append((request, future, on_done))
        self._dispatch()
        return future

    def _dispatch(self) -> None:
        queue, free = self._queue, self._free
        while queue and free:
            pending = queue.popleft()
            if pending[1].done():  # cancelled by its client while queued
                dropped(self._stats, pending[0])
                continue
            self._start(free.popleft(), pending)

    def _start(self, instance: BackendInstance, pending: _Pending) -> None:
        """Hand a request to an instance; completion arrives as a callback, with no task per execution
        (and no future either, when the backend calls back itself)."""
        request = pending[0]
        started = time.monotonic_ns()
        self._stats.queue.add(started - request.arrival_ns)
        if request.trace is not None:
            request.trace.compute_started(started)
        self._running += 1
        watcher = watch(instance, request, pending[1])
        try:
            execution = instance.execute_then([request], functools.partial(self._finish, instance, pending, watcher))
            if execution is None:
                return
            if not isinstance(execution, asyncio.Future):
                execution = self._loop.create_task(execution)
        except Exception as exc:  # a backend bug: fail this request (never from inside `submit`), keep serving
            failed = self._failed(instance, f"failed: {exc!r}")
            self._loop.call_soon(self._finish, instance, pending, watcher, failed)
            return
        execution.add_done_callback(functools.partial(self._collect, instance, pending, watcher))

    def _collect(
        self, instance: BackendInstance, pending: _Pending, watcher: Watcher | None, done: asyncio.Future
    ) -> None:
        if done.cancelled():
            result = self._failed(instance, "was cancelled")
        elif done.exception() is not None:
            result = self._failed(instance, f"failed: {done.exception()!r}")
        else:
            result = done.result()
        self._finish(instance, pending, watcher, result)

    def _finish(
        self, instance: BackendInstance, pending: _Pending, watcher: Watcher | None, result: ExecutionResult
    ) -> None:
        """Settle the request, let `on_done` go on with it (an ensemble sends its next step), then count."""
        self._running -= 1
        if self._retiring and instance in self._retiring:
            self._slot_back(instance)
        else:
            self._free.append(instance)
        request, future, on_done = pending
        if len(result.results) != 1:
            result = self._failed(instance, f"returned {len(result.results)} results for 1 requests")
        if request.trace is not None:
            request.trace.compute_ended(result.compute_input_ns, result.compute_output_ns)
        if not settle(self._stats, request, future, result.results[0], watcher):
            on_done = None  # cancelled by its client while it ran: its canceller goes on without it
        if on_done is not None:
            try:
                on_done(future)
            except Exception as exc:  # the caller's bug: report it as a done callback's would be, keep serving
                self._loop.call_exception_handler({"message": "on_done callback failed", "exception": exc})
        self._stats.record_execution(
            request.batch_size(self._max_batch_size), 1, result.compute_input_ns, result.compute_infer_ns,
            result.compute_output_ns,
        )
        self._dispatch()

    def _failed(self, instance: BackendInstance, what: str) -> ExecutionResult:
        return ExecutionResult([internal(f"model '{self._model_name}' instance '{instance.name}' {what}")])

    async def drain(self) -> None:
        """Wait until nothing is queued or running (used before unloading)."""
        while self._queue or self._running:
            await asyncio.sleep(0.005)

