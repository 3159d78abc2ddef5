"""What the onnxruntime, pytorch and tensorrt backends share: an engine that runs one tensor per input and
releases the GIL, driven from a thread of its own so that the event loop never waits on it.

A batch's requests are merged (padded to a common shape and stacked, `core.batching`), run once, and
split back per request. Outputs along a padded axis are trimmed back to each request's own length, so every
request gets what it would have got alone: an output axis declared `-1` whose size is the length the inputs
were padded to is taken to follow that length (a sequence axis such as `last_hidden_state`'s).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol

import numpy as np
from tritonclient.grpc import model_config_pb2

from transerve.backends.base import BackendInstance, ExecutionResult, Placement
from transerve.backends.idle_ending_executor import IdleEndingExecutor
from transerve.backends.index_bounds import IndexBound, out_of_bounds
from transerve.config.model_config import ConfigError
from transerve.core.batching import merge_inputs, split_outputs
from transerve.core.datatypes import NUMPY_DTYPES, config_to_protocol
from transerve.core.errors import ServerError, internal, invalid_arg, unavailable
from transerve.core.extras import MissingExtra, import_optional
from transerve.core.types import InferRequest, InferResponse, Tensor


def import_engine(module: str, extra: str) -> ModuleType:
    """The engine's module, imported on first use; UNAVAILABLE naming the extra to install when it is missing."""
    try:
        return import_optional(module, extra)
    except MissingExtra as exc:
        raise unavailable(str(exc)) from None


class Engine(Protocol):
    """One loaded model in one engine, called from its instance's thread only."""

    def run(self, inputs: dict[str, np.ndarray], outputs: Sequence[str]) -> dict[str, np.ndarray]:
        """Outputs by name for named inputs, the batch axis first when the model batches."""


@dataclass(frozen=True, slots=True)
class OutputSpec:
    name: str
    datatype: str
    dtype: np.dtype
    #: Config dims, without the batch axis.
    dims: tuple[int, ...]


def output_specs(config: model_config_pb2.ModelConfig) -> list[OutputSpec]:
    specs = []
    for output in config.output:
        datatype = config_to_protocol(model_config_pb2.DataType.Name(output.data_type))
        dims = tuple(output.reshape.shape) if output.HasField("reshape") else tuple(output.dims)
        specs.append(OutputSpec(output.name, datatype, NUMPY_DTYPES[datatype], dims))
    return specs


class ThreadedInstance(BackendInstance):
    """One instance: its engine is only ever called from a thread of its own, one at a time (the pytorch
    backend's ends after an idle second and the next execution starts another: `IdleEndingExecutor`).

    Two executions may be handed over at once: the second waits in the thread's queue, so the engine starts it
    as soon as the first ends instead of idling while the event loop answers and dispatches (the dynamic
    batcher hands batches to idle instances only, so this matters for the direct scheduler).

    `bounds` are the inputs that index an embedding table (`index_bounds`): a request holding an id outside one
    is answered its 400 alone, and the rest of its batch runs.
    """

    max_inflight = 2

    def __init__(
        self,
        model_name: str,
        version: str,
        name: str,
        config: model_config_pb2.ModelConfig,
        executor: Executor,
        engine: Engine,
        loop: asyncio.AbstractEventLoop,
        bounds: Sequence[IndexBound] = (),
    ) -> None:
        self.name = name
        self._bounds = tuple(bounds)
        self._model_name = model_name
        self._version = version
        self._batching = config.max_batch_size > 0
        self._outputs = output_specs(config)
        self._executor = executor
        #: The engine's model (an onnxruntime session, a TorchScript module...): touch it from its thread only.
        self.engine = engine
        self._loop = loop

    def execute(self, requests: list[InferRequest]) -> asyncio.Future[ExecutionResult]:
        return self._loop.run_in_executor(self._executor, self._execute, requests)

    async def close(self) -> None:
        self.engine = None  # type: ignore[assignment]  # the engine's memory goes with its last reference
        await self._loop.run_in_executor(None, self._executor.shutdown)

    def _execute(self, requests: list[InferRequest]) -> ExecutionResult:
        refused = {}
        for index, request in enumerate(requests if self._bounds else ()):
            error = out_of_bounds(self._bounds, request)
            if error is not None:
                refused[index] = error
        if not refused:
            return self._execute_all(requests)
        kept = [request for index, request in enumerate(requests) if index not in refused]
        result = self._execute_all(kept) if kept else ExecutionResult([])
        answers = iter(result.results)
        result.results = [refused[index] if index in refused else next(answers) for index in range(len(requests))]
        return result

    def _execute_all(self, requests: list[InferRequest]) -> ExecutionResult:
        try:
            if self._batching:
                return self._run_merged(requests)
            total = ExecutionResult([])
            for request in requests:  # a model without a batch axis runs each request alone
                one = self._run_merged([request], merge=False)
                total.results.extend(one.results)
                total.compute_input_ns += one.compute_input_ns
                total.compute_infer_ns += one.compute_infer_ns
                total.compute_output_ns += one.compute_output_ns
            return total
        except ServerError as exc:
            return ExecutionResult([exc] * len(requests))
        except Exception as exc:  # the engine's own error: the requests fail, the instance keeps serving
            error = internal(f"model '{self._model_name}' instance '{self.name}': {type(exc).__name__}: {exc}")
            return ExecutionResult([error] * len(requests))

    def _run_merged(self, requests: list[InferRequest], merge: bool = True) -> ExecutionResult:
        started = time.monotonic_ns()
        if merge:
            inputs, sizes = merge_inputs(requests)
        else:
            inputs, sizes = {tensor.name: tensor.data for tensor in requests[0].inputs}, []
        wanted = self._wanted(requests)
        merged_at = time.monotonic_ns()
        produced = self.engine.run(inputs, [spec.name for spec in wanted])
        ran_at = time.monotonic_ns()
        for spec in wanted:
            array = produced[spec.name]
            if array.dtype != spec.dtype:
                raise internal(f"model '{self._model_name}' produced output '{spec.name}' as {array.dtype}, "
                               f"but its config declares {spec.datatype}")
        per_request = split_outputs(produced, sizes) if merge else [produced]
        padded = _padded_lengths(requests, inputs) if merge and len(requests) > 1 else None
        results: list[InferResponse | ServerError] = []
        for index, (request, arrays) in enumerate(zip(requests, per_request, strict=True)):
            names = None if request.outputs is None else {output.name for output in request.outputs}
            tensors = []
            for spec in wanted:
                if names is not None and spec.name not in names:
                    continue
                array = arrays[spec.name]
                if padded:
                    array = _trim(array, spec.dims, padded, index)
                tensors.append(Tensor(spec.name, spec.datatype, np.ascontiguousarray(array)))
            results.append(InferResponse(self._model_name, self._version, tensors, id=request.id))
        return ExecutionResult(results, merged_at - started, ran_at - merged_at, time.monotonic_ns() - ran_at)

    def _wanted(self, requests: list[InferRequest]) -> list[OutputSpec]:
        """The outputs any request of the batch asked for (all of them when one asked for none in particular)."""
        if any(request.outputs is None for request in requests):
            return self._outputs
        names = {output.name for request in requests for output in request.outputs or ()}
        return [spec for spec in self._outputs if spec.name in names]


