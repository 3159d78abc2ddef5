"""Progress of `transerve export` and `convert` on stderr: numbered steps with their durations, ticking on a
terminal. A step that fails in a library (transformers, torch, onnx, CTranslate2) fails as an ExportError: one line
naming the model folder, the step and the cause, never the library's traceback."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

from transerve.export.hf import ExportError

#: The most characters of a library's message an error line carries (torch's can run to pages).
MAX_CAUSE = 600


class Progress:
    def __init__(self, total: int, stream: TextIO | None = None, subject: Path | None = None) -> None:
        self._total = total
        #: The folder the steps work on, named in a failed step's error where its title does not name it.
        self._subject = subject
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
        except ExportError:
            self._finish(label, started, stop, ticker, "failed")
            raise
        except Exception as exc:
            self._finish(label, started, stop, ticker, "failed")
            where = "" if self._subject is None or str(self._subject) in title else f"{self._subject}: "
            raise ExportError(f"{where}{title} failed: {cause(exc)}") from exc
        except BaseException:
            self._finish(label, started, stop, ticker, "interrupted")
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


def cause(exc: BaseException) -> str:
    """A library's exception on one line: its message, with its type where the message alone may not say it."""
    text = " ".join(str(exc).split())
    if len(text) > MAX_CAUSE:
        text = text[:MAX_CAUSE] + "..."
    if text and (type(exc) in (ValueError, RuntimeError) or isinstance(exc, OSError)):
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
