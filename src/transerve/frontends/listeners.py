"""The frontends `transerve serve` runs, built from their options: which services listen where, with what access
rules, TLS and limits. The CLI turns flags into `FrontendOptions`; past `build_listeners` it sees each frontend
only as a `Frontend` (start, stop_accepting, close)."""

from __future__ import annotations

from dataclasses import dataclass

from transerve.frontends.access import HeaderForwarding, Restrictions
from transerve.frontends.frontend import Frontend
from transerve.frontends.grpc.limits import Http2Limits
from transerve.frontends.http.protocol import HttpLimits
from transerve.frontends.tls import TlsOptions
from transerve.server import Server


@dataclass(frozen=True)
class AccessOptions:
    """The frontends' restrictions, header forwarding and TLS, checked before anything starts."""

    http_restrictions: Restrictions
    grpc_restrictions: Restrictions
    http_forwarding: HeaderForwarding | None
    grpc_forwarding: HeaderForwarding | None
    http_tls: TlsOptions | None = None
    grpc_tls: TlsOptions | None = None


@dataclass(frozen=True)
class Address:
    host: str
    port: int


@dataclass(frozen=True)
class FrontendOptions:
    """What the frontends are built from; a service whose address is None is not served."""

    access: AccessOptions
    grpc: Address | None
    grpc_transport: str  # "native" (http2/) or "grpcio" (grpc.aio)
    grpc_limits: Http2Limits
    http: Address | None
    http_max_input_size: int
    http_limits: HttpLimits
    metrics: Address | None
    cpu_metrics: bool
    gpu_metrics: bool
    metrics_interval_ms: float
    #: `--trust-request-chat-template`: the OpenAI API renders a chat request's own `chat_template`.
    trust_request_chat_template: bool = False


@dataclass(frozen=True)
class Listener:
    """One service to start: its name in the log, its frontend and where it listens."""

    name: str
    frontend: Frontend
    address: Address


def build_listeners(server: Server, options: FrontendOptions) -> list[Listener]:
    """The services in the order they start: gRPC first, as in Triton, so that a client which saw HTTP ready can
    rely on gRPC listening too. The frontends are imported here, so that the CLI's other commands load none."""
    from transerve.frontends.grpc.grpcio import GrpcFrontend
    from transerve.frontends.grpc.http2.server import NativeGrpcFrontend
    from transerve.frontends.http.app import HttpFrontend
    from transerve.frontends.metrics import MetricsFrontend

    access = options.access
    listeners: list[Listener] = []
    if options.grpc is not None:
        restricted, forwarding, tls = access.grpc_restrictions, access.grpc_forwarding, access.grpc_tls
        grpc: Frontend = (NativeGrpcFrontend(server, options.grpc_limits, restricted, forwarding, tls=tls)
                          if options.grpc_transport == "native"
                          else GrpcFrontend(server, restricted, forwarding, tls, options.grpc_limits))
        listeners.append(Listener("GRPC over TLS" if tls else "GRPC", grpc, options.grpc))
    if options.http is not None:
        http = HttpFrontend(server, options.http_max_input_size, access.http_restrictions, access.http_forwarding,
                            access.http_tls, options.http_limits, options.trust_request_chat_template)
        listeners.append(Listener("HTTPS" if access.http_tls else "HTTP", http, options.http))
    if options.metrics is not None:
        metrics = MetricsFrontend(server, options.cpu_metrics, options.gpu_metrics, options.metrics_interval_ms)
        listeners.append(Listener("Metrics", metrics, options.metrics))
    return listeners
