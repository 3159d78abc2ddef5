"""The Serve deployment: each replica owns one `transerve serve` child (its python workers included), forwards
Serve's HTTP requests to it, reports its readiness as the replica's health, and drains when stopped.

Why a child process rather than the server inside the replica: the server owns its event loop (uvloop), its
signal handlers, its worker processes and an exit backstop; in a child it runs exactly as `transerve serve` does,
and a fault in it ends at the process boundary, which Serve sees as a failed health check and replaces. The cost
is one loopback HTTP hop per request (benchmarks/README.md, "Ray Serve")."""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

from ray import serve
from starlette.requests import Request
from starlette.responses import Response

from .child import ChildServer
from .forwarding import Forwarder, unavailable
from .settings import ReplicaSettings

READY_PROBE_TIMEOUT_S = 5.0
"""Under Serve's own health-check timeout (10 s by default), so that a slow answer reads as not ready."""


class TranserveReplica:
    """One replica: a child server and the requests in flight to it."""

    def __init__(self, settings: ReplicaSettings) -> None:
        self.replica = serve.get_replica_context().replica_id.unique_id
        log_dir = Path(settings.log_dir or tempfile.gettempdir())
        log_dir.mkdir(parents=True, exist_ok=True)
        self._settings = settings
        self._child = ChildServer(settings.repositories, settings.server_flags,
                                  log_dir / f"transerve-ray-{self.replica}.log", self.replica)
        self._child.start(settings.ready_timeout_s)
        self._forwarder = Forwarder(self._child.http_port, self.replica)
        self._in_flight = 0
        self._draining = False

    async def __call__(self, request: Request) -> Response:
        if self._draining:
            return unavailable(f"replica {self.replica} is stopping")
        self._in_flight += 1
        return await self._forwarder.forward(request, self._done)

    def _done(self) -> None:
        self._in_flight -= 1

    async def check_health(self) -> None:
        """Serve's probe: healthy while the child runs and answers `/v2/health/ready` with 200."""
        if not self._child.alive:
            raise RuntimeError(f"transerve serve exited:\n{self._child.log_tail()}")
        if not await asyncio.to_thread(self._child.ready, READY_PROBE_TIMEOUT_S):
            raise RuntimeError("transerve serve is not ready (/v2/health/ready)")

    async def __del__(self) -> None:
        """Drain: refuse new requests, wait for those in flight (streams included) up to `drain_timeout_s`, then
        stop the child, which waits for what it still runs up to `exit_grace_s`."""
        self._draining = True
        deadline = time.monotonic() + self._settings.drain_timeout_s
        while self._in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.to_thread(self._child.stop, self._settings.exit_grace_s)
        await self._forwarder.close()
