"""The grpc.aio transport (`--grpc-transport=grpcio`): the service in grpc.aio's calling convention, the health
service as a generic handler, grpc-core's channel arguments for the shared limits, and the listening server."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import Message
from tritonclient.grpc import service_pb2_grpc

from transerve.core.errors import ServerError
from transerve.frontends.access import HeaderForwarding, Restrictions, grpcio_metadata
from transerve.frontends.grpc.health import HealthCheckRequest, HealthCheckResponse, health_check
from transerve.frontends.grpc.limits import (
    MAX_CONCURRENT_STREAMS,
    MAX_HEADER_LIST,
    Http2Limits,
)
from transerve.frontends.grpc.limits import (
    STREAM_WINDOW as STREAM_WINDOW_BYTES,
)
from transerve.frontends.grpc.rpc import GRPC_STATUS, Rpc
from transerve.frontends.grpc.service import InferenceService
from transerve.frontends.tls import TlsOptions
from transerve.server import Server

log = logging.getLogger("transerve.grpc")

#: Triton sends messages up to INT32_MAX bytes; so do we (what we receive is `Http2Limits.max_message`).
MAX_MESSAGE_BYTES = 2**31 - 1

#: Calls that may wait for the server to pick them up. grpc.aio takes calls from gRPC core one at a time, and
#: core's defaults (1000, hard 3000) cancel the rest of a burst that Triton's C++ server would have served; a full
#: MAX_CONCURRENT_STREAMS burst fits. Core keeps a call reset while it waits (rapid reset) in this queue, a few KB
#: each, so the queue is what bounds that flood's memory: past the soft limit core refuses calls at random, past
#: twice it all of them (RESOURCE_EXHAUSTED).
MAX_PENDING_CALLS = MAX_CONCURRENT_STREAMS


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


def health_handler(server: Server, service: InferenceService) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler("grpc.health.v1.Health", {
        "Check": grpc.unary_unary_rpc_method_handler(
            _grpcio_unary(Rpc("Check", HealthCheckRequest, health_check(server), False), service),
            request_deserializer=HealthCheckRequest.FromString,
            response_serializer=HealthCheckResponse.SerializeToString,
        ),
    })


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
