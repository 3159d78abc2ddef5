"""The request path: one `Call` per accepted request owns its accounting, its cancellation and the shaping of its
response.

A call is counted in flight from the moment it is made until it settles, exactly once, whichever way it ends
(answered, failed, cancelled by its caller): `stop()` waits for that count to reach zero, so a count that leaked
would hold shutdown until the exit timeout. A call is a small object with slots and no task of its own; the
server's coroutines (`infer`, a stream's runner) and the callback-driven callers (ensemble steps, through
`Server.submit`) settle it the same way.
"""

from __future__ import annotations

import asyncio
import time

from transerve.config.model_config import backend_name
from transerve.core.classification import PARAMETER as CLASSIFICATION
from transerve.core.classification import class_count, classify_response
from transerve.core.errors import ErrorCode, ServerError
from transerve.core.streams import ResponseStream
from transerve.core.types import InferRequest, InferResponse
from transerve.server.registry import ModelVersion
from transerve.server.shared_memory import REGION, SharedMemoryRegistry

#: Triton's answer (UNSUPPORTED, HTTP 501) to a one-response inference on a decoupled model.
DECOUPLED_INFER_MESSAGE = "HTTP end point doesn't support models with decoupled transaction policy"


def shaped_outputs(request: InferRequest) -> bool:
    """Whether an output of `request` asks for classification or for a shared memory region."""
    return any(
        output.parameters and (output.parameters.get(CLASSIFICATION) or REGION in output.parameters)
        for output in request.outputs or ()
    )


def response_bytes(response: InferResponse) -> int:
    """The bytes a response's outputs hold (a BYTES element counts its length and Triton's 4-byte prefix)."""
    total = 0
    for tensor in response.outputs:
        data = tensor.data
        if data.dtype == object:
            total += 4 * data.size + sum(len(element) for element in data.flat if isinstance(element, (bytes, str)))
        else:
            total += data.nbytes
    return total


class RequestPath:
    """What the calls of one server share: the in-flight count, the shared memory regions outputs go to and the
    bound on a response's size (`--max-response-bytes`: a larger one is refused before any frontend encodes or
    copies it, its memory let go; a python model's large outputs are still views into its worker's memory then)."""

    __slots__ = ("inflight", "shared_memory", "max_response_bytes")

    def __init__(self, shared_memory: SharedMemoryRegistry, max_response_bytes: int = 1 << 30) -> None:
        self.inflight = 0
        self.shared_memory = shared_memory
        self.max_response_bytes = max_response_bytes


