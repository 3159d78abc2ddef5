"""Instance-group updates in place, as Triton makes them.

A load of a model that is serving, whose config differs from the one it was loaded with in `instance_group`
(or `version_policy`) only and whose other files did not change, changes its instances rather than reloading it:
Triton's rule (`ConfigChangeRequiresReload`: the configs compared with those two fields left out; the files
compared by modification time). Instances are matched by their group's settings, name and count left out (kind,
GPUs, rate limiter, ...): as many as a group of the new config asks for are kept, the others are removed, and
the missing ones are created. Added instances are initialized (and warmed up) while the others serve; removed
ones get no new request and are finalized once their running executions are done, and an instance that a
sequence holds serves that sequence to its end first. No request queued or running meanwhile fails.

The request path does not change: the scheduler's instance lists change between requests, on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from tritonclient.grpc import model_config_pb2

from transerve.backends.base import BackendInstance, Placement, group_placements
from transerve.config.model_config import to_json_dict
from transerve.scheduling.warmup import warm_up
from transerve.server.registry import ModelVersion
from transerve.server.tasks import BackgroundTasks

log = logging.getLogger("transerve")


def needs_reload(old: model_config_pb2.ModelConfig, new: model_config_pb2.ModelConfig) -> bool:
    """Whether going from `old` to `new` takes a full reload: anything beyond the instance groups and the
    version policy differs."""
    return _without_instances(old) != _without_instances(new)


def _without_instances(config: model_config_pb2.ModelConfig) -> model_config_pb2.ModelConfig:
    copy = model_config_pb2.ModelConfig()
    copy.CopyFrom(config)
    copy.ClearField("instance_group")
    copy.ClearField("version_policy")
    return copy


def group_signature(group: model_config_pb2.ModelInstanceGroup) -> bytes:
    """What makes two instances interchangeable: their group's settings without its name and count."""
    copy = model_config_pb2.ModelInstanceGroup()
    copy.CopyFrom(group)
    copy.ClearField("name")
    copy.count = 1
    return copy.SerializeToString(deterministic=True)


def instance_groups(
    config: model_config_pb2.ModelConfig, instances: list[BackendInstance]
) -> list[tuple[BackendInstance, bytes]] | None:
    """Each instance a model was loaded with and its group's signature, in the order backends create them
    (`backends.base.instance_placements`); None when the instances do not follow that order."""
    signatures = [group_signature(group) for group in config.instance_group
                  for _ in group_placements(group, range(max(group.count, 1)))]
    if len(signatures) != len(instances):
        return None
    return list(zip(instances, signatures, strict=True))


def plan(
    current: list[tuple[BackendInstance, bytes]], config: model_config_pb2.ModelConfig
) -> tuple[list[tuple[BackendInstance, bytes]], list[tuple[Placement, bytes]], list[BackendInstance]]:
    """(kept, to add, to remove) for the normalized `config`: per group, the oldest matching instances are kept."""
    available: dict[bytes, list[BackendInstance]] = {}
    for instance, signature in current:
        available.setdefault(signature, []).append(instance)
    taken = {instance.name for instance, _ in current}
    kept: list[tuple[BackendInstance, bytes]] = []
    added: list[tuple[Placement, bytes]] = []
    for group in config.instance_group:
        signature = group_signature(group)
        per_index = len(group_placements(group, [0]))
        wanted = max(group.count, 1) * per_index
        matching = available.get(signature, [])
        kept.extend((instance, signature) for instance in matching[:wanted])
        missing = wanted - len(matching[:wanted])
        del matching[:wanted]
        indexes = _free_indexes(group.name, taken, -(-missing // per_index))
        for placement in group_placements(group, indexes)[:missing]:
            taken.add(placement.name)
            added.append((placement, signature))
    removed = [instance for instances in available.values() for instance in instances]
    return kept, added, removed


def _free_indexes(group_name: str, taken: set[str], count: int) -> list[int]:
    """The lowest `count` indexes whose `<group>_<index>` names no instance has."""
    indexes: list[int] = []
    index = 0
    while len(indexes) < count:
        if f"{group_name}_{index}" not in taken:
            indexes.append(index)
        index += 1
    return indexes


async def update_instances(
    model: ModelVersion, config: model_config_pb2.ModelConfig, model_path: Path, tasks: BackgroundTasks
) -> None:
    """Give a serving version the instance groups of `config` (its other fields are the version's): instances
    added, then the removed ones retired; waits for those no sequence holds to be finalized."""
    assert model.instance_groups is not None
    updated = model_config_pb2.ModelConfig()
    updated.CopyFrom(model.config)
    del updated.instance_group[:]
    updated.instance_group.extend(config.instance_group)
    kept, added, removed = plan(model.instance_groups, updated)
    backend_model = model.backend_model
    instances: list[BackendInstance] = []
    if added:
        instances = await backend_model.add_instances(updated, [placement for placement, _ in added])
        try:
            await warm_up(model.name, updated, model_path, instances)
        except BaseException:
            await asyncio.gather(*(instance.close() for instance in instances))
            raise
        backend_model.instances.extend(instances)
        model.scheduler.add_instances(instances)
    model.instance_groups = kept + [(instance, signature) for instance, (_, signature) in zip(instances, added,
                                                                                               strict=True)]
    model.config = backend_model.config = updated
    model.config_dict = to_json_dict(updated)
    if added or removed:
        log.info("model '%s' version %s: instances updated in place (%d added, %d removed)", model.name,
                 model.version, len(added), len(removed))
    if removed:
        await _retire(model, removed, tasks)


async def _retire(model: ModelVersion, removed: list[BackendInstance], tasks: BackgroundTasks) -> None:
    loop = asyncio.get_running_loop()
    closed = {id(instance): loop.create_future() for instance in removed}

    async def close(instance: BackendInstance) -> None:
        try:
            await instance.close()
        finally:
            future = closed[id(instance)]
            if not future.done():
                future.set_result(None)

    def idle(instance: BackendInstance) -> None:
        instances = model.backend_model.instances
        if any(instance is running for running in instances):
            instances.remove(instance)
        tasks.start(close(instance), f"finalizing a removed instance of model '{model.name}'")

    held = model.scheduler.retire(removed, idle)
    if held:
        log.info("model '%s' version %s: %d removed instances serve their sequences to the end first",
                 model.name, model.version, len(held))
    held_ids = {id(instance) for instance in held}
    await asyncio.gather(*(closed[id(instance)] for instance in removed if id(instance) not in held_ids))
