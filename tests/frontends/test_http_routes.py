"""The /v2 route table on its own: each path reaches its handler with its captured segments, a path a row matches
with another method is a 405 and one no row matches a 404, with the corner cases Triton's router has (the section
catch-alls, a version's trace settings, an empty region name)."""

from __future__ import annotations

import pytest

from transerve.frontends.http.routes import ROUTES, TABLE


def answer(method: str, path: str) -> tuple[str, dict[str, str]] | int:
    """The handler and its arguments, or the status a path without a handler gets."""
    matched = TABLE.match(path.strip("/").split("/")[1:])
    if matched is None:
        return 404
    route, values = matched
    return (route.handler, dict(zip(route.captures, values, strict=True))) if route.allows(method) else 405


@pytest.mark.parametrize(("method", "path", "expected"), [
    ("POST", "/v2/models/m/infer", ("infer", {"model": "m"})),
    ("POST", "/v2/models/m/versions/3/infer", ("infer", {"model": "m", "version": "3"})),
    ("GET", "/v2/models/m/infer", 405),
    ("POST", "/v2/models/m/generate_stream", ("generate_stream", {"model": "m"})),
    ("GET", "/v2", ("server_metadata", {})),
    ("POST", "/v2", 405),
    ("GET", "/v2/health/ready", ("ready", {})),
    ("GET", "/v2/health/other", 404),
    ("GET", "/v2/models/stats", ("all_statistics", {})),
    ("GET", "/v2/models/stats/ready", ("model_ready", {"model": "stats"})),
    ("GET", "/v2/models/m/versions/2", ("model_metadata", {"model": "m", "version": "2"})),
    ("GET", "/v2/models/m/versions", 404),
    ("GET", "/v2/models", 404),
    ("POST", "/v2/models/m/trace/setting", ("model_trace_setting", {"model": "m"})),
    ("PUT", "/v2/models/m/trace/setting", 405),
    ("GET", "/v2/models/m/versions/1/trace/setting", ("not_found", {"model": "m", "version": "1"})),
    ("GET", "/v2/repository/index", 405),
    ("POST", "/v2/repository/models/m/load", ("load", {"model": "m"})),
    ("GET", "/v2/repository/elsewhere", 405),
    ("POST", "/v2/repository/elsewhere", ("not_found", {})),
    ("GET", "/v2/repository", 405),
    ("POST", "/v2/systemsharedmemory/region/r/register", ("system_shm_register", {"region": "r"})),
    ("POST", "/v2/systemsharedmemory/register", ("not_found", {})),
    ("GET", "/v2/systemsharedmemory/region//status", ("not_found", {})),
    ("POST", "/v2/cudasharedmemory/unregister", ("cuda_shm_unregister", {})),
    ("GET", "/v2/trace/setting", ("trace_setting", {})),
    ("DELETE", "/v2/logging", 405),
    ("GET", "/v2/elsewhere", 404),
])
def test_paths_reach_their_handlers_or_get_404_and_405_as_in_triton(method: str, path: str, expected: object) -> None:
    assert answer(method, path) == expected


def test_every_route_names_a_handler_of_the_app() -> None:
    from transerve.frontends.http.app import HttpFrontend

    assert all(callable(getattr(HttpFrontend, f"_on_{route.handler}", None)) for route in ROUTES)
