"""Routes `/inference.GRPCInferenceService/<Method>` and `/grpc.health.v1.Health/Check` to the shared service's
methods, runs each call as one task, and serves them on a listening socket (`NativeGrpcFrontend`)."""

from __future__ import annotations

import asyncio
import logging

from google.protobuf.message import DecodeError, Message

from transerve.core.errors import ServerError, internal
from transerve.frontends.access import HeaderForwarding, Restrictions
from transerve.frontends.grpc.health import HealthCheckRequest, health_check
from transerve.frontends.grpc.http2.connection import Http2Connection
from transerve.frontends.grpc.http2.headers import DEADLINE_EXCEEDED, INTERNAL, OK, UNAVAILABLE, UNIMPLEMENTED
from transerve.frontends.grpc.http2.stream import Stream
from transerve.frontends.grpc.limits import Http2Limits
from transerve.frontends.grpc.rpc import GRPC_STATUS, SERVICE, Rpc
from transerve.frontends.grpc.service import InferenceService
from transerve.frontends.tls import TlsOptions, listen_kwargs
from transerve.server import Server

log = logging.getLogger("transerve.grpc")

_STATUS = {code: status.value[0] for code, status in GRPC_STATUS.items()}


class Router:
    """Starts each call: a unary one once its request is complete, a streaming one as soon as it opens."""

    def __init__(self, routes: dict[bytes, Rpc], service: InferenceService) -> None:
        self._routes = routes
        self._service = service

    def call_opened(self, connection: Http2Connection, stream: Stream) -> bool:
        head = stream.head
        if head.http_status != 200:
            connection.reply_http(stream, head.http_status)
            return False
        if head.refusal is not None:
            connection.finish(stream, *head.refusal)
            return False
        if self._service.restrictions is not None:  # first, as Triton, whose every method exists
            refusal = self._service.refusal(head.path.rpartition(b"/")[2].decode("latin-1"), head.metadata)
            if refusal is not None:
                connection.finish(stream, UNAVAILABLE, refusal)
                return False
        rpc = self._routes.get(head.path)
        if rpc is None:
            connection.finish(stream, UNIMPLEMENTED, f"method {head.path.decode('latin-1')} is not implemented")
            return False
        stream.route = rpc
        if head.timeout is not None:
            stream.timer = connection.loop.call_later(head.timeout, _deadline, connection, stream)
        if rpc.streaming:
            stream.task = connection.loop.create_task(_run_streaming(connection, stream, rpc))
            return True
        return False

    def call_ended(self, connection: Http2Connection, stream: Stream) -> bool:
        rpc = stream.route
        if rpc is None or rpc.streaming:
            return False
        stream.task = connection.loop.create_task(_run_unary(connection, stream, rpc))
        return True

    def call_closed(self, connection: Http2Connection, stream: Stream) -> None:
        if stream.timer is not None:
            stream.timer.cancel()

    def call_cancelled(self, connection: Http2Connection, stream: Stream) -> None:
        if stream.task is not None:
            stream.task.cancel()


def _deadline(connection: Http2Connection, stream: Stream) -> None:
    connection.finish(stream, DEADLINE_EXCEEDED, "Deadline Exceeded", discard=True)
    if stream.task is not None:
        stream.task.cancel()


def _parse(rpc: Rpc, message: bytes | bytearray | memoryview) -> Message:
    try:
        return rpc.request_type.FromString(message)
    except DecodeError:
        raise internal(f"cannot parse the {rpc.request_type.__name__} message") from None


async def _run_unary(connection: Http2Connection, stream: Stream, rpc: Rpc) -> None:
    try:
        if len(stream.messages) != 1 or stream.inbox:
            raise internal(f"{rpc.name} takes exactly one request message")
        request = _parse(rpc, connection.take(stream))
        extra = (stream.head.metadata,) if rpc.takes_metadata else ()
        if rpc.serialized is not None:
            answer = await rpc.serialized(request, *extra)
        else:
            answer = (await rpc.handler(request, *extra)).SerializeToString()  # type: ignore[misc]
    except ServerError as exc:
        connection.finish(stream, _STATUS[exc.code], exc.message)
    except Exception:
        log.exception("unhandled error in %s", rpc.name)
        connection.finish(stream, INTERNAL, f"internal error in {rpc.name}")
    else:
        connection.respond(stream, answer)


