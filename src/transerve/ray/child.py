"""One `transerve serve` child process per replica: started on loopback with free ports, waited for until ready,
and stopped with SIGTERM (the server drains its own requests) then SIGKILL.

The process is started by a keeper thread that lives as long as the child does, and the child is given a
parent-death signal: if the replica's process dies (killed, or Ray ends the actor), Linux sends the child SIGTERM,
so no server outlives its replica. The signal follows the thread that forked, hence the thread that waits."""

from __future__ import annotations

import ctypes
import http.client
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

PR_SET_PDEATHSIG = 1
LOOPBACK = "127.0.0.1"
REPLICA_ENV = "TRANSERVE_RAY_REPLICA"
"""Names the replica in its child's environment, so that `ps e` or psutil can tell which server is whose."""


class ChildError(RuntimeError):
    """The child server exited or did not become ready in time; the message carries its log's tail."""


def free_ports(count: int) -> list[int]:
    """Distinct loopback ports free right now (held open together so they differ)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind((LOOPBACK, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


class ChildServer:
    """A `transerve serve` process on loopback; `http_port` is where the replica forwards to."""

    def __init__(self, repositories: Sequence[str], server_flags: Sequence[str], log_path: Path, replica: str) -> None:
        self.http_port, self.grpc_port, self.metrics_port = free_ports(3)
        self.log_path = log_path
        self._command = [
            sys.executable, "-m", "transerve", "serve",
            *(f"--model-repository={repository}" for repository in repositories),
            f"--http-address={LOOPBACK}", f"--http-port={self.http_port}",
            f"--grpc-address={LOOPBACK}", f"--grpc-port={self.grpc_port}",
            f"--metrics-address={LOOPBACK}", f"--metrics-port={self.metrics_port}",
            *server_flags,
        ]
        self._env = {**os.environ, REPLICA_ENV: replica}
        self._started = threading.Event()
        self._process: subprocess.Popen[bytes] | None = None
        self._failure: BaseException | None = None
        self._keeper = threading.Thread(target=self._keep, name="transerve-child", daemon=True)

    def start(self, ready_timeout: float) -> None:
        """Start the process and wait until `/v2/health/ready` answers 200."""
        self._keeper.start()
        self._started.wait()
        if self._process is None:
            raise ChildError(f"could not start {self._command[:4]}: {self._failure}")
        deadline = time.monotonic() + ready_timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise ChildError(f"transerve serve exited with {self._process.returncode}:\n{self.log_tail()}")
            if self.ready(timeout=1.0):
                return
            time.sleep(0.1)
        self.stop(grace=5.0)
        raise ChildError(f"transerve serve was not ready after {ready_timeout:.0f} s:\n{self.log_tail()}")

    def _keep(self) -> None:
        try:
            with open(self.log_path, "ab") as log:
                self._process = subprocess.Popen(self._command, stdin=subprocess.DEVNULL, stdout=log,
                                                 stderr=subprocess.STDOUT, env=self._env,
                                                 preexec_fn=_die_with_parent)
        except OSError as error:
            self._failure = error
        finally:
            self._started.set()
        if self._process is not None:
            self._process.wait()

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def ready(self, timeout: float) -> bool:
        """Whether the server answers `/v2/health/ready` with 200 (a blocking call: the caller picks the thread)."""
        connection = http.client.HTTPConnection(LOOPBACK, self.http_port, timeout=timeout)
        try:
            connection.request("GET", "/v2/health/ready")
            return connection.getresponse().status == 200
        except OSError:
            return False
        finally:
            connection.close()

    def stop(self, grace: float) -> None:
        """SIGTERM (the server stops accepting and waits for its requests), then SIGKILL after `grace` seconds."""
        process = self._process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"
