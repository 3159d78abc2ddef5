"""What the in-process scheduler tests share: an instance whose executions wait for the test, a config parsed as
the server parses it, and running a test coroutine on a fresh loop.

Each test file's instance says what it records of an execution and how it answers (`record`, `answer`); when it
answers stays with the test (`release`), so every scheduling decision is observed exactly, with no workers and no
sleeping beyond the delays under test.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from transerve.backends.base import BackendInstance, ExecutionResult
from transerve.config.model_config import normalize, parse_config_text, validate
from transerve.core.types import InferRequest


class HeldInstance(BackendInstance):
    """Holds each execution open until the test calls `release` (at once with `auto`), oldest first."""

    def __init__(self, name: str, auto: bool = False) -> None:
        self.name = name
        self.auto = auto
        self._open: list[tuple[asyncio.Future[ExecutionResult], list[InferRequest]]] = []

    def record(self, requests: list[InferRequest]) -> None:
        """Keep what the test looks at of an execution; called as it starts."""

    def answer(self, requests: list[InferRequest]) -> ExecutionResult:
        raise NotImplementedError

    def execute(self, requests: list[InferRequest]) -> asyncio.Future[ExecutionResult]:
        self.record(requests)
        future = asyncio.get_running_loop().create_future()
        self._open.append((future, requests))
        if self.auto:
            self.release()
        return future

    def release(self) -> None:
        """Answer the oldest open execution."""
        future, requests = self._open.pop(0)
        future.set_result(self.answer(requests))

    async def close(self) -> None:
        pass


def model_config(text: str) -> object:
    """A config as the server holds it (parsed, normalized and validated) for the model named "m"."""
    parsed = parse_config_text(text)
    normalize(parsed, "m")
    validate(parsed, "m")
    return parsed


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 10))


async def settle() -> None:
    """Let callbacks scheduled by completed executions run."""
    for _ in range(5):
        await asyncio.sleep(0)
