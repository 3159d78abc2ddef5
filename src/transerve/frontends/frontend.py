"""What every frontend offers the CLI: a listener started on an address, told to stop accepting at shutdown
(before the server finishes its requests) and closed after the server has stopped."""

from __future__ import annotations

from typing import Protocol


class Frontend(Protocol):
    async def start(self, host: str, port: int) -> None:
        """Listen on `host:port`; OSError when the address cannot be bound."""
        ...

    def stop_accepting(self, grace: float) -> None:
        """Take no new connections or calls; those already accepted get their answers (for up to `grace`
        seconds, where the transport needs a bound)."""
        ...

    async def close(self) -> None:
        """Let settled answers be written, then release the listener."""
        ...
