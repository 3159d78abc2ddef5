"""The bytes a connection writes: frames written in one turn of the event loop leave in one write, so that a turn's
answers, window updates and acknowledgments cost the socket (and TLS) one call."""

from __future__ import annotations

import asyncio


class FrameWriter:
    """Collects a turn's frames and writes them together at the end of the turn (or at `flush`)."""

    __slots__ = ("_loop", "_transport", "_tls", "_out", "_scheduled")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._transport: asyncio.Transport | None = None
        self._tls = False  # the transport encrypts: see `flush`
        self._out: list[bytes | memoryview] = []
        self._scheduled = False

    def attach(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._tls = transport.get_extra_info("sslcontext") is not None

    def write(self, data: bytes | memoryview) -> None:
        self._out.append(data)
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        if self._out and self._transport is not None and not self._transport.is_closing():
            if self._tls:
                # The SSL transport makes each piece a TLS record of its own; joined, a turn's frames are one, which
                # seals and opens far cheaper (benchmarks/README.md, "Figures behind the code"). A turn's bytes are
                # bounded by the windows and the write buffer's high-water mark, so the copy is too.
                self._transport.write(b"".join(self._out))
            else:
                self._transport.writelines(self._out)
        self._out = []

    def discard(self) -> None:
        """The connection is gone: what waits to be written never will be."""
        self._out.clear()
