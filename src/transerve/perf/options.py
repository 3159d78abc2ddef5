"""The command line's values, checked and bounded: every bad flag is one `PerfError` line, before any request."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

#: Bounds that keep one run finite and the client process sane; docs/perf.md lists them.
MAX_CONCURRENCY = 256
MAX_REQUEST_RATE = 20000.0
MAX_LEVELS = 64
MAX_TRIALS = 100
MAX_WINDOW_MS = 600_000
MIN_WINDOW_MS = 50
MAX_REQUEST_COUNT = 1_000_000
MAX_BATCH = 4096
MAX_THREADS = 256
MAX_STRING_LENGTH = 1 << 20


class PerfError(Exception):
    """A problem the user can fix (a flag, the model, the server): printed as one line, exit status 1."""


#: How long one inference may take, its answer read whole, before the run stops with an error (--request-timeout).
REQUEST_TIMEOUT_S = 300.0
#: The largest answer read (--max-answer-bytes): a runaway server stops the run instead of growing the tool.
MAX_ANSWER_BYTES = 256 << 20


@dataclass(frozen=True)
class Options:
    """What one run measures and how; `levels` are concurrencies or request rates, `mode` says which."""

    model: str
    version: str = ""
    url: str = "localhost:8000"
    protocol: str = "http"
    batch_size: int = 1
    mode: str = "concurrency"  # or "request_rate"
    levels: tuple[float, ...] = (1,)
    distribution: str = "constant"
    shapes: dict[str, list[int]] = field(default_factory=dict)
    string_data: str | None = None
    string_length: int = 128
    input_data: str = "random"
    window_ms: int = 5000
    measurement_mode: str = "time_windows"
    request_count: int = 50
    percentile: int | None = None
    max_trials: int = 10
    stability: float = 10.0
    csv_file: Path | None = None
    plot_file: Path | None = None
    max_threads: int = 16
    sync: bool = True
    verbose: bool = False
    #: perf_analyzer's -l: a level whose latency (average, or the --percentile) reaches this many ms ends the
    #: search, unreported; 0 is no limit.
    latency_threshold_ms: int = 0
    #: `--request-timeout`: the most one request may take, its answer read whole; `--max-answer-bytes`: the largest
    #: answer read.
    request_timeout_s: float = REQUEST_TIMEOUT_S
    max_answer_bytes: int = MAX_ANSWER_BYTES


def parse_range(text: str, flag: str, integer: bool, open_end: bool = False) -> tuple[float, ...]:
    """perf_analyzer's `start:end:step` (end and step optional; step defaults to 1) as the list of levels. With
    `open_end` (a latency limit is set), an end of 0 is perf_analyzer's "no limit": levels up to the bounds."""
    parts = text.split(":")
    if not 1 <= len(parts) <= 3 or any(not part.strip() for part in parts):
        raise PerfError(f"{flag} takes start[:end[:step]], got '{text}'")
    try:
        numbers = [int(part) if integer else float(part) for part in parts]
    except ValueError:
        kind = "integers" if integer else "numbers"
        raise PerfError(f"{flag} takes {kind}: start[:end[:step]], got '{text}'") from None
    start = numbers[0]
    end = numbers[1] if len(numbers) > 1 else start
    step = numbers[2] if len(numbers) > 2 else 1
    if open_end and end == 0 and start > 0 and step > 0:
        return concurrency_levels(int(start), 0, int(step)) if integer else _open_rates(start, step)
    if start <= 0 or step <= 0 or end < start:
        raise PerfError(f"{flag}: start and step must be positive and end at least start, got '{text}'")
    levels: list[float] = []
    value = start
    while value <= end + (0 if integer else 1e-9):
        levels.append(value)
        if len(levels) > MAX_LEVELS:
            raise PerfError(f"{flag} '{text}' makes more than {MAX_LEVELS} load levels")
        value += step
    return tuple(levels)


def concurrency_levels(start: int, end: int, step: int = 1) -> tuple[float, ...]:
    """perf_analyzer's deprecated -t START and -c END (step 1): from START to END, START alone when END is below
    it (perf_analyzer's search runs its first level whatever the end), and END 0 is no limit: as many levels as
    the bounds allow (MAX_LEVELS, concurrency up to MAX_CONCURRENCY)."""
    if start <= 0:
        raise PerfError(f"-t (concurrency) must be above 0, got {start}")
    if end < 0 or end > MAX_CONCURRENCY:
        raise PerfError(f"-c (maximum concurrency) must be 0 (no limit) to {MAX_CONCURRENCY}, got {end}")
    last = min(MAX_CONCURRENCY, start + step * (MAX_LEVELS - 1)) if end == 0 else max(start, end)
    levels = tuple(float(level) for level in range(start, last + 1, step))
    if len(levels) > MAX_LEVELS:
        raise PerfError(f"-t {start} -c {end} makes more than {MAX_LEVELS} load levels")
    return levels


def _open_rates(start: float, step: float) -> tuple[float, ...]:
    levels = [start + index * step for index in range(MAX_LEVELS)]
    return tuple(level for level in levels if level <= MAX_REQUEST_RATE)


_SHAPE = re.compile(r"^(.+):(\d+(?:,\d+)*)$")


def parse_shape(text: str) -> tuple[str, list[int]]:
    """`--shape NAME:d1,d2`: the shape of a variable-sized input, without the batch dimension."""
    match = _SHAPE.match(text.strip())
    if not match:
        raise PerfError(f"--shape takes NAME:d1,d2,... with non-negative integers, got '{text}'")
    return match.group(1), [int(dim) for dim in match.group(2).split(",")]


def check_bounds(options: Options) -> None:
    """Refuse values no run can use; the range parser bounds the number of levels already."""
    checks = [
        (options.batch_size < 1 or options.batch_size > MAX_BATCH, f"-b must be between 1 and {MAX_BATCH}"),
        (not MIN_WINDOW_MS <= options.window_ms <= MAX_WINDOW_MS,
         f"-p (measurement window) must be between {MIN_WINDOW_MS} and {MAX_WINDOW_MS} ms"),
        (not 1 <= options.max_trials <= MAX_TRIALS, f"--max-trials must be between 1 and {MAX_TRIALS}"),
        (not 0 < options.stability <= 1000, "-s (stability percentage) must be above 0 and at most 1000"),
        (not 1 <= options.request_count <= MAX_REQUEST_COUNT,
         f"--measurement-request-count must be between 1 and {MAX_REQUEST_COUNT}"),
        (options.percentile is not None and not 1 <= options.percentile <= 99, "--percentile must be between 1 and 99"),
        (not 0 <= options.string_length <= MAX_STRING_LENGTH,
         f"--string-length must be between 0 and {MAX_STRING_LENGTH}"),
        (not 1 <= options.max_threads <= MAX_THREADS, f"--max-threads must be between 1 and {MAX_THREADS}"),
        (options.mode == "concurrency" and max(options.levels) > MAX_CONCURRENCY,
         f"--concurrency-range goes up to {MAX_CONCURRENCY}"),
        (options.latency_threshold_ms < 0, "-l (latency threshold) must be 0 (no limit) or more milliseconds"),
        (not options.request_timeout_s > 0, "--request-timeout must be positive"),
        (not 1 <= options.max_answer_bytes < 2**31, f"--max-answer-bytes must be between 1 and {2**31 - 1}"),
        (options.mode == "request_rate" and max(options.levels) > MAX_REQUEST_RATE,
         f"--request-rate-range goes up to {MAX_REQUEST_RATE:g} requests/s"),
    ]
    for failed, message in checks:
        if failed:
            raise PerfError(message)
