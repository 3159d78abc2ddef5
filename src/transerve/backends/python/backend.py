"""The Triton-compatible `python` backend: each model instance is a worker process.

The server side of an instance keeps one worker, talks to it through `ipc.AsyncConnection`
(shared-memory tensors, a socket for control) and restarts it when it dies: requests in flight at
that moment fail with an INTERNAL error naming the model, and later requests go to a fresh worker.
The server also ends workers on purpose (see docs/security.md, "Faults"): a busy worker of a model being
unloaded once the exit timeout has passed, a worker past its model's `max_worker_rss_bytes`, a worker whose
execute runs on `hung-execute-grace-secs` after its request timed out; what such a worker was running fails
UNAVAILABLE, and the last two are restarted. Workers die with the server (a parent-death signal).
A decoupled model's responses and the BLS calls a model makes travel on the same connection
(`streams.WorkerStreams`).

This module loads a model (settings, environment, auto-complete, one worker per instance); `instance.py` is an
instance's side of the executions, `process.py` a worker process as the server starts, calls and stops it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from tritonclient.grpc import model_config_pb2

from transerve.backends.base import (
    Backend,
    BackendInstance,
    BackendModel,
    ModelContext,
    Placement,
    instance_placements,
)
from transerve.backends.python.environments import DEFAULT_MAX_BYTES as DEFAULT_ENV_MAX_BYTES
from transerve.backends.python.environments import PARAMETER as ENV_PARAMETER
from transerve.backends.python.environments import ExecutionEnvironments
from transerve.backends.python.instance import RSS_PARAMETER, PythonInstance, Rescheduling
from transerve.backends.python.ipc import OP_AUTO_COMPLETE
from transerve.backends.python.process import DEFAULT_HUNG_GRACE_S, WorkerProcess, WorkerSpec
from transerve.backends.python.shm import DEFAULT_ARENA_BYTES
from transerve.config import model_config
from transerve.core.errors import ErrorCode, ServerError

logger = logging.getLogger(__name__)

#: Executions an instance accepts before earlier ones finish (`--backend-config=python,max-inflight=N`).
DEFAULT_MAX_INFLIGHT = 4


class PythonBackend(Backend):
    """Loads Triton python-backend models (`model.py` with `class TritonPythonModel`)."""

    name = "python"

    def __init__(self) -> None:
        self._environments = ExecutionEnvironments()

    async def load(self, context: ModelContext) -> BackendModel:
        where = f"failed to load '{context.name}' version {context.version}"
        try:
            return await self._load(context)
        except ServerError as exc:
            logger.error("%s: %s", where, exc.message)
            raise ServerError(exc.code, f"{where}: {exc.message}") from None

    async def _load(self, context: ModelContext) -> BackendModel:
        config = context.config
        model_file = context.model_file("model.py")
        if not model_file.is_file():
            raise ServerError(ErrorCode.INVALID_ARG, f"model file '{model_file}' not found")
        interpreter = None
        if ENV_PARAMETER in config.parameters and config.parameters[ENV_PARAMETER].string_value:
            interpreter = await self._environments.interpreter(
                config.parameters[ENV_PARAMETER].string_value,
                context.model_path,
                context.repository_path,
                _setting(context.backend_config, "execution-env-max-bytes", DEFAULT_ENV_MAX_BYTES, 1),
            )
        spec = WorkerSpec(
            model_name=context.name,
            model_version=context.version,
            model_file=model_file,
            arena_bytes=_setting(context.backend_config, "shm-default-byte-size", DEFAULT_ARENA_BYTES, 4096),
            max_inflight=_setting(context.backend_config, "max-inflight", DEFAULT_MAX_INFLIGHT, 1),
            log_fd=getattr(getattr(context.runtime, "log", None), "page_fd", None),  # stand-ins in tests have no log
            interpreter=interpreter,
            max_rss_bytes=_rss_ceiling(config),
            hung_grace_s=_setting(context.backend_config, "hung-execute-grace-secs", DEFAULT_HUNG_GRACE_S, 0, float),
        )
        if config.sequence_batching.state:
            # Triton's python backend loads such a model but never stores the output state, so every request
            # would see the initial state: refusing says so instead of computing wrong answers.
            raise ServerError(
                ErrorCode.INVALID_ARG,
                "implicit state (sequence_batching.state) is not supported by the python backend: "
                "keep the state in the model, keyed by the CORRID control input",
            )
        placements = instance_placements(config)
        first = await WorkerProcess.start(spec, placements[0].name)
        if context.auto_complete:
            try:
                config = await _auto_complete(first, config, context.name)
            except BaseException:
                await first.abort()
                raise
        rescheduling = Rescheduling(config) if config.sequence_batching.iterative_sequence else None
        model = PythonModel(config, [], context, spec, rescheduling)
        model.instances.extend(await model.add_instances(config, placements, first))
        return model


class PythonModel(BackendModel):
    """A loaded python-backend model; it can add instances while the others serve."""

    updates_instances = True

    def __init__(
        self,
        config: model_config_pb2.ModelConfig,
        instances: list[PythonInstance],
        context: ModelContext,
        spec: WorkerSpec,
        rescheduling: Rescheduling | None,
    ) -> None:
        super().__init__(config, instances)
        self._context = context
        self._spec = spec
        self._rescheduling = rescheduling

    async def add_instances(
        self, config: model_config_pb2.ModelConfig, placements: list[Placement], first: WorkerProcess | None = None
    ) -> list[BackendInstance]:
        """A worker per placement (`first`, already started, for the first), its `initialize` given `config`, as
        Triton initializes them; on failure none is left running."""
        instances = [
            PythonInstance(
                self._spec,
                placement.name,
                _initialize_args(self._context, config, placement.name, placement.kind, placement.device_id),
                config.model_transaction_policy.decoupled,
                self._context.runtime,
                self._rescheduling,
                self.restarts,
                self._given_up,
            )
            for placement in placements
        ]
        outcomes = await asyncio.gather(
            *(instance.start(first if index == 0 else None) for index, instance in enumerate(instances)),
            return_exceptions=True,
        )
        failure = next((outcome for outcome in outcomes if isinstance(outcome, BaseException)), None)
        if failure is not None:
            await asyncio.gather(*(instance.close() for instance in instances))
            raise failure
        return list(instances)

    def _given_up(self, reason: str) -> None:
        """An instance is not restarted any more: the model is UNAVAILABLE, with why, until it is loaded again."""
        self.unavailable = self.unavailable or reason


async def _auto_complete(
    worker: WorkerProcess, config: model_config_pb2.ModelConfig, name: str
) -> model_config_pb2.ModelConfig:
    """Let the model's `auto_complete_config` fill in the config, then check the result again."""
    completed = await worker.call(OP_AUTO_COMPLETE, model_config.to_json(config))
    try:
        config = model_config.parse_config_json(completed)
        model_config.normalize(config, name)
        model_config.validate(config, name)
    except model_config.ConfigError as exc:
        raise ServerError(ErrorCode.INVALID_ARG, f"auto-completed config is invalid: {exc}") from None
    return config


