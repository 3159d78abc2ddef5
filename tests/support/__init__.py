"""Helpers shared by end-to-end tests and benchmarks: real server processes on free loopback ports.

`start_transerve(repo, *args)` and `start_triton(repo, *args)` are context managers that yield a running
`ServerProcess` (`.http_url`, `.http_port`, `.grpc_port`, `.metrics_port`, `.log`) and stop it on exit.
"""

from .servers import (
    EXAMPLE_REPOSITORY,
    REPO_ROOT,
    ServerProcess,
    ServerStartError,
    free_ports,
    start_server,
    start_transerve,
)
from .triton_reference import TritonInstall, TritonUnavailable, find_triton, in_ci, require_triton, start_triton

__all__ = [
    "EXAMPLE_REPOSITORY",
    "REPO_ROOT",
    "ServerProcess",
    "ServerStartError",
    "TritonInstall",
    "TritonUnavailable",
    "find_triton",
    "free_ports",
    "in_ci",
    "require_triton",
    "start_server",
    "start_transerve",
    "start_triton",
]
