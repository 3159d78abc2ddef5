"""Start, wait for and stop real server processes (transerve, or anything speaking KServe v2 HTTP) for tests.

Tests talk to servers over real sockets, so every helper here is about doing that without flakiness:
ports are picked by the kernel on 127.0.0.1, readiness is polled (never slept for) under a deadline, a
failure shows the tail of the process's own log, and every process is stopped (SIGTERM, then SIGKILL of
its whole process group) by the context manager that started it, even when the test fails.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
"""The checkout this file lives in; examples and the default Triton venv are found relative to it."""

EXAMPLE_REPOSITORY = REPO_ROOT / "examples" / "model_repository"

DEFAULT_READY_TIMEOUT_S = 120.0
"""Generous because CI machines are slow and a python-backend server starts one worker per model."""

DEFAULT_STOP_TIMEOUT_S = 20.0
"""How long a graceful SIGTERM may take before the process group is killed."""

_PORT_IN_USE = re.compile(r"address already in use|already in use|errno 98|eaddrinuse", re.IGNORECASE)
_START_ATTEMPTS = 3
"""A port picked as free can be taken by another process before our server binds it; then we retry."""


class ServerStartError(RuntimeError):
    """A server process exited or did not become ready in time; the message carries its log tail."""


def free_ports(count: int) -> list[int]:
    """Return `count` distinct TCP ports on 127.0.0.1 that are free right now.

    All sockets are held open until every port is chosen, so the ports are distinct from each other;
    another process may still take one before the server binds it, which `start_server` retries on.
    """
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def http_status(port: int, path: str, timeout: float = 2.0, https: ssl.SSLContext | None = None) -> int | None:
    """GET `path` on 127.0.0.1:`port` (over TLS with `https`) and return the status code, or None when nothing
    answers.

    Uses http.client rather than requests so readiness polling has no dependency and no retry logic of its own.
    """
    conn = (http.client.HTTPSConnection("127.0.0.1", port, timeout=timeout, context=https) if https is not None
            else http.client.HTTPConnection("127.0.0.1", port, timeout=timeout))
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        return response.status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


class ServerProcess:
    """One running server: its process, its ports and its log.

    The log goes to a file rather than a pipe, so a chatty server can never block on a full pipe buffer
    and the whole log stays readable after the process is gone.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        http_port: int,
        grpc_port: int,
        metrics_port: int,
        log_path: Path,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        https: ssl.SSLContext | None = None,
    ) -> None:
        self.name = name
        #: The client context for a server whose HTTP port speaks TLS (`--http-use-ssl`); None for plain HTTP.
        self.https = https
        self.argv = list(argv)
        self.http_port = http_port
        self.grpc_port = grpc_port
        self.metrics_port = metrics_port
        self.log_path = log_path
        self.returncode: int | None = None
        self._final_log: str | None = None
        with open(log_path, "wb") as log_file:
            # A new session makes the server the leader of its own process group, so that `stop` can reach
            # worker processes (python-backend stubs) that would otherwise outlive a killed parent.
            self.process = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cwd,
                start_new_session=True,
            )

    @property
    def http_url(self) -> str:
        """host:port, the form tritonclient expects."""
        return f"127.0.0.1:{self.http_port}"

    @property
    def base_url(self) -> str:
        """http://host:port, the form requests expects."""
        return f"http://{self.http_url}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def log(self) -> str:
        """Everything the process has written to stdout and stderr so far (kept after `stop`, whose caller may
        delete the log's directory)."""
        if self._final_log is not None:
            return self._final_log
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.splitlines()[-lines:])

    def running(self) -> bool:
        return self.process.poll() is None

    def alive(self) -> bool:
        """The process is running and answers /v2/health/live with 200: what "survived a bad request" means."""
        return self.running() and http_status(self.http_port, "/v2/health/live", timeout=10.0,
                                                     https=self.https) == 200

    def wait_ready(self, timeout: float = DEFAULT_READY_TIMEOUT_S) -> None:
        """Poll /v2/health/ready until it answers 200; raise ServerStartError with the log tail otherwise."""
        deadline = time.monotonic() + timeout
        interval = 0.02
        while True:
            if not self.running():
                raise ServerStartError(
                    f"{self.name} exited with code {self.process.returncode} before becoming ready\n"
                    f"command: {' '.join(self.argv)}\n--- log tail ---\n{self.log_tail()}"
                )
            if http_status(self.http_port, "/v2/health/ready", https=self.https) == 200:
                # A 200 could come from a foreign process that grabbed the port first; ours would then be dying.
                if self.running():
                    return
                continue
            if time.monotonic() >= deadline:
                raise ServerStartError(
                    f"{self.name} not ready on {self.http_url} after {timeout:.0f} s\n"
                    f"command: {' '.join(self.argv)}\n--- log tail ---\n{self.log_tail()}"
                )
            time.sleep(interval)
            interval = min(interval * 2, 0.25)

    def stop(self, timeout: float = DEFAULT_STOP_TIMEOUT_S) -> int:
        """SIGTERM the server, wait up to `timeout`, then SIGKILL its whole process group; return the exit code.

        The group is killed even after a clean exit, so that no orphaned worker survives the test.
        """
        if self.returncode is not None:
            return self.returncode
        if self.running():
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._kill_group()
            self.process.wait(timeout=timeout)
        self._kill_group()
        self._final_log = self.log_path.read_text(errors="replace")
        self.returncode = self.process.returncode
        return self.returncode

    def _kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)


