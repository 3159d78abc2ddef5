"""Time to first token and time per output token, per model: the two latencies a text-generation client feels,
with the token counts and end-to-end latencies vLLM's metrics report beside them.

Frontends that see tokens arrive (the OpenAI API) record them; the metrics port exposes them as Prometheus
histograms and counters, under transerve's names and vLLM's. Buckets are fixed, so recording is a bisect and two
integer bumps, and the collector reads plain numbers without a lock (the event loop is the only writer).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

#: Upper bounds in seconds: from a warm GPU's few milliseconds to a loaded CPU's seconds.
FIRST_TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0,
                       3.0, 5.0, 10.0, 20.0, 40.0)
PER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                     0.5, 0.75, 1.0, 2.5)
#: A whole request, from a short answer to a long one on a loaded CPU.
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0)
#: How a request ended, as vLLM's `request_success` counts it.
FINISH_REASONS = ("stop", "length", "abort")


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
    #: Each gap between two arrivals of a sequence's tokens (vLLM's inter-token latency).
    inter_token: Histogram = field(default_factory=lambda: Histogram(PER_TOKEN_BUCKETS))
    end_to_end: Histogram = field(default_factory=lambda: Histogram(REQUEST_BUCKETS))
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))
    #: Sequences a frontend has in the model now (started and not ended).
    active: int = 0

    def record(self, first_token_s: float, decode_s: float, later_tokens: int) -> None:
        """One request: the time its first token took, and the time its other `later_tokens` took after it."""
        self.first_token.observe(first_token_s)
        if later_tokens > 0:
            self.per_output_token.observe(decode_s / later_tokens)

    def record_request(self, prompt_tokens: int, generation_tokens: int, seconds: float) -> None:
        """One request that ended well: its tokens (as its usage reports them) and its end-to-end time."""
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += generation_tokens
        self.end_to_end.observe(seconds)

    def record_finish(self, finish: str | None) -> None:
        """How one sequence ended (None: it did not end by itself: its client went away, or it failed)."""
        self.finished[finish if finish in self.finished else "abort"] += 1
