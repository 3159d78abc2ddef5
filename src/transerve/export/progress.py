"""Progress of `transerve export` on stderr: numbered steps with their durations, ticking on a terminal."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO


class Progress:
    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        self._total = total
        self._done = 0
        self._stream = stream or sys.stderr

    @contextmanager
    def step(self, title: str) -> Iterator[None]:
        """`[2/5] exporting to ONNX... 3.1 s`; on a terminal the seconds count up while the step runs."""
        self._done += 1
        label = f"[{self._done}/{self._total}] {title}..."
        started = time.monotonic()
        stop = threading.Event()
        ticker = None
        if self._stream.isatty():
            ticker = threading.Thread(target=self._tick, args=(label, started, stop), daemon=True)
            ticker.start()
        else:
            self._stream.write(label)
            self._stream.flush()
        try:
            yield
        except BaseException:
            self._finish(label, started, stop, ticker, "failed")
            raise
        self._finish(label, started, stop, ticker, "")

    def note(self, text: str) -> None:
        self._stream.write(f"      {text}\n")
        self._stream.flush()

    def _tick(self, label: str, started: float, stop: threading.Event) -> None:
        while not stop.wait(0.2):
            self._stream.write(f"\r{label} {time.monotonic() - started:.0f} s")
            self._stream.flush()

    def _finish(
        self, label: str, started: float, stop: threading.Event, ticker: threading.Thread | None, outcome: str
    ) -> None:
        stop.set()
        if ticker is not None:
            ticker.join()
            self._stream.write(f"\r{label}")
        suffix = f" {outcome}" if outcome else ""
        self._stream.write(f" {time.monotonic() - started:.1f} s{suffix}\n")
        self._stream.flush()
