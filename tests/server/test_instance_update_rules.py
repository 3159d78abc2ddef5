"""Which config changes update a model's instances in place, and which instances an update keeps, adds and removes
(Triton's rules: configs compared without `instance_group` and `version_policy`; instances matched by their group's
settings without name and count)."""

from __future__ import annotations

import pytest
from support.scheduling import HeldInstance, model_config

from transerve.server.instance_update import instance_groups, needs_reload, plan


def config(groups: str, extra: str = "") -> object:
    return model_config(f"""
        name: "m" backend: "python" max_batch_size: 0
        input [ {{ name: "IN" data_type: TYPE_INT32 dims: [ 1 ] }} ]
        output [ {{ name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
        instance_group [ {groups} ]
        {extra}""")


def loaded(groups: str) -> list:
    """The instances a model loaded with these groups has, named as backends name them."""
    cfg = config(groups)
    names = [f"{group.name}_{index}" for group in cfg.instance_group for index in range(group.count)]
    current = instance_groups(cfg, [HeldInstance(name) for name in names])
    assert current is not None
    return current


@pytest.mark.parametrize("new", [
    "{ count: 4 kind: KIND_CPU }", '{ name: "other" count: 1 kind: KIND_CPU }', "{ count: 1 kind: KIND_CPU }",
    "{ count: 1 kind: KIND_CPU }, { count: 2 kind: KIND_MODEL }",
])
def test_instance_groups_alone_update_in_place(new: str) -> None:
    assert not needs_reload(config("{ count: 1 kind: KIND_CPU }"), config(new))


@pytest.mark.parametrize("extra", [
    "dynamic_batching { }",
    'parameters { key: "p" value: { string_value: "1" } }',
    "sequence_batching { direct { } }",
])
def test_any_other_change_reloads(extra: str) -> None:
    assert needs_reload(config("{ count: 1 kind: KIND_CPU }"), config("{ count: 2 kind: KIND_CPU }", extra))


def test_a_version_policy_change_alone_does_not_reload() -> None:
    before = config("{ count: 1 kind: KIND_CPU }")
    after = config("{ count: 1 kind: KIND_CPU }", "version_policy { all { } }")
    assert not needs_reload(before, after)


def test_a_count_change_keeps_the_oldest_and_names_new_ones_after_free_indexes() -> None:
    current = loaded("{ count: 3 kind: KIND_CPU }")
    kept, added, removed = plan(current, config("{ count: 1 kind: KIND_CPU }"))
    assert [instance.name for instance, _ in kept] == ["m_0_0"]
    assert [instance.name for instance in removed] == ["m_0_1", "m_0_2"]
    assert added == []
    kept, added, removed = plan(kept, config("{ count: 3 kind: KIND_CPU }"))
    assert [placement.name for placement, _ in added] == ["m_0_1", "m_0_2"] and removed == []


def test_count_zero_is_one() -> None:
    current = loaded("{ count: 1 kind: KIND_CPU }")
    kept, added, removed = plan(current, config("{ count: 0 kind: KIND_CPU }"))
    assert len(kept) == 1 and added == [] and removed == []


def test_instances_are_matched_by_their_group_settings_not_its_name() -> None:
    current = loaded('{ name: "a" count: 2 kind: KIND_CPU }')
    renamed = config('{ name: "b" count: 1 kind: KIND_CPU }, { name: "c" count: 2 kind: KIND_CPU }')
    kept, added, removed = plan(current, renamed)
    assert [instance.name for instance, _ in kept] == ["a_0", "a_1"]
    assert [placement.name for placement, _ in added] == ["c_0"] and removed == []
    other_kind = config('{ name: "a" count: 2 kind: KIND_MODEL }')
    kept, added, removed = plan(current, other_kind)
    assert kept == [] and [placement.kind for placement, _ in added] == ["MODEL", "MODEL"]
    assert [instance.name for instance in removed] == ["a_0", "a_1"]
    assert {placement.name for placement, _ in added}.isdisjoint({"a_0", "a_1"})


def test_instances_that_do_not_follow_the_config_cannot_be_updated() -> None:
    assert instance_groups(config("{ count: 2 kind: KIND_CPU }"), [HeldInstance("x")]) is None
