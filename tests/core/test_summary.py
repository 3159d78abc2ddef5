"""Latency summaries and `--metrics-config` parsing, on a fake clock (the end-to-end comparison with Triton is in
tests/e2e/test_metrics.py)."""

from __future__ import annotations

import logging
import math

import pytest

from transerve.core.stats import ModelStats
from transerve.core.summary import DEFAULT_QUANTILES, SLICE_CAPACITY, LatencySummary
from transerve.server.metrics_config import MetricsConfig, parse_metrics_config


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_quantiles_are_nearest_ranks_and_sum_and_count_cumulative() -> None:
    clock = Clock()
    summary = LatencySummary(((0.5, 0.05), (0.9, 0.01), (1.0, 0.0)), clock=clock)
    assert all(math.isnan(value) for _, value in summary.values())  # an empty window, as Prometheus reports it
    for value in range(1, 11):
        summary.observe(value)
    assert summary.values() == [(0.5, 5.0), (0.9, 9.0), (1.0, 10.0)]
    assert (summary.sum, summary.count) == (55, 10)


def test_observations_leave_the_window_after_max_age() -> None:
    clock = Clock()
    summary = LatencySummary(((0.5, 0.05),), max_age_s=60.0, age_buckets=5, clock=clock)
    summary.observe(1000, times=3)
    clock.now = 30.0
    summary.observe(1)
    assert summary.values() == [(0.5, 1000.0)]
    clock.now = 61.0  # the first three are older than the window now
    assert summary.values() == [(0.5, 1.0)]
    clock.now = 500.0
    assert math.isnan(summary.values()[0][1])
    assert (summary.sum, summary.count) == (3001, 4)


def test_a_busy_window_keeps_bounded_samples_and_close_quantiles() -> None:
    summary = LatencySummary(((0.5, 0.05), (0.99, 0.001)), clock=Clock())
    for value in range(100_000):
        summary.observe(value)
    assert sum(len(part.values) for part in summary._slices) <= SLICE_CAPACITY * len(summary._slices)
    (_, median), (_, p99) = summary.values()
    assert abs(median - 50_000) < 3_000 and abs(p99 - 99_000) < 1_000


def test_stats_observe_per_request_durations_in_microseconds() -> None:
    stats = ModelStats()
    stats.add_summaries(DEFAULT_QUANTILES, cached=False)
    stats.success.add(2_500_000)
    stats.record_execution(batch_size=4, request_count=2, input_ns=10_000, infer_ns=30_000, output_ns=0)
    assert (stats.success.summary.count, stats.success.summary.sum) == (1, 2500)
    assert (stats.compute_infer.summary.count, stats.compute_infer.summary.sum) == (2, 60)
    assert stats.cache_hit.summary is None
    cached = ModelStats()
    cached.add_summaries(DEFAULT_QUANTILES, cached=True)
    assert cached.success.summary is None and cached.cache_miss.summary is not None


def test_metrics_config_reads_tritons_settings() -> None:
    assert parse_metrics_config([]) == MetricsConfig()
    config = parse_metrics_config(["summary_latencies=true", "counter_latencies=false",
                                   "summary_quantiles=0.5:0.05,0.75x:0.01"])
    assert config == MetricsConfig(counter_latencies=False, summary_latencies=True,
                                   quantiles=((0.5, 0.05), (0.75, 0.01)))
    # Only Triton's exact spellings change anything.
    assert parse_metrics_config(["summary_latencies=True", "counter_latencies=0"]) == MetricsConfig()


def test_bad_quantiles_are_logged_and_skipped(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR):
        config = parse_metrics_config(["summary_quantiles=bad,x:0.1,2:0.1"])
    assert config.quantiles == DEFAULT_QUANTILES
    assert "No ':' delimiter found" in caplog.text


def test_unknown_settings_are_ignored_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert parse_metrics_config(["histogram_latencies=true"]) == MetricsConfig()
    assert "histogram_latencies" in caplog.text


@pytest.mark.parametrize("value", ["foo", "=x", "a=", "a,b=c"])
def test_malformed_settings_are_refused(value: str) -> None:
    with pytest.raises(ValueError, match=f"--metrics-config option format is <setting>=<value>. Got {value}"):
        parse_metrics_config([value])
