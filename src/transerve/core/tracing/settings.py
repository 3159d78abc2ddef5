"""A trace setting (the global one, or a model's) and the JSON trace file it writes to, as in Triton's tracer.

A setting is replaced, never changed, by an update: traces already sampled keep the setting they were sampled
under, and a replaced setting writes what it collected once its last trace is done. Files are written by one
thread of their own, in order, so the event loop never waits on the disk.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from transerve.core.tracing.options import OFF, TRITON

log = logging.getLogger("transerve")

#: The fields the trace extension can change.
FIELDS = ("level", "rate", "count", "log_frequency")
#: Rendered traces a setting keeps in memory at most before saving them, whatever `log_frequency` says: clients can
#: set the level, rate and frequency, so what they make the server hold must be bounded. With `log_frequency` 0
#: (save at exit) saving early changes nothing in the file; otherwise the early ones make an indexed file of their own.
MAX_KEPT_CHARS = 64 * 1024 * 1024


class TraceFile:
    """Triton's trace output: `<file>` gets a JSON array that grows with every save and closes at exit, each
    `<file>.<n>` one array of the traces saved together."""

    def __init__(self, path: str, writer: ThreadPoolExecutor) -> None:
        self.path = path
        self._writer = writer
        self._index = 0
        self._opened = False
        self._closed = False

    def save(self, traces: list[str], indexed: bool) -> None:
        if self._closed:  # a trace that ends after exit (its answer was still being sent) is dropped
            return
        if indexed:
            name = f"{self.path}.{self._index}"
            self._index += 1
            self._writer.submit(_write, name, "w", "[" + ",".join(traces) + "]")
        else:
            self._writer.submit(_write, self.path, "a" if self._opened else "w",
                                ("," if self._opened else "[") + ",".join(traces))
            self._opened = True

    def close(self) -> None:
        if self._opened:
            self._writer.submit(_write, self.path, "a", "]")
        self._closed = True


def _write(name: str, mode: str, text: str) -> None:
    try:
        with open(name, mode, encoding="utf-8") as file:
            file.write(text)
    except OSError as exc:
        log.error("failed creating trace file: %s", exc)


class Setting:
    """Triton's TraceSetting: the values, which of them were set here rather than inherited, and the counters
    that sampling and writing keep."""

    __slots__ = ("level", "rate", "count", "log_frequency", "file", "mode", "config", "specified", "reason",
                 "_sampled", "_collected", "_kept", "_kept_chars", "_live", "_retired")

    def __init__(self, level: int, rate: int, count: int, log_frequency: int, file: TraceFile, mode: str,
                 config: list[tuple[str, str]], specified: frozenset[str] = frozenset()) -> None:
        self.level = level
        self.rate = rate
        #: Traces left to take (-1: no limit); sampling counts it down, and the extension shows what is left.
        self.count = count
        self.log_frequency = log_frequency
        self.file = file
        self.mode = mode
        #: The mode's `--trace-config` entries, which the extension shows.
        self.config = config
        #: The fields set on this setting rather than taken from the one it falls back to.
        self.specified = specified
        if level == OFF:
            self.reason = "tracing is disabled"
        elif rate == 0:
            self.reason = "sample rate must be non-zero"
        elif mode == TRITON and not file.path:
            self.reason = "trace file name is not given"
        else:
            self.reason = ""
        self._sampled = 0
        self._collected = 0
        #: Finished traces (rendered) not yet saved to the file, and their length.
        self._kept: list[str] = []
        self._kept_chars = 0
        #: Sampled traces not finished yet.
        self._live = 0
        self._retired = False

    @property
    def valid(self) -> bool:
        return not self.reason and self.count != 0

    def sample(self, force: bool = False) -> bool:
        """Whether to trace the next request: every `rate`-th one while `count` lasts, or any when `force`d (an
        OpenTelemetry context came with it). A rate of 0 samples only forced ones."""
        hit = False
        if self.rate:
            if not self.valid and not force:
                return False
            self._sampled += 1
            hit = self._sampled % self.rate == 0
            if hit and self.count > 0:
                self.count -= 1
            elif hit and self.count == 0:
                hit = False
        if hit or force:
            self._live += 1
            return True
        return False

    def collect(self, rendered: str | None) -> None:
        """A trace sampled under this setting is done; `rendered` is its JSON entries (None in OpenTelemetry
        mode)."""
        self._live -= 1
        if rendered is None:
            return
        self._collected += 1
        if rendered:  # a trace whose request was refused before it ran has nothing to write
            self._kept.append(rendered)
            self._kept_chars += len(rendered)
        if (self.count == 0 and self._collected == self._sampled) or (
                self.log_frequency and len(self._kept) >= self.log_frequency):
            self._save(indexed=True)
        elif self._kept_chars > MAX_KEPT_CHARS or (self._retired and self._live == 0):
            self._save(indexed=self.log_frequency != 0)

    def retire(self) -> None:
        """Replaced by an update (or the server stops): save what is kept once no trace of it is running."""
        self._retired = True
        if self._live == 0:
            self._save(indexed=self.log_frequency != 0)

    def flush(self) -> None:
        """At exit: save what is kept, whatever still runs."""
        self._save(indexed=self.log_frequency != 0)

    def _save(self, indexed: bool) -> None:
        if self._kept:
            traces, self._kept, self._kept_chars = self._kept, [], 0
            self.file.save(traces, indexed)
