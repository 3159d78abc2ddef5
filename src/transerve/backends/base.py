"""The contract between the core and every backend.

A `Backend` turns a model version on disk into a `BackendModel`, which owns one
`BackendInstance` per configured instance. The scheduler hands an instance a list
of validated requests and gets back one result per request, in order.
"""

from __future__ import annotations

import abc
import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tritonclient.grpc import model_config_pb2

from transerve.core.errors import ServerError
from transerve.core.types import InferRequest, InferResponse
from transerve.repository.paths import inside

if TYPE_CHECKING:
    from transerve.backends.runtime import Runtime


@dataclass(slots=True)
class ModelContext:
    """Everything a backend needs to load one model version."""

    name: str
    version: str
    #: `<repository>/<model>`.
    model_path: Path
    #: `<repository>/<model>/<version>`.
    version_path: Path
    repository_path: Path
    config: model_config_pb2.ModelConfig
    #: `--backend-config=<backend>,KEY=VALUE` settings for this backend.
    backend_config: dict[str, str] = field(default_factory=dict)
    #: False under `--disable-auto-complete-config`.
    auto_complete: bool = True
    #: The server, for backends whose models call it (ensembles, BLS, model control, custom metrics); None in
    #: tests that load a backend alone.
    runtime: Runtime | None = None

    def model_file(self, default: str) -> Path:
        """The version's model file (or folder): `default_model_filename`, else `default`; INVALID_ARG when the
        name leads outside the model's folder."""
        name = self.config.default_model_filename or default
        return inside(self.model_path, self.version_path, name, "default_model_filename")


@dataclass(slots=True)
class Rerun:
    """Requests of an execution that their model rescheduled and that ran again within it (the python backend's
    iterative sequences). Triton runs a rescheduled request as a new execution, and counts it as one."""

    #: The requests that ran again, as positions in the execution.
    indexes: list[int]
    #: Monotonic nanoseconds at which their previous run ended, rescheduling them.
    rescheduled_ns: int
    compute_input_ns: int = 0
    compute_infer_ns: int = 0
    compute_output_ns: int = 0


@dataclass(slots=True)
class ExecutionResult:
    """One result per request (a response or that request's error), plus where the time went.

    A decoupled model's result is None: its responses went into the request's `response_stream`. The compute
    times are those of the first run; `reruns`, if any, are the runs of rescheduled requests after it.
    """

    results: list[InferResponse | ServerError | None]
    compute_input_ns: int = 0
    compute_infer_ns: int = 0
    compute_output_ns: int = 0
    reruns: list[Rerun] | None = None


class BackendInstance(abc.ABC):
    """One model instance. `execute` may be called again before an earlier call returns,
    up to `max_inflight` calls; the instance runs them in the order they were made."""

    name: str
    max_inflight: int = 1
    #: Whether `cancel` can stop a running request; schedulers only watch for client cancellation when it can.
    cancellable: bool = False

    @abc.abstractmethod
    def execute(self, requests: list[InferRequest]) -> Awaitable[ExecutionResult]:
        """Run the requests; a failure of the whole call is returned per request, not raised.

        An `async def` implementation is fine; returning an `asyncio.Future` that a callback
        resolves saves the scheduler a task per execution on hot paths.
        """

    def execute_then(
        self, requests: list[InferRequest], done: Callable[[ExecutionResult], None]
    ) -> Awaitable[ExecutionResult] | None:
        """`execute`, for a backend that can call `done` with the result itself, from the callback in which
        the result arrives (never before returning): it then returns None, saving the event-loop turn a
        future's callback costs. By default it returns `execute`'s awaitable and never calls `done`.
        """
        return self.execute(requests)

    def abort(self, reason: str) -> None:
        """The instance is being closed and out of time: stop what it still runs, failing those requests
        UNAVAILABLE with `reason`, if it can (python workers are killed; a thread cannot be)."""
        return None

    def prefix_cache_stats(self) -> tuple[int, int, int, int] | None:
        """A generation engine's prefix cache counters since load, for the metrics: prompt tokens looked up, tokens
        found, lookups that found something and lookups that found nothing; None where there is no such cache."""
        return None

    def cancel(self, request: InferRequest) -> None:
        """The client of `request`, which this instance is executing, went away (a decoupled request hears of it
        through its response stream instead). Instances that set `cancellable` stop its work early; the
        execution still completes, and whatever it returns for the request is dropped."""
        return None  # by default the execution runs to its end

    def expired(self, request: InferRequest) -> None:
        """`request`, which this instance is executing, passed its deadline and its client was answered: by default
        as if its client went away."""
        self.cancel(request)

    @abc.abstractmethod
    async def close(self) -> None:
        """Release the instance (the python backend calls the model's `finalize`)."""


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one instance runs: Triton's instance name, its kind (`CPU`, `GPU`, `MODEL`) and GPU id."""

    name: str
    kind: str
    device_id: int


def group_placements(group: model_config_pb2.ModelInstanceGroup, indexes: Iterable[int]) -> list[Placement]:
    """The placements of a normalized group's instances at these indexes: named `<group name>_<index in group>`,
    and for KIND_GPU one on every listed GPU, as Triton creates them."""
    kind = model_config_pb2.ModelInstanceGroup.Kind.Name(group.kind).removeprefix("KIND_")
    devices = list(group.gpus) if kind == "GPU" else [0]
    return [Placement(f"{group.name}_{index}", kind, device) for index in indexes for device in devices]


def instance_placements(config: model_config_pb2.ModelConfig) -> list[Placement]:
    """Every instance of a normalized config: `count` per group (`group_placements`)."""
    placements = [placement for group in config.instance_group
                  for placement in group_placements(group, range(max(group.count, 1)))]
    return placements or [Placement(f"{config.name}_0", "CPU", 0)]


class BackendModel:
    """A loaded model version and its instances."""

    #: Whether `add_instances` can start instances beside the running ones, for an instance-group update in place
    #: (Triton's); the model of a backend that cannot is reloaded instead.
    updates_instances = False

    async def add_instances(
        self, config: model_config_pb2.ModelConfig, placements: list[Placement]
    ) -> list[BackendInstance]:
        """Start (and initialize) one instance per placement, `config` being the model's config with its new
        instance groups; on failure none is left running. The caller schedules onto them and owns them."""
        raise NotImplementedError

    def __init__(self, config: model_config_pb2.ModelConfig, instances: list[BackendInstance]) -> None:
        #: The final configuration, after the backend's auto-completion.
        self.config = config
        self.instances = list(instances)
        #: Instances restarted, by reason ("crash", "memory", "hung"): python workers; exported as a metric.
        self.restarts: Counter[str] = Counter()
        #: Why the model cannot serve any more though loaded (a python instance past its restart cap); "" while it can.
        #: The registry then answers it not ready, with this reason, until it is loaded again.
        self.unavailable = ""

    async def unload(self) -> None:
        await asyncio.gather(*(instance.close() for instance in self.instances))


class Backend(abc.ABC):
    """A kind of backend (`python`, `onnxruntime`, ...): loads model versions."""

    name: str

    @abc.abstractmethod
    async def load(self, context: ModelContext) -> BackendModel:
        """Load the version and start its instances; raise ServerError with the reason on failure."""
