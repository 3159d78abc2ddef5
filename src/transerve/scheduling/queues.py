"""The dynamic batcher's queue: priority levels, each with Triton's queue policy.

Semantics follow Triton's `ModelQueuePolicy`: a level holds at most `max_queue_size` requests (0: no limit)
and a request that waits longer than its timeout is rejected (REJECT) or moved behind every request of its
level that has not timed out (DELAY). A request's timeout is the level's `default_timeout_microseconds`; with
`allow_timeout_override` a request may ask for a shorter one (never a longer one, and 0 means none).
Priority 1 is the highest; priority 0, or one above `priority_levels`, means `default_priority_level`.

Requests leave the middle of a level when the bucketed strategy picks them, so entries are marked rather
than removed, and a level is compacted when marked entries pile up.
"""

from __future__ import annotations

import asyncio
import heapq
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from tritonclient.grpc import model_config_pb2

from transerve.core.errors import ServerError, unavailable
from transerve.core.types import InferRequest, InferResponse

QUEUED, DELAYED, GONE = 0, 1, 2


class Pending:
    """A queued request and what the batcher needs to place it, computed once at arrival."""

    __slots__ = ("request", "future", "size", "deadline_ns", "group", "state")

    def __init__(
        self, request: InferRequest, future: asyncio.Future[InferResponse], size: int, group: object = None
    ) -> None:
        self.request = request
        self.future = future
        #: Samples the request carries: its batch dimension (at least 1).
        self.size = size
        #: Monotonic ns after which the queue policy applies; 0 for none.
        self.deadline_ns = 0
        #: Requests batch together only within a group (a length bucket, a shape); None when all may.
        self.group = group
        self.state = QUEUED


@dataclass(frozen=True, slots=True)
class QueuePolicy:
    """One level's `ModelQueuePolicy`."""

    delay_on_timeout: bool
    default_timeout_us: int
    allow_timeout_override: bool
    max_queue_size: int

    @classmethod
    def from_config(cls, policy: model_config_pb2.ModelQueuePolicy) -> QueuePolicy:
        return cls(
            delay_on_timeout=policy.timeout_action == model_config_pb2.ModelQueuePolicy.DELAY,
            default_timeout_us=int(policy.default_timeout_microseconds),
            allow_timeout_override=policy.allow_timeout_override,
            max_queue_size=int(policy.max_queue_size),
        )

    def timeout_us(self, request: InferRequest) -> int:
        """The request's timeout: a request may shorten the default, as in Triton, never lengthen it."""
        timeout = self.default_timeout_us
        if self.allow_timeout_override and 0 < request.timeout_us < timeout:
            timeout = request.timeout_us
        return timeout


class Level:
    """The requests of one priority level: in arrival order, then those delayed by a timeout."""

    __slots__ = ("policy", "queued", "delayed", "live")

    def __init__(self, policy: QueuePolicy) -> None:
        self.policy = policy
        self.queued: deque[Pending] = deque()
        self.delayed: deque[Pending] = deque()
        self.live = 0

    def __iter__(self) -> Iterator[Pending]:
        for pending in self.queued:
            if pending.state == QUEUED:
                yield pending
        for pending in self.delayed:
            if pending.state == DELAYED:
                yield pending

    def compact(self) -> None:
        """Drop entries that left (from the heads cheaply; everywhere once they outnumber the rest)."""
        queued, delayed = self.queued, self.delayed
        while queued and queued[0].state != QUEUED:
            queued.popleft()
        while delayed and delayed[0].state != DELAYED:
            delayed.popleft()
        if len(queued) + len(delayed) > 2 * self.live + 32:
            self.queued = deque(p for p in queued if p.state == QUEUED)
            self.delayed = deque(p for p in delayed if p.state == DELAYED)


class RequestQueue:
    """Every waiting request of a model, in the order the batcher considers them."""

    def __init__(self, batching: model_config_pb2.ModelDynamicBatching) -> None:
        self._levels_count = int(batching.priority_levels)
        self._default_level = int(batching.default_priority_level) if self._levels_count else 0
        self._default_policy = QueuePolicy.from_config(batching.default_queue_policy)
        self._policies = {int(k): QueuePolicy.from_config(v) for k, v in batching.priority_queue_policy.items()}
        self._levels: dict[int, Level] = {}
        self._order: list[int] = []
        #: (deadline, arrival sequence, request) of requests with a timeout; entries of gone requests linger.
        self._deadlines: list[tuple[int, int, Pending]] = []
        self._sequence = 0
        self.live = 0

    def level_of(self, request: InferRequest) -> int:
        priority = request.priority
        if priority == 0 or priority > self._levels_count:
            return self._default_level
        return priority

    def push(self, pending: Pending, now_ns: int) -> ServerError | None:
        """Queue a request, or say why it cannot be (its level is full)."""
        number = self.level_of(pending.request)
        level = self._levels.get(number)
        if level is None:
            level = self._levels[number] = Level(self._policies.get(number, self._default_policy))
            self._order = sorted(self._levels)
        policy = level.policy
        if policy.max_queue_size and level.live >= policy.max_queue_size:
            request_id = pending.request.id or "<id_unknown>"
            return unavailable(f"[request id: {request_id}] Exceeds maximum queue size")
        timeout_us = policy.timeout_us(pending.request) if policy.default_timeout_us else 0
        if timeout_us:
            pending.deadline_ns = now_ns + timeout_us * 1000
            self._sequence += 1
            heapq.heappush(self._deadlines, (pending.deadline_ns, self._sequence, pending))
        level.queued.append(pending)
        level.live += 1
        self.live += 1
        return None

    def __iter__(self) -> Iterator[Pending]:
        """Waiting requests: by level (1 first), within a level in arrival order, delayed ones last."""
        for number in self._order:
            yield from self._levels[number]

    def remove(self, batch: list[Pending]) -> None:
        """Take requests out (dispatched, rejected or abandoned by their client)."""
        touched: dict[int, Level] = {}
        for pending in batch:
            if pending.state == GONE:
                continue
            pending.state = GONE
            number = self.level_of(pending.request)
            level = touched[number] = self._levels[number]
            level.live -= 1
            self.live -= 1
        for level in touched.values():
            level.compact()

    def next_deadline(self) -> int:
        """The earliest timeout among waiting requests, 0 if none."""
        deadlines = self._deadlines
        while deadlines and deadlines[0][2].state != QUEUED:
            heapq.heappop(deadlines)
        return deadlines[0][0] if deadlines else 0

    def expire(self, now_ns: int) -> list[Pending]:
        """Apply the policy to requests past their timeout: returns those to reject; delays the others."""
        rejected = []
        deadlines = self._deadlines
        while (deadline := self.next_deadline()) and deadline < now_ns:
            pending = heapq.heappop(deadlines)[2]
            level = self._levels[self.level_of(pending.request)]
            if level.policy.delay_on_timeout:
                pending.state = DELAYED
                level.delayed.append(pending)
                level.compact()
            else:
                rejected.append(pending)
        self.remove(rejected)
        return rejected
