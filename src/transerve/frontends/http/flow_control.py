"""An HTTP/1.1 connection's flow control both ways: whether it reads from its client, whether its client reads
what it writes (asyncio's pause_writing/resume_writing), and a wait for writers while the client does not.

It only keeps the two flags true to what was asked of the transport; when to pause (a pipelining queue too deep, a
client that does not read) is the connection's policy (`protocol.py`).
"""

from __future__ import annotations

import asyncio


class FlowControl:
    __slots__ = ("_loop", "transport", "reading_paused", "write_paused", "_writable")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self.reading_paused = False
        #: The transport's write buffer is above its high-water mark: the client is not reading.
        self.write_paused = False
        #: Resolved when the buffer drains below its low-water mark.
        self._writable: asyncio.Future[None] | None = None

    def pause_reading(self) -> None:
        if not self.reading_paused and self.transport is not None:
            self.reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> bool:
        """Read again, unless the client still does not read its answers; whether reading resumed."""
        if self.write_paused or not self.reading_paused or self.transport is None:
            return False
        self.reading_paused = False
        self.transport.resume_reading()
        return True

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        writable, self._writable = self._writable, None
        if writable is not None and not writable.done():
            writable.set_result(None)

    async def drain(self) -> None:
        """Return once the client reads again (at once when it does)."""
        if self.write_paused:
            if self._writable is None:
                self._writable = self._loop.create_future()
            await self._writable
