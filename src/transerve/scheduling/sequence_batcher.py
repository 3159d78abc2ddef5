"""The sequence batcher: Triton's scheduler for stateful models (`sequence_batching`).

Every request names its sequence (`sequence_id`, an integer or a string). From its START request to its
END request a sequence holds one batch slot of one instance, so all its requests run on that instance, in
order, one per execution. Sequences that find every slot taken wait in a backlog, in arrival order, for
the next slot that frees; a sequence idle for `max_sequence_idle_microseconds` (measured from its last
request's arrival, as Triton measures it) loses its slot, and a later request without START fails.
Before a request executes, the batcher adds the control inputs the config declares (START, END, READY,
CORRID) to it, with the values and shapes Triton gives them.

The two strategies are Triton's:

- direct: a request's index in the executed batch is its slot. Free slots below the highest busy one get
  "null" requests (READY false, CORRID 0, zeroed inputs) whose results are dropped, so a model that keeps
  state per batch slot always finds a sequence at the same index. `max_queue_delay_microseconds` with
  `minimum_slot_utilization` lets a batch wait for more slots to fill.
- oldest: an instance holds up to `max_candidate_sequences` sequences and batches the oldest ready request
  of each, as a dynamic batcher would (`preferred_batch_size`, `max_queue_delay_microseconds`); the next
  request of a sequence becomes ready only when its previous one has finished.

Each instance runs one execution at a time (not `max_inflight`), as Triton's instances do: the next batch
is formed when the previous one finishes, which is what lets requests gather into batches. Requests whose
variable-size inputs differ in shape do not share a batch (unless the input allows ragged batches).

Cancellation, as in Triton: a request whose client has gone ends its sequence when the batcher reaches it (at the
front of its slot, or in a backlog about to take a slot). It and every request of the sequence still queued are
answered CANCELLED and counted as CANCELED failures, the slot goes to the next sequence, and a later request of the
sequence needs a START again. A request already batched when its client goes still executes.

Implicit state (`sequence_batching.state`) is not implemented here; backends that cannot carry it refuse
such configs at load.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable

import numpy as np
from tritonclient.grpc import model_config_pb2

from transerve.backends.base import BackendInstance, ExecutionResult, Rerun
from transerve.config.sequence_batching import BooleanControl, SequenceControls, sequence_controls
from transerve.core.datatypes import NUMPY_DTYPES
from transerve.core.errors import ErrorCode, ServerError, internal, invalid_arg
from transerve.core.protocol_parameters import SEQUENCE_END, SEQUENCE_START
from transerve.core.stats import ModelStats
from transerve.core.types import InferRequest, InferResponse, Tensor
from transerve.scheduling import OnDone, OnIdle
from transerve.scheduling.cancellation import Watcher, settle, watch
from transerve.scheduling.sequence_lanes import DirectLane, Lane, OldestLane, Pending, Slot

log = logging.getLogger("transerve")

#: How often the reaper looks again at an idle sequence that still waits in the backlog (Triton's 50 ms).
_BACKLOG_RECHECK_NS = 50_000_000
_UINT64_MASK = (1 << 64) - 1
#: What `_ControlTensors.tensors` is asked for: a request's START/END flags, or a null request.
_NOT_READY = -1


class _Backlog:
    """Requests of a sequence that started while every slot was taken."""

    __slots__ = ("queue",)

    def __init__(self) -> None:
        self.queue: deque[Pending] = deque()


class _ControlTensors:
    """The control inputs as tensors: the START/END/READY combinations are built once and shared."""

    def __init__(self, controls: SequenceControls, batching: bool) -> None:
        self._shape = (1, 1) if batching else (1,)
        self._corrid_name = controls.corrid_name
        self._corrid_datatype = controls.corrid_datatype
        self._corrid_dtype = NUMPY_DTYPES.get(controls.corrid_datatype)
        # Keyed by the request's START|END flags, or _NOT_READY for a null request.
        self._by_flags: dict[int, list[Tensor]] = {}
        for flags in (0, SEQUENCE_START, SEQUENCE_END, SEQUENCE_START | SEQUENCE_END, _NOT_READY):
            ready = flags != _NOT_READY
            values = (
                (controls.start, ready and bool(flags & SEQUENCE_START)),
                (controls.end, ready and bool(flags & SEQUENCE_END)),
                (controls.ready, ready),
            )
            self._by_flags[flags] = [self._boolean(control, on) for control, on in values if control is not None]

    def _boolean(self, control: BooleanControl, on: bool) -> Tensor:
        value = control.true_value if on else control.false_value
        data = np.full(self._shape, value, dtype=NUMPY_DTYPES[control.datatype])
        data.flags.writeable = False
        return Tensor(control.name, control.datatype, data)

    def tensors(self, flags: int, correlation_id: int | str) -> list[Tensor]:
        controls = self._by_flags[flags]
        if not self._corrid_name:
            return controls
        return [*controls, Tensor(self._corrid_name, self._corrid_datatype, self._corrid(correlation_id))]

    def _corrid(self, correlation_id: int | str) -> np.ndarray:
        """CORRID as the model declared it. Where Triton leaves it uninitialized (a string id for a numeric
        CORRID), it is 0; an integer id for a string CORRID is its decimal text."""
        if self._corrid_datatype == "BYTES":
            text = correlation_id if isinstance(correlation_id, str) else str(correlation_id)
            return np.full(self._shape, text.encode(), dtype=np.object_)
        number = 0 if isinstance(correlation_id, str) else correlation_id & _UINT64_MASK
        # A narrower CORRID keeps the low bytes of the 64-bit id, as Triton's copy does.
        return np.full(self._shape, number, dtype=np.uint64).astype(self._corrid_dtype)


class SequenceBatcher:
    """Sequences bound to instance slots, control inputs added, batches formed per strategy."""

    def __init__(
        self,
        model_name: str,
        config: model_config_pb2.ModelConfig,
        instances: list[BackendInstance],
        stats: ModelStats,
    ) -> None:
        self._model_name = model_name
        self._stats = stats
        self._loop = asyncio.get_running_loop()
        batching = config.sequence_batching
        self._max_batch_size = config.max_batch_size
        self._idle_ns = batching.max_sequence_idle_microseconds * 1000
        controls = sequence_controls(config)
        self._controls = _ControlTensors(controls, batching=config.max_batch_size > 0)
        # Control names that are also client inputs: the control value replaces what the client sent.
        self._overridden = controls.names & {tensor.name for tensor in config.input}
        # Inputs whose shape must agree within a batch: variable-size ones that do not allow ragged batches.
        self._equal_shapes = frozenset(
            tensor.name for tensor in config.input if -1 in tensor.dims and not tensor.allow_ragged_batch
        )
        self._check_inputs = bool(self._equal_shapes) or any(tensor.optional for tensor in config.input)
        self._batching = batching
        self._lanes: list[Lane] = [self._lane(number, instance) for number, instance in enumerate(instances)]
        self._lane_numbers = itertools.count(len(instances))
        #: Lanes of retired instances that still hold sequences or run a batch.
        self._retiring: list[Lane] = []
        self._free: list[Slot] = [slot for lane in self._lanes for slot in lane.slots]
        heapq.heapify(self._free)
        #: Sequence id -> its slot, from its first request until its END request is queued.
        self._assigned: dict[int | str, Slot] = {}
        #: Sequence id -> its backlog, while the sequence is still sending requests there.
        self._backlogged: dict[int | str, _Backlog] = {}
        self._backlogs: deque[_Backlog] = deque()
        #: Sequence id -> arrival (monotonic ns) of its latest request, for the idle reaper.
        self._last_seen: dict[int | str, int] = {}
        self._reaper: asyncio.TimerHandle | None = None
        self._queued = 0
        self._running = 0
        #: iterative_sequence: ids given to requests sent outside a sequence, each a sequence of its own.
        self._iterative = batching.iterative_sequence
        self._own_ids = itertools.count(1)
        self._single: set[int | str] = set()

    def _lane(self, number: int, instance: BackendInstance) -> Lane:
        batching, max_batch = self._batching, max(1, self._max_batch_size)
        if batching.HasField("oldest"):
            slots = batching.oldest.max_candidate_sequences or max_batch
            return OldestLane(self, number, instance, slots, max_batch, batching.oldest)
        return DirectLane(self, number, instance, max_batch, batching.direct)

    # ---- the face the core sees -----------------------------------------------------------------------

    def add_instances(self, instances: list[BackendInstance]) -> None:
        """New lanes; their slots go to the backlog's oldest sequences first."""
        for instance in instances:
            lane = self._lane(next(self._lane_numbers), instance)
            self._lanes.append(lane)
            for slot in lane.slots:
                self.release(slot)
            lane.start()

    def retire(self, instances: list[BackendInstance], on_idle: OnIdle) -> list[BackendInstance]:
        """The instances' lanes take no new sequence; each serves the sequences it holds to their end, and is
        idle once they ended and its last batch finished (as Triton keeps a removed instance for them)."""
        lanes = [lane for lane in self._lanes if any(lane.instance is gone for gone in instances)]
        held = []
        for lane in lanes:
            self._lanes.remove(lane)
            lane.retiring = on_idle
            lane.released = {slot for slot in self._free if slot.lane is lane}
            if len(lane.released) < len(lane.slots):
                held.append(lane.instance)
        self._free = [slot for slot in self._free if slot.lane.retiring is None]
        heapq.heapify(self._free)
        self._retiring.extend(lanes)
        for lane in lanes:
            self.lane_idle(lane)
        return held

    def lane_idle(self, lane: Lane, force: bool = False) -> None:
        """A retired lane may be done: no sequence holds a slot of it and no batch runs (or the model unloads)."""
        on_idle = lane.retiring
        if on_idle is None or lane not in self._retiring:
            return
        if force or (len(lane.released) == len(lane.slots) and lane.idle):
            self._retiring.remove(lane)
            on_idle(lane.instance)

    @property
    def pending_count(self) -> int:
        """Requests accepted but not yet executing."""
        return self._queued

    def submit(self, request: InferRequest, on_done: OnDone | None = None) -> asyncio.Future[InferResponse]:
        """Route a request to its sequence's slot (or the backlog); the future resolves with its response."""
        future: asyncio.Future[InferResponse] = self._loop.create_future()
        if on_done is not None:
            future.add_done_callback(on_done)
        if self._iterative and (request.correlation_id == 0 or request.correlation_id == ""):
            # Triton's iterative sequencer makes such a request a sequence of its own, which ends when the model
            # releases the request; the backend runs it again meanwhile if the model reschedules it.
            request.correlation_id = next(self._own_ids)
            request.flags = SEQUENCE_START
            self._single.add(request.correlation_id)
        correlation_id, flags = request.correlation_id, request.flags
        slot = self._assigned.get(correlation_id)
        backlog = self._backlogged.get(correlation_id) if slot is None else None
        error = self._refusal(request, known=slot is not None or backlog is not None)
        if error is not None:
            self._single.discard(correlation_id)
            future.set_exception(error)
            return future
        if flags & SEQUENCE_START and (slot is not None or backlog is not None):
            log.warning(
                "sequence %s for model '%s' has a conflict: the previous sequence did not end before this START; "
                "it continues in the same place",
                correlation_id,
                self._model_name,
            )
        ends = flags & SEQUENCE_END or correlation_id in self._single
        if ends:
            # An ended sequence is not the reaper's business any more.
            self._last_seen.pop(correlation_id, None)
        else:
            self._last_seen[correlation_id] = request.arrival_ns
            if self._reaper is None:
                self._arm_reaper(request.arrival_ns + self._idle_ns)
        self._queued += 1
        pending = Pending(request, future)
        if slot is None and backlog is None:
            if self._free:
                slot = heapq.heappop(self._free)
                if not ends:
                    self._assigned[correlation_id] = slot
            else:
                backlog = _Backlog()
                self._backlogs.append(backlog)
                if not ends:
                    self._backlogged[correlation_id] = backlog
        elif ends:
            # Later requests with this id start a new sequence.
            self._assigned.pop(correlation_id, None)
            self._backlogged.pop(correlation_id, None)
        if backlog is not None:
            backlog.queue.append(pending)
        elif slot is not None:
            slot.lane.enqueue(slot, pending)
        return future

    def _refusal(self, request: InferRequest, known: bool) -> ServerError | None:
        """Triton's reasons to refuse a request to a sequence model, with its wording."""
        if self._max_batch_size > 0 and request.batch_size(self._max_batch_size) > 1:
            return invalid_arg(
                f"inference request to model '{self._model_name}' must specify batch-size 1 due to requirements "
                "of sequence batcher"
            )
        if request.correlation_id == 0 or request.correlation_id == "":
            return invalid_arg(
                f"inference request to model '{self._model_name}' must specify a non-zero or non-empty "
                "correlation ID"
            )
        if not known and not request.flags & SEQUENCE_START:
            return invalid_arg(
                f"inference request for sequence {request.correlation_id} to model '{self._model_name}' must "
                "specify the START flag on the first request of the sequence"
            )
        return None

    async def drain(self) -> None:
        """Wait until nothing is queued or running (used before unloading); retired lanes are done then."""
        while self._queued or self._running:
            await asyncio.sleep(0.005)
        for lane in list(self._retiring):
            self.lane_idle(lane, force=True)

    # ---- slots, backlog and the idle reaper ------------------------------------------------------------

    def release(self, slot: Slot) -> None:
        """A slot's sequence ended: give the slot to the oldest backlogged sequence, or free it. A backlogged
        sequence with a cancelled request is cancelled instead (Triton looks at it here too). A retired lane's
        slot goes to nobody."""
        if slot.lane.retiring is not None:
            slot.lane.released.add(slot)
            self.lane_idle(slot.lane)
            return
        while self._backlogs:
            backlog = self._backlogs.popleft()
            correlation_id = backlog.queue[-1].request.correlation_id
            if self._backlogged.get(correlation_id) is backlog:
                del self._backlogged[correlation_id]
            if any(pending.future.cancelled() for pending in backlog.queue):
                self._last_seen.pop(correlation_id, None)
                self._cancel(backlog.queue)
                continue
            if not backlog.queue[-1].request.flags & SEQUENCE_END:
                # Still sending: its later requests go straight to the slot.
                self._assigned[correlation_id] = slot
            slot.queue.extend(backlog.queue)
            return
        heapq.heappush(self._free, slot)

    def end_cancelled(self, slot: Slot) -> None:
        """The request at the front of the slot was cancelled: its sequence ends there, with every request it
        still has queued, and the slot goes to the next sequence."""
        first = slot.queue[0]
        assert first is not None
        correlation_id = first.request.correlation_id
        if self._assigned.get(correlation_id) is slot:
            del self._assigned[correlation_id]
            self._last_seen.pop(correlation_id, None)
        queued = list(slot.queue)
        slot.queue.clear()
        self._cancel(queued)
        self.release(slot)

    def _cancel(self, queued: Iterable[Pending | None]) -> None:
        """Answer the requests of a cancelled sequence CANCELLED; those whose client went away are counted here,
        as the core never sees their outcome."""
        now = time.monotonic_ns()
        for pending in queued:
            if pending is None:
                continue
            self._queued -= 1
            if pending.future.cancelled():
                self._stats.record_failure(ErrorCode.CANCELLED, now - pending.request.arrival_ns)
            elif not pending.future.done():
                pending.future.set_exception(ServerError(
                    ErrorCode.CANCELLED,
                    f"sequence {pending.request.correlation_id} of model '{self._model_name}' was cancelled"))

    def _arm_reaper(self, deadline_ns: int) -> None:
        delay_s = max(0, deadline_ns - time.monotonic_ns()) / 1e9
        self._reaper = self._loop.call_later(delay_s, self._reap)

    def _reap(self) -> None:
        """End sequences idle past the limit: their slot frees once their queued requests have run."""
        self._reaper = None
        now = time.monotonic_ns()
        next_deadline = None
        for correlation_id, seen in list(self._last_seen.items()):
            deadline = seen + self._idle_ns
            if deadline > now:
                next_deadline = deadline if next_deadline is None else min(next_deadline, deadline)
                continue
            slot = self._assigned.pop(correlation_id, None)
            if slot is not None:
                del self._last_seen[correlation_id]
                slot.lane.enqueue(slot, None)
            elif correlation_id in self._backlogged:
                # Still waiting for a slot: look again soon, it may have one by then.
                recheck = now + _BACKLOG_RECHECK_NS
                next_deadline = recheck if next_deadline is None else min(next_deadline, recheck)
            else:
                del self._last_seen[correlation_id]
        if next_deadline is not None:
            self._arm_reaper(next_deadline)

    # ---- what lanes share ------------------------------------------------------------------------------

    def ends(self, request: InferRequest) -> bool:
        """Whether the request, about to execute, is its sequence's last (END, or a sequence of its own)."""
        if request.flags & SEQUENCE_END:
            return True
        if request.correlation_id in self._single:
            self._single.discard(request.correlation_id)
            self._assigned.pop(request.correlation_id, None)  # set if it came through the backlog
            return True
        return False

    def prepare(self, request: InferRequest) -> None:
        """Add the control inputs to a request about to be batched (replacing any the client sent)."""
        controls = self._controls.tensors(request.flags & (SEQUENCE_START | SEQUENCE_END), request.correlation_id)
        if self._overridden:
            request.inputs = [tensor for tensor in request.inputs if tensor.name not in self._overridden]
        request.inputs.extend(controls)

    def null_request(self, model_name: str, zeros: list[Tensor]) -> InferRequest:
        """A placeholder for an empty direct slot: zeroed inputs, READY false, CORRID 0, no outputs asked."""
        return InferRequest(model_name, [*zeros, *self._controls.tensors(_NOT_READY, 0)], outputs=[])

    def zeroed_inputs(self, inputs: list[Tensor]) -> list[Tensor]:
        """Client inputs with zeroed data, for null requests shaped as the batch's real ones."""
        zeros = []
        for tensor in inputs:
            if tensor.datatype == "BYTES":
                data = np.full(tensor.data.shape, b"", dtype=np.object_)
            else:
                data = np.zeros(tensor.data.shape, dtype=tensor.data.dtype)
            zeros.append(Tensor(tensor.name, tensor.datatype, data))
        return zeros

    def batch_key(self, request: InferRequest) -> object:
        """Requests batch together only with equal keys: the same inputs present, and equal shapes where the
        model needs them."""
        if not self._check_inputs:
            return None
        return tuple(
            (tensor.name, tensor.data.shape if tensor.name in self._equal_shapes else None)
            for tensor in sorted(request.inputs, key=lambda tensor: tensor.name)
        )

    def execute(
        self,
        lane: Lane,
        requests: list[InferRequest],
        futures: list[asyncio.Future[InferResponse] | None],
        finished: Callable[[], None],
    ) -> None:
        """Run a batch on the lane's instance; `futures` has None for null requests, whose results are
        dropped. `finished` runs once every result is delivered."""
        started = time.monotonic_ns()
        real = 0
        watchers: list[Watcher | None] = []
        for request, future in zip(requests, futures, strict=True):
            if future is not None:
                real += 1
                self._stats.queue.add(started - request.arrival_ns)
                if request.trace is not None:
                    request.trace.compute_started(started)
                watchers.append(watch(lane.instance, request, future))
            else:
                watchers.append(None)
        self._queued -= real
        self._running += 1

        def collect(done: asyncio.Future[ExecutionResult]) -> None:
            if done.cancelled():
                result = self._failed(lane, len(requests), "was cancelled")
            elif done.exception() is not None:
                result = self._failed(lane, len(requests), f"failed: {done.exception()!r}")
            else:
                result = done.result()
            self._deliver(lane, requests, futures, watchers, real, result)
            finished()

        try:
            execution = lane.instance.execute(requests)
            if not isinstance(execution, asyncio.Future):
                execution = self._loop.create_task(execution)
        except Exception as exc:  # a backend bug: fail this batch, keep serving
            failed = self._failed(lane, len(requests), f"failed: {exc!r}")
            self._deliver(lane, requests, futures, watchers, real, failed)
            finished()
            return
        execution.add_done_callback(collect)

    def _deliver(
        self,
        lane: Lane,
        requests: list[InferRequest],
        futures: list[asyncio.Future[InferResponse] | None],
        watchers: list[Watcher | None],
        real: int,
        result: ExecutionResult,
    ) -> None:
        self._running -= 1
        if len(result.results) != len(requests):
            count = len(result.results)
            result = self._failed(lane, len(requests), f"returned {count} results for {len(requests)} requests")
        for request in requests:
            if request.trace is not None:
                request.trace.compute_ended(result.compute_input_ns, result.compute_output_ns)
        # Triton counts null requests in the batch size, but not as inferences.
        self._stats.record_execution(
            len(requests), real, result.compute_input_ns, result.compute_infer_ns, result.compute_output_ns,
            inferences=real,
        )
        for rerun in result.reruns or ():
            self._record_rerun(requests, futures, rerun)
        for request, future, watcher, outcome in zip(requests, futures, watchers, result.results, strict=True):
            if future is not None:
                settle(self._stats, request, future, outcome, watcher)

    def _record_rerun(
        self, requests: list[InferRequest], futures: list[asyncio.Future[InferResponse] | None], rerun: Rerun
    ) -> None:
        """Count rescheduled requests that ran again as Triton counts them, which queues them anew: each run is an
        execution, and the run that rescheduled a request is a success of its own (the last run is counted as any
        request is). They ran again at once, so with no time in the queue."""
        real = [index for index in rerun.indexes if futures[index] is not None]
        for index in real:
            self._stats.success.add(rerun.rescheduled_ns - requests[index].arrival_ns)
        self._stats.queue.add(0, len(real))
        self._stats.record_execution(
            len(rerun.indexes), len(real), rerun.compute_input_ns, rerun.compute_infer_ns, rerun.compute_output_ns,
            inferences=len(real),
        )

    def _failed(self, lane: Lane, count: int, what: str) -> ExecutionResult:
        error = internal(f"model '{self._model_name}' instance '{lane.instance.name}' {what}")
        return ExecutionResult([error] * count)

    def call_later(self, delay_ns: int, callback: Callable[[], None]) -> asyncio.TimerHandle:
        return self._loop.call_later(delay_ns / 1e9, callback)
