"""Run an ensemble request: each step is a request to the core, submitted as soon as its inputs exist.

Steps go through their models' own schedulers, so a batched model inside an ensemble batches across
ensemble requests, and a model's statistics count its ensemble traffic.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from transerve.backends.base import Backend, BackendInstance, BackendModel, ExecutionResult, ModelContext
from transerve.backends.ensemble.graph import Step, build_steps
from transerve.backends.ensemble.walk import Walk
from transerve.config.model_config import ConfigError
from transerve.core.errors import ServerError, invalid_arg
from transerve.core.signature import ModelSignature
from transerve.core.types import InferRequest, InferResponse, RequestedOutput, Tensor

#: Ensemble requests are not limited by instance slots: each one is a little graph of awaits.
MAX_CONCURRENT_REQUESTS = 4096


class EnsembleBackend(Backend):
    """`platform: "ensemble"`: checks the graph against the loaded composing models."""

    name = "ensemble"

    async def load(self, context: ModelContext) -> BackendModel:
        runtime = context.runtime
        if runtime is None:
            raise invalid_arg(f"ensemble '{context.name}' needs the server to run its steps")
        signatures: dict[tuple[str, str], ModelSignature] = {}
        for raw in context.config.ensemble_scheduling.step:
            version = "" if raw.model_version < 0 else str(raw.model_version)
            try:
                model = runtime.get_version(raw.model_name, version)
            except ServerError:
                continue  # build_steps names the missing model
            if model.config.model_transaction_policy.decoupled:
                raise invalid_arg(f"ensemble '{context.name}': step model '{raw.model_name}' is decoupled, "
                                  "which ensembles do not support yet")
            signatures[(raw.model_name, version)] = model.signature
        try:
            steps = build_steps(context.name, context.config, signatures)
        except ConfigError as exc:
            raise invalid_arg(str(exc)) from None
        outputs = [output.name for output in context.config.output]
        instance = EnsembleInstance(context.name, context.version, steps, outputs, runtime)
        return EnsembleModel(context.config, [instance])


class EnsembleModel(BackendModel):
    def __init__(self, config: Any, instances: list[BackendInstance]) -> None:
        self.config = config
        self.instances = instances


class EnsembleInstance(BackendInstance):
    """Executes ensemble requests concurrently, each as its own graph walk (`walk.Walk`)."""

    max_inflight = MAX_CONCURRENT_REQUESTS

    def __init__(self, name: str, version: str, steps: list[Step], outputs: list[str], runtime: Any) -> None:
        self._loop = asyncio.get_running_loop()
        self.name = name
        self._version = version
        self.steps = steps
        self._outputs = outputs
        self.runtime = runtime
        #: Per step, the outputs its requests ask for (shared by those requests, which nobody mutates).
        self._requested = {step.index: [RequestedOutput(name) for name in step.outputs] for step in steps}

    def execute(self, requests: list[InferRequest]) -> asyncio.Future[ExecutionResult]:
        """A future the walks' callbacks resolve: no task per ensemble request."""
        future: asyncio.Future[ExecutionResult] = self._loop.create_future()
        results: list[InferResponse | ServerError | None] = [None] * len(requests)
        remaining = [len(requests)]

        def done(index: int, result: InferResponse | ServerError) -> None:
            results[index] = result
            remaining[0] -= 1
            if not remaining[0] and not future.done():
                future.set_result(ExecutionResult(results))

        for index, request in enumerate(requests):
            Walk(self, request, functools.partial(done, index)).start()
        return future

    async def close(self) -> None:
        """Nothing to release: the composing models have their own lifecycles."""

    @staticmethod
    def ready(step: Step, tensors: dict[str, Tensor]) -> bool:
        return all(tensor in tensors for tensor in step.inputs.values())

    def make_request(self, step: Step, request: InferRequest, tensors: dict[str, Tensor]) -> InferRequest:
        """The core request of one step, with the ensemble request's id, sequence and scheduling fields."""
        return InferRequest(
            model_name=step.model_name,
            model_version=step.model_version,
            id=request.id,
            inputs=[Tensor(name, tensors[t].datatype, tensors[t].data) for name, t in step.inputs.items()],
            outputs=self._requested[step.index],
            parameters=request.parameters,
            correlation_id=request.correlation_id,
            flags=request.flags,
            priority=request.priority,
            timeout_us=request.timeout_us,
        )

    def respond(self, request: InferRequest, tensors: dict[str, Tensor]) -> InferResponse:
        return InferResponse(self.name, self._version, [tensors[name] for name in self._outputs if name in tensors])
