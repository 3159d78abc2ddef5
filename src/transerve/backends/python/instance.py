"""A python-backend model instance: one worker process (`process.WorkerProcess`), restarted when it dies (with a
growing delay, and not past a cap: `restarts.RestartBudget`; the instance is then given up and its model told).

Executions are sent to the worker with up to `max_inflight` queued in its socket; a reply settles the execution,
unless the model answers some requests later through response senders (`_Completion`) or reschedules them under an
iterative sequence (`Rescheduling`, run again here). Cancellation, request timeouts (a hung execute restarts the
worker) and the memory ceiling are watched per instance.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import numpy as np
from tritonclient.grpc import model_config_pb2

from transerve.backends.base import BackendInstance, ExecutionResult, Rerun
from transerve.backends.python.ipc import OP_EXECUTE, OP_INITIALIZE, OP_IS_READY, PENDING, RESCHEDULED
from transerve.backends.python.process import WorkerProcess, WorkerSpec, describe_exit
from transerve.backends.python.restarts import RestartBudget
from transerve.backends.python.shm import Entry
from transerve.backends.python.streams import LateResponse, WorkerStreams
from transerve.backends.runtime import Runtime
from transerve.config.sequence_batching import sequence_controls
from transerve.core.datatypes import NUMPY_DTYPES
from transerve.core.errors import ErrorCode, ServerError
from transerve.core.types import InferRequest, InferResponse, Tensor

logger = logging.getLogger(__name__)

#: The model config parameter that caps a worker's resident memory (bytes); past it, the worker is restarted.
RSS_PARAMETER = "max_worker_rss_bytes"
#: How often a worker's resident memory is read (/proc/<pid>/statm, which is cheap) when it is capped.
RSS_POLL_S = 0.5


class PythonInstance(BackendInstance):
    """One model instance: a worker process, restarted when it dies.

    Up to `max_inflight` executions are queued in the worker's socket, so it finds its next request
    waiting when it finishes one instead of sleeping until the server sends it (a sleeping worker
    costs the server a cross-CPU wake-up per request); benchmarks/README.md, "Figures behind the
    code", has what 4 against 2 served.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        name: str,
        initialize_args: dict[str, str],
        decoupled: bool,
        runtime: Runtime | None,
        rescheduling: Rescheduling | None = None,
        restarts: Counter[str] | None = None,
        on_given_up: Callable[[str], None] | None = None,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self.name = name
        self.max_inflight = spec.max_inflight
        self._spec = spec
        self._initialize_args = initialize_args
        self._decoupled = decoupled
        #: A decoupled request hears of its client's cancellation through its response stream instead.
        self.cancellable = not decoupled
        self._runtime = runtime
        self._rescheduling = rescheduling
        self._worker: WorkerProcess | None = None
        self._starting: asyncio.Task[WorkerProcess] | None = None
        self._has_is_ready = False
        self._closed = False
        #: Tasks started from callbacks, kept referenced until they finish.
        self._background: set[asyncio.Task[None]] = set()
        #: Workers restarted, by reason ("crash", "memory", "hung"), shared by the model's instances (a metric).
        self._restarts: Counter[str] = Counter() if restarts is None else restarts
        #: A worker killed by `abort`, for `close` to wait on.
        self._aborted: WorkerProcess | None = None
        self._rss_timer: asyncio.TimerHandle | None = None
        self._budget = RestartBudget()
        #: Why the worker is not restarted any more (`restarts`); None while it is.
        self.given_up: str | None = None
        self._on_given_up = on_given_up

    async def start(self, worker: WorkerProcess | None = None) -> None:
        """Start (or adopt, after auto-complete) a worker and initialize the model in it."""
        self._worker = await self._launch(worker)
        if self._spec.max_rss_bytes:
            self._rss_timer = self._loop.call_later(RSS_POLL_S, self._check_rss)

    async def _launch(self, worker: WorkerProcess | None = None, delay: float = 0.0) -> WorkerProcess:
        if delay:
            await asyncio.sleep(delay)
        if worker is None:
            worker = await WorkerProcess.start(self._spec, self.name)
        streams = worker.streams = WorkerStreams(
            worker.connection, self._runtime, self._spec.model_name, self._spec.model_version
        )
        worker.exit_code.add_done_callback(lambda _: streams.lost(self._lost_error(worker)))
        try:
            self._has_is_ready = await worker.call(OP_INITIALIZE, self._initialize_args)
        except BaseException:
            await worker.abort()
            raise
        worker.exit_code.add_done_callback(lambda _: self._on_worker_exit(worker))
        return worker

    def _on_worker_exit(self, worker: WorkerProcess) -> None:
        """A worker died: unless we are closing, start a fresh one at once."""
        if self._closed or worker is not self._worker:
            return
        self._restarts["crash"] += 1
        logger.error(
            "model '%s' instance '%s' process exited unexpectedly (%s); restarting it",
            self._spec.model_name,
            self.name,
            describe_exit(worker.exit_code.result()),
        )
        self._worker = None
        self._restart()

    def _end_worker(self, worker: WorkerProcess, why: str, reason: str) -> None:
        """Kill a worker on purpose and start a fresh one at once: what it ran fails UNAVAILABLE."""
        if self._closed or worker is not self._worker:
            return
        self._restarts[why] += 1
        logger.error("model '%s' instance '%s': %s; restarting it", self._spec.model_name, self.name, reason)
        worker.end(reason)
        self._worker = None
        self._restart()

    def _check_rss(self) -> None:
        """Restart the worker if its resident memory passed the model's ceiling (polled, so a worker busy in a
        long execute is caught too)."""
        if self._closed:
            return
        worker, ceiling = self._worker, self._spec.max_rss_bytes
        if worker is not None:
            rss = worker.rss_bytes()
            if rss > ceiling:
                self._end_worker(
                    worker, "memory", f"its resident memory ({rss} bytes) passed {RSS_PARAMETER} ({ceiling} bytes)"
                )
        self._rss_timer = self._loop.call_later(RSS_POLL_S, self._check_rss)

    def _restart(self) -> asyncio.Task[WorkerProcess] | None:
        """The running restart, or a new one after the budget's delay (a failed restart is retried by the next
        request); None once the budget refuses it, and the instance is given up."""
        if self.given_up is not None:
            return None
        if self._starting is None or self._starting.done():
            delay = self._budget.next_delay()
            if delay is None:
                self._give_up(self._budget.refusal())
                return None
            self._starting = self._loop.create_task(self._launch(delay=delay))
            self._starting.add_done_callback(self._restarted)
        return self._starting

    def _give_up(self, reason: str) -> None:
        self.given_up = reason
        logger.error("model '%s' instance '%s' is UNAVAILABLE: %s", self._spec.model_name, self.name, reason)
        if self._on_given_up is not None:
            self._on_given_up(f"instance '{self.name}': {reason}")

    def _restarted(self, task: asyncio.Task[WorkerProcess]) -> None:
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            logger.error("model '%s' instance '%s' failed to restart: %s", self._spec.model_name, self.name, error)
        elif self._closed:
            self._in_background(task.result().stop())
        else:
            self._worker = task.result()

    async def _current_worker(self) -> WorkerProcess:
        if self._worker is not None:
            return self._worker
        if self._closed:
            raise ServerError(ErrorCode.UNAVAILABLE, f"model instance '{self.name}' is closed")
        starting = self._restart()
        if starting is None:
            raise ServerError(ErrorCode.UNAVAILABLE, f"model instance '{self.name}' is not available: {self.given_up}")
        try:
            return await asyncio.shield(starting)
        except ServerError as exc:
            raise ServerError(
                ErrorCode.UNAVAILABLE, f"model instance '{self.name}' is not available: {exc.message}"
            ) from None

    def execute(self, requests: list[InferRequest]) -> Awaitable[ExecutionResult]:
        """A future that the reply's reader callback resolves: no task per execution while the
        worker is up; a coroutine waits for the worker only while it is being restarted."""
        future: asyncio.Future[ExecutionResult] = self._loop.create_future()
        return self.execute_then(requests, functools.partial(_settle, future)) or future

    def execute_then(
        self, requests: list[InferRequest], done: Callable[[ExecutionResult], None]
    ) -> Awaitable[ExecutionResult] | None:
        """While the worker is up, `done` runs in the reader callback that decoded the reply."""
        worker = self._worker
        if worker is None:
            return self._execute_after_restart(requests)
        return self._send(worker, requests, done)

    async def _execute_after_restart(self, requests: list[InferRequest]) -> ExecutionResult:
        try:
            worker = await self._current_worker()
        except ServerError as exc:
            return ExecutionResult([exc] * len(requests))
        future: asyncio.Future[ExecutionResult] = self._loop.create_future()
        return await (self._send(worker, requests, functools.partial(_settle, future)) or future)

    def _send(
        self,
        worker: WorkerProcess,
        requests: list[InferRequest],
        done: Callable[[ExecutionResult], None],
        tokens: list[int] | None = None,
    ) -> asyncio.Future[ExecutionResult] | None:
        """Send an execute whose reply calls `done`; a settled future instead if it cannot be sent. A request
        run again keeps the `tokens` it already has (its responses go under it, it is cancelled under it)."""
        try:
            if tokens is None and worker.streams:
                tokens = worker.streams.open(requests) if self._decoupled else worker.streams.watch(requests)
            worker.connection.call(
                OP_EXECUTE,
                _execute_body(requests, tokens),
                _input_groups(requests),
                on_reply=functools.partial(self._replied, worker, requests, tokens, done),
                on_lost=functools.partial(self._worker_lost, worker, requests, done),
            )
            return None
        except Exception as exc:  # an input the transport cannot carry
            logger.exception("model '%s': cannot send requests to instance '%s'", self._spec.model_name, self.name)
            if not self._decoupled and worker.streams:
                for request in requests:
                    worker.streams.unwatch(request)
            future = self._loop.create_future()
            error = ServerError(ErrorCode.INTERNAL, f"cannot send the request to the model: {exc}")
            future.set_result(ExecutionResult([error] * len(requests)))
            return future

    def _replied(
        self,
        worker: WorkerProcess,
        requests: list[InferRequest],
        tokens: list[int] | None,
        done: Callable[[ExecutionResult], None],
        body: tuple[Any, Any],
        outputs: list[list[Entry]],
    ) -> None:
        try:
            result, late, again = self._execution_result(worker, requests, tokens, body, outputs)
        except Exception as exc:  # a reply this server cannot read: fail its requests, keep serving
            logger.exception("model '%s': bad reply from instance '%s'", self._spec.model_name, self.name)
            error = ServerError(
                ErrorCode.INTERNAL, f"model '{self._spec.model_name}' instance '{self.name}' failed: {exc!r}"
            )
            result, late, again = ExecutionResult([error] * len(requests)), [], []
            if not self._decoupled and worker.streams is not None:
                for request in requests:
                    worker.streams.unwatch(request)
        if not late and not again:
            done(result)
            return
        completion = _Completion(result, done, len(late) + bool(again))
        for index, late_id in late:
            worker.streams.expect_late(
                late_id, functools.partial(self._late, worker.streams, completion, requests[index], index)
            )
        if again:
            self._run_again(worker, requests, tokens, again, completion)

    def cancel(self, request: InferRequest) -> None:
        """Tell the worker: the model's `is_cancelled()` for the request becomes True (the scheduler calls this
        when the client of a request this instance runs goes away)."""
        worker = self._worker
        if worker is not None and worker.streams is not None:
            worker.streams.cancel(request)

    def expired(self, request: InferRequest) -> None:
        """Past its deadline the request is cancelled, and its worker restarted if it still runs it `hung_grace_s`
        later. (Told by the deadline's timer, which may fire a little before the deadline by the clock.)"""
        worker = self._worker
        self.cancel(request)
        if worker is not None and worker.streams is not None:
            self._loop.call_later(self._spec.hung_grace_s, self._check_hung, worker, request)

    def _check_hung(self, worker: WorkerProcess, request: InferRequest) -> None:
        """A request timed out `hung_grace_s` ago: if its worker still runs it, the worker is hung (or too slow to be
        of use): restart it rather than let it hold the instance forever."""
        if worker.streams is not None and worker.streams.holds(request):
            worker.hung_on = request
            self._end_worker(
                worker, "hung", f"an execute ran {self._spec.hung_grace_s:g}s past its request's timeout"
            )

    def _late(
        self,
        streams: WorkerStreams,
        completion: _Completion,
        request: InferRequest,
        index: int,
        response: LateResponse | ServerError,
    ) -> None:
        """A non-decoupled request's response, sent by its model after `execute` returned."""
        streams.unwatch(request)
        if isinstance(response, ServerError):
            completion.settle(index, response)
            return
        error, parameters, tensors = response
        if error is not None:
            completion.settle(index, ServerError(ErrorCode[error[0]], error[1]))
            return
        outputs = [Tensor(name, datatype, data) for name, datatype, data in tensors]
        completion.settle(
            index,
            InferResponse(
                self._spec.model_name, self._spec.model_version, outputs, id=request.id, parameters=parameters or {}
            ),
        )

    def _run_again(
        self,
        worker: WorkerProcess,
        requests: list[InferRequest],
        tokens: list[int] | None,
        again: list[int],
        completion: _Completion,
    ) -> None:
        """Run rescheduled requests again at once, on this instance, as one execute; their results replace the
        placeholders of the first."""
        assert self._rescheduling is not None
        rerun = [self._rescheduling.again(requests[index]) for index in again]
        rerun_tokens = None if tokens is None else [tokens[index] for index in again]
        merge = functools.partial(completion.merge, again, time.monotonic_ns())
        settled = self._send(worker, rerun, merge, rerun_tokens)
        if settled is not None:
            settled.add_done_callback(lambda future: merge(future.result()))

    def _execution_result(
        self,
        worker: WorkerProcess,
        requests: list[InferRequest],
        tokens: list[int] | None,
        body: tuple[Any, Any],
        outputs: list[list[Entry]],
    ) -> tuple[ExecutionResult, list[tuple[int, int]], list[int]]:
        """The reply's result, the (index, id) of responses still to come, and the indexes of requests to run
        again."""
        results, (input_ns, infer_ns, output_ns) = body
        late: list[tuple[int, int]] = []
        again: list[int] = []
        responses: list[InferResponse | ServerError | None] = []
        model_name, model_version = self._spec.model_name, self._spec.model_version
        decoupled, streams = self._decoupled, worker.streams
        for index, ((code, message, parameters), tensors) in enumerate(zip(results, outputs, strict=True)):
            if code is None:
                if decoupled:  # its responses went through its stream
                    responses.append(None)
                    continue
                responses.append(
                    InferResponse(
                        model_name,
                        model_version,
                        [Tensor(name, datatype, data) for name, datatype, data in tensors],
                        id=requests[index].id,
                        parameters=parameters or {},
                    )
                )
                if streams is not None:
                    streams.unwatch(requests[index])
            elif code == PENDING:
                late.append((index, message))
                responses.append(None)
            elif code == RESCHEDULED and self._rescheduling is not None:
                again.append(index)
                responses.append(None)
            else:
                if code == RESCHEDULED:
                    code, message = "INTERNAL", (
                        f"model '{model_name}' rescheduled a request, which needs "
                        "'sequence_batching { iterative_sequence: true }' in its configuration"
                    )
                if streams is not None:
                    if not decoupled:
                        streams.unwatch(requests[index])
                    elif tokens is not None:
                        streams.drop(tokens[index])
                responses.append(ServerError(ErrorCode[code], message))
        return ExecutionResult(responses, input_ns, infer_ns, output_ns), late, again

    def _lost_error(self, worker: WorkerProcess) -> ServerError:
        """The error of requests a worker was running when it ended: UNAVAILABLE if the server ended it (the
        request may be sent again), INTERNAL if it died (the model may well fail it again)."""
        where = f"Failed to process the request(s): model '{self._spec.model_name}' instance '{self.name}'"
        if worker.ended_by is not None:
            return ServerError(ErrorCode.UNAVAILABLE, f"{where} was stopped: {worker.ended_by}")
        return ServerError(
            ErrorCode.INTERNAL, f"{where} process exited unexpectedly ({describe_exit(worker.exit_code.result())})"
        )

    def _worker_lost(
        self, worker: WorkerProcess, requests: list[InferRequest], done: Callable[[ExecutionResult], None]
    ) -> None:
        """Fail an execution whose worker died, once the exit code can name the cause; one that waited behind a hung
        execute (a sync model runs one at a time, so the model never saw it) runs again on the fresh worker."""

        async def settle() -> None:
            await worker.exited()
            hung_on = worker.hung_on
            if hung_on is not None and not self._closed and all(request is not hung_on for request in requests):
                done(await self._execute_after_restart(requests))
                return
            done(ExecutionResult([self._lost_error(worker)] * len(requests)))

        self._in_background(settle())

    def _in_background(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = self._loop.create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def is_ready(self) -> bool:
        """Whether the worker is up and, if the model defines `is_ready`, what it answers."""
        worker = self._worker
        if worker is None:
            return False
        if not self._has_is_ready:
            return True
        try:
            return bool(await worker.call(OP_IS_READY, None))
        except ServerError:
            return False

    def abort(self, reason: str) -> None:
        """Closing, out of time: kill a worker that is still running something (its requests fail UNAVAILABLE);
        an idle one is left to `close`, which lets the model finalize."""
        self._closed = True
        worker = self._worker
        if worker is not None and worker.connection.busy:
            worker.end(reason)
            self._worker, self._aborted = None, worker

    async def close(self) -> None:
        self._closed = True
        if self._rss_timer is not None:
            self._rss_timer.cancel()
        if self._starting is not None and not self._starting.done():
            self._starting.cancel()
            await asyncio.gather(self._starting, return_exceptions=True)
        worker, self._worker = self._worker, None
        if worker is not None:
            await worker.stop()
        if self._aborted is not None:
            await self._aborted.exit_code
        await asyncio.gather(*self._background, return_exceptions=True)


class _Completion:
    """An execution some of whose results come after its reply: responses a non-decoupled model sends after
    `execute` returned, and the results of rescheduled requests run again. `done` runs once all are in."""

    __slots__ = ("_result", "_done", "_waiting")

    def __init__(self, result: ExecutionResult, done: Callable[[ExecutionResult], None], waiting: int) -> None:
        self._result = result
        self._done = done
        self._waiting = waiting

    def settle(self, index: int, outcome: InferResponse | ServerError) -> None:
        self._result.results[index] = outcome
        self._one_less()

    def merge(self, indexes: list[int], rescheduled_ns: int, rerun: ExecutionResult) -> None:
        """The results of the requests at `indexes`, run again: one more run of the execution, and those of its
        own rescheduled requests."""
        result = self._result
        for index, outcome in zip(indexes, rerun.results, strict=True):
            result.results[index] = outcome
        runs = result.reruns = result.reruns or []
        runs.append(
            Rerun(indexes, rescheduled_ns, rerun.compute_input_ns, rerun.compute_infer_ns, rerun.compute_output_ns)
        )
        for inner in rerun.reruns or ():
            inner.indexes = [indexes[index] for index in inner.indexes]
            runs.append(inner)
        self._one_less()

    def _one_less(self) -> None:
        self._waiting -= 1
        if self._waiting == 0:
            self._done(self._result)


class Rescheduling:
    """How a rescheduled request runs again (`sequence_batching { iterative_sequence: true }`): as Triton's
    iterative sequencer re-enqueues it, with flags 0, so its START and END control inputs (if the model declares
    them) become false."""

    def __init__(self, config: model_config_pb2.ModelConfig) -> None:
        controls = sequence_controls(config)
        shape = (1, 1) if config.max_batch_size > 0 else (1,)
        self._false: dict[str, Tensor] = {}
        for control in (controls.start, controls.end):
            if control is not None:
                data = np.full(shape, control.false_value, dtype=NUMPY_DTYPES[control.datatype])
                data.flags.writeable = False
                self._false[control.name] = Tensor(control.name, control.datatype, data)

    def again(self, request: InferRequest) -> InferRequest:
        request.flags = 0
        if self._false:
            request.inputs = [self._false.get(tensor.name, tensor) for tensor in request.inputs]
        return request


def _settle(future: asyncio.Future[ExecutionResult], result: ExecutionResult) -> None:
    if not future.done():
        future.set_result(result)


def _execute_body(requests: list[InferRequest], tokens: list[int] | None) -> list[tuple[Any, ...]]:
    """Per request, what the worker's InferenceRequest needs besides the tensors (and, for a
    decoupled model, the token its responses are sent under; for a traced one, its trace id, which the
    model's BLS calls name as their parent, and its OpenTelemetry context)."""
    return [
        (
            request.id,
            request.correlation_id,
            request.flags,
            request.parameters,
            None if request.outputs is None else [output.name for output in request.outputs],
            None if tokens is None else tokens[index],
            None if request.trace is None else request.trace.for_model(),
        )
        for index, request in enumerate(requests)
    ]


def _input_groups(requests: list[InferRequest]) -> list[list[Entry]]:
    return [[(tensor.name, tensor.datatype, tensor.data) for tensor in request.inputs] for request in requests]