async def _run_streaming(connection: Http2Connection, stream: Stream, rpc: Rpc) -> None:
    try:
        extra = (stream.head.metadata,) if rpc.takes_metadata else ()
        async for answer in rpc.handler(_Requests(connection, stream, rpc), *extra):  # type: ignore[union-attr]
            if not connection.send_message(stream, answer.SerializeToString()):
                await connection.drained(stream)
    except ServerError as exc:
        connection.finish(stream, _STATUS[exc.code], exc.message)
    except Exception:
        log.exception("unhandled error in %s", rpc.name)
        connection.finish(stream, INTERNAL, f"internal error in {rpc.name}")
    else:
        connection.finish(stream, OK)


class _Requests:
    """A streaming call's requests as they arrive; taking one may reopen the stream's window."""

    __slots__ = ("_connection", "_stream", "_rpc")

    def __init__(self, connection: Http2Connection, stream: Stream, rpc: Rpc) -> None:
        self._connection = connection
        self._stream = stream
        self._rpc = rpc

    def __aiter__(self) -> _Requests:
        return self

    async def __anext__(self) -> Message:
        stream = self._stream
        while not stream.messages:
            if stream.closed:
                raise StopAsyncIteration
            if stream.remote_closed:
                if stream.inbox:
                    raise internal("the stream ended inside a request message")
                raise StopAsyncIteration
            stream.waiter = self._connection.loop.create_future()
            await stream.waiter
        return _parse(self._rpc, self._connection.take(stream))


class NativeGrpcFrontend:
    """Serves the inference and health services over the native HTTP/2 transport, on the running event loop."""

    def __init__(self, server: Server, limits: Http2Limits | None = None, restrictions: Restrictions | None = None,
                 forwarding: HeaderForwarding | None = None, tls: TlsOptions | None = None) -> None:
        self.server = server
        self.limits = limits or Http2Limits()
        self._tls = tls
        self._restrictions = restrictions
        self._forwarding = forwarding
        self._router: Router | None = None
        self._listener: asyncio.base_events.Server | None = None
        self._connections: set[Http2Connection] = set()
        self._abort_timer: asyncio.TimerHandle | None = None

    async def start(self, host: str, port: int) -> None:
        """Listen on host:port; raises OSError when the address cannot be bound."""
        loop = asyncio.get_running_loop()
        service = InferenceService(self.server, loop, self._restrictions, self._forwarding)
        routes = {f"/{SERVICE.full_name}/{rpc.name}".encode(): rpc for rpc in service.rpcs()}
        routes[b"/grpc.health.v1.Health/Check"] = Rpc("Check", HealthCheckRequest, health_check(self.server), False)
        self._router = Router(routes, service)
        self._listener = await loop.create_server(self._connect, host.strip("[]"), port, reuse_address=True,
                                                  **listen_kwargs(self._tls, "h2"))

    def _connect(self) -> Http2Connection:
        assert self._router is not None
        connection = Http2Connection(self._router, self.limits, self._connections.discard)
        self._connections.add(connection)
        return connection

    def stop_accepting(self, grace: float) -> None:
        """Refuse new calls (GOAWAY); those in flight, and open streams, go on for up to `grace` seconds or until
        `close`."""
        if self._listener is None or self._abort_timer is not None:
            return
        self._listener.close()
        for connection in list(self._connections):
            connection.goaway()
        self._abort_timer = asyncio.get_running_loop().call_later(grace, self._abort_all)

    def _abort_all(self) -> None:
        for connection in list(self._connections):
            connection.abort(UNAVAILABLE, "the server is shutting down")

    async def close(self, linger: float = 1.0) -> None:
        """Let answers already computed reach their clients (up to `linger` seconds), then end every call."""
        if self._listener is None:
            return
        self.stop_accepting(linger)
        await self._wait_closed(linger)
        self._abort_all()
        await self._wait_closed(linger)
        if self._abort_timer is not None:
            self._abort_timer.cancel()

    async def _wait_closed(self, timeout: float) -> None:
        pending = [connection.closed for connection in self._connections]
        if pending:
            await asyncio.wait(pending, timeout=timeout)
