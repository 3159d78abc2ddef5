"""The Triton-compatible `python` backend: each model instance is a worker process.

The server side of an instance keeps one worker, talks to it through `ipc.AsyncConnection`
(shared-memory tensors, a socket for control) and restarts it when it dies: requests in flight at
that moment fail with an INTERNAL error naming the model, and later requests go to a fresh worker.
A decoupled model's responses and the BLS calls a model makes travel on the same connection
(`streams.WorkerStreams`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import site
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tritonclient.grpc import model_config_pb2

from transerve.backends.base import Backend, BackendInstance, BackendModel, ExecutionResult, ModelContext, Rerun
from transerve.backends.python.environments import DEFAULT_MAX_BYTES as DEFAULT_ENV_MAX_BYTES
from transerve.backends.python.environments import PARAMETER as ENV_PARAMETER
from transerve.backends.python.environments import ExecutionEnvironments, Interpreter
from transerve.backends.python.ipc import (
    DEFAULT_ARENA_BYTES,
    OP_AUTO_COMPLETE,
    OP_EXECUTE,
    OP_FINALIZE,
    OP_INITIALIZE,
    OP_IS_READY,
    OP_LOAD,
    PENDING,
    RESCHEDULED,
    AsyncConnection,
    ConnectionLost,
    Endpoint,
    Entry,
    Region,
    socket_pair,
)
from transerve.backends.python.streams import LateResponse, WorkerStreams
from transerve.config import model_config
from transerve.config.sequence_batching import sequence_controls
from transerve.core.datatypes import NUMPY_DTYPES
from transerve.core.errors import ErrorCode, ServerError
from transerve.core.types import InferRequest, InferResponse, Tensor

logger = logging.getLogger(__name__)

#: How long `close` waits for the model's `finalize`, then for the process to exit, before killing it.
STOP_TIMEOUT_S = 10.0
#: How long to wait for a worker whose socket closed to actually exit, before killing it.
EXIT_TIMEOUT_S = 5.0
#: Executions an instance accepts before earlier ones finish (`--backend-config=python,max-inflight=N`).
DEFAULT_MAX_INFLIGHT = 4


@dataclass(slots=True, frozen=True)
class WorkerSpec:
    """What every worker of one model version is started with."""

    model_name: str
    model_version: str
    model_file: Path
    arena_bytes: int
    max_inflight: int
    #: The server's log settings page (`core.log_settings`), which `pb_utils.Logger` follows; None: none.
    log_fd: int | None = None
    #: The model's own Python environment (EXECUTION_ENV_PATH); None: the server's interpreter.
    interpreter: Interpreter | None = None


class WorkerProcess:
    """One running worker and the connection to it.

    `exit_code` resolves when the process is gone; a pidfd tells the event loop, so a dead worker
    is noticed even when a child process of the model still holds the socket open.
    """

    def __init__(self, process: subprocess.Popen[bytes], sock: socket.socket, endpoint: Endpoint, instance: str):
        self._loop = asyncio.get_running_loop()
        self.process = process
        self.instance = instance
        self.exit_code: asyncio.Future[int] = self._loop.create_future()
        self.connection = AsyncConnection(sock, endpoint, self._loop)
        #: Decoupled requests and BLS calls, once an instance adopts the worker.
        self.streams: WorkerStreams | None = None
        self._pidfd = os.pidfd_open(process.pid)
        self._loop.add_reader(self._pidfd, self._on_exit)

    @classmethod
    async def start(cls, spec: WorkerSpec, instance: str) -> WorkerProcess:
        """Spawn a worker for `instance` and have it import the model; raises ServerError if it cannot."""
        parent, child = socket_pair()
        to_worker = Region.create(spec.arena_bytes, f"transerve-{instance}-in")
        from_worker = Region.create(spec.arena_bytes, f"transerve-{instance}-out")
        command = [
            *(spec.interpreter.command if spec.interpreter else (sys.executable,)),
            "-m",
            "transerve.backends.python.worker",
            "--socket-fd",
            str(child.fileno()),
            "--input-fd",
            str(to_worker.fd),
            "--output-fd",
            str(from_worker.fd),
        ]
        passed = [child.fileno(), to_worker.fd, from_worker.fd]
        if spec.log_fd is not None:
            command += ["--log-settings-fd", str(spec.log_fd)]
            passed.append(spec.log_fd)
        try:
            process = subprocess.Popen(
                command,
                pass_fds=passed,
                stdin=subprocess.DEVNULL,
                stdout=_stderr_fd(),
                env=spec.interpreter.environment if spec.interpreter else _worker_environment(),
            )
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
            to_worker.close_fd()
            from_worker.close_fd()
        worker = cls(process, parent, Endpoint(outgoing=to_worker, incoming=from_worker), instance)
        load = {
            "model_name": spec.model_name,
            "model_version": spec.model_version,
            "model_file": str(spec.model_file),
            "instance_name": instance,
        }
        try:
            await worker.call(OP_LOAD, load)
        except BaseException:
            await worker.abort()
            raise
        return worker

    async def call(self, op: int, body: Any) -> Any:
        """A lifecycle call; the model's failure raises ServerError, and so does the worker's death."""
        try:
            (error, value), _ = await self.connection.request(op, body)
        except ConnectionLost:
            exit_code = describe_exit(await self.exited())
            raise ServerError(
                ErrorCode.INTERNAL, f"model instance '{self.instance}' process exited unexpectedly ({exit_code})"
            ) from None
        if error is not None:
            code, message = error
            raise ServerError(ErrorCode[code], message)
        return value

    async def exited(self) -> int:
        """The exit code, killing a worker that closed its socket but does not exit."""
        try:
            return await asyncio.wait_for(asyncio.shield(self.exit_code), EXIT_TIMEOUT_S)
        except asyncio.TimeoutError:
            self.kill()
            return await self.exit_code

    def _on_exit(self) -> None:
        self._loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        try:
            # Messages the worker sent before it died are still in the socket: deliver them first.
            self.connection.read_ready(drain=True)
        finally:
            self.connection.lose()
            self.exit_code.set_result(self.process.wait())

    async def stop(self) -> None:
        """Call the model's `finalize`, then end the process, killing it if it takes too long."""
        if not self.connection.closed:
            try:
                await asyncio.wait_for(self.call(OP_FINALIZE, None), STOP_TIMEOUT_S)
            except (ServerError, asyncio.TimeoutError) as exc:
                logger.warning("model instance '%s' did not finalize cleanly: %s", self.instance, exc)
        try:
            await asyncio.wait_for(asyncio.shield(self.exit_code), STOP_TIMEOUT_S)
        except asyncio.TimeoutError:
            self.kill()
            await self.exit_code

    def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()

    async def abort(self) -> None:
        """Kill the worker without waiting on model code, and wait until it is gone."""
        self.kill()
        await self.exit_code


