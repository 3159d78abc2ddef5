"""The progress bar on stderr: redrawn in place on a terminal (at most five times a second), silent elsewhere, where
only the final summary is written (logs and pipes get no carriage-return noise)."""

from __future__ import annotations

import time
from typing import TextIO

_WIDTH = 30
_INTERVAL_S = 0.2


class ProgressBar:
    def __init__(self, stream: TextIO, total: int, done: int) -> None:
        self._stream = stream
        self._live = stream.isatty()
        self._total = total
        self._done = done
        self._start_done = done
        self._failed = 0
        self._started = time.monotonic()
        self._drawn = 0.0

    def advance(self, lines: int, failed: int) -> None:
        self._done += lines
        self._failed += failed
        now = time.monotonic()
        if self._live and (now - self._drawn >= _INTERVAL_S or self._done == self._total):
            self._drawn = now
            self._stream.write(f"\r{self.render(now)}")
            self._stream.flush()

    def render(self, now: float) -> str:
        fraction = self._done / self._total if self._total else 1.0
        filled = int(fraction * _WIDTH)
        rate = (self._done - self._start_done) / max(now - self._started, 1e-9)
        errors = f", {self._failed} failed" if self._failed else ""
        return (f"[{'#' * filled}{'.' * (_WIDTH - filled)}] {self._done}/{self._total} lines {fraction:4.0%} "
                f"{rate:.1f} lines/s{errors}")

    def interrupt(self, text: str) -> None:
        """Write a line of its own (an error report) without tearing the bar."""
        self._stream.write(f"\r\x1b[K{text}\n" if self._live else f"{text}\n")
        if self._live and self._drawn:
            self._stream.write(self.render(time.monotonic()))
        self._stream.flush()

    def close(self) -> None:
        if self._live and self._drawn:
            self._stream.write("\n")
            self._stream.flush()
