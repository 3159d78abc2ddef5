"""`inference.GRPCInferenceService`, each RPC one core call.

`InferenceService` holds the RPCs free of any transport: a unary RPC takes its request message and returns its
response or raises ServerError, ModelStreamInfer maps requests to answers. Both transports call those same
methods: grpc.aio (`grpcio.py`, through Triton's generated `GRPCInferenceServiceServicer`, so method names, messages
and routing come from tritonclient's `service_pb2_grpc` rather than a copy of the .proto) and the native HTTP/2 one
in `http2/`, which routes by the same service descriptor (`rpc.py`). The inference RPCs are in `inference.py`,
grpc.health.v1 in `health.py`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import Message
from tritonclient.grpc import model_config_pb2, service_pb2

from transerve.core.errors import ErrorCode, ServerError, invalid_arg, not_found, unavailable, unsupported
from transerve.core.tracing.extension import changes_from_grpc
from transerve.frontends.access import GRPC_GROUPS, HeaderForwarding, Restrictions, metadata_lookup
from transerve.frontends.grpc.codec import parse_version
from transerve.frontends.grpc.inference import InferenceRpcs
from transerve.frontends.grpc.rpc import SERVICE, Metadata, Rpc
from transerve.server import ControlMode, ModelVersion, Server
from transerve.server.shared_memory import CUDA_REGISTER_REFUSAL, UnopenedRegion

_NOT_EXPLICIT = "explicit model load / unload is not allowed if polling is enabled"


class InferenceService(InferenceRpcs):
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


def _no_repository_name(name: str) -> None:
    if name:
        raise unsupported("'repository_name' specification is not supported")