def describe_exit(code: int) -> str:
    """`code 1`, or `code -11, signal SIGSEGV` for a worker killed by a signal."""
    if code < 0:
        try:
            return f"code {code}, signal {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"code {code}"


def _stderr_fd() -> int:
    """Where worker output goes: the server's stderr (fd 2 when sys.stderr is not a real file)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return 2


def _worker_environment() -> dict[str, str]:
    """The server's environment, plus the folder transerve lives in when it is not installed there."""
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[3])
    if package_root not in site.getsitepackages():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    return env


class PythonInstance(BackendInstance):
    """One model instance: a worker process, restarted when it dies.

    Up to `max_inflight` executions are queued in the worker's socket, so it finds its next request
    waiting when it finishes one instead of sleeping until the server sends it: measured on a 2-core
    box with add_sub over HTTP, 4 served ~30% more requests per second than 2 (a sleeping worker
    costs the server a cross-CPU wake-up per request), with no cost in latency at low load.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        name: str,
        initialize_args: dict[str, str],
        decoupled: bool,
        runtime: Any,
        rescheduling: Rescheduling | None = None,
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

    async def start(self, worker: WorkerProcess | None = None) -> None:
        """Start (or adopt, after auto-complete) a worker and initialize the model in it."""
        self._worker = await self._launch(worker)

    async def _launch(self, worker: WorkerProcess | None = None) -> WorkerProcess:
        if worker is None:
            worker = await WorkerProcess.start(self._spec, self.name)
        streams = worker.streams = WorkerStreams(
            worker.connection, self._runtime, self._spec.model_name, self._spec.model_version
        )
        worker.exit_code.add_done_callback(lambda done: streams.lost(self._exit_message(done.result())))
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
        logger.error(
            "model '%s' instance '%s' process exited unexpectedly (%s); restarting it",
            self._spec.model_name,
            self.name,
            describe_exit(worker.exit_code.result()),
        )
        self._worker = None
        self._restart()

    def _restart(self) -> asyncio.Task[WorkerProcess]:
        """The running restart, or a new one (a failed restart is retried by the next request)."""
        if self._starting is None or self._starting.done():
            self._starting = self._loop.create_task(self._launch())
            self._starting.add_done_callback(self._restarted)
        return self._starting

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
        try:
            return await asyncio.shield(self._restart())
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
                on_lost=functools.partial(self._worker_lost, worker, len(requests), done),
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

    def _exit_message(self, exit_code: int) -> str:
        return (
            f"Failed to process the request(s): model '{self._spec.model_name}' instance '{self.name}' "
            f"process exited unexpectedly ({describe_exit(exit_code)})"
        )

    def _worker_lost(self, worker: WorkerProcess, count: int, done: Callable[[ExecutionResult], None]) -> None:
        """Fail an execution whose worker died, once the exit code can name the cause."""

        async def settle() -> None:
            error = ServerError(ErrorCode.INTERNAL, self._exit_message(await worker.exited()))
            done(ExecutionResult([error] * count))

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

    async def close(self) -> None:
        self._closed = True
        if self._starting is not None and not self._starting.done():
            self._starting.cancel()
            await asyncio.gather(self._starting, return_exceptions=True)
        worker, self._worker = self._worker, None
        if worker is not None:
            await worker.stop()
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


class PythonBackend(Backend):
    """Loads Triton python-backend models (`model.py` with `class TritonPythonModel`)."""

    name = "python"

    def __init__(self) -> None:
        self._environments = ExecutionEnvironments()

    async def load(self, context: ModelContext) -> BackendModel:
        where = f"failed to load '{context.name}' version {context.version}"
        try:
            return await self._load(context)
        except ServerError as exc:
            logger.error("%s: %s", where, exc.message)
            raise ServerError(exc.code, f"{where}: {exc.message}") from None

    async def _load(self, context: ModelContext) -> BackendModel:
        config = context.config
        model_file = context.model_file("model.py")
        if not model_file.is_file():
            raise ServerError(ErrorCode.INVALID_ARG, f"model file '{model_file}' not found")
        interpreter = None
        if ENV_PARAMETER in config.parameters and config.parameters[ENV_PARAMETER].string_value:
            interpreter = await self._environments.interpreter(
                config.parameters[ENV_PARAMETER].string_value,
                context.model_path,
                context.repository_path,
                _setting(context.backend_config, "execution-env-max-bytes", DEFAULT_ENV_MAX_BYTES, 1),
            )
        spec = WorkerSpec(
            model_name=context.name,
            model_version=context.version,
            model_file=model_file,
            arena_bytes=_setting(context.backend_config, "shm-default-byte-size", DEFAULT_ARENA_BYTES, 4096),
            max_inflight=_setting(context.backend_config, "max-inflight", DEFAULT_MAX_INFLIGHT, 1),
            log_fd=getattr(getattr(context.runtime, "log", None), "page_fd", None),
            interpreter=interpreter,
        )
        if config.sequence_batching.state:
            # Triton's python backend loads such a model but never stores the output state, so every request
            # would see the initial state: refusing says so instead of computing wrong answers.
            raise ServerError(
                ErrorCode.INVALID_ARG,
                "implicit state (sequence_batching.state) is not supported by the python backend: "
                "keep the state in the model, keyed by the CORRID control input",
            )
        names = _instance_names(config)
        first = await WorkerProcess.start(spec, names[0][0])
        if context.auto_complete:
            try:
                config = await _auto_complete(first, config, context.name)
            except BaseException:
                await first.abort()
                raise
        decoupled = config.model_transaction_policy.decoupled
        rescheduling = Rescheduling(config) if config.sequence_batching.iterative_sequence else None
        instances = [
            PythonInstance(
                spec,
                name,
                _initialize_args(context, config, name, kind, device),
                decoupled,
                context.runtime,
                rescheduling,
            )
            for name, kind, device in names
        ]
        outcomes = await asyncio.gather(
            *(instance.start(first if index == 0 else None) for index, instance in enumerate(instances)),
            return_exceptions=True,
        )
        failure = next((outcome for outcome in outcomes if isinstance(outcome, BaseException)), None)
        if failure is not None:
            await asyncio.gather(*(instance.close() for instance in instances))
            raise failure
        return BackendModel(config, instances)


async def _auto_complete(
    worker: WorkerProcess, config: model_config_pb2.ModelConfig, name: str
) -> model_config_pb2.ModelConfig:
    """Let the model's `auto_complete_config` fill in the config, then check the result again."""
    completed = await worker.call(OP_AUTO_COMPLETE, model_config.to_json(config))
    try:
        config = model_config.parse_config_json(completed)
        model_config.normalize(config, name)
        model_config.validate(config, name)
    except model_config.ConfigError as exc:
        raise ServerError(ErrorCode.INVALID_ARG, f"auto-completed config is invalid: {exc}") from None
    return config


