"""Per model-version statistics in Triton's shape (`/v2/models/.../stats`, ModelStatistics).

Counters are plain integers mutated on the event loop thread, so no lock is needed and
none serialises requests.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from transerve.core.errors import ErrorCode
from transerve.core.summary import LatencySummary
from transerve.core.token_timing import TokenTimings

FAILURE_REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER")
#: Validation failures never reach the statistics (as in Triton), so what fails here was either refused by
#: the scheduler (queue full, timed out), cancelled, or failed in the model.
_FAILURE_REASON = {ErrorCode.UNAVAILABLE: "REJECTED", ErrorCode.CANCELLED: "CANCELED"}


@dataclass(slots=True)
class Duration:
    count: int = 0
    ns: int = 0
    #: With `summary_latencies`, each request's duration in microseconds is observed here too.
    summary: LatencySummary | None = None

    def add(self, ns: int, count: int = 1) -> None:
        """`count` requests that took `ns` together (a batch's requests are each charged the same time)."""
        self.count += count
        self.ns += ns
        if self.summary is not None and count:
            self.summary.observe(ns // count // 1000, count)

    def as_dict(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass(slots=True)
class BatchStats:
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


@dataclass(slots=True)
class ModelStats:
    """What Triton reports per model version: request outcomes, time per phase, batches formed."""

    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    #: Response cache lookups that answered the request, and those that did not (lookup plus insertion time).
    cache_hit: Duration = field(default_factory=Duration)
    cache_miss: Duration = field(default_factory=Duration)
    batches: dict[int, BatchStats] = field(default_factory=dict)
    #: Failed requests by Triton's metric reason (REJECTED, CANCELED, BACKEND, OTHER).
    failures: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAILURE_REASONS, 0))
    load_duration_secs: float = 0.0
    #: Time to first token and per output token, recorded by frontends that stream tokens (the OpenAI API).
    tokens: TokenTimings = field(default_factory=TokenTimings)

    def add_summaries(self, quantiles: Sequence[tuple[float, float]], cached: bool) -> None:
        """Observe the latencies Triton summarises: request (not for a model with the response cache, whose
        request summary Triton 2.51 leaves out), queue and compute, and cache hits and misses when it caches."""
        durations = ["queue", "compute_input", "compute_infer", "compute_output"]
        durations += ["cache_hit", "cache_miss"] if cached else ["success"]
        for name in durations:
            getattr(self, name).summary = LatencySummary(quantiles)

    def record_failure(self, code: ErrorCode, duration_ns: int) -> None:
        """A request that failed after validation: in the scheduler's queue or in the model."""
        self.fail.add(duration_ns)
        self.failures[_FAILURE_REASON.get(code, "BACKEND")] += 1

    def record_outcome(self, code: ErrorCode | None, duration_ns: int) -> None:
        """A request that ran to its end after its client went away, counted by how it ended (None: it succeeded),
        as Triton counts what its backend reports."""
        if code is None:
            self.success.add(duration_ns)
        else:
            self.record_failure(code, duration_ns)

    def record_execution(
        self,
        batch_size: int,
        request_count: int,
        input_ns: int,
        infer_ns: int,
        output_ns: int,
        inferences: int | None = None,
    ) -> None:
        """One backend execution of `request_count` requests holding `batch_size` samples, of which
        `inferences` (default: all) were asked for by clients; the sequence batcher pads with null requests."""
        self.execution_count += 1
        self.inference_count += batch_size if inferences is None else inferences
        self.last_inference_ms = time.time_ns() // 1_000_000
        # Triton charges each request the full compute time of the execution it was part of.
        self.compute_input.add(input_ns * request_count, request_count)
        self.compute_infer.add(infer_ns * request_count, request_count)
        self.compute_output.add(output_ns * request_count, request_count)
        batch = self.batches.get(batch_size)
        if batch is None:
            batch = self.batches[batch_size] = BatchStats()
        batch.compute_input.add(input_ns)
        batch.compute_infer.add(infer_ns)
        batch.compute_output.add(output_ns)

    def as_dict(self, name: str, version: str) -> dict:
        return {
            "name": name,
            "version": version,
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {
                "success": self.success.as_dict(),
                "fail": self.fail.as_dict(),
                "queue": self.queue.as_dict(),
                "compute_input": self.compute_input.as_dict(),
                "compute_infer": self.compute_infer.as_dict(),
                "compute_output": self.compute_output.as_dict(),
                "cache_hit": self.cache_hit.as_dict(),
                "cache_miss": self.cache_miss.as_dict(),
            },
            "response_stats": {},
            "batch_stats": [
                {
                    "batch_size": size,
                    "compute_input": batch.compute_input.as_dict(),
                    "compute_infer": batch.compute_infer.as_dict(),
                    "compute_output": batch.compute_output.as_dict(),
                }
                for size, batch in sorted(self.batches.items())
            ],
            "memory_usage": [],
        }


@dataclass(slots=True)
class EnsembleStats(ModelStats):
    """An ensemble's statistics, whose failures Triton 2.51 counts its own way, which dashboards and Triton's
    tests read: as reason OTHER whatever failed, and twice per request (once as the error is answered, once as
    the request is released), in `fail` as in `nv_inference_request_failure`."""

    def record_failure(self, code: ErrorCode, duration_ns: int) -> None:
        self.fail.add(2 * duration_ns, 2)
        self.failures["OTHER"] += 2
