"""What the service and the two transports share about a method: its route in tritonclient's service descriptor,
its calling convention (`Rpc`), and Triton's mapping of error codes to gRPC statuses."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import NamedTuple

import grpc
from google.protobuf.message import Message
from tritonclient.grpc import service_pb2

from transerve.core.errors import ErrorCode

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
