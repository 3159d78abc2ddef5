"""The sequence batcher's lanes: the batch slots of one instance, and how a batch is formed from them under each of
Triton's strategies (`DirectLane`: each sequence at its slot's index, null requests in the gaps; `OldestLane`: the
oldest ready request of up to `max_candidate_sequences` sequences). The batcher (`sequence_batcher.py`) owns the
sequences, the backlog and execution; a lane calls back into it for what they share.
"""

from __future__ import annotations

import abc
import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from tritonclient.grpc import model_config_pb2

from transerve.backends.base import BackendInstance
from transerve.core.types import InferRequest, InferResponse, Tensor

if TYPE_CHECKING:
    from transerve.scheduling.sequence_batcher import SequenceBatcher


class Pending:
    """A queued request and the future its client awaits."""

    __slots__ = ("request", "future")

    def __init__(self, request: InferRequest, future: asyncio.Future[InferResponse]) -> None:
        self.request = request
        self.future = future


class Slot:
    """One batch slot of one instance. `queue` holds its sequence's requests; None in it marks where the
    reaper ended an idle sequence."""

    __slots__ = ("lane", "index", "queue", "in_flight")

    def __init__(self, lane: Lane, index: int) -> None:
        self.lane = lane
        self.index = index
        self.queue: deque[Pending | None] = deque()
        #: oldest: a request of this slot is waiting to execute or executing.
        self.in_flight = False

    def __lt__(self, other: Slot) -> bool:
        """Free slots are handed out lowest index first, so load spreads over instances (Triton's order)."""
        return (self.index, self.lane.number) < (other.index, other.lane.number)


