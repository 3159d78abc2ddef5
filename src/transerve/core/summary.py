"""Latency summaries (`--metrics-config summary_latencies=true`): Triton's per-model Prometheus summaries.

Like the prometheus-cpp summaries Triton 2.51 uses, the quantiles describe a sliding window of the last
`max_age` seconds, kept in `age_buckets` slices so that old observations leave a slice at a time, while the
sum and count cover the whole life of the model. prometheus-cpp estimates quantiles with CKMS within an error
per quantile; here a slice keeps its observations exactly up to `SLICE_CAPACITY` and a uniform sample beyond,
so quantiles are exact (nearest rank) under that many observations per slice and closely estimated above it.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence

#: Triton's default quantiles and their allowed errors (`summary_quantiles` replaces them).
DEFAULT_QUANTILES: tuple[tuple[float, float], ...] = ((0.5, 0.05), (0.9, 0.01), (0.95, 0.001), (0.99, 0.001),
                                                      (0.999, 0.001))
#: prometheus-cpp's defaults, which Triton does not change.
MAX_AGE_S = 60.0
AGE_BUCKETS = 5
#: Observations one slice keeps; memory stays bounded however fast requests come.
SLICE_CAPACITY = 2048


class _Slice:
    __slots__ = ("values", "seen")

    def __init__(self) -> None:
        self.values: list[int] = []
        self.seen = 0

    def add(self, value: int, times: int, rng: random.Random) -> None:
        room = min(SLICE_CAPACITY - len(self.values), times)
        if room > 0:
            self.values.extend([value] * room)
            self.seen += room
            times -= room
        for _ in range(times):  # reservoir sampling: each observation of the slice is kept with equal probability
            self.seen += 1
            index = rng.randrange(self.seen)
            if index < SLICE_CAPACITY:
                self.values[index] = value


class LatencySummary:
    """Observations in microseconds: cumulative sum and count, and quantiles over a sliding window."""

    __slots__ = ("quantiles", "sum", "count", "_slices", "_slice_s", "_slice_end", "_clock", "_rng")

    def __init__(self, quantiles: Sequence[tuple[float, float]] = DEFAULT_QUANTILES, max_age_s: float = MAX_AGE_S,
                 age_buckets: int = AGE_BUCKETS, clock: Callable[[], float] = time.monotonic) -> None:
        self.quantiles = [quantile for quantile, _ in quantiles]
        self.sum = 0
        self.count = 0
        self._slices = [_Slice() for _ in range(age_buckets)]
        self._slice_s = max_age_s / age_buckets
        self._clock = clock
        self._slice_end = clock() + self._slice_s
        self._rng = random.Random(0)

    def observe(self, value: int, times: int = 1) -> None:
        """`times` observations of `value` (a batch's requests each took the same compute time)."""
        self._rotate()
        self.sum += value * times
        self.count += times
        self._slices[-1].add(value, times, self._rng)

    def values(self) -> list[tuple[float, float]]:
        """(quantile, value) over the window; NaN when the window is empty, as Prometheus summaries report."""
        self._rotate()
        weighted = sorted((value, part.seen / len(part.values)) for part in self._slices for value in part.values)
        total = sum(weight for _, weight in weighted)
        answers = []
        for quantile in self.quantiles:
            answers.append((quantile, _nearest_rank(weighted, quantile * total) if weighted else math.nan))
        return answers

    def _rotate(self) -> None:
        """Retire the slices older than the window: a new empty slice per `max_age / age_buckets` elapsed."""
        now = self._clock()
        if now < self._slice_end:
            return
        steps = int((now - self._slice_end) // self._slice_s) + 1
        retired = min(steps, len(self._slices))
        self._slices = self._slices[retired:] + [_Slice() for _ in range(retired)]
        self._slice_end += steps * self._slice_s


def _nearest_rank(weighted: list[tuple[int, float]], rank: float) -> float:
    """The smallest value whose cumulative weight reaches `rank`."""
    cumulative = 0.0
    for value, weight in weighted:
        cumulative += weight
        if cumulative >= rank - 1e-9:
            return float(value)
    return float(weighted[-1][0])
