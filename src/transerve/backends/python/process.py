"""A python-backend worker process, as the server sees it: how it is started (its interpreter, environment and
model), called, watched (a pidfd says when it exits; its resident memory is read from /proc) and stopped.

Each worker leads its own process group (a session of its own), and the group is killed when the worker ends, so
the processes a model starts (a `subprocess.Popen` in `initialize`) end with it; one that starts a session of
its own escapes. Its stdout and stderr reach the server's log through `output.WorkerOutput`, within a budget."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import site
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transerve.backends.python.environments import Interpreter
from transerve.backends.python.ipc import OP_FINALIZE, OP_LOAD, AsyncConnection, ConnectionLost, Endpoint, socket_pair
from transerve.backends.python.output import WorkerOutput
from transerve.backends.python.shm import Region
from transerve.backends.python.streams import WorkerStreams
from transerve.core.errors import ErrorCode, ServerError
from transerve.core.types import InferRequest

logger = logging.getLogger(__name__)

#: How long `close` waits for the model's `finalize`, then for the process to exit, before killing it.
STOP_TIMEOUT_S = 10.0
#: How long to wait for a worker whose socket closed to actually exit, before killing it.
EXIT_TIMEOUT_S = 5.0
#: How long an execute may go on after its request's timeout expired before its worker is deemed hung and
#: restarted (`--backend-config=python,hung-execute-grace-secs=N`): a model sees `is_cancelled()` at the timeout
#: and may stop on its own first; a worker restart costs the model's `initialize`.
DEFAULT_HUNG_GRACE_S = 10.0



@dataclass(slots=True, frozen=True)
class WorkerSpec:
    """What every worker of one model version is started with."""

    model_name: str
    model_version: str
    model_file: Path
    arena_bytes: int
    max_inflight: int
    #: The server's log settings page (`core.log_settings`), which `pb_utils.Logger` follows; None: none.
    log_fd: int | None = None
    #: The model's own Python environment (EXECUTION_ENV_PATH); None: the server's interpreter.
    interpreter: Interpreter | None = None
    #: `max_worker_rss_bytes`: a worker whose resident memory passes it is restarted; 0: no ceiling.
    max_rss_bytes: int = 0
    #: `hung-execute-grace-secs`: how long an execute may run past its request's timeout.
    hung_grace_s: float = DEFAULT_HUNG_GRACE_S


class WorkerProcess:
    """One running worker and the connection to it.

    `exit_code` resolves when the process is gone; a pidfd tells the event loop, so a dead worker
    is noticed even when a child process of the model still holds the socket open.
    """

    def __init__(
        self, process: subprocess.Popen[bytes], sock: socket.socket, endpoint: Endpoint, instance: str, output: int
    ):
        self._loop = asyncio.get_running_loop()
        self.process = process
        self.instance = instance
        self.output = WorkerOutput(output, instance, self._loop)
        self.exit_code: asyncio.Future[int] = self._loop.create_future()
        self.connection = AsyncConnection(sock, endpoint, self._loop)
        #: Why the server killed this worker on purpose (unload, memory, a hung execute); None while it has not.
        self.ended_by: str | None = None
        #: The timed-out request whose execute hung this worker: executes queued behind it run again elsewhere.
        self.hung_on: InferRequest | None = None
        #: Decoupled requests and BLS calls, once an instance adopts the worker.
        self.streams: WorkerStreams | None = None
        self._pidfd = os.pidfd_open(process.pid)
        self._loop.add_reader(self._pidfd, self._on_exit)

    @classmethod
    async def start(cls, spec: WorkerSpec, instance: str) -> WorkerProcess:
        """Spawn a worker for `instance` and have it import the model; raises ServerError if it cannot."""
        parent, child = socket_pair()
        to_worker = Region.create(spec.arena_bytes, f"transerve-{instance}-in")
        from_worker = Region.create(spec.arena_bytes, f"transerve-{instance}-out")
        command = [
            *(spec.interpreter.command if spec.interpreter else (sys.executable,)),
            "-m",
            "transerve.backends.python.worker",
            "--socket-fd",
            str(child.fileno()),
            "--input-fd",
            str(to_worker.fd),
            "--output-fd",
            str(from_worker.fd),
            "--parent-pid",
            str(os.getpid()),
        ]
        passed = [child.fileno(), to_worker.fd, from_worker.fd]
        if spec.log_fd is not None:
            command += ["--log-settings-fd", str(spec.log_fd)]
            passed.append(spec.log_fd)
        output, written = os.pipe()
        try:
            process = subprocess.Popen(
                command,
                pass_fds=passed,
                stdin=subprocess.DEVNULL,
                stdout=written,
                stderr=written,
                start_new_session=True,
                env=spec.interpreter.environment if spec.interpreter else _worker_environment(),
            )
        except BaseException:
            parent.close()
            os.close(output)
            raise
        finally:
            os.close(written)
            child.close()
            to_worker.close_fd()
            from_worker.close_fd()
        worker = cls(process, parent, Endpoint(outgoing=to_worker, incoming=from_worker), instance, output)
        load = {
            "model_name": spec.model_name,
            "model_version": spec.model_version,
            "model_file": str(spec.model_file),
            "instance_name": instance,
        }
        try:
            await worker.call(OP_LOAD, load)
        except BaseException:
            await worker.abort()
            raise
        return worker

    async def call(self, op: int, body: Any) -> Any:
        """A lifecycle call; the model's failure raises ServerError, and so does the worker's death."""
        try:
            (error, value), _ = await self.connection.request(op, body)
        except ConnectionLost:
            exit_code = describe_exit(await self.exited())
            raise ServerError(
                ErrorCode.INTERNAL, f"model instance '{self.instance}' process exited unexpectedly ({exit_code})"
            ) from None
        if error is not None:
            code, message = error
            raise ServerError(ErrorCode[code], message)
        return value

    async def exited(self) -> int:
        """The exit code, killing a worker that closed its socket but does not exit."""
        try:
            return await asyncio.wait_for(asyncio.shield(self.exit_code), EXIT_TIMEOUT_S)
        except asyncio.TimeoutError:
            self.kill()
            return await self.exit_code

    def _on_exit(self) -> None:
        self._loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        # The worker is a zombie until reaped below, so its pid still names its group: end what the model started.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        try:
            # Messages the worker sent before it died are still in the socket: deliver them first.
            self.connection.read_ready(drain=True)
        finally:
            self.connection.lose()
            self.output.close()
            self.exit_code.set_result(self.process.wait())

    async def stop(self) -> None:
        """Call the model's `finalize`, then end the process, killing it if it takes too long."""
        if not self.connection.closed:
            try:
                await asyncio.wait_for(self.call(OP_FINALIZE, None), STOP_TIMEOUT_S)
            except (ServerError, asyncio.TimeoutError) as exc:
                logger.warning("model instance '%s' did not finalize cleanly: %s", self.instance, exc)
        try:
            await asyncio.wait_for(asyncio.shield(self.exit_code), STOP_TIMEOUT_S)
        except asyncio.TimeoutError:
            self.kill()
            await self.exit_code

    def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()

    def end(self, reason: str) -> None:
        """Kill the worker on purpose: what it was running fails UNAVAILABLE, naming `reason`."""
        if self.ended_by is None:
            self.ended_by = reason
        self.kill()

    def rss_bytes(self) -> int:
        """The worker's resident memory (0 once it is gone)."""
        try:
            with open(f"/proc/{self.process.pid}/statm", "rb") as statm:
                return int(statm.read().split()[1]) * _PAGE_BYTES
        except (OSError, ValueError, IndexError):
            return 0

    async def abort(self) -> None:
        """Kill the worker without waiting on model code, and wait until it is gone."""
        self.kill()
        await self.exit_code


_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def describe_exit(code: int) -> str:
    """`code 1`, or `code -11, signal SIGSEGV` for a worker killed by a signal."""
    if code < 0:
        try:
            return f"code {code}, signal {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"code {code}"


def _worker_environment() -> dict[str, str]:
    """The server's environment, plus the folder transerve lives in when it is not installed there."""
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[3])
    if package_root not in site.getsitepackages():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    return env
