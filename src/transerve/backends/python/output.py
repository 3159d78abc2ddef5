"""A worker's stdout and stderr, read on the server's event loop into the server's log, within a budget.

A model may print anything, as fast as it likes; what reaches the log is bounded per worker: lines cut at
`LINE_MAX_BYTES`, and two token buckets (lines and bytes) that allow a burst (a traceback, a model's start-up
chatter) and then a steady rate. Lines past the budget are dropped and counted, and one line says how many once
the budget allows again (or the worker ends). While it drops, the server stops reading for `PAUSE_S`, so a flood
costs the server a bounded share of a core and slows the flooding worker (its writes block on the full pipe)
instead of the server. `pb_utils.Logger` lines keep their level (their first letter: I, W, E, V).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

logger = logging.getLogger("transerve.backends.python.worker_output")

#: A line longer than this is cut (the rest, up to its newline, is dropped).
LINE_MAX_BYTES = 4096
#: The budget per worker: a burst of this many lines / bytes, refilled at the rates below.
BURST_LINES = 1000
BURST_BYTES = 1 << 20
LINES_PER_S = 100.0
BYTES_PER_S = 64 << 10
#: How long reading pauses once lines were dropped.
PAUSE_S = 0.1
#: The most read at once (a pipe holds 64 KiB by default).
READ_BYTES = 64 << 10

_LEVELS = {ord("I"): logging.INFO, ord("W"): logging.WARNING, ord("E"): logging.ERROR, ord("V"): logging.DEBUG}


class WorkerOutput:
    """Reads one worker's output pipe (non-blocking, on the loop) until end of file or `close`."""

    def __init__(self, fd: int, instance: str, loop: asyncio.AbstractEventLoop) -> None:
        self._fd = fd
        self._instance = instance
        self._loop = loop
        self._partial = b""
        self._cutting = False  # in the rest of a line already cut
        self._lines = float(BURST_LINES)
        self._bytes = float(BURST_BYTES)
        self._refilled = time.monotonic()
        self.suppressed = 0
        self._resume: asyncio.TimerHandle | None = None
        os.set_blocking(fd, False)
        loop.add_reader(fd, self._readable)

    def _readable(self) -> None:
        try:
            data = os.read(self._fd, READ_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.close()
            return
        dropped = self.suppressed
        self.feed(data)
        if self.suppressed > dropped and self._resume is None:
            self._loop.remove_reader(self._fd)
            self._resume = self._loop.call_later(PAUSE_S, self._resumed)

    def _resumed(self) -> None:
        self._resume = None
        if self._fd >= 0:
            self._loop.add_reader(self._fd, self._readable)

    def feed(self, data: bytes) -> None:
        """Log the complete lines in `data` (the budget allowing); keep an incomplete last one for later."""
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        if self._cutting:
            if not lines:  # still inside the line already cut
                self._partial = b""
                return
            del lines[0]
            self._cutting = False
        if len(self._partial) > LINE_MAX_BYTES:
            lines.append(self._partial)
            self._partial, self._cutting = b"", True
        if not lines:
            return
        self._refill()
        for index, line in enumerate(lines):
            if self._lines < 1:  # the budget is spent: count the rest at once
                self.suppressed += len(lines) - index
                return
            self._emit(line)

    def _refill(self) -> None:
        now = time.monotonic()
        elapsed, self._refilled = now - self._refilled, now
        self._lines = min(BURST_LINES, self._lines + elapsed * LINES_PER_S)
        self._bytes = min(BURST_BYTES, self._bytes + elapsed * BYTES_PER_S)

    def _emit(self, line: bytes) -> None:
        size = min(len(line), LINE_MAX_BYTES)
        if self._lines < 1 or self._bytes < size:
            self.suppressed += 1
            return
        self._note_suppressed()
        self._lines -= 1
        self._bytes -= size
        text = line[:LINE_MAX_BYTES].decode(errors="replace").rstrip("\r")
        if len(line) > LINE_MAX_BYTES:
            text += f" [line cut at {LINE_MAX_BYTES} bytes]"
        level = _LEVELS.get(line[0], logging.INFO) if line else logging.INFO
        logger.log(level, "model instance '%s': %s", self._instance, text)

    def _note_suppressed(self) -> None:
        if self.suppressed:
            logger.warning(
                "model instance '%s': suppressed %d lines of its output (over %d lines or %d bytes a second)",
                self._instance, self.suppressed, LINES_PER_S, BYTES_PER_S,
            )
            self.suppressed = 0

    def close(self) -> None:
        """Log what is left (a last line without its newline, the suppressed count) and stop reading."""
        if self._fd < 0:
            return
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        else:
            self._loop.remove_reader(self._fd)
        try:
            rest = os.read(self._fd, READ_BYTES)
        except OSError:
            rest = b""
        os.close(self._fd)
        self._fd = -1
        self.feed(rest + b"\n" if rest or self._partial else b"")
        self._note_suppressed()
