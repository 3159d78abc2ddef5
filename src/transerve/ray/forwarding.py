"""A Serve request (a Starlette `Request`) forwarded to the replica's own server on loopback, and its answer
back: bodies whole, except server-sent events (generate_stream, `/v1` streams), which are relayed chunk by
chunk as the server writes them. Compressed bodies pass through untouched both ways."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping

import aiohttp
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

#: Headers about one connection, not the message: never forwarded (RFC 9110 7.6.1), plus those recomputed.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer",
                        "upgrade", "host", "content-length"})

REPLICA_HEADER = "transerve-replica"
"""Names the replica that answered: requests' spread and per-replica statistics are read from it."""


def _forwardable(headers: Mapping[str, str]) -> list[tuple[str, str]]:
    return [(name, value) for name, value in headers.items() if name.lower() not in HOP_BY_HOP]


def unavailable(message: str) -> Response:
    """Triton's error body, status 503: the replica cannot reach its server (stopping, or the child died)."""
    return Response(f'{{"error":"{message}"}}', status_code=503, media_type="application/json")


class Forwarder:
    """Forwards to one loopback port over a pooled keep-alive session, created on the replica's event loop."""

    def __init__(self, port: int, replica: str) -> None:
        self._base = f"http://127.0.0.1:{port}"
        self._replica = replica
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, force_close=False),
                auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None))
        return self._session

    async def forward(self, request: Request, done: Callable[[], None]) -> Response:
        """Send `request` on; `done` is called exactly once, when the answer is fully relayed or has failed."""
        settled = False

        def finish() -> None:
            nonlocal settled
            if not settled:
                settled = True
                done()

        try:
            return await self._exchange(request, finish)
        except BaseException:
            finish()
            raise

    async def _exchange(self, request: Request, finish: Callable[[], None]) -> Response:
        url = self._base + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        try:
            upstream = await self._client().request(
                request.method, url, data=await request.body(), headers=_forwardable(request.headers),
                skip_auto_headers=("Content-Type", "User-Agent", "Accept-Encoding", "Accept"), allow_redirects=False)
        except (aiohttp.ClientError, OSError) as error:
            finish()
            return unavailable(f"replica {self._replica} cannot reach its server: {type(error).__name__}")
        headers = dict(_forwardable(upstream.headers))
        headers[REPLICA_HEADER] = self._replica
        if upstream.headers.get("Content-Type", "").startswith("text/event-stream"):
            return StreamingResponse(self._relay(upstream, finish), status_code=upstream.status, headers=headers)
        try:
            body = await upstream.read()
        except (aiohttp.ClientError, OSError) as error:
            return unavailable(f"replica {self._replica} lost its server mid-answer: {type(error).__name__}")
        finally:
            upstream.release()
            finish()
        return Response(body, status_code=upstream.status, headers=headers)

    async def _relay(self, upstream: aiohttp.ClientResponse, done: Callable[[], None]) -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.content.iter_any():
                yield chunk
        finally:
            upstream.close()  # the client may have gone: the server sees its request cancelled
            done()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            await asyncio.sleep(0)
