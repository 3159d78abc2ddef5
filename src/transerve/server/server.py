"""The Server: the registry of loaded models, their lifecycle, and the one request path every frontend calls.

It is the top of the house below the frontends: it imports the backends (through `loading.py`), the schedulers
and the repository, and hands each backend itself as the `backends.runtime.Runtime` they may call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tritonclient.grpc import model_config_pb2

from transerve.core.custom_metrics import CustomMetrics
from transerve.core.errors import ServerError, invalid_arg, unavailable, unsupported
from transerve.core.log_settings import ServerLog
from transerve.core.streams import ResponseStream
from transerve.core.tracing import Tracer
from transerve.core.types import InferRequest, InferResponse
from transerve.repository.overrides import write_model_files
from transerve.repository.remote import RemoteRepository, StorageError
from transerve.repository.repository import MAX_MODEL_NAME_BYTES, ModelLocation, is_plain_model_name
from transerve.scheduling import OnDone
from transerve.scheduling.response_cache import ResponseCache
from transerve.server.loading import ModelLoader, composing_order, ensemble_steps
from transerve.server.options import ControlMode, ServerOptions
from transerve.server.polling import poll_forever, poll_once
from transerve.server.registry import ModelRecord, ModelRegistry, ModelState, ModelVersion
from transerve.server.requests import DECOUPLED_INFER_MESSAGE, Call, RequestPath, run_decoupled, run_single
from transerve.server.shared_memory import SharedMemoryRegistry
from transerve.server.tasks import BackgroundTasks

log = logging.getLogger("transerve")

#: The Triton release whose API and behaviour transerve answers as: the version in the server metadata, which
#: Triton's clients and tests compare (transerve's own is `transerve --version`).
TRITON_VERSION = "2.51.0"

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


@dataclass(slots=True)
class _ModelLock:
    """A model's lock and how many hold or await it."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


