"""`--model-control-mode=poll`: the repositories are scanned every `--repository-poll-secs`, and the models
follow them (added ones load, removed ones unload, changed ones reload; a failed reload keeps the old)."""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from transerve.repository.fingerprint import fingerprint
from transerve.repository.repository import ModelRepository

log = logging.getLogger("transerve")


class Polled(Protocol):
    """What polling needs of the server."""

    repository: ModelRepository

    def loaded_fingerprints(self) -> dict[str, str]: ...

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None: ...

    async def load_logged(self, name: str) -> None: ...


async def poll_once(server: Polled) -> None:
    """Bring the loaded models in line with the repositories once (remote ones are downloaded first where their
    listing changed, so the local fingerprints follow them; one that cannot be listed aborts this poll)."""
    if server.repository.remotes:
        await asyncio.to_thread(server.repository.refresh, True)
    found, _ = server.repository.scan()
    loaded = server.loaded_fingerprints()
    for name in [name for name in loaded if name not in found]:
        await server.unload_model(name)
    for name, location in found.items():
        if loaded.get(name) != fingerprint(location.path):
            await server.load_logged(name)


async def poll_forever(server: Polled, interval: float) -> None:
    """Poll until cancelled; a poll that fails unexpectedly is logged and the next one runs as usual."""
    while True:
        await asyncio.sleep(interval)
        try:
            await poll_once(server)
        except Exception:
            log.exception("polling the model repositories failed; polling again in %gs", interval)
