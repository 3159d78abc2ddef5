"""`inference.GRPCInferenceService` and `grpc.health.v1.Health/Check`, each RPC one core call.

`InferenceService` holds the RPCs free of any transport: a unary RPC takes its request message and returns its
response or raises ServerError, ModelStreamInfer maps requests to answers. Both transports call those same
methods: grpc.aio here (through Triton's generated `GRPCInferenceServiceServicer`, so method names, messages and
routing come from tritonclient's `service_pb2_grpc` rather than a copy of the .proto) and the native HTTP/2 one
in `http2/`, which routes by the same service descriptor.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, NamedTuple

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory
from google.protobuf.message import Message
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

from transerve.core.errors import ErrorCode, ServerError, invalid_arg, not_found, unavailable, unsupported
from transerve.core.server import ControlMode, ModelVersion, Server
from transerve.core.shared_memory import CUDA_REGISTER_REFUSAL, UnopenedRegion
from transerve.core.streams import ResponseStream, StreamItem
from transerve.core.tracing import Trace
from transerve.core.tracing.extension import changes_from_grpc
from transerve.core.types import InferRequest, InferResponse
from transerve.frontends.access import GRPC_GROUPS, HeaderForwarding, Restrictions, grpcio_metadata, metadata_lookup
from transerve.frontends.grpc.codec import (
    decode_infer_request,
    encode_infer_response,
    encode_infer_response_bytes,
    parse_version,
)
from transerve.frontends.grpc.limits import (
    MAX_CONCURRENT_STREAMS,
    MAX_HEADER_LIST,
    Http2Limits,
)
from transerve.frontends.grpc.limits import (
    STREAM_WINDOW as STREAM_WINDOW_BYTES,
)
from transerve.frontends.tls import TlsOptions

log = logging.getLogger("transerve.grpc")

#: Triton's mapping of error codes to gRPC status codes.
GRPC_STATUS = {
    ErrorCode.INVALID_ARG: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
    ErrorCode.UNSUPPORTED: grpc.StatusCode.UNIMPLEMENTED,
    ErrorCode.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    ErrorCode.CANCELLED: grpc.StatusCode.CANCELLED,
    ErrorCode.UNKNOWN: grpc.StatusCode.UNKNOWN,
}

#: Triton sends messages up to INT32_MAX bytes; so do we (what we receive is `Http2Limits.max_message`).
MAX_MESSAGE_BYTES = 2**31 - 1

#: Calls that may wait for the server to pick them up. grpc.aio takes calls from gRPC core one at a time, and
#: core's defaults (1000, hard 3000) cancel the rest of a burst that Triton's C++ server would have served; a full
#: MAX_CONCURRENT_STREAMS burst fits. Core keeps a call reset while it waits (rapid reset) in this queue, a few KB
#: each, so the queue is what bounds that flood's memory: past the soft limit core refuses calls at random, past
#: twice it all of them (RESOURCE_EXHAUSTED).
MAX_PENDING_CALLS = MAX_CONCURRENT_STREAMS

#: Requests of one stream that may be in flight before the server stops reading from it, so that a client
#: sending faster than the model answers is slowed by HTTP/2 flow control instead of filling memory.
STREAM_WINDOW = 256

_NOT_EXPLICIT = "explicit model load / unload is not allowed if polling is enabled"

#: The service as tritonclient's generated code describes it: method names, request types, streaming.
SERVICE = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]

Unary = Callable[..., Awaitable[Message]]
Streaming = Callable[..., AsyncIterator[Message]]
#: A call's custom metadata, (lowercase name, value) pairs.
Metadata = tuple[tuple[str, str], ...]


class Rpc(NamedTuple):
    """One method of the service as a transport routes it."""

    name: str
    request_type: type[Message]
    handler: Unary | Streaming
    streaming: bool
    #: The handler answering with the serialized response, for a transport that sends bytes (ModelInfer).
    serialized: Callable[..., Awaitable[bytes]] | None = None
    #: Whether the handler takes the call's metadata after its request (inference, for header forwarding).
    takes_metadata: bool = False


class InferenceService:
    """Triton's inference service over the core `Server`; unary methods raise ServerError for a failed RPC."""

    def __init__(self, server: Server, loop: asyncio.AbstractEventLoop, restrictions: Restrictions | None = None,
                 forwarding: HeaderForwarding | None = None) -> None:
        self._server = server
        #: `--grpc-restricted-protocol`: RPCs of a restricted group need its header (UNAVAILABLE otherwise).
        self.restrictions = restrictions if restrictions is not None and restrictions.required else None
        #: `--grpc-header-forward-pattern`: matching metadata become parameters of inference requests.
        self._forwarding = forwarding
        # Kept rather than looked up per stream request: CPython's get_running_loop() costs a getpid() syscall.
        self._loop = loop
        # Metadata and config answers per (kind, name, version), with the config of the ModelVersion they describe:
        # a load makes new versions with new configs, and holding a config, unlike a version, keeps no backend alive.
        self._cached: dict[tuple[str, str, str], tuple[model_config_pb2.ModelConfig, Message]] = {}

    def refusal(self, method: str, metadata: Metadata) -> str | None:
        """Triton's message when a call lacks the header its method's group requires; None when it may run."""
        if self.restrictions is None:
            return None
        return self.restrictions.refusal(GRPC_GROUPS.get(method), metadata_lookup(metadata))

    # ---- health and metadata ---------------------------------------------------------------------

    async def ServerLive(self, request: service_pb2.ServerLiveRequest) -> service_pb2.ServerLiveResponse:
        return service_pb2.ServerLiveResponse(live=self._server.live)

    async def ServerReady(self, request: service_pb2.ServerReadyRequest) -> service_pb2.ServerReadyResponse:
        return service_pb2.ServerReadyResponse(ready=self._server.ready)

    async def ModelReady(self, request: service_pb2.ModelReadyRequest) -> service_pb2.ModelReadyResponse:
        return service_pb2.ModelReadyResponse(
            ready=self._server.model_ready(request.name, parse_version(request.version))
        )

    async def ServerMetadata(self, request: service_pb2.ServerMetadataRequest) -> service_pb2.ServerMetadataResponse:
        return service_pb2.ServerMetadataResponse(**self._server.metadata())

    async def ModelMetadata(self, request: service_pb2.ModelMetadataRequest) -> service_pb2.ModelMetadataResponse:
        return self._per_version("metadata", request.name, request.version,
                                 lambda model: self._build_metadata(model, parse_version(request.version)))

    async def ModelConfig(self, request: service_pb2.ModelConfigRequest) -> service_pb2.ModelConfigResponse:
        return self._per_version(
            "config", request.name, request.version, lambda model: service_pb2.ModelConfigResponse(config=model.config)
        )

    def _per_version(self, kind: str, name: str, version: str, build: Callable[[ModelVersion], Message]) -> Any:
        """A cached answer about one model version; a reload makes new versions, so a stale answer never shows."""
        version = parse_version(version)
        model = self._server.get_version(name, version)
        key = (kind, name, version)
        cached = self._cached.get(key)
        if cached is None or cached[0] is not model.config:
            cached = self._cached[key] = (model.config, build(model))
        return cached[1]

    def _build_metadata(self, model: ModelVersion, version: str) -> service_pb2.ModelMetadataResponse:
        metadata = self._server.model_metadata(model.name, version)
        tensor = service_pb2.ModelMetadataResponse.TensorMetadata
        return service_pb2.ModelMetadataResponse(
            name=metadata["name"],
            versions=metadata["versions"],
            platform=metadata["platform"],
            inputs=[tensor(**spec) for spec in metadata["inputs"]],
            outputs=[tensor(**spec) for spec in metadata["outputs"]],
        )

    async def ModelStatistics(
        self, request: service_pb2.ModelStatisticsRequest
    ) -> service_pb2.ModelStatisticsResponse:
        statistics = self._server.statistics(request.name, parse_version(request.version))
        # The core's dicts are Triton's JSON statistics, whose names are the proto's, so any drift fails loudly.
        return json_format.ParseDict(statistics, service_pb2.ModelStatisticsResponse())

    # ---- inference -------------------------------------------------------------------------------

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

    # ---- model repository ------------------------------------------------------------------------

    async def RepositoryIndex(
        self, request: service_pb2.RepositoryIndexRequest
    ) -> service_pb2.RepositoryIndexResponse:
        _no_repository_name(request.repository_name)
        index = service_pb2.RepositoryIndexResponse.ModelIndex
        entries = self._server.repository_index(ready_only=request.ready)
        return service_pb2.RepositoryIndexResponse(models=[index(**entry) for entry in entries])

    async def RepositoryModelLoad(
        self, request: service_pb2.RepositoryModelLoadRequest
    ) -> service_pb2.RepositoryModelLoadResponse:
        self._explicit_control()
        _no_repository_name(request.repository_name)
        config = None
        files: dict[str, bytes] = {}
        for key, parameter in request.parameters.items():
            if key == "config":
                if parameter.WhichOneof("parameter_choice") != "string_param":
                    raise invalid_arg("invalid value type for load parameter 'config', expected string_param.")
                config = parameter.string_param
            elif key.startswith("file:"):
                if parameter.WhichOneof("parameter_choice") != "bytes_param":
                    raise invalid_arg(f"invalid value type for load parameter '{key}', expected bytes_param.")
                files[key[len("file:"):]] = parameter.bytes_param
        await self._server.load_model(request.model_name, config, files)
        return service_pb2.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(
        self, request: service_pb2.RepositoryModelUnloadRequest
    ) -> service_pb2.RepositoryModelUnloadResponse:
        self._explicit_control()
        _no_repository_name(request.repository_name)
        await self._server.unload_model(request.model_name)
        return service_pb2.RepositoryModelUnloadResponse()

    # ---- shared memory ---------------------------------------------------------------------------

    async def SystemSharedMemoryStatus(
        self, request: service_pb2.SystemSharedMemoryStatusRequest
    ) -> service_pb2.SystemSharedMemoryStatusResponse:
        regions = self._server.shared_memory.status(request.name or None)
        status = service_pb2.SystemSharedMemoryStatusResponse.RegionStatus
        return service_pb2.SystemSharedMemoryStatusResponse(regions={r["name"]: status(**r) for r in regions})

    async def SystemSharedMemoryRegister(
        self, request: service_pb2.SystemSharedMemoryRegisterRequest
    ) -> service_pb2.SystemSharedMemoryRegisterResponse:
        try:
            self._server.shared_memory.register(request.name, request.key, request.offset, request.byte_size)
        except UnopenedRegion as exc:  # Triton's code, which tritonclient's tests check over gRPC
            raise ServerError(ErrorCode.INTERNAL, exc.message) from None
        return service_pb2.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(
        self, request: service_pb2.SystemSharedMemoryUnregisterRequest
    ) -> service_pb2.SystemSharedMemoryUnregisterResponse:
        self._server.shared_memory.unregister(request.name or None)
        return service_pb2.SystemSharedMemoryUnregisterResponse()

    async def CudaSharedMemoryStatus(
        self, request: service_pb2.CudaSharedMemoryStatusRequest
    ) -> service_pb2.CudaSharedMemoryStatusResponse:
        if request.name:
            raise not_found(f"Unable to find cuda shared memory region: '{request.name}'")
        return service_pb2.CudaSharedMemoryStatusResponse()

    async def CudaSharedMemoryRegister(
        self, request: service_pb2.CudaSharedMemoryRegisterRequest
    ) -> service_pb2.CudaSharedMemoryRegisterResponse:
        raise invalid_arg(CUDA_REGISTER_REFUSAL)

    async def CudaSharedMemoryUnregister(
        self, request: service_pb2.CudaSharedMemoryUnregisterRequest
    ) -> service_pb2.CudaSharedMemoryUnregisterResponse:
        return service_pb2.CudaSharedMemoryUnregisterResponse()

    # ---- logging ---------------------------------------------------------------------------------

    async def LogSettings(self, request: service_pb2.LogSettingsRequest) -> service_pb2.LogSettingsResponse:
        changes = {}
        for key, value in request.settings.items():
            kind = value.WhichOneof("parameter_choice")
            if kind is None:
                raise invalid_arg(f"log setting '{key}' has no value")
            changes[key] = getattr(value, kind)
        settings = self._server.log.update(changes) if changes else self._server.log.as_dict()
        response = service_pb2.LogSettingsResponse()
        for key, value in settings.items():
            kind = "bool_param" if isinstance(value, bool) else "uint32_param" if isinstance(value, int) else (
                "string_param")
            setattr(response.settings[key], kind, value)
        return response

    # ---- trace -----------------------------------------------------------------------------------

    async def TraceSetting(self, request: service_pb2.TraceSettingRequest) -> service_pb2.TraceSettingResponse:
        """Reads a model's trace settings ("" for the global ones); changes them when the request names some."""
        tracing = self._server.tracing
        tracing.check_model(request.model_name)
        if request.settings:
            changes = changes_from_grpc({key: list(value.value) for key, value in request.settings.items()})
            settings = tracing.update(request.model_name, changes)
        else:
            settings = tracing.settings(request.model_name)
        response = service_pb2.TraceSettingResponse()
        for key, value in settings:
            response.settings[key].value.extend(value if isinstance(value, list) else [value])
        return response

    def _explicit_control(self) -> None:
        if self._server.options.control_mode is not ControlMode.EXPLICIT:
            raise unavailable(_NOT_EXPLICIT)

    def rpcs(self) -> Iterator[Rpc]:
        """Every method of the proto this class implements; any other is left to each transport's
        UNIMPLEMENTED."""
        for method in SERVICE.methods:
            handler = getattr(self, method.name, None)
            if handler is not None:
                request_type = getattr(service_pb2, method.input_type.name)
                serialized = self._model_infer_serialized if method.name == "ModelInfer" else None
                # A stream reads its metadata for triton_grpc_error; ModelInfer only to forward headers or to read
                # OpenTelemetry's trace context.
                takes_metadata = method.name == "ModelStreamInfer" or (
                    method.name == "ModelInfer" and (self._forwarding is not None or self._server.tracing.propagates)
                )
                yield Rpc(method.name, request_type, handler, method.client_streaming, serialized, takes_metadata)


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