def _instance_names(config: model_config_pb2.ModelConfig) -> list[tuple[str, str, int]]:
    """(name, kind, device id) of every instance, as Triton creates them: `count` instances per group, each
    named `<group name>_<index in group>`, and for KIND_GPU that many on every listed GPU."""
    names = []
    for group in config.instance_group:
        kind = model_config_pb2.ModelInstanceGroup.Kind.Name(group.kind).removeprefix("KIND_")
        devices = list(group.gpus) if kind == "GPU" else [0]
        names.extend(
            (f"{group.name}_{index}", kind, device) for index in range(max(group.count, 1)) for device in devices
        )
    return names or [(f"{config.name}_0", "CPU", 0)]


def _initialize_args(
    context: ModelContext, config: model_config_pb2.ModelConfig, instance: str, kind: str, device: int
) -> dict[str, str]:
    """The `args` Triton passes to `initialize`, every value a string."""
    return {
        "model_config": model_config.to_json(config),
        "model_instance_kind": kind,
        "model_instance_name": instance,
        "model_instance_device_id": str(device),
        "model_repository": str(context.model_path),
        "model_version": context.version,
        "model_name": context.name,
    }


def _setting(backend_config: dict[str, str], key: str, default: int, minimum: int) -> int:
    """An integer from `--backend-config=python,KEY=VALUE`, e.g. `shm-default-byte-size` (arena bytes)."""
    value = backend_config.get(key)
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        number = minimum - 1
    if number < minimum:
        raise ServerError(ErrorCode.INVALID_ARG, f"backend config {key} must be an integer >= {minimum}, got '{value}'")
    return number