class Lane(abc.ABC):
    """The slots of one instance and the batches formed from them; one execution at a time."""

    def __init__(self, batcher: SequenceBatcher, number: int, instance: BackendInstance, slots: int) -> None:
        self.batcher = batcher
        self.number = number
        self.instance = instance
        self.slots = [Slot(self, index) for index in range(slots)]
        self.busy = False
        self._timer: asyncio.TimerHandle | None = None
        #: Set when the instance is retired (an instance-group update): who hears once the lane is idle.
        self.retiring: Callable[[BackendInstance], None] | None = None
        #: A retired lane's slots that no sequence holds any more.
        self.released: set[Slot] = set()

    @abc.abstractmethod
    def enqueue(self, slot: Slot, pending: Pending | None) -> None:
        """Add a request (or the reaper's end mark) to a slot of this lane."""

    def _wait(self, delay_ns: int) -> None:
        """Form the batch again after `delay_ns`, unless a completion or arrival does it first."""
        if self._timer is None:
            self._timer = self.batcher.call_later(delay_ns, self._timed_out)

    def _timed_out(self) -> None:
        self._timer = None
        self.schedule()

    def _stop_waiting(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    @abc.abstractmethod
    def schedule(self) -> None:
        """Start the next batch if the instance is free and one is due."""

    def start(self) -> None:
        """A new lane's slots were just handed out (to backlogged sequences): run what they hold."""
        self.schedule()

    @property
    def idle(self) -> bool:
        """Nothing queued in its slots, and no batch running."""
        return not self.busy and not any(slot.queue for slot in self.slots)

    def _finished(self) -> None:
        self.busy = False
        self.schedule()
        if self.retiring is not None:
            self.batcher.lane_idle(self)


class DirectLane(Lane):
    """Direct strategy: a batch holds each busy slot's next request at the slot's index."""

    def __init__(
        self,
        batcher: SequenceBatcher,
        number: int,
        instance: BackendInstance,
        slots: int,
        config: model_config_pb2.ModelSequenceBatching.StrategyDirect,
    ) -> None:
        super().__init__(batcher, number, instance, slots)
        self._delay_ns = config.max_queue_delay_microseconds * 1000
        self._utilization = config.minimum_slot_utilization

    def enqueue(self, slot: Slot, pending: Pending | None) -> None:
        slot.queue.append(pending)
        self.schedule()

    def schedule(self) -> None:
        if self.busy:
            return
        for slot in self.slots:
            while slot.queue and (slot.queue[0] is None or slot.queue[0].future.cancelled()):
                if slot.queue[0] is None:  # the reaper's mark reached the front: every request before it has run
                    slot.queue.popleft()
                    self.batcher.release(slot)
                else:
                    self.batcher.end_cancelled(slot)
        heads = [(slot, slot.queue[0]) for slot in self.slots if slot.queue]
        if not heads:
            return
        if self._delay_ns and self._utilization and len(heads) / len(self.slots) < self._utilization:
            waited = time.monotonic_ns() - min(pending.request.arrival_ns for _, pending in heads)
            if waited < self._delay_ns:
                self._wait(self._delay_ns - waited)
                return
        self._stop_waiting()
        first = heads[0][1]
        assert first is not None  # marks were taken off the fronts above
        key = self.batcher.batch_key(first.request)
        # Null requests copy the first request's inputs as the client sent them, before controls are added.
        client_inputs = list(first.request.inputs)
        zeros: list[Tensor] | None = None
        requests: list[InferRequest] = []
        futures: list[asyncio.Future[InferResponse] | None] = []
        for slot in self.slots[: heads[-1][0].index + 1]:
            pending = slot.queue[0] if slot.queue else None
            if pending is None or (key is not None and self.batcher.batch_key(pending.request) != key):
                if zeros is None:
                    zeros = self.batcher.zeroed_inputs(client_inputs)
                requests.append(self.batcher.null_request(first.request.model_name, zeros))
                futures.append(None)
                continue
            slot.queue.popleft()
            request = pending.request
            self.batcher.prepare(request)
            requests.append(request)
            futures.append(pending.future)
            if self.batcher.ends(request):
                self.batcher.release(slot)
        self.busy = True
        self.batcher.execute(self, requests, futures, self._finished)


class OldestLane(Lane):
    """Oldest strategy: each slot's next request joins a queue, batched oldest first."""

    def __init__(
        self,
        batcher: SequenceBatcher,
        number: int,
        instance: BackendInstance,
        slots: int,
        max_batch: int,
        config: model_config_pb2.ModelSequenceBatching.StrategyOldest,
    ) -> None:
        super().__init__(batcher, number, instance, slots)
        self._preferred = sorted(config.preferred_batch_size)
        #: A batch this big goes at once (the largest preferred size, else the largest batch).
        self._target = self._preferred[-1] if self._preferred else max_batch
        self._delay_ns = config.max_queue_delay_microseconds * 1000
        #: (slot, request, monotonic ns it became ready): the queue delay counts from the last.
        self._ready: deque[tuple[Slot, Pending, int]] = deque()

    def enqueue(self, slot: Slot, pending: Pending | None) -> None:
        slot.queue.append(pending)
        if not slot.in_flight:
            self._advance(slot)
        self.schedule()

    @property
    def idle(self) -> bool:
        return super().idle and not self._ready

    def start(self) -> None:
        for slot in self.slots:
            self._advance(slot)
        self.schedule()

    def _advance(self, slot: Slot) -> None:
        """Make the slot's next request ready, releasing the slot at its sequence's end (Triton's
        CompleteAndNext); a sequence taking the slot over waits for the ending one's last request."""
        while slot.queue and not slot.in_flight:
            pending = slot.queue[0]
            if pending is not None and pending.future.cancelled():
                self.batcher.end_cancelled(slot)
                continue
            slot.queue.popleft()
            if pending is None:
                self.batcher.release(slot)
                continue
            request = pending.request
            self.batcher.prepare(request)
            slot.in_flight = True
            self._ready.append((slot, pending, time.monotonic_ns()))
            if self.batcher.ends(request):
                self.batcher.release(slot)

    def schedule(self) -> None:
        if self.busy or not self._ready:
            return
        key = self.batcher.batch_key(self._ready[0][1].request)
        count = 0
        for _, pending, _ in self._ready:
            if count == self._target or (key is not None and self.batcher.batch_key(pending.request) != key):
                break
            count += 1
        if count < self._target and count == len(self._ready):
            # The batch could still grow: wait out the queue delay, then take a preferred size if one fits.
            waited = time.monotonic_ns() - self._ready[0][2]
            if waited < self._delay_ns:
                self._wait(self._delay_ns - waited)
                return
            if self._delay_ns:
                count = next((size for size in reversed(self._preferred) if size <= count), count)
        self._stop_waiting()
        batch = [self._ready.popleft() for _ in range(count)]
        self.busy = True
        self.batcher.execute(
            self,
            [pending.request for _, pending, _ in batch],
            [pending.future for _, pending, _ in batch],
            lambda: self._completed([slot for slot, _, _ in batch]),
        )

    def _completed(self, slots: list[Slot]) -> None:
        for slot in slots:
            slot.in_flight = False
            self._advance(slot)
        self._finished()
