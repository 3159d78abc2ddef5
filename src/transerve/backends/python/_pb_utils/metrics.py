"""pb_utils.MetricFamily and Metric: custom metrics whose values live in the server's registry."""

from __future__ import annotations

import weakref
from typing import Any

from transerve.backends.python._pb_utils import link
from transerve.backends.python._pb_utils.errors import TritonModelException, _require
from transerve.backends.python._pb_utils.link import _ask_server
from transerve.backends.python.ipc import OP_METRIC
from transerve.core.custom_metrics import Kind as MetricKind

#: pybind11 exports an enum's values into its module too.
COUNTER, GAUGE, HISTOGRAM = MetricKind.COUNTER, MetricKind.GAUGE, MetricKind.HISTOGRAM


class MetricFamily:
    """A family of custom metrics on the server's /metrics (its values live in the server). As in Triton, a
    family deleted before its metrics makes them unusable."""

    COUNTER = MetricKind.COUNTER
    GAUGE = MetricKind.GAUGE
    HISTOGRAM = MetricKind.HISTOGRAM

    __slots__ = ("_handle", "_kind", "_metrics", "__weakref__")

    def __init__(self, name: str, description: str, kind: MetricKind) -> None:
        self._handle: int | None = None
        _require(name, str, "MetricFamily", "name")
        _require(description, str, "MetricFamily", "description")
        if not isinstance(kind, MetricKind):
            raise TypeError(f"MetricFamily(): kind must be a pb_utils.MetricKind, not {type(kind).__name__}")
        self._kind = kind
        self._metrics: weakref.WeakSet[Metric] = weakref.WeakSet()
        self._handle = _ask_server(
            OP_METRIC, ("family", name, description, int(kind)), "Error when creating MetricFamily"
        )

    def Metric(self, labels: dict[str, str] | None = None, buckets: list[float] | None = None) -> Metric:  # noqa: N802
        """A metric of this family with these labels (the same labels share one value); a histogram needs its
        bucket boundaries."""
        if labels is not None and not isinstance(labels, dict):
            raise TritonModelException("Failed to create metric. Labels must be a dictionary.")
        if buckets is not None:
            if not isinstance(buckets, list):
                raise TritonModelException("Failed to create metric. Buckets must be a list.")
            if self._kind != MetricKind.HISTOGRAM:
                raise TritonModelException("Failed to create metric. Unexpected buckets found.")
            buckets = [_number(bound, "buckets") for bound in buckets]
        elif self._kind == MetricKind.HISTOGRAM:
            raise TritonModelException("Failed to create metric. Missing required buckets.")
        metric = Metric(_ask_server(OP_METRIC, ("metric", self._handle, labels or {}, buckets),
                                    "Error when creating Metric"))
        self._metrics.add(metric)
        return metric

    def __del__(self) -> None:
        for metric in list(self._metrics):
            metric._clear()
        if self._handle is not None and link._channel is not None:
            link._channel.later.append((OP_METRIC, 0, ("delete", self._handle)))


class Metric:
    """One metric of a MetricFamily (made by `MetricFamily.Metric`)."""

    __slots__ = ("_handle", "_cleared", "__weakref__")

    def __init__(self, handle: int) -> None:
        self._handle = handle
        self._cleared = False

    def increment(self, value: float) -> None:
        self._operate("increment", value, "Failed to increment metric value")

    def set(self, value: float) -> None:
        self._operate("set", value, "Failed to set metric value")

    def observe(self, value: float) -> None:
        self._operate("observe", value, "Failed to observe metric value")

    def value(self) -> float:
        return float(self._operate("value", None, "Failed to get metric value"))

    def _operate(self, action: str, value: float | None, failure: str) -> Any:
        body = (action, self._handle) if value is None else (action, self._handle, _number(value, "value"))
        if self._cleared:
            raise TritonModelException(
                f"{failure}: Invalid metric operation as the corresponding 'MetricFamily' has been deleted. The "
                "'MetricFamily' object should be deleted AFTER its corresponding 'Metric' objects have been deleted."
            )
        return _ask_server(OP_METRIC, body, failure)

    def _clear(self) -> None:
        if not self._cleared:
            self._cleared = True
            if link._channel is not None:
                link._channel.later.append((OP_METRIC, 0, ("delete", self._handle)))

    def __del__(self) -> None:
        self._clear()


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, not {type(value).__name__}")
    return float(value)
