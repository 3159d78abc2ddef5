"""Run an ensemble request: each step is a request to the core, submitted as soon as its inputs exist.

Steps go through their models' own schedulers, so a batched model inside an ensemble batches across
ensemble requests, and a model's statistics count its ensemble traffic.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Iterable

from tritonclient.grpc import model_config_pb2

from transerve.backends.base import Backend, BackendInstance, BackendModel, ExecutionResult, ModelContext
from transerve.backends.ensemble.graph import Step, build_steps, needed_steps
from transerve.backends.ensemble.streaming import StreamingWalk, check_decoupled_origins
from transerve.backends.ensemble.walk import Tensors, Walk
from transerve.backends.runtime import Runtime
from transerve.config.model_config import ConfigError
from transerve.core.errors import ServerError, invalid_arg
from transerve.core.protocol_parameters import SEQUENCE_END, SEQUENCE_START
from transerve.core.signature import ModelSignature
from transerve.core.types import InferRequest, InferResponse, RequestedOutput, Tensor

#: Ensemble requests are not limited by instance slots: each one is a little graph of awaits.
MAX_CONCURRENT_REQUESTS = 4096
#: How many sets of requested outputs keep their pruned step lists (a client picks the sets, so they are bounded).
MAX_PRUNED_SETS = 64
#: Steps in one ensemble, and ensembles inside ensembles: far past any real graph, and short of what a config
#: (which a client can send through the load API) could make the server walk or nest without end.
MAX_STEPS = 1024
MAX_DEPTH = 32


class EnsembleBackend(Backend):
    """`platform: "ensemble"`: checks the graph against the loaded composing models."""

    name = "ensemble"

    async def load(self, context: ModelContext) -> BackendModel:
        runtime = context.runtime
        if runtime is None:
            raise invalid_arg(f"ensemble '{context.name}' needs the server to run its steps")
        if len(context.config.ensemble_scheduling.step) > MAX_STEPS:
            raise invalid_arg(f"ensemble '{context.name}' has {len(context.config.ensemble_scheduling.step)} steps; "
                              f"an ensemble may have at most {MAX_STEPS}")
        _check_depth(context.name, context.config.ensemble_scheduling.step, runtime)
        signatures: dict[tuple[str, str], ModelSignature] = {}
        decoupled_models: set[tuple[str, str]] = set()
        for raw in context.config.ensemble_scheduling.step:
            version = "" if raw.model_version < 0 else str(raw.model_version)
            try:
                model = runtime.get_version(raw.model_name, version)
            except ServerError:
                continue  # build_steps names the missing model
            signatures[(raw.model_name, version)] = model.signature
            if model.config.model_transaction_policy.decoupled:
                decoupled_models.add((raw.model_name, version))
        outputs = [output.name for output in context.config.output]
        try:
            steps = build_steps(context.name, context.config, signatures)
            decoupled = {step.index for step in steps if (step.model_name, step.model_version) in decoupled_models}
            if decoupled:
                check_decoupled_origins(context.name, steps, decoupled, outputs)
        except ConfigError as exc:
            raise invalid_arg(str(exc)) from None
        # As Triton reports it: an ensemble with a decoupled step answers as a decoupled model does.
        context.config.model_transaction_policy.decoupled = bool(decoupled)
        optional = {tensor.name for tensor in context.config.input if tensor.optional}
        instance = EnsembleInstance(context.name, context.version, steps, outputs, runtime, decoupled, optional)
        return BackendModel(context.config, [instance])


def _check_depth(name: str, steps: Iterable[model_config_pb2.ModelEnsembling.Step], runtime: Runtime) -> None:
    """Refuse an ensemble nested more than MAX_DEPTH ensembles deep, walking the loaded composing models' configs
    with a stack (a deep chain must not exhaust Python's), each model at most once per depth."""
    pending = [(step.model_name, "" if step.model_version < 0 else str(step.model_version), 2) for step in steps]
    #: The deepest each model was reached at: one reached deeper again is walked again.
    deepest: dict[tuple[str, str], int] = {}
    while pending:
        model_name, version, depth = pending.pop()
        if deepest.get((model_name, version), 0) >= depth:
            continue
        deepest[(model_name, version)] = depth
        try:
            config = runtime.get_version(model_name, version).config
        except ServerError:
            continue  # build_steps names the missing model
        if not config.HasField("ensemble_scheduling"):
            continue
        if depth > MAX_DEPTH:
            raise invalid_arg(f"ensemble '{name}' nests ensembles more than {MAX_DEPTH} deep (through "
                              f"'{model_name}'); at most {MAX_DEPTH} levels are served")
        pending.extend((step.model_name, "" if step.model_version < 0 else str(step.model_version), depth + 1)
                       for step in config.ensemble_scheduling.step)


class EnsembleInstance(BackendInstance):
    """Executes ensemble requests concurrently, each as its own graph walk (`walk.Walk`)."""

    max_inflight = MAX_CONCURRENT_REQUESTS
    #: A one-response request whose client goes away ends its walk, which cancels the steps still running (a
    #: generation step then stops decoding); decoupled requests are cancelled through their streams instead.
    cancellable = True

    def __init__(
        self, name: str, version: str, steps: list[Step], outputs: list[str], runtime: Runtime, decoupled: set[int],
        optional: set[str],
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self.name = name
        self._version = version
        self.steps = steps
        self._outputs = outputs
        self.runtime = runtime
        #: Per step, the outputs its requests ask for (shared by those requests, which nobody mutates).
        self._requested = {step.index: [RequestedOutput(name) for name in step.outputs] for step in steps}
        #: Optional ensemble inputs: when a request leaves one out, the steps it feeds run without it.
        self._optional = frozenset(optional)
        #: The steps of requests that ask for some of the outputs only, by the set they ask for.
        self._pruned: dict[frozenset[str], list[Step]] = {}
        self._streaming = StreamingWalk(self, decoupled) if decoupled else None
        #: The one-response walks running, by their request's identity: what `cancel` finds them by.
        self._walks: dict[int, Walk] = {}

    def execute(self, requests: list[InferRequest]) -> asyncio.Future[ExecutionResult]:
        """A future the walks' callbacks resolve: no task per ensemble request."""
        if self._streaming is not None:
            return asyncio.ensure_future(self._streaming.execute(requests))
        future: asyncio.Future[ExecutionResult] = self._loop.create_future()

        def settle(result: ExecutionResult) -> None:
            if not future.done():
                future.set_result(result)

        self._walk(requests, settle)
        return future

    def execute_then(
        self, requests: list[InferRequest], done: Callable[[ExecutionResult], None]
    ) -> Awaitable[ExecutionResult] | None:
        """The last walk to end calls `done`, in the callback of its last step."""
        if self._streaming is not None:
            return self.execute(requests)
        self._walk(requests, done)
        return None

    def _walk(self, requests: list[InferRequest], done: Callable[[ExecutionResult], None]) -> None:
        """Start a walk per request; `done` gets their results once all have ended (a loop turn later if
        they all ended at once, as `execute_then` promises)."""
        results: list[InferResponse | ServerError | None] = [None] * len(requests)
        remaining = [len(requests)]
        starting = True

        def walked(index: int, result: InferResponse | ServerError) -> None:
            self._walks.pop(id(requests[index]), None)
            results[index] = result
            remaining[0] -= 1
            if remaining[0]:
                return
            if starting:
                self._loop.call_soon(done, ExecutionResult(results))
            else:
                done(ExecutionResult(results))

        for index, request in enumerate(requests):
            walk = Walk(self, request, functools.partial(walked, index))
            self._walks[id(request)] = walk
            walk.start()
        starting = False

    def cancel(self, request: InferRequest) -> None:
        walk = self._walks.get(id(request))
        if walk is not None:
            walk.cancel()

    async def close(self) -> None:
        """Nothing to release: the composing models have their own lifecycles."""

    def start_tensors(self, request: InferRequest) -> Tensors:
        """The request's inputs, and the optional inputs it left out as settled but absent."""
        tensors: Tensors = {tensor.name: tensor for tensor in request.inputs}
        for name in self._optional:
            tensors.setdefault(name, None)
        return tensors

    def steps_for(self, request: InferRequest) -> list[Step]:
        """Every step, or, when the request asks for some outputs only, the steps those need (Triton runs no
        others: their models see no request)."""
        if request.outputs is None or len(request.outputs) == len(self._outputs):
            return self.steps
        wanted = frozenset(output.name for output in request.outputs)
        steps = self._pruned.get(wanted)
        if steps is None:
            steps = needed_steps(self.steps, self._outputs, wanted)
            if len(self._pruned) < MAX_PRUNED_SETS:
                self._pruned[wanted] = steps
        return steps

    def ready(self, step: Step, tensors: Tensors) -> bool:
        return all(tensor in tensors for tensor in step.inputs.values())

    def make_request(self, step: Step, request: InferRequest, tensors: Tensors) -> InferRequest:
        """The core request of one step, with the ensemble request's id, sequence and scheduling fields; a traced
        ensemble request's step is traced as its child."""
        return InferRequest(
            model_name=step.model_name,
            model_version=step.model_version,
            id=request.id,
            inputs=[Tensor(name, tensors[t].datatype, tensors[t].data) for name, t in step.inputs.items()
                    if tensors[t] is not None],
            outputs=self._requested[step.index],
            parameters=request.parameters,
            correlation_id=request.correlation_id,
            flags=request.flags,
            priority=request.priority,
            timeout_us=request.timeout_us,
            trace=request.trace.child() if request.trace is not None else None,
        )

    def respond(self, request: InferRequest, tensors: Tensors) -> InferResponse:
        """The ensemble's outputs (those the request asked for, when it named some), with the sequence
        parameters Triton puts on every ensemble response."""
        names = self._outputs if request.outputs is None else [output.name for output in request.outputs]
        parameters = {"sequence_id": request.correlation_id, "sequence_start": bool(request.flags & SEQUENCE_START),
                      "sequence_end": bool(request.flags & SEQUENCE_END)}
        outputs = [tensor for tensor in (tensors.get(name) for name in names) if tensor is not None]
        return InferResponse(self.name, self._version, outputs, id=request.id, parameters=parameters)
