"""Custom metrics that model code creates (the python backend's `pb_utils.MetricFamily`), served on /metrics beside
Triton's own families.

As in Triton (its core's metric families over prometheus-cpp): a family is registered once per name, and creating it
again with the same kind returns it, keeping the first description, while another kind is refused. Each family or
metric a model creates is a handle; handles to the same labels of a family share one series, which disappears with
its last handle. A family stays registered once created (prometheus-cpp never unregisters one), but only series are
written out. Errors carry Triton's words. Everything is bounded: families, series, labels, buckets and text lengths,
so that model code cannot grow the server without limit. The registry holds plain numbers; `frontends/metrics.py`
turns them into the exposition format.
"""

from __future__ import annotations

import bisect
import enum
import itertools
import math
import re
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field

from transerve.core.errors import ErrorCode, ServerError

MAX_FAMILIES = 1024
MAX_SERIES = 16384
MAX_HANDLES = 65536
MAX_LABELS = 32
MAX_BUCKETS = 256
MAX_TEXT = 1024

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


class Kind(enum.IntEnum):
    """pb_utils.MetricFamily.COUNTER, GAUGE and HISTOGRAM."""

    COUNTER = 0
    GAUGE = 1
    HISTOGRAM = 2


@dataclass(slots=True)
class Series:
    """One labelled metric of a family: its value, or a histogram's bucket counts, sum and count."""

    labels: dict[str, str]
    value: float = 0.0
    buckets: tuple[float, ...] = ()
    counts: list[int] = field(default_factory=list)
    count: int = 0
    handles: int = 0


@dataclass(slots=True)
class Family:
    name: str
    description: str
    kind: Kind
    series: dict[frozenset[tuple[str, str]], Series] = field(default_factory=dict)


