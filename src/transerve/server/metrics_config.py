"""`--metrics-config <setting>=<value>`: which per-model latency metrics exist, as tritonserver 2.51 reads it.

Triton 2.51 knows three settings: `counter_latencies=false` drops the latency counters, `summary_latencies=true`
adds latency summaries, `summary_quantiles=<q>:<error>[,...]` sets their quantiles. It ignores any other setting
(2.51 has no histogram latencies); so does transerve, with a warning.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass

from transerve.core.summary import DEFAULT_QUANTILES

log = logging.getLogger("transerve")

_LEADING_NUMBER = re.compile(r"\s*[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


@dataclass(frozen=True)
class MetricsConfig:
    counter_latencies: bool = True
    summary_latencies: bool = False
    quantiles: tuple[tuple[float, float], ...] = DEFAULT_QUANTILES


def parse_metrics_config(values: Iterable[str]) -> MetricsConfig:
    """The flags in order, later ones winning; ValueError with tritonserver's message for a malformed one."""
    settings: dict[str, str] = {}
    for text in values:
        setting, equals, value = text.partition("=")
        if not equals or not setting or not value or "," in setting:
            raise ValueError(f"--metrics-config option format is <setting>=<value>. Got {text}")
        if setting not in ("counter_latencies", "summary_latencies", "summary_quantiles"):
            log.warning("--metrics-config setting '%s' is not one Triton 2.51 knows; ignored", setting)
        settings[setting] = value
    quantiles = _quantiles(settings["summary_quantiles"]) if "summary_quantiles" in settings else ()
    return MetricsConfig(
        # As Triton compares them: only these exact spellings change the defaults.
        counter_latencies=settings.get("counter_latencies") != "false",
        summary_latencies=settings.get("summary_latencies") == "true",
        quantiles=quantiles or DEFAULT_QUANTILES,
    )


def _quantiles(text: str) -> tuple[tuple[float, float], ...]:
    """`<quantile>:<error>` pairs separated by commas; a pair that does not parse is logged and skipped, and each
    number is read as C's strtod reads it (its leading number), as Triton does."""
    pairs = []
    for pair in text.split(","):
        quantile, colon, error = pair.partition(":")
        if not colon:
            log.error("Invalid option: [%s]. No ':' delimiter found. Expected format is <quantile>:<error>", pair)
            continue
        numbers = [_LEADING_NUMBER.match(part) for part in (quantile, error)]
        if None in numbers:
            log.error("Invalid option: [%s]. Error: stod", pair)
            continue
        value = float(numbers[0][0])  # type: ignore[index]
        if not 0.0 <= value <= 1.0:
            log.error("Invalid option: [%s]. A quantile is between 0 and 1", pair)
            continue
        pairs.append((value, float(numbers[1][0])))  # type: ignore[index]
    return tuple(pairs)