def _initialize_args(
    context: ModelContext, config: model_config_pb2.ModelConfig, instance: str, kind: str, device: int
) -> dict[str, str]:
    """The `args` Triton passes to `initialize`, every value a string."""
    return {
        "model_config": model_config.to_json(config),
        "model_instance_kind": kind,
        "model_instance_name": instance,
        "model_instance_device_id": str(device),
        "model_repository": str(context.model_path),
        "model_version": context.version,
        "model_name": context.name,
    }


def _setting(backend_config: dict[str, str], key: str, default: Any, minimum: int, kind: type = int) -> Any:
    """A number from `--backend-config=python,KEY=VALUE`, e.g. `shm-default-byte-size` (arena bytes)."""
    value = backend_config.get(key)
    if value is None:
        return default
    try:
        number = kind(value)
    except ValueError:
        number = minimum - 1
    if not number >= minimum:  # NaN included
        what = "an integer" if kind is int else "a number"
        raise ServerError(ErrorCode.INVALID_ARG, f"backend config {key} must be {what} >= {minimum}, got '{value}'")
    return number


def _rss_ceiling(config: model_config_pb2.ModelConfig) -> int:
    """The model's `max_worker_rss_bytes` parameter (0: none); INVALID_ARG unless a positive integer."""
    if RSS_PARAMETER not in config.parameters:
        return 0
    value = config.parameters[RSS_PARAMETER].string_value.strip()
    if not value.isdigit() or int(value) <= 0:
        raise ServerError(
            ErrorCode.INVALID_ARG, f"parameter {RSS_PARAMETER} must be a positive number of bytes, got '{value}'"
        )
    return int(value)
