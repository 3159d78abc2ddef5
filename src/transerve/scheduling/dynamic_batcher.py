"""Triton's dynamic batcher: requests wait in a priority queue and leave it as batches, one per idle instance.

How a batch forms (as Triton forms it): requests are taken in queue order while their samples fit in
`max_batch_size`. If the taken ones reach a preferred batch size, the largest such prefix goes at once; if
the next request would overshoot the largest preferred size, what was taken goes at once. Otherwise the
batch waits for more requests until its oldest request has waited `max_queue_delay_microseconds`, then goes
as it is. With no delay configured it goes at once. Requests that must have equal shapes (see `strategy`)
end a batch at the first one that differs; with length buckets a batch takes only its bucket's requests.

An instance gets its next batch only when it is idle, unlike the direct scheduler's pipelining: a batch
sent early to a busy worker could no longer grow, so batches would shrink under load.

Everything runs on the event loop with callbacks: one timer for the whole model (the next queue-delay
expiry or request timeout), no task per request or per batch.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterable

from tritonclient.grpc import model_config_pb2

from transerve.backends.base import BackendInstance, ExecutionResult
from transerve.core.errors import internal, unavailable
from transerve.core.stats import ModelStats
from transerve.core.types import InferRequest, InferResponse
from transerve.scheduling import OnDone, OnIdle
from transerve.scheduling.cancellation import TIMEOUT_MESSAGE, Watcher, dropped, settle, watch
from transerve.scheduling.queues import Pending, RequestQueue
from transerve.scheduling.strategy import batching_strategy


class _Execution:
    """A dispatched batch and, once its instance answered, the result."""

    __slots__ = ("batch", "watchers", "result")

    def __init__(self, batch: list[Pending], watchers: list[Watcher | None]) -> None:
        self.batch = batch
        #: Per request, what tells its instance that its client went away (see `cancellation`).
        self.watchers = watchers
        self.result: ExecutionResult | None = None

    def answer(self, stats: ModelStats) -> None:
        """Resolve each request's future with its own outcome."""
        assert self.result is not None
        for pending, watcher, outcome in zip(self.batch, self.watchers, self.result.results, strict=True):
            settle(stats, pending.request, pending.future, outcome, watcher)