def _padded_lengths(requests: list[InferRequest], merged: dict[str, np.ndarray]) -> dict[int, list[int]]:
    """For each length the inputs were padded to: every request's own length along that axis."""
    lengths: dict[int, list[int]] = {}
    for index, request in enumerate(requests):
        for tensor in request.inputs:
            for axis in range(1, tensor.data.ndim):
                own, padded = tensor.data.shape[axis], merged[tensor.name].shape[axis]
                if own != padded:
                    row = lengths.setdefault(padded, [padded] * len(requests))
                    row[index] = own if row[index] == padded else max(row[index], own)
    return lengths


def _trim(array: np.ndarray, dims: tuple[int, ...], padded: dict[int, list[int]], index: int) -> np.ndarray:
    """A request's output cut back along each variable axis whose size is a padded length."""
    cut = [slice(None)] * array.ndim
    for axis, dim in enumerate(dims, start=1):
        if dim == -1 and axis < array.ndim and array.shape[axis] in padded:
            cut[axis] = slice(0, padded[array.shape[axis]][index])
    return array[tuple(cut)]


async def open_engines(
    loop: asyncio.AbstractEventLoop,
    placements: list[Placement],
    opener: Callable[[Placement], Engine],
    prefix: str,
    idle_seconds: float | None = None,
    thread_setup: Callable[[Placement], None] | None = None,
) -> list[tuple[Executor, Engine]]:
    """One engine per instance, each opened in the thread that will run it, all at once, off the event loop
    (loading a model takes seconds). On failure every thread is released and the first error raised. With
    `idle_seconds`, an instance's thread ends after that long without work and the next execution starts another
    (`IdleEndingExecutor`), each new thread running `thread_setup` first."""

    def executor(placement: Placement) -> Executor:
        name = f"{prefix}-{placement.name}"
        if idle_seconds is None:
            return ThreadPoolExecutor(1, thread_name_prefix=name)
        setup = None if thread_setup is None else functools.partial(thread_setup, placement)
        return IdleEndingExecutor(name, idle_seconds, setup)

    executors = [executor(p) for p in placements]
    try:
        engines = await asyncio.gather(*(
            loop.run_in_executor(executor, opener, placement)
            for executor, placement in zip(executors, placements, strict=True)
        ))
    except BaseException:
        release(executors)
        raise
    return list(zip(executors, engines, strict=True))


def load_failure(exc: Exception, where: str, library: str, filename: str) -> ServerError:
    """What a failed engine load answers, prefixed with the model it is: a ServerError keeps its code, a config the
    model does not match is INVALID_ARG, and so is the library's own error (a corrupt file, an unsupported
    operator, a plan for another GPU), on one line and at most 500 characters of it."""
    if isinstance(exc, ServerError):
        return ServerError(exc.code, f"{where}: {exc.message}")
    if isinstance(exc, ConfigError):
        return invalid_arg(f"{where}: {exc}")
    return invalid_arg(f"{where}: {library} cannot load {filename}: {' '.join(str(exc).split())[:500]}")


def release(executors: Sequence[Executor]) -> None:
    for executor in executors:
        executor.shutdown(wait=False)