class Call:
    """One request to one model version, from acceptance to answer.

    Making it counts the request in flight (and starts its trace); exactly one of `answer`, `fail`,
    `end_stream` or `cancel` settles it, and a second settling is ignored.
    """

    __slots__ = ("_path", "model", "request", "future", "_open", "_pinned")

    def __init__(self, path: RequestPath, model: ModelVersion, request: InferRequest) -> None:
        self._path = path
        self.model = model
        self.request = request
        #: The scheduler's future, for callers that submit and finish in a callback.
        self.future: asyncio.Future[InferResponse] | None = None
        request.arrival_ns = time.monotonic_ns()
        if request.trace is not None:
            # An ensemble computes nothing itself, so it has no COMPUTE_* stamps, as in Triton.
            request.trace.started(model.name, model.version, request.id, request.inputs,
                                  computes=backend_name(model.config) != "ensemble")
        path.inflight += 1
        self._open = True
        #: The shared memory regions its outputs go to, in use until it settles (see `shared_memory`).
        self._pinned = (path.shared_memory.pin_outputs(request)
                        if request.outputs is not None and path.shared_memory.registered else None)

    def _settle(self) -> bool:
        if not self._open:
            return False
        self._open = False
        self._path.inflight -= 1
        if self._pinned is not None:
            self._path.shared_memory.unpin(self._pinned)
        return True

    def answer(self, response: InferResponse) -> InferResponse:
        """Count a success and shape the response to what the request asked for; a response past the size bound
        fails the request (INVALID_ARG) instead."""
        if not self._open:
            return response
        try:
            self.bounded(response)
        except ServerError as error:
            self.fail(error)
            raise
        self._settle()
        model, request = self.model, self.request
        model.stats.success.add(time.monotonic_ns() - request.arrival_ns)
        if request.trace is not None:
            request.trace.ended(response)
        response.id = request.id
        response.model_name = model.name
        response.model_version = model.version
        if request.outputs is not None:  # as Triton answers: in the order the model produced them, each once
            wanted = {output.name for output in request.outputs}
            kept = []
            for tensor in response.outputs:
                if tensor.name in wanted:
                    wanted.discard(tensor.name)
                    kept.append(tensor)
            response.outputs = kept
            if shaped_outputs(request):
                self.shape(response)
        return response

    def bounded(self, response: InferResponse) -> InferResponse:
        """The response, unless its outputs pass `--max-response-bytes`: then INVALID_ARG is raised, the outputs
        dropped at once (a decoupled model's stream gets it as an error response and goes on)."""
        size = response_bytes(response)
        if size > self._path.max_response_bytes:
            response.outputs = []  # let the memory go now
            raise ServerError(ErrorCode.INVALID_ARG, (
                f"the response of model '{self.model.name}' holds {size} bytes of outputs, more than the "
                f"{self._path.max_response_bytes} allowed (--max-response-bytes)"))
        return response

    def shape_bounded(self, response: InferResponse) -> InferResponse:
        return self.shape(self.bounded(response))

    def fail(self, error: BaseException) -> None:
        """The request ended without a response: a ServerError counts as a failure; a cancellation does not."""
        if not self._settle():
            return
        if isinstance(error, ServerError):
            self.model.stats.record_failure(error.code, time.monotonic_ns() - self.request.arrival_ns)
        if self.request.trace is not None:
            self.request.trace.ended(None)

    def end_stream(self) -> None:
        """A decoupled request's `execute` returned: a success (its responses went through its stream)."""
        if not self._settle():
            return
        if self.request.trace is not None:
            self.request.trace.ended(None)
        self.model.stats.success.add(time.monotonic_ns() - self.request.arrival_ns)

    def result(self) -> InferResponse:
        """The response of the submitted request once its future is done, or its error raised."""
        try:
            response = self.future.result()
        except BaseException as exc:
            self.fail(exc)
            raise
        return self.answer(response)

    def cancel(self) -> bool:
        """Give the submitted request up; it is settled here unless its future was already done."""
        if not self.future.cancel():
            return False
        self.fail(asyncio.CancelledError())
        return True

    def shape(self, response: InferResponse) -> InferResponse:
        """What the request's output parameters ask of a response: classification, then shared memory."""
        counts = class_count(self.request)
        if counts:
            classify_response(response, counts, self.model.labels, self.model.signature.max_batch_size > 0)
        self._path.shared_memory.write_outputs(self.request, response)
        return response


async def run_single(path: RequestPath, model: ModelVersion, request: InferRequest, stream: ResponseStream) -> None:
    """A one-response model's request, answered through a stream. The call is made here, in the task, so a task
    cancelled before it ever ran has counted nothing."""
    call = Call(path, model, request)
    try:
        response = await model.scheduler.submit(request)
    except BaseException as exc:
        call.fail(exc)
        if isinstance(exc, ServerError):
            stream.fail(exc)
            return
        raise
    try:
        stream.send(call.answer(response), final=True)
    except ServerError as exc:
        stream.fail(exc)


async def run_decoupled(path: RequestPath, model: ModelVersion, request: InferRequest, stream: ResponseStream) -> None:
    """A decoupled model's request: the scheduler's future settles when `execute` returns, the responses come
    through the stream, each held to the size bound (and shaped by the call, when the request's outputs ask)."""
    call = Call(path, model, request)
    stream.shape_response = call.shape_bounded if shaped_outputs(request) else call.bounded
    try:
        await model.scheduler.submit(request)
    except BaseException as exc:
        if isinstance(exc, ServerError):
            stream.fail(exc)
            call.fail(exc)
            return
        call.fail(exc)
        raise
    call.end_stream()