class DynamicBatcher:
    """One model's `dynamic_batching` scheduler over its instances."""

    def __init__(
        self,
        model_name: str,
        config: model_config_pb2.ModelConfig,
        instances: list[BackendInstance],
        stats: ModelStats,
    ) -> None:
        batching = config.dynamic_batching
        self._model_name = model_name
        self._stats = stats
        self._model_max_batch = int(config.max_batch_size)
        self._max_batch = max(1, self._model_max_batch)
        preferred = {int(size) for size in batching.preferred_batch_size}
        if not preferred and self._model_max_batch > 0:
            preferred = {self._model_max_batch}  # what Triton's config normalisation fills in
        self._preferred = frozenset(preferred)
        self._max_preferred = max(preferred, default=0)
        self._delay_ns = int(batching.max_queue_delay_microseconds) * 1000
        strategy = batching_strategy(config)
        self._bucketing = strategy.bucketing
        self._padding = strategy.padding
        self._shape_key = strategy.shape_key
        self._queue = RequestQueue(batching)
        self._free: deque[BackendInstance] = deque(instances)
        self._running = 0
        #: Retired instances still executing a batch, with who hears when it is done.
        self._retiring: dict[BackendInstance, OnIdle] = {}
        #: Dispatched batches awaiting their turn to answer, oldest first (only with preserve_ordering).
        self._in_order: deque[_Execution] | None = deque() if batching.preserve_ordering else None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_ns = 0
        # Kept rather than looked up per request: CPython's get_running_loop() costs a getpid() syscall.
        self._loop = asyncio.get_running_loop()

    @property
    def pending_count(self) -> int:
        """Requests waiting in the queue (Triton's pending request count)."""
        return self._queue.live

    def add_instances(self, instances: list[BackendInstance]) -> None:
        self._free.extend(instances)
        self._dispatch()

    def retire(self, instances: list[BackendInstance], on_idle: OnIdle) -> list[BackendInstance]:
        """An idle instance leaves at once; a busy one when its batch is done."""
        for instance in instances:
            if any(instance is idle for idle in self._free):
                self._free.remove(instance)
                on_idle(instance)
            else:
                self._retiring[instance] = on_idle
        return []

    def submit(self, request: InferRequest, on_done: OnDone | None = None) -> asyncio.Future[InferResponse]:
        """Queue a request; the future resolves with its response or raises its ServerError."""
        future: asyncio.Future[InferResponse] = self._loop.create_future()
        if on_done is not None:
            future.add_done_callback(on_done)
        size = request.batch_size(self._model_max_batch) or 1
        if self._bucketing is not None:
            group = self._bucketing.bucket(request)
        elif self._shape_key is not None:
            group = self._shape_key(request)
        else:
            group = None
        refused = self._queue.push(Pending(request, future, size, group), time.monotonic_ns())
        if refused is not None:
            future.set_exception(refused)
            return future
        self._dispatch()
        return future

    # ---- forming batches ---------------------------------------------------------------------------------

    def _dispatch(self) -> None:
        """Give every idle instance a batch if one is due; otherwise wake up when one will be."""
        queue = self._queue
        if not queue.live:
            return
        now = time.monotonic_ns()
        deadline = queue.next_deadline()
        if deadline and deadline < now:
            self._reject(queue.expire(now))
            deadline = queue.next_deadline()
        while self._free and queue.live:
            batch, wait_ns = self._next_batch(now)
            if batch is None:
                if wait_ns > 0:
                    self._wake_at(min(now + wait_ns, deadline) if deadline else now + wait_ns)
                return
            queue.remove(batch)
            self._start(self._free.popleft(), batch)
        if queue.live and deadline:
            self._wake_at(deadline)  # every instance is busy: reject timed-out requests while they wait

    def _next_batch(self, now: int) -> tuple[list[Pending] | None, int]:
        """The batch to send now, or (None, ns until one may be due)."""
        if self._bucketing is None:
            return self._form(self._queue, now)
        buckets: dict[object, list[Pending]] = {}
        for pending in self._queue:
            buckets.setdefault(pending.group, []).append(pending)
        wait = 0
        # In order of each bucket's first request: the oldest request's bucket (of the highest priority) first.
        for members in buckets.values():
            batch, bucket_wait = self._form(members, now)
            if batch is not None:
                return batch, 0
            wait = bucket_wait if not wait else min(wait, bucket_wait)
        return None, wait

    def _form(self, candidates: Iterable[Pending], now: int) -> tuple[list[Pending] | None, int]:
        """Triton's batch formation over `candidates` (in queue order); see the module docstring."""
        batch: list[Pending] = []
        size = 0
        best = 0
        send_now = False
        oldest = now
        abandoned = []
        for pending in candidates:
            if pending.future.done():  # its client went away while it waited
                abandoned.append(pending)
                dropped(self._stats, pending.request)
                continue
            if batch:
                total = size + pending.size
                if total > self._max_preferred and not best:
                    best = len(batch)
                if total > self._max_batch or (self._shape_key is not None and pending.group != batch[0].group):
                    send_now = True
                    break
            batch.append(pending)
            size += pending.size
            oldest = min(oldest, pending.request.arrival_ns)
            if size in self._preferred:
                best = len(batch)
        if abandoned:
            self._queue.remove(abandoned)
        if not batch:
            return None, 0
        delay = self._delay_ns
        delay_exceeded = delay and now - oldest >= delay
        if best and not delay_exceeded:
            return batch[:best], 0
        if send_now or size >= self._max_preferred or not delay or delay_exceeded:
            return batch, 0
        return None, oldest + delay - now

    def _wake_at(self, at_ns: int) -> None:
        """One timer for the model: keep an earlier wake-up, else move it to `at_ns`."""
        if self._timer is not None:
            if self._timer_ns <= at_ns:
                return
            self._timer.cancel()
        self._timer_ns = at_ns
        self._timer = self._loop.call_later(max(0.0, (at_ns - time.monotonic_ns()) / 1e9), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._dispatch()

    def _reject(self, rejected: list[Pending]) -> None:
        for pending in rejected:
            if pending.future.done():  # its client went away first
                dropped(self._stats, pending.request)
            else:
                pending.future.set_exception(unavailable(TIMEOUT_MESSAGE))

    # ---- executing -----------------------------------------------------------------------------------

    def _start(self, instance: BackendInstance, batch: list[Pending]) -> None:
        """Hand a batch to an instance; completion arrives as a callback, with no task per execution."""
        started = time.monotonic_ns()
        requests = [pending.request for pending in batch]
        for request in requests:
            self._stats.queue.add(started - request.arrival_ns)
            if request.trace is not None:
                request.trace.compute_started(started)
        self._running += 1
        entry = _Execution(batch, [watch(instance, pending.request, pending.future) for pending in batch])
        if self._in_order is not None:
            self._in_order.append(entry)
        try:
            if self._padding is not None:
                self._padding.apply(requests)
            execution = instance.execute(requests)
            if not isinstance(execution, asyncio.Future):
                execution = self._loop.create_task(execution)
        except Exception as exc:  # a backend bug: fail this batch, keep serving
            self._finish(instance, entry, self._failed(instance, batch, f"failed: {exc!r}"))
            return
        execution.add_done_callback(lambda done: self._collect(instance, entry, done))

    def _collect(self, instance: BackendInstance, entry: _Execution, done: asyncio.Future) -> None:
        batch = entry.batch
        if done.cancelled():
            result = self._failed(instance, batch, "was cancelled")
        elif done.exception() is not None:
            result = self._failed(instance, batch, f"failed: {done.exception()!r}")
        else:
            result = done.result()
        self._finish(instance, entry, result)

    def _finish(self, instance: BackendInstance, entry: _Execution, result: ExecutionResult) -> None:
        batch = entry.batch
        self._running -= 1
        if self._retiring and instance in self._retiring:
            self._retiring.pop(instance)(instance)
        else:
            self._free.append(instance)
        if len(result.results) != len(batch):
            result = self._failed(instance, batch, f"returned {len(result.results)} results for {len(batch)} requests")
        for pending in batch:
            if pending.request.trace is not None:
                pending.request.trace.compute_ended(result.compute_input_ns, result.compute_output_ns)
        self._stats.record_execution(
            sum(pending.size for pending in batch),
            len(batch),
            result.compute_input_ns,
            result.compute_infer_ns,
            result.compute_output_ns,
        )
        entry.result = result
        if self._in_order is None:
            entry.answer(self._stats)
        else:
            while self._in_order and self._in_order[0].result is not None:
                self._in_order.popleft().answer(self._stats)
        self._dispatch()

    def _failed(self, instance: BackendInstance, batch: list[Pending], what: str) -> ExecutionResult:
        error = internal(f"model '{self._model_name}' instance '{instance.name}' {what}")
        return ExecutionResult([error] * len(batch))

    async def drain(self) -> None:
        """Wait until nothing is queued or running (used before unloading)."""
        while self._queue.live or self._running:
            await asyncio.sleep(0.005)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

