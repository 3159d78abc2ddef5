"""Run an ensemble request: each step is a request to the core, started as soon as its inputs exist.

Steps go through their models' own schedulers, so a batched model inside an ensemble batches across
ensemble requests, and a model's statistics count its ensemble traffic.
"""

from __future__ import annotations

import asyncio
from typing import Any

from transerve.backends.base import Backend, BackendInstance, BackendModel, ExecutionResult, ModelContext
from transerve.backends.ensemble.graph import Step, build_steps
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
    """Executes ensemble requests concurrently, each as its own graph walk."""

    max_inflight = MAX_CONCURRENT_REQUESTS

    def __init__(self, name: str, version: str, steps: list[Step], outputs: list[str], runtime: Any) -> None:
        self.name = name
        self._version = version
        self._steps = steps
        self._outputs = outputs
        self._runtime = runtime

    async def execute(self, requests: list[InferRequest]) -> ExecutionResult:
        if len(requests) == 1:
            return ExecutionResult([await self._run(requests[0])])
        return ExecutionResult(list(await asyncio.gather(*(self._run(request) for request in requests))))

    async def close(self) -> None:
        """Nothing to release: the composing models have their own lifecycles."""

    async def _run(self, request: InferRequest) -> InferResponse | ServerError:
        tensors = {tensor.name: tensor for tensor in request.inputs}
        pending = list(self._steps)
        running: dict[asyncio.Future[InferResponse], Step] = {}
        try:
            while pending or running:
                ready = [step for step in pending if all(t in tensors for t in step.inputs.values())]
                for step in ready:
                    pending.remove(step)
                if len(ready) == 1 and not running:  # a chain: no task, no wait set
                    step = ready[0]
                    self._store(step, await self._call(step, request, tensors), tensors)
                    continue
                for step in ready:
                    running[asyncio.ensure_future(self._call(step, request, tensors))] = step
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for future in done:
                    self._store(running.pop(future), future.result(), tensors)
        except _StepFailed as failed:
            for future in running:
                future.cancel()
            return failed.error
        return InferResponse(self.name, self._version, [tensors[name] for name in self._outputs if name in tensors])

    async def _call(self, step: Step, request: InferRequest, tensors: dict[str, Tensor]) -> InferResponse:
        step_request = InferRequest(
            model_name=step.model_name,
            model_version=step.model_version,
            id=request.id,
            inputs=[Tensor(name, tensors[t].datatype, tensors[t].data) for name, t in step.inputs.items()],
            outputs=[RequestedOutput(name) for name in step.outputs],
            parameters=request.parameters,
            correlation_id=request.correlation_id,
            flags=request.flags,
            priority=request.priority,
            timeout_us=request.timeout_us,
        )
        try:
            return await self._runtime.infer(step_request)
        except ServerError as exc:
            raise _StepFailed(ServerError(exc.code, f"in ensemble '{self.name}', {step.label} failed: "
                                                    f"{exc.message}")) from None

    @staticmethod
    def _store(step: Step, response: InferResponse, tensors: dict[str, Tensor]) -> None:
        for output in response.outputs:
            target = step.outputs.get(output.name)
            if target is not None:
                tensors[target] = Tensor(target, output.datatype, output.data)


class _StepFailed(Exception):
    def __init__(self, error: ServerError) -> None:
        super().__init__(error.message)
        self.error = error
