"""Config checks the schedulers rely on: dynamic_batching as Triton validates it, and instance placement."""

from __future__ import annotations

import pytest

from transerve.config import devices
from transerve.config.model_config import ConfigError, normalize, parse_config_text, validate

BASE = """
name: "m" backend: "python" max_batch_size: 8
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
"""


def load(extra: str, max_batch_size: int = 8):
    config = parse_config_text(BASE.replace("max_batch_size: 8", f"max_batch_size: {max_batch_size}") + extra)
    normalize(config, "m")
    validate(config, "m")
    return config


def test_preferred_batch_size_defaults_to_max_batch_size_as_in_triton():
    def preferred(extra: str, max_batch_size: int = 8) -> list[int]:
        return list(load(extra, max_batch_size).dynamic_batching.preferred_batch_size)

    assert preferred("dynamic_batching { }") == [8]
    assert preferred("dynamic_batching { preferred_batch_size: [ 2, 4 ] }") == [2, 4]
    assert preferred("dynamic_batching { }", max_batch_size=0) == []


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("dynamic_batching { preferred_batch_size: [ 0 ] }", "dynamic batching preferred size must be positive for m"),
        ("dynamic_batching { preferred_batch_size: [ 9 ] }", "preferred size must be <= max batch size for m"),
        ("dynamic_batching { priority_levels: 2 }", "default priority level must be in range [1, 2] for m"),
        (
            "dynamic_batching { priority_levels: 2 default_priority_level: 1 "
            "priority_queue_policy { key: 3 value: { } } }",
            "priority queue policy must have priority level in range [1, 2] for m",
        ),
        (
            "dynamic_batching { preserve_ordering: true priority_levels: 2 default_priority_level: 1 }",
            "Only one priority level is allowed when 'preserve_ordering' is true for m",
        ),
        (
            "dynamic_batching { preserve_ordering: true "
            "default_queue_policy { timeout_action: DELAY default_timeout_microseconds: 10 } }",
            "Queue policy can not have DELAY as timeout action when 'preserve_ordering' is true for m",
        ),
        ('instance_group [ { kind: KIND_CPU gpus: [ 0 ] } ]', "instance group m_0 of model m has kind KIND_CPU but"),
        ('instance_group [ { kind: KIND_MODEL gpus: [ 0 ] } ]', "has kind KIND_MODEL but specifies one or more GPUs"),
    ],
)
def test_triton_rejects_these_and_so_do_we(extra, message):
    with pytest.raises(ConfigError) as caught:
        load(extra)
    assert message in str(caught.value)


@pytest.fixture
def no_gpus(monkeypatch):
    monkeypatch.setattr("transerve.config.model_config.visible_gpus", lambda: ())


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr("transerve.config.model_config.visible_gpus", lambda: (0, 1))


def test_without_gpus_kind_gpu_fails_and_kind_auto_is_cpu(no_gpus):
    with pytest.raises(ConfigError, match="instance group g of model m has kind KIND_GPU but no GPUs are available"):
        load('instance_group [ { name: "g" kind: KIND_GPU } ]')
    with pytest.raises(ConfigError, match="specifies invalid or unsupported gpu id 0"):
        load("instance_group [ { kind: KIND_GPU gpus: [ 0 ] } ]")
    group = load("instance_group [ { kind: KIND_AUTO count: 2 } ]").instance_group[0]
    assert (group.kind, group.count, list(group.gpus)) == (group.KIND_CPU, 2, [])


def test_with_gpus_kind_gpu_gets_every_gpu_and_kind_auto_is_gpu(two_gpus):
    group = load("instance_group [ { kind: KIND_GPU } ]").instance_group[0]
    assert list(group.gpus) == [0, 1]
    auto = load("instance_group [ { kind: KIND_AUTO gpus: [ 1 ] } ]").instance_group[0]
    assert (auto.kind, list(auto.gpus)) == (auto.KIND_GPU, [1])
    with pytest.raises(ConfigError, match="unsupported gpu id 2. Visible GPUs are: 0, 1"):
        load("instance_group [ { kind: KIND_GPU gpus: [ 2 ] } ]")


@pytest.mark.parametrize(
    ("present", "visible", "expected"),
    [(2, None, 2), (2, "", 0), (2, "1", 1), (2, "0,1,5,1", 2), (4, "3,9,0", 1), (1, "GPU-abc", 1), (0, "0", 0)],
)
def test_cuda_visible_devices_counts_as_cuda_does(present, visible, expected):
    assert devices._visible_count(present, visible) == expected