class CustomMetrics:
    """The custom metric families of one server and the handles model code holds to them."""

    def __init__(self) -> None:
        self._families: dict[str, Family] = {}
        self._handles: dict[int, tuple[Hashable, Family, Series | None]] = {}
        self._ids = itertools.count(1)
        self._series = 0

    # ---- what model code asks -------------------------------------------------------------------------

    def new_family(self, owner: Hashable, name: str, description: str, kind: int) -> int:
        """A handle to the family `name`, registered now unless it exists with the same kind."""
        if len(name) > MAX_TEXT or len(description) > MAX_TEXT:
            raise _invalid(f"metric family names and descriptions are limited to {MAX_TEXT} characters")
        if kind not in Kind.__members__.values():
            raise _invalid("Unsupported kind passed to MetricFamily constructor.")
        family = self._families.get(name)
        if family is None:
            if name.startswith("__") or not _METRIC_NAME.fullmatch(name):
                raise _invalid("Invalid metric name")
            if len(self._families) >= MAX_FAMILIES:
                raise _invalid(f"no more than {MAX_FAMILIES} custom metric families can be registered")
            family = self._families[name] = Family(name, description, Kind(kind))
        elif family.kind != kind:
            raise _invalid("Family name already exists with different type")
        return self._handle(owner, family, None)

    def new_metric(
        self, owner: Hashable, family_handle: int, labels: dict[str, str], buckets: list[float] | None
    ) -> int:
        """A handle to the series of `labels` in a family, created now unless it exists (its buckets then stay)."""
        family = self._family(family_handle)
        if len(labels) > MAX_LABELS:
            raise _invalid(f"a custom metric has at most {MAX_LABELS} labels")
        for key, value in labels.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise _invalid("metric labels must map strings to strings")
            if len(key) > MAX_TEXT or len(value) > MAX_TEXT:
                raise _invalid(f"metric labels are limited to {MAX_TEXT} characters")
            reserved = key.startswith("__") or (key == "le" and family.kind is Kind.HISTOGRAM)
            if reserved or not _LABEL_NAME.fullmatch(key):
                raise _invalid("Invalid label name")
        if family.kind is Kind.HISTOGRAM:
            if buckets is None:
                raise _invalid("Bucket boundaries not found in Metric args.")
            if len(buckets) > MAX_BUCKETS:
                raise _invalid(f"a histogram has at most {MAX_BUCKETS} buckets")
            if any(not later > earlier for earlier, later in itertools.pairwise(buckets)):
                raise _invalid("Bucket Boundaries must be strictly sorted")
        elif buckets is not None:
            kind = "counter" if family.kind is Kind.COUNTER else "gauge"
            raise _invalid(f"Unexpected args found in {kind} Metric constructor.")
        key = frozenset(labels.items())
        series = family.series.get(key)
        if series is None:
            if self._series >= MAX_SERIES:
                raise _invalid(f"no more than {MAX_SERIES} custom metrics can exist")
            bounds = tuple(float(bound) for bound in buckets or ())
            series = Series(dict(labels), buckets=bounds, counts=[0] * len(bounds))
            family.series[key] = series
            self._series += 1
        return self._handle(owner, family, series)

    def delete(self, handle: int) -> None:
        """Release a family's or a metric's handle; a series goes with its last handle. Unknown handles are ignored
        (a model's handles are released when its worker goes, whatever it sent)."""
        entry = self._handles.pop(handle, None)
        if entry is None:
            return
        _, family, series = entry
        if series is not None:
            series.handles -= 1
            if series.handles == 0:
                del family.series[frozenset(series.labels.items())]
                self._series -= 1

    def release(self, owner: Hashable) -> None:
        """Every handle `owner` holds (a worker that is gone)."""
        for handle in [handle for handle, (holder, _, _) in self._handles.items() if holder == owner]:
            self.delete(handle)

    def increment(self, handle: int, value: float) -> None:
        kind, series = self._metric(handle)
        if kind is Kind.COUNTER:
            if value < 0.0:
                raise _invalid(
                    "TRITONSERVER_METRIC_KIND_COUNTER can only be incremented monotonically by non-negative values."
                )
        elif kind is Kind.HISTOGRAM:
            raise _unsupported(kind, "Increment")
        series.value += value

    def set(self, handle: int, value: float) -> None:
        kind, series = self._metric(handle)
        if kind is not Kind.GAUGE:
            raise _unsupported(kind, "Set")
        series.value = value

    def observe(self, handle: int, value: float) -> None:
        kind, series = self._metric(handle)
        if kind is not Kind.HISTOGRAM:
            raise _unsupported(kind, "Observe")
        index = bisect.bisect_left(series.buckets, value)
        for position in range(index, len(series.counts)):
            series.counts[position] += 1
        series.count += 1
        series.value += value

    def value(self, handle: int) -> float:
        kind, series = self._metric(handle)
        if kind is Kind.HISTOGRAM:
            raise _unsupported(kind, "Value")
        return series.value

    # ---- what /metrics shows --------------------------------------------------------------------------

    def families(self) -> Iterator[tuple[str, str, str, list[tuple[str, dict[str, str], float]]]]:
        """(name, description, type, samples) of each family with series; a sample is (name, labels, value)."""
        for family in self._families.values():
            if not family.series:
                continue
            samples: list[tuple[str, dict[str, str], float]] = []
            for series in family.series.values():
                if family.kind is not Kind.HISTOGRAM:
                    samples.append((family.name, series.labels, series.value))
                    continue
                samples.append((f"{family.name}_count", series.labels, float(series.count)))
                samples.append((f"{family.name}_sum", series.labels, series.value))
                for bound, count in zip(series.buckets, series.counts, strict=True):
                    samples.append((f"{family.name}_bucket", {**series.labels, "le": _bound(bound)}, float(count)))
                samples.append((f"{family.name}_bucket", {**series.labels, "le": "+Inf"}, float(series.count)))
            yield family.name, family.description, family.kind.name.lower(), samples

    # ---- handles ----------------------------------------------------------------------------------------

    def _handle(self, owner: Hashable, family: Family, series: Series | None) -> int:
        if len(self._handles) >= MAX_HANDLES:
            raise _invalid(f"no more than {MAX_HANDLES} custom metric objects can exist")
        handle = next(self._ids)
        self._handles[handle] = (owner, family, series)
        if series is not None:
            series.handles += 1
        return handle

    def _family(self, handle: int) -> Family:
        entry = self._handles.get(handle)
        if entry is None or entry[2] is not None:
            raise ServerError(ErrorCode.INTERNAL, "the metric family has been deleted")
        return entry[1]

    def _metric(self, handle: int) -> tuple[Kind, Series]:
        entry = self._handles.get(handle)
        if entry is None or entry[2] is None:
            raise ServerError(ErrorCode.INTERNAL, "Metric has been invalidated.")
        return entry[1].kind, entry[2]


def _bound(bound: float) -> str:
    """A bucket's upper bound as prometheus-cpp writes it: 0.1, 1, 2.5."""
    return "+Inf" if math.isinf(bound) and bound > 0 else f"{bound:.16g}"


def _invalid(message: str) -> ServerError:
    return ServerError(ErrorCode.INVALID_ARG, message)


def _unsupported(kind: Kind, operation: str) -> ServerError:
    return ServerError(ErrorCode.UNSUPPORTED, f"TRITONSERVER_METRIC_KIND_{kind.name} does not support {operation}")