def start_server(
    name: str,
    make_argv: Callable[[int, int, int], Sequence[str]],
    *,
    log_dir: Path,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    ready_timeout: float = DEFAULT_READY_TIMEOUT_S,
    https: ssl.SSLContext | None = None,
) -> ServerProcess:
    """Start a server on three free ports and wait until it is ready (polled over TLS with `https`).

    `make_argv(http_port, grpc_port, metrics_port)` builds the command line. When the process dies because a
    port was taken in the meantime, new ports are picked and it is started again.
    """
    attempt = 0
    while True:
        attempt += 1
        http_port, grpc_port, metrics_port = free_ports(3)
        server = ServerProcess(
            name,
            make_argv(http_port, grpc_port, metrics_port),
            http_port=http_port,
            grpc_port=grpc_port,
            metrics_port=metrics_port,
            log_path=log_dir / f"{name}-{attempt}.log",
            env=env,
            cwd=cwd,
            https=https,
        )
        try:
            server.wait_ready(ready_timeout)
            return server
        except ServerStartError:
            server.stop()
            if attempt >= _START_ATTEMPTS or not _PORT_IN_USE.search(server.log):
                raise


def transerve_argv(
    repository: str | os.PathLike[str], http_port: int, grpc_port: int, metrics_port: int, *extra: str
) -> list[str]:
    """The `transerve serve` command line, with tritonserver's flag names, every service bound to loopback."""
    return [
        sys.executable,
        "-m",
        "transerve",
        "serve",
        "--model-repository",
        str(repository),
        "--http-port",
        str(http_port),
        "--grpc-port",
        str(grpc_port),
        "--metrics-port",
        str(metrics_port),
        "--http-address",
        "127.0.0.1",
        "--grpc-address",
        "127.0.0.1",
        "--metrics-address",
        "127.0.0.1",
        *extra,
    ]


@contextlib.contextmanager
def start_transerve(
    repository: str | os.PathLike[str] = EXAMPLE_REPOSITORY,
    *extra_args: str,
    ready_timeout: float = DEFAULT_READY_TIMEOUT_S,
    source: Path = REPO_ROOT / "src",
    https: ssl.SSLContext | None = None,
) -> Iterator[ServerProcess]:
    """Run `python -m transerve serve` on `repository` (served in place) until the block exits.

    `extra_args` are appended to the command line, e.g. `start_transerve(repo, "--model-control-mode=explicit")`;
    `source` is the folder transerve is imported from (benchmarks pass an older commit's to compare); `https` is
    the client context readiness is polled with when the flags make the HTTP port speak TLS.
    """
    # The checkout's own source comes first on the path, so the tests exercise this tree even where a different
    # transerve is installed; unbuffered output keeps the log complete when the process is killed.
    pythonpath = os.pathsep.join(filter(None, [str(source), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=pythonpath)
    with tempfile.TemporaryDirectory(prefix="transerve-test-") as tmp:
        server = start_server(
            "transerve",
            # As given: a Path would fold the '//' of an object-storage URL (s3://...).
            lambda http, grpc, metrics: transerve_argv(repository, http, grpc, metrics, *extra_args),
            log_dir=Path(tmp),
            env=env,
            cwd=Path(tmp),
            ready_timeout=ready_timeout,
            https=https,
        )
        try:
            yield server
        finally:
            server.stop()