class Server(ModelRegistry):
    """Owns the models; frontends call `infer` and the metadata/control methods."""

    def __init__(self, options: ServerOptions) -> None:
        #: Where the object-storage repositories are mirrored: this server's own folder, removed at stop.
        self._mirror: Path | None = None
        remotes = []
        if options.remote_repositories:
            self._mirror = Path(tempfile.mkdtemp(prefix="transerve-models-", dir=options.repository_cache))
            remotes = [RemoteRepository(url, self._mirror / str(index), options.max_model_bytes)
                       for index, url in enumerate(options.remote_repositories)]
        super().__init__(options.repositories, remotes)
        self.options = options
        #: The system shared memory regions clients registered (Triton's shared memory extension).
        self.shared_memory = SharedMemoryRegistry(options.limits.shm_regions, options.limits.shm_regions_per_object)
        #: The log settings, which clients may read and change (Triton's logging extension).
        self.log = ServerLog(options.log_settings)
        #: Which requests are traced, and the settings clients may read and change (Triton's trace extension).
        self.tracing = Tracer(options.trace, self.model_ready)
        #: The responses of models whose config enables `response_cache`, when the server has a cache.
        self.response_cache = ResponseCache(options.cache_bytes) if options.cache_bytes is not None else None
        #: Metric families that model code created (pb_utils.MetricFamily), shown on /metrics.
        self.custom_metrics = CustomMetrics()
        self._loader = ModelLoader(options, self, self.response_cache, self._load_composing_models)
        self._path = RequestPath(self.shared_memory, options.max_response_bytes)
        self._live = False
        #: Why the start failed, when the server serves on anyway (`--exit-on-error=false`): neither live nor ready.
        self.start_error: str | None = None
        self._stopping = False
        self._model_locks: dict[str, _ModelLock] = {}
        #: Unloads of reloaded models' old versions, and polling.
        self._tasks = BackgroundTasks()
        self._poll_task: asyncio.Task[None] | None = None
        #: The tasks of `infer_stream` requests (a request's own failure goes to its stream).
        self._streams: set[asyncio.Task[None]] = set()
        #: The event loop the server runs on, kept from start() (looking it up costs a syscall).
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def _inflight(self) -> int:
        """Requests accepted and not yet settled (`requests.Call`)."""
        return self._path.inflight

    @property
    def explicit_model_control(self) -> bool:
        return self.options.control_mode is ControlMode.EXPLICIT

    # ---- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the models the control mode asks for; broken ones are recorded, never fatal (a remote repository
        that cannot be read is: UNAVAILABLE)."""
        self._loop = asyncio.get_running_loop()
        if self.repository.remotes:
            # A repository that cannot be read stops the start, as in Triton; models download as they load.
            try:
                await asyncio.to_thread(self.repository.refresh, False)
            except StorageError as exc:
                raise unavailable(str(exc)) from None
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
        steps = {name: ensemble_steps(found[name], self.options.limits.config_bytes) for name in names if name in found}
        ensembles = {name: named for name, named in steps.items() if named is not None}
        await asyncio.gather(*(self.load_logged(name) for name in names if name not in ensembles))
        while ensembles:
            # Those that contain no ensemble still waiting; in a cycle none qualifies, and they load (and fail) anyway.
            wave = [name for name, named in ensembles.items() if not (named - {name}) & ensembles.keys()]
            wave = wave or list(ensembles)
            for name in wave:
                del ensembles[name]
            await asyncio.gather(*(self.load_logged(name) for name in wave))
        if self.options.control_mode is ControlMode.POLL:
            self._poll_task = self._tasks.start(poll_forever(self, self.options.poll_secs), "polling the repositories")

    def fail_start(self, reason: str) -> None:
        """The start failed (a repository missing or unreadable) and the server serves on, as Triton does under
        `--exit-on-error=false`: nothing is loaded, the health endpoints answer not live and not ready, the
        metadata endpoints answer."""
        self.start_error = reason
        self._loop = asyncio.get_running_loop()
        self._live = False

    async def load_logged(self, name: str) -> None:
        """`load_model`, its refusal logged rather than raised (loads at start and by polling)."""
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
        while self._path.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if self._path.inflight:
            log.warning("exit timeout reached with %d requests in flight", self._path.inflight)
        await asyncio.gather(*(self._loader.unload_record(record, max(0.0, deadline - time.monotonic()),
                                                          "the server is shutting down")
                               for record in list(self._models.values())))
        await self._tasks.join()
        self._models.clear()
        self.tracing.close()
        if self._mirror is not None:
            shutil.rmtree(self._mirror, ignore_errors=True)
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
        """Named "triton", with the version of the Triton release transerve answers as: what Triton's clients and
        tests expect of the server they talk to."""
        return {"name": "triton", "version": TRITON_VERSION, "extensions": EXTENSIONS}

    def loaded_fingerprints(self) -> dict[str, str]:
        """Each model name the server holds a record of, with the fingerprint of the folder it loaded."""
        return {name: record.fingerprint for name, record in self._models.items()}

    # ---- inference -------------------------------------------------------------------------------

    async def infer(self, request: InferRequest) -> InferResponse:
        """Validate once, schedule, and shape the response to what the client asked for."""
        model = self._validated_model(request)
        call = Call(self._path, model, request)
        try:
            response = await model.scheduler.submit(request)
        except BaseException as exc:
            call.fail(exc)
            raise
        return call.answer(response)

    def _validated_model(self, request: InferRequest) -> ModelVersion:
        """The version a one-response request names, with the request checked against it."""
        if self._stopping:
            raise unavailable("the server is shutting down")
        model = self.get_version(request.model_name, request.model_version)
        if model.decoupled:
            raise unsupported(DECOUPLED_INFER_MESSAGE)
        model.signature.validate(request)
        return model

    def submit(self, request: InferRequest, on_done: OnDone) -> Call:
        """`infer` for callers that finish in a callback rather than a coroutine (ensemble steps): validate and
        schedule now; `on_done(future)` is called once the call's future is done, and `call.result()` then gives
        the response. Saves a coroutine and a task wake-up, and with the direct scheduler also the loop turn of a
        done callback. The call owns the accounting: a caller gives a request up with `call.cancel()`."""
        model = self._validated_model(request)
        call = Call(self._path, model, request)
        try:
            call.future = model.scheduler.submit(request, on_done)
        except BaseException as exc:
            call.fail(exc)
            raise
        return call

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
            request.response_stream = stream
            runner = run_decoupled(self._path, model, request, stream)
        else:
            runner = run_single(self._path, model, request, stream)
        task = (self._loop or asyncio.get_running_loop()).create_task(runner)
        self._streams.add(task)
        task.add_done_callback(self._streams.discard)
        stream.on_cancel(task.cancel)
        return stream

    # ---- model control ---------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _lock(self, name: str) -> AsyncIterator[None]:
        """Hold model `name`'s lock; the lock is kept only while someone holds or awaits it, so that names a client
        makes up (loads and unloads of models that do not exist) leave nothing behind."""
        lock = self._model_locks.get(name)
        if lock is None:
            lock = self._model_locks[name] = _ModelLock()
        lock.users += 1
        try:
            async with lock.lock:
                yield
        finally:
            lock.users -= 1
            if not lock.users:
                del self._model_locks[name]

    async def load_model(
        self, name: str, config_json: str | bytes | None = None, files: dict[str, bytes] | None = None
    ) -> None:
        """Load (or reload) a model; the old versions keep serving until the new ones are ready.

        `files` (a load request's `file:<version>/<name>` contents) replace the model's folder: they are
        written to a temporary folder, never into the repository, and need `config_json` beside them.
        """
        _check_model_name(name)
        files = files or {}
        self.options.limits.check_load(name, len(config_json or ""), len(files),
                                       sum(len(content) for content in files.values()))
        async with self._lock(name):
            override = None
            if files:
                if not config_json:
                    raise invalid_arg(f"failed to load '{name}': 'file:' contents need a 'config' parameter too")
                override = await asyncio.to_thread(write_model_files, name, files)
                location = ModelLocation(name, override / name, override)
            else:
                await self._fetch(name)
                location = await asyncio.to_thread(self.repository.locate, name)
                if location is None:
                    raise invalid_arg(f"failed to load '{name}', failed to poll from model repository")
            old = self._models.get(name)
            if old is None:
                self._models[name] = ModelRecord(name, ModelState.LOADING)
            try:
                config, versions = await asyncio.to_thread(self._loader.read_config, location, config_json)
                if old is not None and override is None and await self._loader.update_in_place(
                        old, location, config, versions, self._tasks):
                    log.info("model '%s' is %s (versions %s)", name, old.state.value, sorted(old.versions))
                    return
                record = await self._load_retrying(location, config, versions)
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
                self._tasks.start(self._loader.unload_record(old, self.options.exit_timeout_secs, "it was reloaded"),
                                  f"unloading the old versions of reloaded model '{name}'")
            log.info("model '%s' is %s (versions %s)", name, record.state.value, sorted(record.versions))

    async def _load_retrying(
        self, location: ModelLocation, config: model_config_pb2.ModelConfig, versions: list[int]
    ) -> ModelRecord:
        """`--model-load-retry-count`: a load that failed is tried again, that many times, as in Triton."""
        retries = self.options.load_retries
        attempt = 0
        while True:
            try:
                return await self._loader.load_record(location, config, versions)
            except ServerError as exc:
                if attempt >= retries:
                    raise
                attempt += 1
                log.warning("model '%s' failed to load (%s); trying again (%d of %d)", location.name, exc.message,
                            attempt, retries)

    async def _fetch(self, name: str) -> None:
        """Download a remote repository's model (again, if it changed) before it loads; a failure leaves a model
        that was not serving UNAVAILABLE with the reason."""
        if not self.repository.remotes:
            return
        try:
            await asyncio.to_thread(self.repository.fetch, name)
        except StorageError as exc:
            old = self._models.get(name)
            if old is None or not old.versions:
                self._models[name] = ModelRecord(name, ModelState.UNAVAILABLE, str(exc))
            raise invalid_arg(f"failed to load '{name}': {exc}") from None

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        """Unload a model; with `unload_dependents`, an ensemble's composing models too."""
        _check_model_name(name)
        if name not in self._models and name not in self._model_locks:
            return  # nothing to unload, and nothing kept for a name a client made up
        async with self._lock(name):
            record = self._models.pop(name, None)
            if record is None:
                return
            await self._loader.unload_record(record, self.options.exit_timeout_secs, "it was unloaded")
            log.info("model '%s' unloaded", name)
        if unload_dependents:
            for model in record.versions.values():
                for step in model.config.ensemble_scheduling.step:
                    if step.model_name != name:
                        await self.unload_model(step.model_name, unload_dependents=True)

    async def _load_composing_models(self, name: str, config: model_config_pb2.ModelConfig) -> None:
        """Explicit control loads what an ensemble needs first, as Triton does: the models its steps name that are
        not loaded, and theirs, leaves first (see `composing_order`), so that none of their loads loads another
        and a chain of ensembles never recurses."""
        order = await asyncio.to_thread(composing_order, name, config, self.repository, self._models.__contains__,
                                        self.options.limits.config_bytes)
        for model_name in order:
            if model_name in self._models:
                continue
            try:
                await self.load_model(model_name)
            except ServerError as exc:
                raise invalid_arg(f"ensemble '{name}': composing model '{model_name}' failed to load: "
                                  f"{exc.message}") from None

    async def poll_once(self) -> None:
        """Load added models, unload removed ones, reload changed ones (a failed reload keeps the old)."""
        await poll_once(self)


def _check_model_name(name: str) -> None:
    if not is_plain_model_name(name):
        shown = name if len(name) <= 80 else name[:77] + "..."
        raise invalid_arg(f"invalid model name '{shown}': it must be a single folder name of at most "
                          f"{MAX_MODEL_NAME_BYTES} bytes")
