"""ModelInfer and ModelStreamInfer: the inference RPCs of `InferenceService`, which mixes them in.

A unary call is one core call; a stream's requests run concurrently, ordinary models' answers released in request
order and a decoupled model's responses as they come, with Triton's trace stamps when a request is traced.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from tritonclient.grpc import service_pb2

from transerve.core.errors import ServerError, unsupported
from transerve.core.streams import ResponseStream, StreamItem
from transerve.core.tracing import Trace
from transerve.core.types import InferRequest, InferResponse
from transerve.frontends.access import HeaderForwarding
from transerve.frontends.grpc.codec import (
    decode_infer_request,
    encode_infer_response,
    encode_infer_response_bytes,
)
from transerve.frontends.grpc.rpc import Metadata
from transerve.server import Server

log = logging.getLogger("transerve.grpc")

#: Requests of one stream that may be in flight before the server stops reading from it, so that a client
#: sending faster than the model answers is slowed by HTTP/2 flow control instead of filling memory.
STREAM_WINDOW = 256


class InferenceRpcs:
    """The inference RPCs; `InferenceService` mixes them in and sets what they use."""

    _server: Server
    _loop: asyncio.AbstractEventLoop
    _forwarding: HeaderForwarding | None

    async def ModelInfer(
        self, request: service_pb2.ModelInferRequest, metadata: Metadata = ()
    ) -> service_pb2.ModelInferResponse:
        return await self._infer_unary(request, metadata, encode_infer_response)

    async def _model_infer_serialized(self, request: service_pb2.ModelInferRequest, metadata: Metadata = ()) -> bytes:
        """ModelInfer's answer already serialized, large outputs without protobuf's serializer."""
        return await self._infer_unary(request, metadata, encode_infer_response_bytes)

    async def _infer_unary(self, request: service_pb2.ModelInferRequest, metadata: Metadata,
                           encode: Callable[[InferResponse], Any]) -> Any:
        if self._is_decoupled(request):  # Triton's gRPC wording; the core's names the HTTP end point
            raise unsupported("ModelInfer RPC doesn't support models with decoupled transaction policy")
        decoded = self._decode(request, metadata)
        tracing = self._server.tracing
        if tracing.active and (trace := tracing.start(decoded, dict(metadata))) is not None:
            return await self._infer_traced(trace, decoded, encode)
        return encode(await self._server.infer(decoded))

    async def _infer_traced(self, trace: Trace, request: InferRequest, encode: Callable[[InferResponse], Any]) -> Any:
        """A traced ModelInfer with Triton's gRPC timestamps. The service sees a call once its message is read,
        so GRPC_WAITREAD_START and _END are both that moment; GRPC_SEND_END is when the answer is encoded for the
        transport."""
        trace.capture("GRPC_WAITREAD_START", trace.started_ns)
        trace.capture("GRPC_WAITREAD_END", trace.started_ns)
        try:
            response = await self._server.infer(request)
            trace.capture("INFER_RESPONSE_COMPLETE")
            trace.capture("GRPC_SEND_START")
            answer = encode(response)
            trace.capture("GRPC_SEND_END")
        finally:
            trace.finish()
        return answer

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[service_pb2.ModelInferRequest], metadata: Metadata = ()
    ) -> AsyncIterator[service_pb2.ModelStreamInferResponse]:
        """Requests of a stream run concurrently. Ordinary models' answers come in request order; a decoupled
        model's responses go out as they are produced, each marked with `triton_final_response`. An error is
        an answer, not the end of the stream; closing the stream cancels what is still running.

        With the `triton_grpc_error: true` header (Triton's), an error a model or its scheduler answers ends the
        stream with that error's gRPC status instead; a request refused before it runs is still answered on it."""
        grpc_errors = ("triton_grpc_error", "true") in metadata
        outbox: asyncio.Queue[service_pb2.ModelStreamInferResponse | ServerError | None] = asyncio.Queue()
        window = asyncio.Semaphore(STREAM_WINDOW)
        tasks: set[asyncio.Task[None]] = set()
        reader = self._loop.create_task(
            self._read_stream(request_iterator, metadata, outbox, window, tasks, grpc_errors)
        )
        try:
            while (message := await outbox.get()) is not None:
                if isinstance(message, ServerError):
                    raise message
                yield message
            reader.result()  # a failure to read the stream ends it with that failure
        finally:
            reader.cancel()
            for task in tasks:
                task.cancel()

    async def _read_stream(
        self,
        requests: AsyncIterator[service_pb2.ModelInferRequest],
        metadata: Metadata,
        outbox: asyncio.Queue[service_pb2.ModelStreamInferResponse | ServerError | None],
        window: asyncio.Semaphore,
        tasks: set[asyncio.Task[None]],
        grpc_errors: bool,
    ) -> None:
        in_order = _InOrder(outbox)
        tracing = self._server.tracing
        waiting = time.monotonic_ns()  # Triton's GRPC_WAITREAD_START of the stream's first request
        try:
            async for request in requests:
                read = None
                if tracing.active:  # when this request's wait began (the previous one was read) and ended
                    read = (waiting, waiting := time.monotonic_ns())
                await window.acquire()
                if self._is_decoupled(request):
                    answer = self._stream_decoupled(request, metadata, outbox, window, grpc_errors, read)
                elif grpc_errors:
                    answer = self._stream_answer_or_end(
                        request, metadata, outbox, window, in_order, in_order.ticket(), read
                    )
                else:
                    answer = self._stream_answer(request, metadata, window, in_order, in_order.ticket(), read)
                task = self._loop.create_task(answer)
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.wait(list(tasks))
        finally:
            outbox.put_nowait(None)

    def _decode(self, request: service_pb2.ModelInferRequest, metadata: Metadata) -> InferRequest:
        decoded = decode_infer_request(request, self._server.shared_memory)
        if self._forwarding is not None and metadata:
            decoded.parameters.update(self._forwarding.parameters(metadata))
        return decoded

    def _is_decoupled(self, request: service_pb2.ModelInferRequest) -> bool:
        try:
            model = self._server.get_version(request.model_name, request.model_version)
        except ServerError:
            return False  # the ordinary path reports the error, in order
        return model.config.model_transaction_policy.decoupled

    def _stream_trace(self, request: InferRequest, metadata: Metadata, read: tuple[int, int]) -> Trace | None:
        """Sample a stream's request (its metadata may carry an OpenTelemetry context); a traced one begins with
        Triton's GRPC_WAITREAD stamps."""
        trace = self._server.tracing.start(request, dict(metadata))
        if trace is not None:
            trace.capture("GRPC_WAITREAD_START", read[0])
            trace.capture("GRPC_WAITREAD_END", read[1])
        return trace

    async def _stream_answer(
        self, request: service_pb2.ModelInferRequest, metadata: Metadata, window: asyncio.Semaphore,
        in_order: _InOrder, ticket: int, read: tuple[int, int] | None,
    ) -> None:
        trace = None
        try:
            decoded = self._decode(request, metadata)
            if read is not None:
                trace = self._stream_trace(decoded, metadata, read)
            message = _stream_response(await self._server.infer(decoded))
        except ServerError as exc:
            message = _stream_error(request, exc.message)
        except Exception:
            log.exception("unhandled error in ModelStreamInfer")
            message = _stream_error(request, "internal error in ModelStreamInfer")
        except BaseException:  # cancelled: the stream is gone
            if trace is not None:
                trace.finish()
            raise
        finally:
            window.release()
        if trace is None:
            in_order.deliver(ticket, message)
            return
        if trace.root.begun:  # the model answered, an error included: Triton's response stamps
            trace.capture("INFER_RESPONSE_COMPLETE")
            _TracedOutbox(in_order, trace).deliver(ticket, message)
        else:
            in_order.deliver(ticket, message)
        trace.finish()

    async def _stream_answer_or_end(
        self,
        request: service_pb2.ModelInferRequest,
        metadata: Metadata,
        outbox: asyncio.Queue[service_pb2.ModelStreamInferResponse | ServerError | None],
        window: asyncio.Semaphore,
        in_order: _InOrder,
        ticket: int,
        read: tuple[int, int] | None,
    ) -> None:
        """`_stream_answer` under triton_grpc_error: a refusal is answered in order, a failure ends the stream."""
        trace = None
        try:
            decoded = self._decode(request, metadata)
            if read is not None:
                trace = self._stream_trace(decoded, metadata, read)
            stream = self._server.infer_stream(decoded)
        except ServerError as exc:
            window.release()
            in_order.deliver(ticket, _stream_error(request, exc.message))
            if trace is not None:
                trace.finish()
            return
        try:
            try:
                item, _ = await (stream if trace is None else _TracedResponses(stream, trace)).receive()
            except StopAsyncIteration:
                return
            finally:
                window.release()
                if not stream.closed:
                    stream.cancel()  # the client closed the stream: drop the request
            if isinstance(item, ServerError):
                outbox.put_nowait(item)
            else:
                (in_order if trace is None else _TracedOutbox(in_order, trace)).deliver(ticket, _stream_response(item))
        finally:
            if trace is not None:
                trace.finish()

    async def _stream_decoupled(
        self,
        request: service_pb2.ModelInferRequest,
        metadata: Metadata,
        outbox: asyncio.Queue[service_pb2.ModelStreamInferResponse | ServerError | None],
        window: asyncio.Semaphore,
        grpc_errors: bool,
        read: tuple[int, int] | None,
    ) -> None:
        """Every response of a decoupled model as it comes; the final flag alone is sent only on request."""
        stream = trace = None
        try:
            infer_request = self._decode(request, metadata)
            if read is not None:
                trace = self._stream_trace(infer_request, metadata, read)
            stream = self._server.infer_stream(infer_request)
            responses, send = (stream, outbox.put_nowait) if trace is None else (
                _TracedResponses(stream, trace), _TracedOutbox(outbox, trace).put_nowait)
            empty_final = request.parameters["triton_enable_empty_final_response"].bool_param \
                if "triton_enable_empty_final_response" in request.parameters else False
            while True:
                try:
                    item, final = await responses.receive()
                except StopAsyncIteration:
                    return
                if item is None:
                    if empty_final:
                        response = service_pb2.ModelInferResponse(
                            model_name=infer_request.model_name, model_version=request.model_version, id=request.id)
                        response.parameters["triton_final_response"].bool_param = True
                        send(service_pb2.ModelStreamInferResponse(infer_response=response))
                elif isinstance(item, ServerError):
                    if grpc_errors:
                        outbox.put_nowait(item)
                    else:
                        send(_stream_error(request, item.message))
                else:
                    item.id = item.id or request.id
                    response = encode_infer_response(item)
                    response.parameters["triton_final_response"].bool_param = final
                    send(service_pb2.ModelStreamInferResponse(infer_response=response))
        except ServerError as exc:
            outbox.put_nowait(_stream_error(request, exc.message))
        except Exception:
            log.exception("unhandled error in ModelStreamInfer")
            outbox.put_nowait(_stream_error(request, "internal error in ModelStreamInfer"))
        finally:
            if stream is not None and not stream.closed:
                stream.cancel()  # the client closed the stream: stop the model
            window.release()
            if trace is not None:
                trace.finish()


class _InOrder:
    """Releases ordinary models' answers in the order their requests came, whatever order they finish in."""

    def __init__(self, outbox: asyncio.Queue[service_pb2.ModelStreamInferResponse | None]) -> None:
        self._outbox = outbox
        self._issued = 0
        self._next = 0
        self._ready: dict[int, service_pb2.ModelStreamInferResponse] = {}

    def ticket(self) -> int:
        ticket, self._issued = self._issued, self._issued + 1
        return ticket

    def deliver(self, ticket: int, message: service_pb2.ModelStreamInferResponse) -> None:
        self._ready[ticket] = message
        while self._next in self._ready:
            self._outbox.put_nowait(self._ready.pop(self._next))
            self._next += 1


class _TracedResponses:
    """A traced stream request's responses: the first one taken stamps INFER_RESPONSE_COMPLETE, as Triton's stream
    handler stamps its first response callback only."""

    __slots__ = ("_stream", "_trace")

    def __init__(self, stream: ResponseStream, trace: Trace | None) -> None:
        self._stream = stream
        self._trace = trace

    async def receive(self) -> tuple[StreamItem, bool]:
        taken = await self._stream.receive()
        if self._trace is not None:
            self._trace.capture("INFER_RESPONSE_COMPLETE")
            self._trace = None
        return taken


class _TracedOutbox:
    """Where a traced stream request's messages go, each between GRPC_SEND_START and GRPC_SEND_END: as for ModelInfer,
    the end is when the message is handed on to be written."""

    __slots__ = ("_outbox", "_trace")

    def __init__(self, outbox: Any, trace: Trace) -> None:
        self._outbox = outbox
        self._trace = trace

    def put_nowait(self, message: service_pb2.ModelStreamInferResponse) -> None:
        self._trace.capture("GRPC_SEND_START")
        self._outbox.put_nowait(message)
        self._trace.capture("GRPC_SEND_END")

    def deliver(self, ticket: int, message: service_pb2.ModelStreamInferResponse) -> None:
        self._trace.capture("GRPC_SEND_START")
        self._outbox.deliver(ticket, message)
        self._trace.capture("GRPC_SEND_END")


def _stream_response(response: InferResponse) -> service_pb2.ModelStreamInferResponse:
    """An ordinary model's answer on a stream, marked final as Triton marks it (so that clients of decoupled
    models can tell the last answer to a request)."""
    message = encode_infer_response(response)
    message.parameters["triton_final_response"].bool_param = True
    return service_pb2.ModelStreamInferResponse(infer_response=message)


def _stream_error(request: service_pb2.ModelInferRequest, message: str) -> service_pb2.ModelStreamInferResponse:
    """An error answer on a stream carries an infer_response naming the request by id, as Triton's does."""
    return service_pb2.ModelStreamInferResponse(
        error_message=message, infer_response=service_pb2.ModelInferResponse(id=request.id)
    )
