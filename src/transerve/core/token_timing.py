"""Time to first token and time per output token, per model: the two latencies a text-generation client feels.

Frontends that see tokens arrive (the OpenAI API) record them; the metrics port exposes them as Prometheus
histograms. Buckets are fixed, so recording is a bisect and two integer bumps, and the collector reads plain
numbers without a lock (the event loop is the only writer).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

#: Upper bounds in seconds: from a warm GPU's few milliseconds to a loaded CPU's seconds.
FIRST_TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0,
                       3.0, 5.0, 10.0, 20.0, 40.0)
PER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                     0.5, 0.75, 1.0, 2.5)


@dataclass(slots=True)
class Histogram:
    """Observations counted per bucket (not cumulative; the exposition sums them), with their total."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        """(`le` label, observations at or below it) for each bound, then +Inf."""
        running, rows = 0, []
        for bound, number in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += number
            rows.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return rows


@dataclass(slots=True)
class TokenTimings:
    first_token: Histogram = field(default_factory=lambda: Histogram(FIRST_TOKEN_BUCKETS))
    per_output_token: Histogram = field(default_factory=lambda: Histogram(PER_TOKEN_BUCKETS))

    def record(self, first_token_s: float, decode_s: float, later_tokens: int) -> None:
        """One request: the time its first token took, and the time its other `later_tokens` took after it."""
        self.first_token.observe(first_token_s)
        if later_tokens > 0:
            self.per_output_token.observe(decode_s / later_tokens)
