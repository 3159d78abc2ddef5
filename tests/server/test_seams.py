"""The typed seams have the faces they promise: the server offers everything a backend may call
(`backends.runtime.Runtime`), and every frontend the CLI starts is a `frontends.frontend.Frontend`."""

from __future__ import annotations

import inspect

import pytest

from transerve.backends.runtime import Runtime, Submitted
from transerve.frontends.frontend import Frontend
from transerve.frontends.grpc.grpcio import GrpcFrontend
from transerve.frontends.grpc.http2.server import NativeGrpcFrontend
from transerve.frontends.http.app import HttpFrontend
from transerve.frontends.metrics import MetricsFrontend
from transerve.server import Server, ServerOptions
from transerve.server.requests import Call


def members(protocol: type) -> set[str]:
    return {name for name in vars(protocol) if not name.startswith("_")}


def test_the_server_offers_what_backends_may_call(tmp_path):
    server = Server(ServerOptions([tmp_path]))
    missing = {name for name in members(Runtime) if not hasattr(server, name)}
    assert not missing
    for name in members(Runtime):
        wanted = getattr(Runtime, name)
        if inspect.isfunction(wanted):
            offered = getattr(Server, name)
            assert inspect.iscoroutinefunction(offered) == inspect.iscoroutinefunction(wanted), name
            assert list(inspect.signature(offered).parameters) == list(inspect.signature(wanted).parameters), name


def test_a_call_is_what_submit_promises():
    assert members(Submitted) <= {name for name in dir(Call)} | set(Call.__slots__)


@pytest.mark.parametrize("frontend", [HttpFrontend, GrpcFrontend, NativeGrpcFrontend, MetricsFrontend])
def test_every_frontend_is_a_frontend(frontend):
    for name in members(Frontend):
        wanted, offered = getattr(Frontend, name), getattr(frontend, name)
        assert inspect.iscoroutinefunction(offered) == inspect.iscoroutinefunction(wanted), name
        required = [p for p in inspect.signature(offered).parameters.values() if p.default is p.empty]
        assert [p.name for p in required] == list(inspect.signature(wanted).parameters), name