def _no_repository_name(name: str) -> None:
    if name:
        raise unsupported("'repository_name' specification is not supported")


# ---- grpc.aio's calling convention --------------------------------------------------------------


async def _admit(rpc: Rpc, service: InferenceService, context: grpc.aio.ServicerContext) -> tuple[Any, ...]:
    """The handler's arguments after the request (the call's metadata, if it takes it), once the call's
    restrictions allow it to run; aborts it with Triton's UNAVAILABLE otherwise."""
    metadata = grpcio_metadata(context.invocation_metadata() or ())
    refusal = service.refusal(rpc.name, metadata)
    if refusal is not None:
        await context.abort(grpc.StatusCode.UNAVAILABLE, refusal)
    return (metadata,) if rpc.takes_metadata else ()


def _grpcio_unary(rpc: Rpc, service: InferenceService) -> Callable[[Message, grpc.aio.ServicerContext],
                                                                    Awaitable[Message]]:
    """A unary RPC for grpc.aio: ServerError becomes its gRPC status; anything else is a bug, reported as INTERNAL."""
    method, name = rpc.handler, rpc.name
    admit = service.restrictions is not None or rpc.takes_metadata

    @functools.wraps(method)
    async def handler(request: Message, context: grpc.aio.ServicerContext) -> Message:  # type: ignore[return]
        extra = await _admit(rpc, service, context) if admit else ()
        try:
            return await method(request, *extra)
        except ServerError as exc:
            await context.abort(GRPC_STATUS[exc.code], exc.message)
        except Exception:
            log.exception("unhandled error in %s", name)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {name}")

    return handler


