"""The registry behind pb_utils.MetricFamily: Triton's sharing rules, its errors, and the bounds."""

import pytest

from transerve.core import custom_metrics
from transerve.core.custom_metrics import CustomMetrics, Kind
from transerve.core.errors import ErrorCode, ServerError


def samples(registry: CustomMetrics) -> dict[str, list]:
    return {name: [(sample, labels, value) for sample, labels, value in found]
            for name, _, _, found in registry.families()}


def test_handles_to_the_same_labels_share_one_series_until_the_last_goes():
    registry = CustomMetrics()
    first = registry.new_family("w1", "a", "first", Kind.COUNTER)
    again = registry.new_family("w2", "a", "second", Kind.COUNTER)  # same kind: the same family, first description
    one = registry.new_metric("w1", first, {"k": "v"}, None)
    two = registry.new_metric("w2", again, {"k": "v"}, None)
    registry.increment(one, 2.5)
    assert registry.value(two) == 2.5
    assert [(name, text) for name, text, _, _ in registry.families()] == [("a", "first")]
    registry.delete(one)
    assert samples(registry) == {"a": [("a", {"k": "v"}, 2.5)]}
    registry.release("w2")
    assert samples(registry) == {}  # no series left: the family is not written out
    with pytest.raises(ServerError, match="Metric has been invalidated"):
        registry.value(two)


def test_values_follow_each_kind():
    registry = CustomMetrics()
    gauge = registry.new_metric("w", registry.new_family("w", "g", "", Kind.GAUGE), {}, None)
    registry.set(gauge, 5)
    registry.increment(gauge, -1.5)
    assert registry.value(gauge) == 3.5
    histogram = registry.new_metric("w", registry.new_family("w", "h", "", Kind.HISTOGRAM), {"x": "1"}, [0.1, 1, 2.5])
    for value in (0.05, 1.0, 6.0):
        registry.observe(histogram, value)
    assert samples(registry)["h"] == [
        ("h_count", {"x": "1"}, 3.0), ("h_sum", {"x": "1"}, 7.05), ("h_bucket", {"x": "1", "le": "0.1"}, 1.0),
        ("h_bucket", {"x": "1", "le": "1"}, 2.0), ("h_bucket", {"x": "1", "le": "2.5"}, 2.0),
        ("h_bucket", {"x": "1", "le": "+Inf"}, 3.0)]
    registry.observe(registry.new_metric("w", registry.new_family("w", "e", "", Kind.HISTOGRAM), {}, []), 1.0)
    assert samples(registry)["e"] == [("e_count", {}, 1.0), ("e_sum", {}, 1.0), ("e_bucket", {"le": "+Inf"}, 1.0)]


@pytest.mark.parametrize(
    ("call", "code", "message"),
    [
        (lambda r, c, g, h: r.increment(c, -1), ErrorCode.INVALID_ARG, "incremented monotonically"),
        (lambda r, c, g, h: r.set(c, 1), ErrorCode.UNSUPPORTED, "COUNTER does not support Set"),
        (lambda r, c, g, h: r.observe(g, 1), ErrorCode.UNSUPPORTED, "GAUGE does not support Observe"),
        (lambda r, c, g, h: r.value(h), ErrorCode.UNSUPPORTED, "HISTOGRAM does not support Value"),
        (lambda r, c, g, h: r.increment(h, 1), ErrorCode.UNSUPPORTED, "HISTOGRAM does not support Increment"),
        (lambda r, c, g, h: r.new_family("w", "c", "", Kind.GAUGE), ErrorCode.INVALID_ARG, "different type"),
        (lambda r, c, g, h: r.new_family("w", "9x", "", Kind.GAUGE), ErrorCode.INVALID_ARG, "Invalid metric name"),
        (lambda r, c, g, h: r.new_family("w", "x", "", 7), ErrorCode.INVALID_ARG, "Unsupported kind"),
        # Handles 1, 3 and 5 are the counter, gauge and histogram families.
        (lambda r, c, g, h: r.new_metric("w", 1, {"a-b": "1"}, None), ErrorCode.INVALID_ARG, "Invalid label name"),
        (lambda r, c, g, h: r.new_metric("w", 5, {"le": "1"}, [1.0]), ErrorCode.INVALID_ARG, "Invalid label name"),
        (lambda r, c, g, h: r.new_metric("w", 5, {}, [1, 1]), ErrorCode.INVALID_ARG, "strictly sorted"),
        (lambda r, c, g, h: r.new_metric("w", 5, {}, None), ErrorCode.INVALID_ARG, "Bucket boundaries not found"),
        (lambda r, c, g, h: r.new_metric("w", 3, {}, [1.0]), ErrorCode.INVALID_ARG, "Unexpected args found in gauge"),
    ],
)
def test_tritons_errors(call, code, message):
    registry = CustomMetrics()
    counter = registry.new_metric("w", registry.new_family("w", "c", "", Kind.COUNTER), {}, None)
    gauge = registry.new_metric("w", registry.new_family("w", "g", "", Kind.GAUGE), {}, None)
    histogram = registry.new_metric("w", registry.new_family("w", "h", "", Kind.HISTOGRAM), {}, [1.0])
    with pytest.raises(ServerError) as raised:
        call(registry, counter, gauge, histogram)
    assert raised.value.code == code and message in raised.value.message


def test_model_code_cannot_grow_the_registry_without_bound(monkeypatch):
    monkeypatch.setattr(custom_metrics, "MAX_FAMILIES", 2)
    monkeypatch.setattr(custom_metrics, "MAX_SERIES", 3)
    registry = CustomMetrics()
    family = registry.new_family("w", "a", "", Kind.GAUGE)
    registry.new_family("w", "b", "", Kind.GAUGE)
    with pytest.raises(ServerError, match="no more than 2 custom metric families"):
        registry.new_family("w", "c", "", Kind.GAUGE)
    for index in range(3):
        registry.new_metric("w", family, {"i": str(index)}, None)
    with pytest.raises(ServerError, match="no more than 3 custom metrics"):
        registry.new_metric("w", family, {"i": "3"}, None)
    with pytest.raises(ServerError, match="at most 32 labels"):
        registry.new_metric("w", family, {f"l{i}": "x" for i in range(33)}, None)
    with pytest.raises(ServerError, match="limited to 1024 characters"):
        registry.new_metric("w", family, {"l": "x" * 1025}, None)
