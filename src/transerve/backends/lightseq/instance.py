"""A LightSeq Transformer or Gpt instance: each row of a request becomes one sequence in the generation backend's
torch engine (which batches them with every other request's rows), and the request is answered with LightSeq's
tensors once all of its rows are done."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from transerve.backends.base import BackendInstance, ExecutionResult
from transerve.backends.generation.engine import GenerationEngine, GenerationRequest, GenerationResult
from transerve.backends.lightseq.decoding import Decoding
from transerve.core.errors import ServerError, internal, invalid_arg
from transerve.core.types import InferRequest, InferResponse, Tensor

#: Executions handed over at once: the engine batches every row it holds, so the scheduler must not hold any back.
MAX_INFLIGHT = 64


class LightSeqGenerationInstance(BackendInstance):
    max_inflight = MAX_INFLIGHT
    cancellable = True

    def __init__(self, model_name: str, version: str, name: str, engine: GenerationEngine, decoding: Decoding,
                 outputs: dict[str, tuple[str, np.dtype]], loop: asyncio.AbstractEventLoop) -> None:
        self.name = name
        self.engine = engine
        self._model_name = model_name
        self._version = version
        self._decoding = decoding
        #: The config's outputs: name -> (datatype, numpy dtype).
        self._outputs = outputs
        self._loop = loop
        self._handles: dict[int, list] = {}

    async def execute(self, requests: list[InferRequest]) -> ExecutionResult:
        started = time.monotonic_ns()
        results = await asyncio.gather(*(self._one(request) for request in requests))
        return ExecutionResult(list(results), compute_infer_ns=time.monotonic_ns() - started)

    def cancel(self, request: InferRequest) -> None:
        for handle in self._handles.get(id(request), ()):
            handle.cancel()

    async def close(self) -> None:
        self.engine.close()

    async def _one(self, request: InferRequest) -> InferResponse | ServerError:
        tensor = next((t for t in request.inputs if t.name == self._decoding.input_name), None)
        if tensor is None or tensor.data.ndim != 2:
            return invalid_arg(f"model '{self._model_name}' expects input '{self._decoding.input_name}' as "
                               "[batch, length] token ids")
        ids = tensor.data
        vocab = self.engine.vocab_size
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= max(vocab, self._decoding.pad_id + 1)):
            return invalid_arg(f"model '{self._model_name}': '{self._decoding.input_name}' holds ids outside the "
                               f"vocabulary (0..{vocab - 1})")
        if ids.shape[1] > self._decoding.max_step:
            return invalid_arg(f"model '{self._model_name}': '{self._decoding.input_name}' is {ids.shape[1]} tokens "
                               f"long; the model's max_step is {self._decoding.max_step}")
        prompts = [self._decoding.prompt(row) for row in ids]
        if any(token >= vocab for prompt in prompts for token in prompt):
            return invalid_arg(f"model '{self._model_name}': '{self._decoding.input_name}' holds ids outside the "
                               f"vocabulary (0..{vocab - 1})")
        if any(not prompt for prompt in prompts):
            return invalid_arg(f"model '{self._model_name}': a row of '{self._decoding.input_name}' holds only "
                               f"padding (id {self._decoding.pad_id})")
        futures: list[asyncio.Future[GenerationResult | None]] = []
        handles = self._handles.setdefault(id(request), [])
        try:
            for prompt in prompts:
                options = self._decoding.options(len(prompt), ids.shape[1])
                future: asyncio.Future[GenerationResult | None] = self._loop.create_future()
                futures.append(future)
                if options is None:
                    future.set_result(None)
                    continue
                handles.append(self.engine.submit(GenerationRequest(prompt, options), None, self._settle(future)))
            outcomes = await asyncio.gather(*futures, return_exceptions=True)
        finally:
            self._handles.pop(id(request), None)
        for outcome in outcomes:
            if isinstance(outcome, ServerError):
                return outcome
            if isinstance(outcome, BaseException):
                return internal(f"model '{self._model_name}': {type(outcome).__name__}: {outcome}")
        arrays = self._decoding.outputs(prompts, outcomes)
        wanted = None if request.outputs is None else {output.name for output in request.outputs}
        tensors = [
            Tensor(name, datatype, np.ascontiguousarray(arrays[name].astype(dtype, copy=False)))
            for name, (datatype, dtype) in self._outputs.items()
            if name in arrays and (wanted is None or name in wanted)
        ]
        return InferResponse(self._model_name, self._version, tensors, id=request.id)

    def _settle(self, future: asyncio.Future):
        """The engine's done callback (called on its thread): the outcome onto the event loop."""
        def done(outcome: GenerationResult | Exception) -> None:
            def settle() -> None:
                if future.done():
                    return
                if isinstance(outcome, Exception):
                    future.set_exception(outcome)
                else:
                    future.set_result(outcome)
            self._loop.call_soon_threadsafe(settle)
        return done