def _grpcio_streaming(rpc: Rpc, service: InferenceService) -> Callable[
        [AsyncIterator[Message], grpc.aio.ServicerContext], AsyncIterator[Message]]:
    admit = service.restrictions is not None or rpc.takes_metadata

    async def handler(requests: AsyncIterator[Message], context: grpc.aio.ServicerContext) -> AsyncIterator[Message]:
        extra = await _admit(rpc, service, context) if admit else ()
        try:
            async for answer in rpc.handler(requests, *extra):
                yield answer
        except ServerError as exc:  # triton_grpc_error: the stream ends with the error's status
            await context.abort(GRPC_STATUS[exc.code], exc.message)

    return handler


class InferenceServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    """The service in grpc.aio's calling convention (request, context); methods it lacks stay UNIMPLEMENTED."""

    def __init__(self, service: InferenceService) -> None:
        for rpc in service.rpcs():
            adapted = _grpcio_streaming(rpc, service) if rpc.streaming else _grpcio_unary(rpc, service)
            setattr(self, rpc.name, adapted)


# ---- grpc.health.v1 ------------------------------------------------------------------------------


def _health_messages() -> tuple[type[Message], type[Message]]:
    """grpc.health.v1's two messages, declared here in a private descriptor pool.

    Two small messages do not justify a dependency (grpcio-health-checking must match grpcio's version
    and brings its own protobuf floor); a private pool cannot clash with that package if it is installed.
    """
    proto = descriptor_pb2.FileDescriptorProto(name="transerve/grpc_health_v1.proto", package="grpc.health.v1",
                                               syntax="proto3")
    request = proto.message_type.add(name="HealthCheckRequest")
    request.field.add(name="service", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
                      label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)
    response = proto.message_type.add(name="HealthCheckResponse")
    status = response.enum_type.add(name="ServingStatus")
    for number, name in enumerate(["UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN"]):
        status.value.add(name=name, number=number)
    response.field.add(name="status", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_ENUM,
                       type_name=".grpc.health.v1.HealthCheckResponse.ServingStatus",
                       label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return (
        message_factory.GetMessageClass(pool.FindMessageTypeByName("grpc.health.v1.HealthCheckRequest")),
        message_factory.GetMessageClass(pool.FindMessageTypeByName("grpc.health.v1.HealthCheckResponse")),
    )


HealthCheckRequest, HealthCheckResponse = _health_messages()
SERVING = 1
NOT_SERVING = 2


def health_check(server: Server) -> Unary:
    """Check answers SERVING while the server is ready, whatever service is named, as Triton does."""

    async def check(request: Message) -> Message:
        return HealthCheckResponse(status=SERVING if server.ready else NOT_SERVING)

    return check


def health_handler(server: Server, service: InferenceService) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler("grpc.health.v1.Health", {
        "Check": grpc.unary_unary_rpc_method_handler(
            _grpcio_unary(Rpc("Check", HealthCheckRequest, health_check(server), False), service),
            request_deserializer=HealthCheckRequest.FromString,
            response_serializer=HealthCheckResponse.SerializeToString,
        ),
    })


# ---- the listening server ------------------------------------------------------------------------


def grpc_core_limits(limits: Http2Limits) -> list[tuple[str, int]]:
    """The native transport's limits as grpc-core's channel arguments. grpc-core has its own defences against
    floods (induced-frame limits, its ping policy, overload protection past MAX_CONCURRENT_STREAMS); these set
    the numbers that the two transports share. grpc-core's SETTINGS-acknowledgment timeout (a minute by default)
    gets the handshake timeout, as on the native transport: until the ACK, core accepts MAX_CONCURRENT_STREAMS
    streams, which a client that never acknowledges could otherwise hold, or reset, for that minute."""
    return [
        ("grpc.max_receive_message_length", min(limits.max_message, MAX_MESSAGE_BYTES)),
        ("grpc.max_concurrent_streams", MAX_CONCURRENT_STREAMS),
        ("grpc.http2.max_ping_strikes", limits.max_ping_strikes),
        ("grpc.http2.min_ping_interval_without_data_ms", round(limits.min_ping_interval * 1000)),
        ("grpc.keepalive_permit_without_calls", int(limits.pings_without_calls)),
        ("grpc.max_connection_idle_ms", round(limits.idle_timeout * 1000)),
        ("grpc.server_handshake_timeout_ms", round(limits.handshake_timeout * 1000)),
        ("grpc.http2.lookahead_bytes", STREAM_WINDOW_BYTES),
        ("grpc.max_metadata_size", MAX_HEADER_LIST),
        ("grpc.http2.settings_timeout", round(limits.handshake_timeout * 1000)),
    ]


class GrpcFrontend:
    """Serves the inference and health services with grpc.aio on one address, on the running event loop."""

    def __init__(self, server: Server, restrictions: Restrictions | None = None,
                 forwarding: HeaderForwarding | None = None, tls: TlsOptions | None = None,
                 limits: Http2Limits | None = None) -> None:
        self.server = server
        self.limits = limits or Http2Limits()
        self._restrictions = restrictions
        self._forwarding = forwarding
        self._tls = tls
        self._grpc: grpc.aio.Server | None = None
        self._stopping: asyncio.Future[None] | None = None

    async def start(self, host: str, port: int) -> None:
        """Listen on host:port; raises OSError when the address cannot be bound."""
        self._grpc = grpc.aio.server(options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
            ("grpc.server.max_pending_requests_hard_limit", 2 * MAX_PENDING_CALLS),
            # gRPC sets SO_REUSEPORT by default, which would let a second server share a busy port silently.
            ("grpc.so_reuseport", 0),
            *grpc_core_limits(self.limits),
        ])
        service = InferenceService(self.server, asyncio.get_running_loop(), self._restrictions, self._forwarding)
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceServicer(service), self._grpc)
        self._grpc.add_generic_rpc_handlers((health_handler(self.server, service),))
        address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
        try:
            bound = (self._grpc.add_secure_port(address, self._tls.grpc_credentials()) if self._tls is not None
                     else self._grpc.add_insecure_port(address))
        except RuntimeError as exc:  # recent grpcio raises, older ones return 0
            raise OSError(str(exc)) from None
        if not bound:
            raise OSError(f"failed to bind to {address}")
        await self._grpc.start()

    def stop_accepting(self, grace: float) -> None:
        """Refuse new RPCs; those in flight, and open streams, go on for up to `grace` seconds or until `close`."""
        if self._grpc is not None and self._stopping is None:
            self._stopping = asyncio.ensure_future(self._grpc.stop(grace))

    async def close(self, linger: float = 1.0) -> None:
        """Let answers already computed reach their clients (up to `linger` seconds), then end every RPC."""
        if self._grpc is None:
            return
        self.stop_accepting(linger)
        assert self._stopping is not None
        await asyncio.wait([self._stopping], timeout=linger)
        await self._grpc.stop(0)
        await self._stopping
