"""The Server: the registry of loaded models and the one request path every frontend calls."""

from __future__ import annotations

import asyncio
import enum
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tritonclient.grpc import model_config_pb2

from transerve import __version__
from transerve.backends.base import Backend, BackendModel, ModelContext
from transerve.config.model_config import (
    ConfigError,
    backend_name,
    complete_backend_fields,
    load_config_file,
    normalize,
    parse_config_json,
    to_json_dict,
    validate,
)
from transerve.core.classification import PARAMETER as CLASSIFICATION
from transerve.core.classification import class_count, classify_response, load_labels
from transerve.core.custom_metrics import CustomMetrics
from transerve.core.errors import ErrorCode, ServerError, invalid_arg, not_found, unavailable, unsupported
from transerve.core.log_settings import LogSettings, ServerLog
from transerve.core.metrics_config import MetricsConfig
from transerve.core.response_cache import CachingScheduler, ResponseCache
from transerve.core.shared_memory import REGION, SharedMemoryRegistry
from transerve.core.signature import ModelSignature
from transerve.core.stats import EnsembleStats, ModelStats
from transerve.core.streams import ResponseStream
from transerve.core.tracing import TraceOptions, Tracer
from transerve.core.types import InferRequest, InferResponse
from transerve.repository.fingerprint import fingerprint
from transerve.repository.overrides import write_model_files
from transerve.repository.repository import (
    ModelLocation,
    ModelRepository,
    available_versions,
    is_plain_model_name,
    select_versions,
)
from transerve.scheduling import OnDone, Scheduler, create_scheduler
from transerve.scheduling.warmup import warm_up

log = logging.getLogger("transerve")

EXTENSIONS = [
    "classification",
    "sequence",
    "model_repository",
    "model_repository(unload_dependents)",
    "schedule_policy",
    "model_configuration",
    "system_shared_memory",
    "binary_tensor_data",
    "parameters",
    "statistics",
    "trace",
    "logging",
]


#: Triton's answer (UNSUPPORTED, HTTP 501) to a one-response inference on a decoupled model.
DECOUPLED_INFER_MESSAGE = "HTTP end point doesn't support models with decoupled transaction policy"


class ControlMode(enum.Enum):
    NONE = "none"
    POLL = "poll"
    EXPLICIT = "explicit"


class ModelState(enum.Enum):
    LOADING = "LOADING"
    READY = "READY"
    UNLOADING = "UNLOADING"
    UNAVAILABLE = "UNAVAILABLE"


@dataclass(slots=True)
class ServerOptions:
    """What `transerve serve` was asked to do."""

    repositories: list[Path]
    control_mode: ControlMode = ControlMode.NONE
    load_models: list[str] = field(default_factory=list)
    strict_readiness: bool = True
    exit_timeout_secs: float = 30.0
    auto_complete: bool = True
    poll_secs: float = 15.0
    backend_configs: dict[str, dict[str, str]] = field(default_factory=dict)
    #: The response cache's size in bytes (`--cache-config local,size=N`); None: no cache.
    cache_bytes: int | None = None
    #: The `--log-*` flags: the logging extension's settings at start.
    log_settings: LogSettings = field(default_factory=LogSettings)
    #: `--metrics-config`: which latency metrics the models keep (summaries are observed as requests finish).
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    #: The `--trace-*` flags: the trace extension's settings at start.
    trace: TraceOptions = field(default_factory=TraceOptions)


@dataclass(slots=True)
class ModelVersion:
    """One loaded, servable version of a model."""

    name: str
    version: str
    config: model_config_pb2.ModelConfig
    config_dict: dict[str, Any]
    signature: ModelSignature
    backend_model: BackendModel
    scheduler: Scheduler
    stats: ModelStats
    #: The config's `model_transaction_policy.decoupled`, read once: a protobuf lookup per request costs more.
    decoupled: bool = False
    #: Each output's labels from its `label_filename`, for the classification extension.
    labels: dict[str, list[str]] = field(default_factory=dict)


