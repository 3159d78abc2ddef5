"""Turning a model folder into servable versions, and releasing them: config, backend, scheduler, cache, warmup.

`ModelLoader` knows nothing of the registry: the server decides which model to (re)load and when, under the
model's lock, and swaps the record this builds in.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Awaitable, Callable, Iterator

from tritonclient.grpc import model_config_pb2

from transerve.backends.base import Backend, ModelContext
from transerve.backends.ensemble.backend import MAX_DEPTH
from transerve.backends.runtime import Runtime
from transerve.config.model_config import (
    MAX_CONFIG_BYTES,
    ConfigError,
    backend_name,
    complete_backend_fields,
    load_config_file,
    normalize,
    parse_config_json,
    to_json_dict,
    validate,
)
from transerve.core.errors import ErrorCode, ServerError, invalid_arg
from transerve.core.signature import ModelSignature
from transerve.core.stats import EnsembleStats, ModelStats
from transerve.repository.fingerprint import fingerprint
from transerve.repository.labels import load_labels
from transerve.repository.repository import (
    ModelLocation,
    ModelRepository,
    available_versions,
    select_versions,
)
from transerve.scheduling import create_scheduler
from transerve.scheduling.response_cache import CachingScheduler, ResponseCache
from transerve.scheduling.warmup import warm_up
from transerve.server.instance_update import instance_groups, needs_reload, update_instances
from transerve.server.options import ControlMode, ServerOptions
from transerve.server.registry import ModelRecord, ModelState, ModelVersion
from transerve.server.tasks import BackgroundTasks

log = logging.getLogger("transerve")

#: The config file of a model folder, left out of the fingerprint that tells whether its other files changed.
CONFIG_FILE = "config.pbtxt"


def backend_registry() -> dict[str, type[Backend]]:
    """Every backend by the name a config gives; their engines are imported when a model first needs them."""
    from transerve.backends.ensemble.backend import EnsembleBackend
    from transerve.backends.generation.backend import GenerationBackend
    from transerve.backends.generation.fastertransformer import FasterTransformerBackend
    from transerve.backends.lightseq.backend import LightSeqBackend
    from transerve.backends.onnxruntime.backend import OnnxRuntimeBackend
    from transerve.backends.python.backend import PythonBackend
    from transerve.backends.pytorch.backend import PyTorchBackend
    from transerve.backends.tensorrt.backend import TensorRTBackend

    return {
        "python": PythonBackend,
        "ensemble": EnsembleBackend,
        "onnxruntime": OnnxRuntimeBackend,
        "pytorch": PyTorchBackend,
        "tensorrt": TensorRTBackend,
        "generation": GenerationBackend,
        "lightseq": LightSeqBackend,
        "fastertransformer": FasterTransformerBackend,
    }


def ensemble_steps(location: ModelLocation, max_config_bytes: int = MAX_CONFIG_BYTES) -> set[str] | None:
    """The models an ensemble's steps name; None for a model that is not an ensemble (or whose config does not
    read: its own load says why)."""
    try:
        config = load_config_file(location.path, max_config_bytes)
    except ConfigError:
        return None
    if backend_name(config) != "ensemble":
        return None
    return {step.model_name for step in config.ensemble_scheduling.step}


def composing_order(
    name: str,
    config: model_config_pb2.ModelConfig,
    repository: ModelRepository,
    loaded: Callable[[str], bool],
    max_config_bytes: int = MAX_CONFIG_BYTES,
) -> list[str]:
    """The models ensemble `name` needs that are not `loaded`, and those they need, each after what it needs: the
    order explicit control loads them in. Walked with a stack, and refused past the nesting the ensemble backend
    serves (MAX_DEPTH), so a chain of any length costs neither Python's stack nor more than MAX_DEPTH reads. Reads
    config files: run it off the event loop."""
    found, _ = repository.scan()
    order: list[str] = []
    seen = {name}
    #: The ensembles being walked, each with the steps still to visit and its depth (`name` is one deep).
    stack: list[tuple[str, Iterator[str], int]] = [
        (name, iter(sorted({step.model_name for step in config.ensemble_scheduling.step})), 1)]
    while stack:
        model, steps, depth = stack[-1]
        step = next(steps, None)
        if step is None:
            stack.pop()
            if model != name:
                order.append(model)
            continue
        if step in seen or loaded(step):
            continue
        seen.add(step)
        location = found.get(step)  # None for a model in two repositories too: its own load names the problem
        named = ensemble_steps(location, max_config_bytes) if location is not None else None
        if named is None:
            order.append(step)
            continue
        if depth + 1 > MAX_DEPTH:
            raise invalid_arg(f"ensemble '{name}' nests ensembles more than {MAX_DEPTH} deep (through '{step}'); at "
                              f"most {MAX_DEPTH} levels are served")
        stack.append((step, iter(sorted(named)), depth + 1))
    return order


class ModelLoader:
    """Loads every version a model's policy selects, and unloads them."""

    def __init__(
        self,
        options: ServerOptions,
        runtime: Runtime,
        response_cache: ResponseCache | None,
        load_composing: Callable[[str, model_config_pb2.ModelConfig], Awaitable[None]],
    ) -> None:
        self._options = options
        self._runtime = runtime
        self._response_cache = response_cache
        #: Explicit control loads an ensemble's composing models first, through the server (they get records).
        self._load_composing = load_composing
        self._backends: dict[str, Backend] = {}
        self._backend_types = backend_registry()

    def read_config(
        self, location: ModelLocation, config_json: str | bytes | None
    ) -> tuple[model_config_pb2.ModelConfig, list[int]]:
        """The model's config (a load request's, or its file's), completed and checked, and the versions its
        policy selects. Parses and reads files: run it off the event loop."""
        name = location.name
        limit = self._options.limits.config_bytes
        try:
            config = (parse_config_json(config_json, limit) if config_json
                      else load_config_file(location.path, limit))
            complete_backend_fields(config, location.path)
            normalize(config, name)
            validate(config, name, partial_io=self._options.auto_complete)
            versions = select_versions(config.version_policy, available_versions(location.path))
        except (ConfigError, OSError) as exc:
            raise invalid_arg(str(exc)) from None
        if not versions:
            raise invalid_arg(f"model '{name}' has no version folders to serve (e.g. '{name}/1/')")
        return config, versions

    async def update_in_place(
        self,
        record: ModelRecord,
        location: ModelLocation,
        config: model_config_pb2.ModelConfig,
        versions: list[int],
        tasks: BackgroundTasks,
    ) -> bool:
        """Triton's instance-group update (see `instance_update`) of a serving model, when only its instance groups
        (or version policy) changed and it serves the same versions; False when it must reload instead."""
        models = list(record.versions.values())
        if (record.state is not ModelState.READY or record.failed or record.override_path is not None
                or record.source_config is None or sorted(record.versions) != sorted(versions)
                or backend_name(config) == "ensemble"
                or any(model.instance_groups is None for model in models)
                or record.files_fingerprint != fingerprint(location.path, CONFIG_FILE)):
            return False
        # The config a load request passes is often the one the server answered with (completed by the backend).
        if needs_reload(record.source_config, config) and any(needs_reload(model.config, config) for model in models):
            return False
        for model in models:
            await update_instances(model, config, location.path, tasks)
        record.source_config = config
        record.fingerprint = fingerprint(location.path)
        return True

    async def load_record(
        self, location: ModelLocation, config: model_config_pb2.ModelConfig, versions: list[int]
    ) -> ModelRecord:
        name = location.name
        if self._options.control_mode is ControlMode.EXPLICIT and backend_name(config) == "ensemble":
            await self._load_composing(name, config)
        digests = await asyncio.to_thread(lambda: (fingerprint(location.path), fingerprint(location.path, CONFIG_FILE)))
        record = ModelRecord(name, ModelState.READY, fingerprint=digests[0], source_config=config,
                             files_fingerprint=digests[1])
        results = await asyncio.gather(
            *(self._load_version(location, config, version) for version in versions), return_exceptions=True
        )
        for version, result in zip(versions, results, strict=True):
            if isinstance(result, ModelVersion):
                record.versions[version] = result
            elif isinstance(result, ServerError):
                record.failed[version] = result.message
            else:
                raise result
        if not record.versions:
            reasons = "; ".join(record.failed.values())
            raise ServerError(ErrorCode.INVALID_ARG, reasons)
        return record

    async def _load_version(
        self, location: ModelLocation, base_config: model_config_pb2.ModelConfig, version: int
    ) -> ModelVersion:
        name = location.name
        config = model_config_pb2.ModelConfig()
        config.CopyFrom(base_config)
        kind = backend_name(config)
        backend = self._backend(kind, name)
        context = ModelContext(
            name=name,
            version=str(version),
            model_path=location.path,
            version_path=location.path / str(version),
            repository_path=location.repository,
            config=config,
            backend_config=self._options.backend_configs.get(kind, {}),
            auto_complete=self._options.auto_complete,
            runtime=self._runtime,
        )
        labels = load_labels(location.path, config)
        cache = self._response_cache if config.response_cache.enable else None
        if cache is not None and (config.model_transaction_policy.decoupled or config.HasField("sequence_batching")):
            decoupled = config.model_transaction_policy.decoupled
            kind = "'decoupled' transaction policy" if decoupled else "sequence batching"
            raise invalid_arg(f"Response Cache does not currently support model {name} with {kind}. Please disable "
                              "the response cache.")
        started = time.monotonic()
        backend_model = await backend.load(context)
        config = backend_model.config
        try:
            normalize(config, name)
            validate(config, name)
        except ConfigError as exc:
            await backend_model.unload()
            raise invalid_arg(str(exc)) from None
        stats_type = EnsembleStats if kind == "ensemble" else ModelStats
        stats = stats_type(load_duration_secs=time.monotonic() - started)
        if self._options.metrics.summary_latencies:
            stats.add_summaries(self._options.metrics.quantiles, cache is not None)
        try:
            scheduler = create_scheduler(name, config, backend_model.instances, stats)
            if cache is not None:
                scheduler = CachingScheduler(scheduler, cache, name, str(version), stats)
            await warm_up(name, config, location.path, backend_model.instances)
        except ServerError:
            await backend_model.unload()
            raise
        return ModelVersion(
            name=name,
            version=str(version),
            config=config,
            config_dict=to_json_dict(config),
            signature=ModelSignature(name, config),
            backend_model=backend_model,
            scheduler=scheduler,
            stats=stats,
            decoupled=config.model_transaction_policy.decoupled,
            labels=labels,
            path=context.version_path,
            instance_groups=instance_groups(config, backend_model.instances) if backend_model.updates_instances
            else None,
        )

    def _backend(self, kind: str, model_name: str) -> Backend:
        backend = self._backends.get(kind)
        if backend is None:
            backend_type = self._backend_types.get(kind)
            if backend_type is None:
                supported = ", ".join(sorted(self._backend_types))
                raise invalid_arg(f"model '{model_name}' needs backend '{kind}', which is not available "
                                  f"(available: {supported})")
            backend = self._backends[kind] = backend_type()
        return backend

    async def unload_record(self, record: ModelRecord, timeout: float, why: str) -> None:
        """Let the versions finish what they have queued and running, for up to `timeout` seconds (the exit
        timeout: Triton waits for in-flight requests), then stop what still runs and release them."""
        await asyncio.gather(*(_unload_version(model, timeout, why) for model in record.versions.values()))
        if record.override_path is not None:
            shutil.rmtree(record.override_path, ignore_errors=True)


async def _unload_version(model: ModelVersion, timeout: float, why: str) -> None:
    try:
        await asyncio.wait_for(model.scheduler.drain(), timeout)
    except asyncio.TimeoutError:
        log.warning("model '%s' version %s still had requests running %gs after unload began: stopping them",
                    model.name, model.version, timeout)
        for instance in model.backend_model.instances:
            instance.abort(f"{why}, and it was still running {timeout:g}s later (the exit timeout)")
    await model.backend_model.unload()
