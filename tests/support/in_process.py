"""A Server driven in the test's own process, for backend tests that need the core's loading path (config
completion, normalization, schedulers) but not the network: faster than a server process, and its internals
can be looked at."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

from transerve.core.types import InferRequest, InferResponse, Tensor
from transerve.server import Server, ServerOptions


def with_server(repository: Path, test: Callable[[Server], Awaitable[None]], **options: Any) -> None:
    """Start a Server on `repository` (not strictly ready: broken models are the point of some tests), run
    `test` against it on one event loop, and always stop it."""

    async def run() -> None:
        server = Server(ServerOptions([repository], strict_readiness=False, **options))
        await server.start()
        try:
            await test(server)
        finally:
            await server.stop()

    asyncio.run(run())


def states(server: Server) -> dict[str, dict[str, str]]:
    """The repository index by model name."""
    return {entry["name"]: entry for entry in server.repository_index()}


def request(model: str, **tensors: tuple[str, np.ndarray]) -> InferRequest:
    """`request("m", INPUT0=("FP32", array))`."""
    return InferRequest(model, [Tensor(name, datatype, data) for name, (datatype, data) in tensors.items()])


def outputs(response: InferResponse) -> dict[str, np.ndarray]:
    return {tensor.name: tensor.data for tensor in response.outputs}
