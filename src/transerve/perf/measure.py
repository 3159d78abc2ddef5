"""Measurement windows over a running load, perf_analyzer's way: requests answered within each window count
towards it; the server's statistics extension is read at both ends of it, and its deltas give the server-side
breakdown. A level is stable when its last three windows' throughput and latency each lie within `stability`
percent of their mean; it is then reported over those three windows merged."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from transerve.perf.load import Load
from transerve.perf.options import MAX_WINDOW_MS, Options, PerfError
from transerve.perf.transport import Timing

PERCENTILES = (50, 90, 95, 99)
SERVER_PARTS = ("queue", "compute_input", "compute_infer", "compute_output")
STABLE_WINDOWS = 3


@dataclass(frozen=True)
class ServerStats:
    """Cumulative counters of one model (all its versions, or the one asked for) from /stats."""

    success_count: int = 0
    success_ns: int = 0
    inference_count: int = 0
    execution_count: int = 0
    parts_ns: dict[str, int] = field(default_factory=dict)

    def minus(self, earlier: ServerStats) -> ServerStats:
        return ServerStats(self.success_count - earlier.success_count, self.success_ns - earlier.success_ns,
                           self.inference_count - earlier.inference_count,
                           self.execution_count - earlier.execution_count,
                           {part: self.parts_ns.get(part, 0) - earlier.parts_ns.get(part, 0) for part in SERVER_PARTS})

    def plus(self, other: ServerStats) -> ServerStats:
        return ServerStats(self.success_count + other.success_count, self.success_ns + other.success_ns,
                           self.inference_count + other.inference_count,
                           self.execution_count + other.execution_count,
                           {part: self.parts_ns.get(part, 0) + other.parts_ns.get(part, 0) for part in SERVER_PARTS})


def server_stats(document: Mapping[str, Any], model: str) -> ServerStats:
    """Sum the entries of `model` in a statistics answer (HTTP numbers or gRPC's JSON, whose int64 are strings)."""
    total = ServerStats(parts_ns={part: 0 for part in SERVER_PARTS})
    for entry in document.get("model_stats", []):
        if entry.get("name") != model:
            continue
        inference = entry.get("inference_stats", {})
        total = total.plus(ServerStats(
            int(inference.get("success", {}).get("count", 0)), int(inference.get("success", {}).get("ns", 0)),
            int(entry.get("inference_count", 0)), int(entry.get("execution_count", 0)),
            {part: int(inference.get(part, {}).get("ns", 0)) for part in SERVER_PARTS}))
    return total


@dataclass(frozen=True)
class Window:
    timings: list[Timing]
    seconds: float
    server: ServerStats


@dataclass(frozen=True)
class LevelResult:
    """One load level, as the summary, the CSV and the plot show it (latencies in microseconds)."""

    level: float
    request_count: int
    throughput: float  # inferences per second: requests times batch size
    avg_us: float
    std_us: float
    percentiles_us: dict[int, float]
    send_us: float
    wait_us: float
    recv_us: float
    server: ServerStats
    stable: bool
    delayed: int = 0
    #: Ended early: one of its last three windows reached the latency limit (-l), as perf_analyzer ends a level.
    over_limit: bool = False

    def server_us(self, part: str) -> float:
        count = self.server.success_count
        return self.server.parts_ns.get(part, 0) / count / 1000 if count else 0.0

    @property
    def server_request_us(self) -> float:
        count = self.server.success_count
        return self.server.success_ns / count / 1000 if count else 0.0

    def latency_us(self, percentile: int | None) -> float:
        return self.avg_us if percentile is None else self.percentiles_us[percentile]


def percentile_of(ordered: list[int], percentile: float) -> float:
    """The nearest-rank percentile of sorted values."""
    rank = max(1, math.ceil(percentile / 100 * len(ordered)))
    return float(ordered[rank - 1])


def summarize(level: float, windows: list[Window], batch_size: int, percentile: int | None, stable: bool,
              delayed: int = 0) -> LevelResult:
    timings = [timing for window in windows for timing in window.timings]
    seconds = sum(window.seconds for window in windows)
    server = ServerStats(parts_ns={part: 0 for part in SERVER_PARTS})
    for window in windows:
        server = server.plus(window.server)
    latencies = sorted(timing.end - timing.start for timing in timings)
    count = len(latencies)
    mean = sum(latencies) / count
    variance = sum((value - mean) ** 2 for value in latencies) / count
    wanted = sorted(set(PERCENTILES) | ({percentile} if percentile else set()))
    return LevelResult(
        level=level, request_count=count, throughput=count * batch_size / seconds, avg_us=mean / 1000,
        std_us=math.sqrt(variance) / 1000,
        percentiles_us={p: percentile_of(latencies, p) / 1000 for p in wanted},
        send_us=sum(t.send for t in timings) / count / 1000, wait_us=sum(t.wait for t in timings) / count / 1000,
        recv_us=sum(t.recv for t in timings) / count / 1000, server=server, stable=stable, delayed=delayed,
    )


def is_stable(results: list[LevelResult], stability: float, percentile: int | None) -> bool:
    """Each of the windows' throughput and latency within `stability` percent of their mean."""
    for values in ([r.throughput for r in results], [r.latency_us(percentile) for r in results]):
        mean = sum(values) / len(values)
        if mean == 0 or any(abs(value - mean) > stability / 100 * mean for value in values):
            return False
    return True


def over_limit(options: Options, result: LevelResult) -> bool:
    """Whether the level ends a search with a latency limit (-l): its latency reached it."""
    limit_us = options.latency_threshold_ms * 1000
    return bool(limit_us) and (result.over_limit or result.latency_us(options.percentile) >= limit_us)


def measure(load: Load, level: float, options: Options, read_stats: Callable[[], ServerStats],
            warn: Callable[[str], None]) -> LevelResult:
    """Windows until the last three are stable, one of them reaches the latency limit (-l), or `max_trials`
    windows were taken."""
    windows: list[Window] = []
    results: list[LevelResult] = []
    stable = over = False
    limit_us = options.latency_threshold_ms * 1000
    while len(windows) < options.max_trials:
        before = read_stats()
        load.recorder.take()
        started = time.perf_counter()
        if options.measurement_mode == "count_windows":
            if not load.recorder.wait_for(options.request_count, MAX_WINDOW_MS / 1000):
                raise PerfError(f"fewer than {options.request_count} requests were answered in "
                                f"{MAX_WINDOW_MS / 1000:g} s: lower --measurement-request-count")
        else:
            load.stopping.wait(options.window_ms / 1000)
        timings = load.recorder.take()
        seconds = time.perf_counter() - started
        if load.recorder.error is not None:
            raise load.recorder.error
        window = Window(timings, seconds, read_stats().minus(before))
        if not timings:
            warn(f"no request was answered in a {seconds * 1000:.0f} ms window; increase -p")
            windows.append(window)
            continue
        windows.append(window)
        results.append(summarize(level, [window], options.batch_size, options.percentile, True))
        if options.verbose:
            latest = results[-1]
            print(f"  Pass [{len(windows)}] throughput: {latest.throughput:.2f} infer/sec. "
                  f"{'Avg' if options.percentile is None else f'p{options.percentile}'} latency: "
                  f"{latest.latency_us(options.percentile):.0f} usec", flush=True)
        if len(windows) >= STABLE_WINDOWS and all(w.timings for w in windows[-STABLE_WINDOWS:]) and is_stable(
                results[-STABLE_WINDOWS:], options.stability, options.percentile):
            stable = True
            break
        if limit_us and len(results) >= STABLE_WINDOWS and any(
                r.latency_us(options.percentile) >= limit_us for r in results[-STABLE_WINDOWS:]):
            over = True
            break
    last = [window for window in windows[-STABLE_WINDOWS:] if window.timings]
    if not last:
        raise PerfError(f"no request was answered within {options.max_trials} windows: increase -p or check the "
                        "model")
    result = summarize(level, last, options.batch_size, options.percentile, stable, load.delayed)
    return replace(result, over_limit=over) if over else result
