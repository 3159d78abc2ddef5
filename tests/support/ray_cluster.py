"""A local Ray cluster for tests: a head and a second node, each a `ray start --block` process with its own CPUs
and custom resources, in its own session so that stopping it reaches the raylet, the GCS and the workers.

Ray resolves 127.0.0.1 to the host's address for its own control plane; what the tests talk to (Serve's HTTP
proxy, the replicas' servers) listens on loopback."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import requests

from .servers import ServerProcess, free_ports

#: The response header that names the replica which answered (transerve.ray).
REPLICA = "transerve-replica"


def _ray(*args: str) -> list[str]:
    return [sys.executable, "-m", "ray.scripts.scripts", *args]


class RayNode:
    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str]) -> None:
        self.name = name
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                            env=env, start_new_session=True)

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM (`ray start --block` then stops what it started), then SIGKILL of the whole session."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


HEAD = ["--head", "--port={port}", "--num-cpus=1", '--resources={"transerve": 1}', "--include-dashboard=false"]
NODE = ["--address=127.0.0.1:{port}", "--num-cpus=2", '--resources={"transerve": 1}']
"""docs/ray.md's cluster: one `transerve` resource per node, so that each node holds one replica."""


@contextlib.contextmanager
def ray_cluster(head: list[str] = HEAD, node: list[str] = NODE, *, env: dict[str, str] | None = None) -> Iterator[str]:
    """Yield the address of a two-node cluster: `ray start` with `head`'s arguments, then `node`'s (`{port}` in
    them is the GCS port, picked free). Each runs with `--block`, in a temporary directory removed after."""
    # Ray's unix sockets live under its temp dir, whose path must stay short (108 bytes on Linux).
    temp = Path(tempfile.mkdtemp(prefix="trray-", dir="/tmp"))
    environment = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **(env or {})}
    (port,) = free_ports(1)
    common = ["--block", "--disable-usage-stats"]
    head = [arg.replace("{port}", str(port)) for arg in head]
    node = [arg.replace("{port}", str(port)) for arg in node]
    nodes = [RayNode("head", _ray("start", *head, f"--temp-dir={temp}", *common), temp / "head.log", environment)]
    try:
        _wait_for_gcs(nodes[0], port)
        nodes.append(RayNode("node", _ray("start", *node, *common),
                             temp / "node.log", environment))
        yield f"127.0.0.1:{port}"
    finally:
        for started in reversed(nodes):
            started.stop()
        shutil.rmtree(temp, ignore_errors=True)


def _wait_for_gcs(head: RayNode, port: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if head.process.poll() is not None:
            raise RuntimeError(f"ray start --head exited:\n{head.log_path.read_text(errors='replace')[-3000:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.2)
    raise RuntimeError(f"ray's GCS not listening on {port} after {timeout:.0f} s")


def replica_of(server: ServerProcess) -> str | None:
    try:
        response = requests.get(f"{server.base_url}/v2/health/ready", timeout=10)
    except requests.RequestException:
        return None
    return response.headers.get(REPLICA) if response.status_code == 200 else None


def wait_for_replicas(server: ServerProcess, count: int, timeout: float, besides: set[str] = frozenset()) -> set[str]:
    """Poll until `count` distinct replicas (not in `besides`) answered within the last 40 requests."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = {replica_of(server) for _ in range(40)} - {None}
        if len(seen - besides) >= count:
            return seen
        time.sleep(0.5)
    raise AssertionError(f"fewer than {count} replicas answer after {timeout} s:\n{server.log_tail()}")