@dataclass(slots=True)
class ModelRecord:
    """A model name: its serving versions, and the state and reason shown in the repository index."""

    name: str
    state: ModelState
    reason: str = ""
    versions: dict[int, ModelVersion] = field(default_factory=dict)
    #: Versions that failed to load, with why.
    failed: dict[int, str] = field(default_factory=dict)
    fingerprint: str = ""
    #: The folder a load request's `file:` contents were written to; removed with the record.
    override_path: Path | None = None

    def latest(self) -> ModelVersion | None:
        return self.versions[max(self.versions)] if self.versions else None


def _shaped_outputs(request: InferRequest) -> bool:
    """Whether an output of `request` asks for classification or for a shared memory region."""
    return any(
        output.parameters and (output.parameters.get(CLASSIFICATION) or REGION in output.parameters)
        for output in request.outputs or ()
    )


def _backend_registry() -> dict[str, type[Backend]]:
    from transerve.backends.ensemble.backend import EnsembleBackend
    from transerve.backends.generation.backend import GenerationBackend
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
    }


def _ensemble_steps(location: ModelLocation) -> set[str] | None:
    """The models an ensemble's steps name; None for a model that is not an ensemble."""
    try:
        config = load_config_file(location.path)
    except ConfigError:
        return None
    if backend_name(config) != "ensemble":
        return None
    return {step.model_name for step in config.ensemble_scheduling.step}


