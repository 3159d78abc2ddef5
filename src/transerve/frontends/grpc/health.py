"""grpc.health.v1.Health/Check for both transports: its messages and its one answer."""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import Message

from transerve.frontends.grpc.rpc import Unary
from transerve.server import Server


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
