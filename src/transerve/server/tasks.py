"""Work the server starts and does not await where it starts it (the unload of a reloaded model's old versions,
polling the repository): tracked, so `stop()` can wait for it, and logged when it fails, since nobody else
would hear of it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger("transerve")


class BackgroundTasks:
    """The server's background tasks, each with a few words saying what it does (for the log)."""

    def __init__(self) -> None:
        self._tasks: dict[asyncio.Task[Any], str] = {}

    def start(self, coroutine: Coroutine[Any, Any, Any], what: str) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks[task] = what
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task[Any]) -> None:
        what = self._tasks.pop(task, "a background task")
        if not task.cancelled() and task.exception() is not None:
            log.error("%s failed", what, exc_info=task.exception())

    def __len__(self) -> int:
        return len(self._tasks)

    async def join(self) -> None:
        """Wait for every task, those started meanwhile included; their failures are logged, not raised."""
        while pending := [task for task in self._tasks if not task.done()]:
            await asyncio.wait(pending)