class Server:
    """Owns the models; frontends call `infer` and the metadata/control methods."""

    def __init__(self, options: ServerOptions) -> None:
        self.options = options
        self.repository = ModelRepository(options.repositories)
        #: The system shared memory regions clients registered (Triton's shared memory extension).
        self.shared_memory = SharedMemoryRegistry()
        #: The log settings, which clients may read and change (Triton's logging extension).
        self.log = ServerLog(options.log_settings)
        #: Which requests are traced, and the settings clients may read and change (Triton's trace extension).
        self.tracing = Tracer(options.trace, self.model_ready)
        #: The responses of models whose config enables `response_cache`, when the server has a cache.
        self.response_cache = ResponseCache(options.cache_bytes) if options.cache_bytes is not None else None
        #: Metric families that model code created (pb_utils.MetricFamily), shown on /metrics.
        self.custom_metrics = CustomMetrics()
        self._models: dict[str, ModelRecord] = {}
        self._backends: dict[str, Backend] = {}
        self._backend_types = _backend_registry()
        self._inflight = 0
        self._live = False
        self._stopping = False
        self._model_locks: dict[str, asyncio.Lock] = {}
        self._poll_task: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        #: The event loop the server runs on, kept from start() (looking it up costs a syscall).
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the models the control mode asks for; broken ones are recorded, never fatal."""
        self._loop = asyncio.get_running_loop()
        self._live = True
        found, duplicates = self.repository.scan()
        for name, reason in duplicates.items():
            self._models[name] = ModelRecord(name, ModelState.UNAVAILABLE, reason)
            log.error("model '%s' is UNAVAILABLE: %s", name, reason)
        if self.options.control_mode is ControlMode.EXPLICIT:
            names = list(found) if "*" in self.options.load_models else self.options.load_models
        else:
            names = list(found)
        # Ensembles check their steps against loaded models, so they load after everything else, and after the
        # ensembles they contain.
        steps = {name: _ensemble_steps(found[name]) for name in names if name in found}
        ensembles = {name: named for name, named in steps.items() if named is not None}
        await asyncio.gather(*(self._load_logged(name) for name in names if name not in ensembles))
        while ensembles:
            # Those that contain no ensemble still waiting; in a cycle none qualifies, and they load (and fail) anyway.
            wave = [name for name, named in ensembles.items() if not (named - {name}) & ensembles.keys()]
            wave = wave or list(ensembles)
            for name in wave:
                del ensembles[name]
            await asyncio.gather(*(self._load_logged(name) for name in wave))
        if self.options.control_mode is ControlMode.POLL:
            self._poll_task = asyncio.ensure_future(self._poll_forever())

    async def _load_logged(self, name: str) -> None:
        try:
            await self.load_model(name)
        except ServerError as exc:
            log.error("model '%s' is UNAVAILABLE: %s", name, exc.message)

    async def stop(self) -> None:
        """Finish in-flight requests (up to the exit timeout), then unload every model: what still runs then is
        stopped (python workers are killed), and its requests answered UNAVAILABLE."""
        self._stopping = True
        if self._poll_task:
            self._poll_task.cancel()
        deadline = time.monotonic() + self.options.exit_timeout_secs
        while self._inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if self._inflight:
            log.warning("exit timeout reached with %d requests in flight", self._inflight)
        await asyncio.gather(*(self._unload_record(record, max(0.0, deadline - time.monotonic()), "the server is "
                                                   "shutting down") for record in list(self._models.values())))
        self._models.clear()
        self.tracing.close()
        self._live = False

    # ---- health and metadata ---------------------------------------------------------------------

    @property
    def live(self) -> bool:
        return self._live

    @property
    def ready(self) -> bool:
        if not self._live or self._stopping:
            return False
        if not self.options.strict_readiness:
            return True
        return all(record.state is ModelState.READY for record in self._models.values())

    def metadata(self) -> dict[str, Any]:
        """Named "triton", as Triton's clients and tests expect of the server they talk to; the version is
        transerve's."""
        return {"name": "triton", "version": __version__, "extensions": EXTENSIONS}

    def get_version(self, name: str, version: str = "") -> ModelVersion:
        """The serving version a request names, or the error Triton gives."""
        record = self._models.get(name)
        if record is None:
            raise not_found(f"Request for unknown model: '{name}' is not found")
        if version:
            serving = record.versions.get(int(version)) if version.isdigit() else None
            if serving is None:
                raise not_found(f"Request for unknown model: '{name}' version {version} is not found")
            return serving
        latest = record.latest()
        if latest is None:
            reason = f": {record.reason}" if record.reason else ""
            raise unavailable(f"model '{name}' is not ready ({record.state.value}){reason}")
        return latest

    def model_ready(self, name: str, version: str = "") -> bool:
        try:
            self.get_version(name, version)
        except ServerError:
            return False
        return True

    def model_metadata(self, name: str, version: str = "") -> dict[str, Any]:
        """As Triton: a request naming a version lists that version, one naming none every ready version."""
        model = self.get_version(name, version)
        versions = sorted(self._models[name].versions) if not version else [int(model.version)]
        return {
            "name": name,
            "versions": [str(v) for v in versions],
            "platform": model.config.platform or backend_name(model.config),
            "inputs": model.signature.metadata_tensors("inputs"),
            "outputs": model.signature.metadata_tensors("outputs"),
        }

    def model_config(self, name: str, version: str = "") -> dict[str, Any]:
        return self.get_version(name, version).config_dict

    def repository_index(self, ready_only: bool = False) -> list[dict[str, str]]:
        """Every model in the repositories, loaded or not, with its state and reason."""
        found, _ = self.repository.scan()
        entries: list[dict[str, str]] = []
        for name in sorted(set(found) | set(self._models)):
            record = self._models.get(name)
            if record is None:
                if not ready_only:
                    entries.append({"name": name})
                continue
            if record.versions or record.failed:
                for version in sorted(set(record.versions) | set(record.failed)):
                    if version in record.versions:
                        entries.append({"name": name, "version": str(version), "state": "READY"})
                    elif not ready_only:
                        entries.append({"name": name, "version": str(version), "state": "UNAVAILABLE",
                                        "reason": record.failed[version]})
            elif not ready_only or record.state is ModelState.READY:
                entry = {"name": name, "state": record.state.value}
                if record.reason:
                    entry["reason"] = record.reason
                entries.append(entry)
        return entries

    def serving_versions(self) -> list[ModelVersion]:
        """Every loaded version, for metrics."""
        return [model for record in self._models.values() for _, model in sorted(record.versions.items())]

    def statistics(self, name: str = "", version: str = "") -> dict[str, Any]:
        if name:
            record = self._models.get(name)
            if record is None or not record.versions:
                raise invalid_arg(f"requested model '{name}' is not available")
            if version:
                model = record.versions.get(int(version)) if version.isdigit() else None
                if model is None:
                    raise invalid_arg(f"requested model version is not available for model '{name}'")
                models = [model]
            else:
                models = [record.versions[v] for v in sorted(record.versions)]
        else:
            models = self.serving_versions()
        return {"model_stats": [m.stats.as_dict(m.name, m.version) for m in models]}

    # ---- inference -------------------------------------------------------------------------------

    async def infer(self, request: InferRequest) -> InferResponse:
        """Validate once, schedule, and shape the response to what the client asked for."""
        return await self._infer_validated(self._validated_model(request), request)

    def _validated_model(self, request: InferRequest) -> ModelVersion:
        """The version a one-response request names, with the request checked against it."""
        if self._stopping:
            raise unavailable("the server is shutting down")
        model = self.get_version(request.model_name, request.model_version)
        if model.decoupled:
            raise unsupported(DECOUPLED_INFER_MESSAGE)
        model.signature.validate(request)
        return model

    def submit(self, request: InferRequest, on_done: OnDone) -> tuple[ModelVersion, asyncio.Future[InferResponse]]:
        """`infer` for callers that finish in a callback rather than a coroutine (ensemble steps): validate and
        schedule now; `on_done(future)` then passes the future to `complete`. Saves a coroutine and a task
        wake-up, and with the direct scheduler also the loop turn of a done callback (see `OnDone`: whoever
        cancels the future calls `complete` for it)."""
        model = self._validated_model(request)
        request.arrival_ns = time.monotonic_ns()
        if request.trace is not None:
            self._trace_started(model, request)
        self._inflight += 1
        return model, model.scheduler.submit(request, on_done)

    def complete(
        self, model: ModelVersion, request: InferRequest, future: asyncio.Future[InferResponse]
    ) -> InferResponse:
        """The response of a request `submit` scheduled, once its future is done; raises its ServerError
        (CancelledError if it was cancelled) and counts the outcome as `infer` does."""
        self._inflight -= 1
        try:
            response = future.result()
        except BaseException as exc:
            if isinstance(exc, ServerError):
                model.stats.record_failure(exc.code, time.monotonic_ns() - request.arrival_ns)
            if request.trace is not None:
                request.trace.ended(None)
            raise
        return self._answer(model, request, response)

    def infer_stream(self, request: InferRequest) -> ResponseStream:
        """Any model's responses as a stream: a decoupled model's zero or more, another model's one.

        Validation errors raise here, before anything is queued; later errors end the stream.
        Cancelling the stream cancels the request: still queued, its scheduler skips it; running,
        the backend hears of it through the stream (decoupled models).
        """
        if self._stopping:
            raise unavailable("the server is shutting down")
        model = self.get_version(request.model_name, request.model_version)
        model.signature.validate(request)
        stream = ResponseStream(self._loop or asyncio.get_running_loop())
        if model.decoupled:
            if _shaped_outputs(request):
                stream.shape_response = lambda response: self._shape(model, request, response)
            request.response_stream = stream
            task = self._track(self._run_decoupled(model, request, stream))
        else:
            task = self._track(self._run_single(model, request, stream))
        stream.on_cancel(task.cancel)
        return stream

    def _track(self, coroutine: Any) -> asyncio.Task:
        task = (self._loop or asyncio.get_running_loop()).create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _run_single(self, model: ModelVersion, request: InferRequest, stream: ResponseStream) -> None:
        try:
            stream.send(await self._infer_validated(model, request), final=True)
        except ServerError as exc:
            stream.fail(exc)

    async def _run_decoupled(self, model: ModelVersion, request: InferRequest, stream: ResponseStream) -> None:
        """The scheduler's future settles when `execute` returns; responses keep coming through the stream."""
        request.arrival_ns = time.monotonic_ns()
        if request.trace is not None:
            self._trace_started(model, request)
        self._inflight += 1
        try:
            await model.scheduler.submit(request)
        except ServerError as exc:
            model.stats.record_failure(exc.code, time.monotonic_ns() - request.arrival_ns)
            stream.fail(exc)
            return
        finally:
            self._inflight -= 1
            if request.trace is not None:
                request.trace.ended(None)
        model.stats.success.add(time.monotonic_ns() - request.arrival_ns)

    async def _infer_validated(self, model: ModelVersion, request: InferRequest) -> InferResponse:
        request.arrival_ns = time.monotonic_ns()
        if request.trace is not None:
            self._trace_started(model, request)
        self._inflight += 1
        try:
            response = await model.scheduler.submit(request)
        except BaseException as exc:
            if isinstance(exc, ServerError):
                model.stats.record_failure(exc.code, time.monotonic_ns() - request.arrival_ns)
            if request.trace is not None:
                request.trace.ended(None)
            raise
        finally:
            self._inflight -= 1
        return self._answer(model, request, response)

    @staticmethod
    def _trace_started(model: ModelVersion, request: InferRequest) -> None:
        """A traced request is accepted: REQUEST_START, QUEUE_START and its inputs (an ensemble computes nothing
        itself, so it has no COMPUTE_* stamps, as in Triton)."""
        request.trace.started(model.name, model.version, request.id, request.inputs,
                              computes=backend_name(model.config) != "ensemble")

    def _answer(self, model: ModelVersion, request: InferRequest, response: InferResponse) -> InferResponse:
        """Count a success and shape the response to what the request asked for."""
        model.stats.success.add(time.monotonic_ns() - request.arrival_ns)
        if request.trace is not None:
            request.trace.ended(response)
        response.id = request.id
        response.model_name = model.name
        response.model_version = model.version
        if request.outputs is not None:  # as Triton answers: in the order the model produced them, each once
            wanted = {output.name for output in request.outputs}
            kept = []
            for tensor in response.outputs:
                if tensor.name in wanted:
                    wanted.discard(tensor.name)
                    kept.append(tensor)
            response.outputs = kept
            if _shaped_outputs(request):
                self._shape(model, request, response)
        return response

    def _shape(self, model: ModelVersion, request: InferRequest, response: InferResponse) -> InferResponse:
        """What the request's output parameters ask of a response: classification, then shared memory."""
        counts = class_count(request)
        if counts:
            classify_response(response, counts, model.labels, model.signature.max_batch_size > 0)
        self.shared_memory.write_outputs(request, response)
        return response

    # ---- model control ---------------------------------------------------------------------------

    def _lock(self, name: str) -> asyncio.Lock:
        lock = self._model_locks.get(name)
        if lock is None:
            lock = self._model_locks[name] = asyncio.Lock()
        return lock

    async def load_model(
        self, name: str, config_json: str | bytes | None = None, files: dict[str, bytes] | None = None
    ) -> None:
        """Load (or reload) a model; the old versions keep serving until the new ones are ready.

        `files` (a load request's `file:<version>/<name>` contents) replace the model's folder: they are
        written to a temporary folder, never into the repository, and need `config_json` beside them.
        """
        if not is_plain_model_name(name):
            raise invalid_arg(f"invalid model name '{name}': it must be a single folder name")
        async with self._lock(name):
            override = None
            if files:
                if not config_json:
                    raise invalid_arg(f"failed to load '{name}': 'file:' contents need a 'config' parameter too")
                override = write_model_files(name, files)
                location = ModelLocation(name, override / name, override)
            else:
                location = self.repository.locate(name)
                if location is None:
                    raise invalid_arg(f"failed to load '{name}', failed to poll from model repository")
            old = self._models.get(name)
            if old is None:
                self._models[name] = ModelRecord(name, ModelState.LOADING)
            try:
                record = await self._load_record(location, config_json)
            except ServerError as exc:
                if override is not None:
                    shutil.rmtree(override, ignore_errors=True)
                if old is not None and old.versions:
                    log.error("reload of model '%s' failed, the old version keeps serving: %s", name, exc.message)
                else:
                    self._models[name] = ModelRecord(name, ModelState.UNAVAILABLE, exc.message)
                raise
            record.override_path = override
            self._models[name] = record
            if old is not None:
                asyncio.ensure_future(self._unload_record(old, self.options.exit_timeout_secs, "it was reloaded"))
            log.info("model '%s' is %s (versions %s)", name, record.state.value, sorted(record.versions))

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        """Unload a model; with `unload_dependents`, an ensemble's composing models too."""
        if not is_plain_model_name(name):
            raise invalid_arg(f"invalid model name '{name}': it must be a single folder name")
        async with self._lock(name):
            record = self._models.pop(name, None)
            if record is None:
                return
            await self._unload_record(record, self.options.exit_timeout_secs, "it was unloaded")
            log.info("model '%s' unloaded", name)
        if unload_dependents:
            for model in record.versions.values():
                for step in model.config.ensemble_scheduling.step:
                    if step.model_name != name:
                        await self.unload_model(step.model_name, unload_dependents=True)

    async def _load_composing_models(self, name: str, config: model_config_pb2.ModelConfig) -> None:
        """Explicit control loads what an ensemble needs first, as Triton does."""
        for step in config.ensemble_scheduling.step:
            if step.model_name != name and step.model_name not in self._models:
                try:
                    await self.load_model(step.model_name)
                except ServerError as exc:
                    raise invalid_arg(f"ensemble '{name}': composing model '{step.model_name}' failed to load: "
                                      f"{exc.message}") from None

    async def _load_record(self, location: ModelLocation, config_json: str | bytes | None) -> ModelRecord:
        name = location.name
        try:
            config = parse_config_json(config_json) if config_json else load_config_file(location.path)
            complete_backend_fields(config, location.path)
            normalize(config, name)
            validate(config, name, partial_io=self.options.auto_complete)
            versions = select_versions(config.version_policy, available_versions(location.path))
        except (ConfigError, OSError) as exc:
            raise invalid_arg(str(exc)) from None
        if not versions:
            raise invalid_arg(f"model '{name}' has no version folders to serve (e.g. '{name}/1/')")
        if self.options.control_mode is ControlMode.EXPLICIT and backend_name(config) == "ensemble":
            await self._load_composing_models(name, config)
        record = ModelRecord(name, ModelState.READY, fingerprint=fingerprint(location.path))
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
            backend_config=self.options.backend_configs.get(kind, {}),
            auto_complete=self.options.auto_complete,
            runtime=self,
        )
        labels = load_labels(location.path, config)
        cached = self.response_cache is not None and config.response_cache.enable
        if cached and (config.model_transaction_policy.decoupled or config.HasField("sequence_batching")):
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
        if self.options.metrics.summary_latencies:
            stats.add_summaries(self.options.metrics.quantiles, cached)
        try:
            scheduler = create_scheduler(name, config, backend_model.instances, stats)
            if cached:
                scheduler = CachingScheduler(scheduler, self.response_cache, name, str(version), stats)
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

    async def _unload_record(self, record: ModelRecord, timeout: float, why: str) -> None:
        """Let the versions finish what they have queued and running, for up to `timeout` seconds (the exit
        timeout: Triton waits for in-flight requests), then stop what still runs and release them."""
        await asyncio.gather(*(self._unload_version(model, timeout, why) for model in record.versions.values()))
        if record.override_path is not None:
            shutil.rmtree(record.override_path, ignore_errors=True)

    @staticmethod
    async def _unload_version(model: ModelVersion, timeout: float, why: str) -> None:
        try:
            await asyncio.wait_for(model.scheduler.drain(), timeout)
        except asyncio.TimeoutError:
            log.warning("model '%s' version %s still had requests running %gs after unload began: stopping them",
                        model.name, model.version, timeout)
            for instance in model.backend_model.instances:
                instance.abort(f"{why}, and it was still running {timeout:g}s later (the exit timeout)")
        await model.backend_model.unload()

    # ---- polling ---------------------------------------------------------------------------------

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.options.poll_secs)
            await self.poll_once()

    async def poll_once(self) -> None:
        """Load added models, unload removed ones, reload changed ones (a failed reload keeps the old)."""
        found, _ = self.repository.scan()
        for name in [n for n in self._models if n not in found]:
            await self.unload_model(name)
        for name, location in found.items():
            record = self._models.get(name)
            if record is None or record.fingerprint != fingerprint(location.path):
                await self._load_logged(name)
