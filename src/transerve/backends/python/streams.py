"""The server side of what a worker has open besides its executes.

* Decoupled requests: each gets a token, sent with the execute; the worker sends the request's
  responses under that token as the model produces them (from `execute` or later, from any of its
  threads), and they go into the request's ResponseStream. Cancelling the stream tells the worker.
* Cancellation of other requests: each gets a token too (`watch`), under which the instance tells the worker
  that its client went away (`cancel`), until the request is answered; the model sees it with `is_cancelled()`.
* Late responses: a non-decoupled request whose model sends its one response after `execute` returned gets an
  id in the execute's reply; the response follows under that id (possibly before the reply is read).
* BLS calls: the worker asks for an inference on another model; it runs through the core
  (`ModelContext.runtime`), in-process, and every answer goes back under the call's id. As in
  Triton, errors are answers, never exceptions: a request the core refuses before running it comes
  back as INTERNAL "Model <name> - Error when running inference: ...", and an error of the model it
  ran keeps its own code (Triton 2.51 turns those into INTERNAL too; later versions keep the code).
  The worker may cancel a call (OP_CANCEL under its id, when the model calls `cancel()` on its
  response iterator or drops it early): the called model's stream is cancelled, and the call's final
  answer is a CANCELLED error. A call made with `trace=request.trace()` names that request's trace id; while
  that request runs, the call is traced as its child (Triton's parent_id).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from transerve.backends.python.ipc import (
    OP_BLS_CALL,
    OP_BLS_RESPONSE,
    OP_CANCEL,
    OP_LATE_RESPONSE,
    OP_METRIC,
    OP_MODEL_CONTROL,
    OP_RESPONSE,
    AsyncConnection,
)
from transerve.backends.python.shm import Entry
from transerve.backends.runtime import Runtime
from transerve.core.errors import ErrorCode, ServerError, unavailable
from transerve.core.streams import ResponseStream
from transerve.core.types import InferRequest, InferResponse, RequestedOutput, Tensor

logger = logging.getLogger(__name__)

#: A late response as it arrives: (error code name and message, or None; parameters or None; output tensors).
LateResponse = tuple[tuple[str, str] | None, dict[str, Any] | None, list[Entry]]


class WorkerStreams:
    """Decoupled requests and BLS calls of one worker process."""

    def __init__(
        self, connection: AsyncConnection, runtime: Runtime | None, model_name: str, model_version: str
    ) -> None:
        self._connection = connection
        self._runtime = runtime
        self._model_name = model_name
        self._model_version = model_version
        self._tokens = itertools.count(1)
        #: Open decoupled requests by token; warm-up requests have no stream and are not kept.
        self._requests: dict[int, tuple[InferRequest, ResponseStream]] = {}
        #: The tokens of other requests until they are answered, by the request's id().
        self._watched: dict[int, int] = {}
        self._calls: dict[int, asyncio.Task[None]] = {}
        #: The called models' streams of running BLS calls, and calls the worker cancelled before theirs opened.
        self._call_streams: dict[int, ResponseStream] = {}
        self._cancelled_calls: set[int] = set()
        #: Late responses awaited by id, and those that came before the reply that announced them.
        self._late: dict[int, Callable[[LateResponse | ServerError], None]] = {}
        self._early: dict[int, LateResponse] = {}
        self._unloading: set[asyncio.Task[None]] = set()
        connection.on_message = self._on_message

    # ---- decoupled requests -----------------------------------------------------------------------

    def open(self, requests: list[InferRequest]) -> list[int]:
        """Tokens for a decoupled execute's requests; their streams now hear from the worker."""
        tokens = []
        for request in requests:
            token = next(self._tokens)
            tokens.append(token)
            stream = request.response_stream
            if stream is not None:
                self._requests[token] = (request, stream)
                self._connection.open_streams += 1
                stream.on_cancel(lambda token=token: self._cancel(token))
        return tokens

    def watch(self, requests: list[InferRequest]) -> list[int]:
        """Tokens for a non-decoupled execute's requests, which `cancel` can tell the worker of until `unwatch`."""
        watched = self._watched
        tokens = []
        for request in requests:
            token = watched[id(request)] = next(self._tokens)
            tokens.append(token)
        return tokens

    def holds(self, request: InferRequest) -> bool:
        """Whether the worker still runs (or has yet to start) a non-decoupled request."""
        return id(request) in self._watched

    def unwatch(self, request: InferRequest) -> None:
        """The request was answered (or failed): its cancellation no longer concerns the worker."""
        self._watched.pop(id(request), None)

    def cancel(self, request: InferRequest) -> None:
        """The client of a non-decoupled request the worker has went away: its `is_cancelled()` becomes True."""
        token = self._watched.get(id(request))
        if token is not None:
            self._connection.notify(OP_CANCEL, token, None)

    def drop(self, token: int) -> None:
        """The request ended without a final response from the model (its execute failed)."""
        if self._requests.pop(token, None) is not None:
            self._connection.open_streams -= 1

    def _cancel(self, token: int) -> None:
        if token in self._requests:
            self._connection.notify(OP_CANCEL, token, None)

    def _respond(self, token: int, body: tuple[bool, bool, Any, Any], tensors: list[Entry]) -> None:
        entry = self._requests.get(token)
        if entry is None:
            return
        request, stream = entry
        final, has_response, error, parameters = body
        if final:
            self.drop(token)
        if error is not None:
            stream.send_error(ServerError(ErrorCode[error[0]], error[1]), final)
        elif has_response:
            outputs = [Tensor(name, datatype, data) for name, datatype, data in tensors]
            response = InferResponse(self._model_name, self._model_version, outputs, request.id, parameters or {})
            stream.send(response, final)
        else:
            stream.close()

    # ---- late responses of non-decoupled requests ------------------------------------------------

    def expect_late(self, late_id: int, settle: Callable[[LateResponse | ServerError], None]) -> None:
        """Call `settle` with the response sent under `late_id` (or the error that ends the worker first)."""
        early = self._early.pop(late_id, None)
        if early is not None:
            settle(early)
            return
        self._late[late_id] = settle
        self._connection.open_streams += 1

    def _late_response(self, late_id: int, body: tuple[Any, Any], tensors: list[Entry]) -> None:
        error, parameters = body
        settle = self._late.pop(late_id, None)
        if settle is None:
            self._early[late_id] = (error, parameters, tensors)
            return
        self._connection.open_streams -= 1
        settle((error, parameters, tensors))

    # ---- BLS ------------------------------------------------------------------------------------------

    def _on_message(self, op: int, call_id: int, body: Any, groups: list[list[Entry]]) -> None:
        if op == OP_RESPONSE:
            self._respond(call_id, body, groups[0] if groups else [])
        elif op == OP_LATE_RESPONSE:
            self._late_response(call_id, body, groups[0] if groups else [])
        elif op == OP_BLS_CALL:
            # The call's trace is spawned now, while the request it names is surely still running.
            trace = self._runtime.tracing.bls_child(body[-1], self._model_name) if body[-1] else None
            self._start_call(call_id, self._run_call(call_id, body, groups[0] if groups else [], trace))
        elif op == OP_MODEL_CONTROL:
            self._start_call(call_id, self._model_control(call_id, *body))
        elif op == OP_METRIC:
            self._metric(call_id, body)
        elif op == OP_CANCEL:  # the model cancelled a BLS call, or dropped its response iterator
            self._cancel_call(call_id)

    def _start_call(self, call_id: int, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._calls[call_id] = task
        self._connection.open_streams += 1
        task.add_done_callback(lambda _: self._call_done(call_id))

    def _cancel_call(self, call_id: int) -> None:
        if call_id not in self._calls:  # it has ended
            return
        stream = self._call_streams.get(call_id)
        if stream is None:
            self._cancelled_calls.add(call_id)
        else:
            stream.cancel()

    def _call_done(self, call_id: int) -> None:
        del self._calls[call_id]
        self._call_streams.pop(call_id, None)
        self._cancelled_calls.discard(call_id)
        self._connection.open_streams -= 1

    async def _run_call(self, call_id: int, body: tuple[Any, ...], inputs: list[Entry], trace: Any) -> None:
        """Run one BLS request through the core and send every answer back (traced under its caller's trace when
        `trace` is its RequestTrace)."""
        name, version, request_id, correlation_id, flags, timeout, parameters, requested, decoupled, _ = body
        request = InferRequest(
            model_name=name,
            inputs=[Tensor(tensor_name, datatype, data) for tensor_name, datatype, data in inputs],
            model_version="" if version < 0 else str(version),
            id=request_id,
            outputs=[RequestedOutput(output) for output in requested] if requested else None,
            parameters=parameters,
            correlation_id=correlation_id,
            flags=flags,
            timeout_us=timeout,
            trace=trace,
        )
        try:
            stream = self._open(request, decoupled)
        except ServerError as exc:
            self._answer(call_id, True, ("INTERNAL", f"Model {name} - Error when running inference: {exc.message}"))
            return
        self._call_streams[call_id] = stream
        if call_id in self._cancelled_calls:
            stream.cancel()
        try:
            while True:
                try:
                    item, final = await stream.receive()
                except StopAsyncIteration:
                    if stream.cancelled:
                        self._answer(call_id, True, ("CANCELLED", f"the BLS request to model {name} was cancelled"))
                    else:
                        self._answer(call_id, True, ("INTERNAL", "the BLS request ended without a response"))
                    return
                if isinstance(item, ServerError):
                    self._answer(call_id, final, (item.code.name, item.message))
                elif item is None:
                    self._answer(call_id, True)
                else:
                    groups = [[(tensor.name, tensor.datatype, tensor.data) for tensor in item.outputs]]
                    self._answer(call_id, final, None, item.parameters or None, groups)
                if final:
                    return
        finally:
            if not stream.closed:
                stream.cancel()  # the worker went away: stop the model we called

    def _open(self, request: InferRequest, decoupled: bool) -> ResponseStream:
        """The called model's responses, or the error Triton gives before running anything."""
        name = request.model_name
        try:
            model = self._runtime.get_version(name, request.model_version)
        except ServerError:
            raise ServerError(
                ErrorCode.INTERNAL, f"Failed for execute the inference request. Model '{name}' is not ready."
            ) from None
        if model.config.model_transaction_policy.decoupled and not decoupled:
            raise ServerError(
                ErrorCode.INTERNAL,
                f"Model {name} is using the decoupled. The current BLS request call doesn't support models using "
                "the decoupled transaction policy. Please use 'decoupled=True' argument to the 'exec' or "
                "'async_exec' calls for decoupled models.'",
            )
        return self._runtime.infer_stream(request)

    def _answer(
        self,
        call_id: int,
        final: bool,
        error: tuple[str, str] | None = None,
        parameters: dict[str, Any] | None = None,
        groups: list[list[Entry]] | None = None,
    ) -> None:
        self._connection.notify(OP_BLS_RESPONSE, call_id, (final, error, parameters), groups or ())

    # ---- model control from model code ----------------------------------------------------------------

    async def _model_control(self, call_id: int, action: str, name: str, argument: Any, files: Any) -> None:
        """pb_utils.load_model / unload_model / is_model_ready, answered as (True, error, value).

        Loading answers once the model is loaded; unloading once it has begun, as Triton's does (a model may
        unload itself from `execute`, which the unload would otherwise wait for)."""
        server = self._runtime
        value = None
        try:
            if action == "ready":
                value = server.model_ready(name, argument)
            elif not server.explicit_model_control:
                raise unavailable("explicit model load / unload is not allowed if polling is enabled")
            elif action == "load":
                await server.load_model(name, argument or None, files or None)
            else:
                task = asyncio.get_running_loop().create_task(server.unload_model(name, bool(argument)))
                self._unloading.add(task)
                task.add_done_callback(self._unloaded)
        except ServerError as exc:
            self._answer(call_id, True, (exc.code.name, exc.message))
            return
        self._connection.notify(OP_BLS_RESPONSE, call_id, (True, None, value))

    def _unloaded(self, task: asyncio.Task[None]) -> None:
        self._unloading.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("model '%s': an unload it asked for failed: %s", self._model_name, task.exception())

    # ---- custom metrics --------------------------------------------------------------------------------

    def _metric(self, call_id: int, body: tuple[Any, ...]) -> None:
        """A pb_utils.MetricFamily or Metric operation on the server's registry; the worker owns what it creates
        until it deletes it or goes away."""
        action, *arguments = body
        metrics = self._runtime.custom_metrics
        if action == "delete":
            metrics.delete(*arguments)
            return
        operations = {
            "family": lambda *args: metrics.new_family(self, *args),
            "metric": lambda *args: metrics.new_metric(self, *args),
            "increment": metrics.increment,
            "set": metrics.set,
            "observe": metrics.observe,
            "value": metrics.value,
        }
        try:
            value = operations[action](*arguments)
        except ServerError as exc:
            self._answer(call_id, True, (exc.code.name, exc.message))
            return
        self._connection.notify(OP_BLS_RESPONSE, call_id, (True, None, value))

    # ---- the worker is gone -------------------------------------------------------------------------

    def lost(self, error: ServerError) -> None:
        """Fail every open stream and stop every BLS call of a worker that died (or that the server ended)."""
        for token in list(self._requests):
            _, stream = self._requests[token]
            self.drop(token)
            stream.fail(error)
        for task in self._calls.values():
            task.cancel()
        if self._runtime is not None:
            self._runtime.custom_metrics.release(self)
        self._watched.clear()
        late, self._late = self._late, {}
        self._early.clear()
        for settle in late.values():
            self._connection.open_streams -= 1
            settle(error)
