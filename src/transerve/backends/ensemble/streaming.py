"""Ensembles with a decoupled step, as Triton runs them: every response of that step runs the steps after it,
and each complete set of outputs is one response of the ensemble, which is therefore decoupled itself.

The steps that do not depend on the decoupled step run once, before it; the ones after it run once per response
it sends, in the order it sent them, so streamed pieces (a detokenizer's text, say) reach the client in order.
As in Triton, every step's inputs, and the ensemble's outputs, must come from one decoupled origin (or none):
tensors fanned out per response cannot be joined with tensors produced once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from transerve.backends.base import ExecutionResult
from transerve.backends.ensemble.graph import Step
from transerve.backends.ensemble.walk import Ensemble, Tensors, store_outputs
from transerve.config.model_config import ConfigError
from transerve.core.errors import ServerError
from transerve.core.streams import ResponseStream
from transerve.core.types import InferRequest, InferResponse


def check_decoupled_origins(name: str, steps: list[Step], decoupled: set[int], outputs: Iterable[str]) -> None:
    """Refuse a graph where a step or the outputs would join tensors of different decoupled origins."""
    origin: dict[str, int | None] = {}  # tensor -> index of the nearest decoupled step upstream, None for none

    def joined(tensors: Iterable[str], where: str) -> int | None:
        origins = {origin.get(tensor) for tensor in tensors}
        if len(origins) > 1:
            raise ConfigError(f"ensemble '{name}': {where} receives inputs that originate from different "
                              "decoupled models")
        return origins.pop() if origins else None

    remaining = list(steps)
    while remaining:  # the graph is acyclic (checked before), so this walks it in dependency order
        step = next(s for s in remaining if all(t in origin or _is_root(t, steps) for t in s.inputs.values()))
        remaining.remove(step)
        source = step.index if step.index in decoupled else joined(step.inputs.values(), step.label)
        origin.update(dict.fromkeys(step.outputs.values(), source))
    joined(outputs, "the ensemble's output")


def _is_root(tensor: str, steps: list[Step]) -> bool:
    return all(tensor not in step.outputs.values() for step in steps)


class StreamingWalk:
    """Runs requests through an ensemble that has a decoupled step; responses go to each request's stream."""

    def __init__(self, ensemble: Ensemble, decoupled: set[int]) -> None:
        self._ensemble = ensemble
        self._decoupled = decoupled

    async def execute(self, requests: list[InferRequest]) -> ExecutionResult:
        await asyncio.gather(*(self._run(request) for request in requests))
        return ExecutionResult([None] * len(requests))

    async def _run(self, request: InferRequest) -> None:
        out: ResponseStream = request.response_stream
        tensors = self._ensemble.start_tensors(request)
        try:
            await self._walk(request, tensors, list(self._ensemble.steps_for(request)), out, lambda: True)
        except ServerError as error:
            out.fail(error)
            return
        out.close()

    async def _walk(
        self, request: InferRequest, tensors: Tensors, pending: list[Step], out: ResponseStream,
        is_last: Callable[[], bool],
    ) -> None:
        """Run the pending steps and send the response; `is_last` says whether it is the ensemble's last one."""
        while pending:
            runnable = [step for step in pending if self._ensemble.ready(step, tensors)]
            plain = [step for step in runnable if step.index not in self._decoupled]
            for step in plain or runnable[:1]:
                pending.remove(step)
            if plain:
                for step in plain:
                    store_outputs(step, await self._call(step, request, tensors), tensors)
                continue
            await self._fan_out(runnable[0], request, tensors, pending, out, is_last)
            return
        if not out.cancelled:
            # As Triton does: the last response carries the final flag when the decoupled step has ended by then.
            out.send(self._ensemble.respond(request, tensors), final=is_last())

    async def _fan_out(
        self, step: Step, request: InferRequest, tensors: Tensors, pending: list[Step], out: ResponseStream,
        is_last: Callable[[], bool],
    ) -> None:
        """Run the steps after the decoupled `step` once per response it sends, in order."""
        try:
            stream = self._ensemble.runtime.infer_stream(self._ensemble.make_request(step, request, tensors))
        except ServerError as exc:
            raise self._named(step, exc) from None
        out.on_cancel(stream.cancel)
        while True:
            try:
                item, final = await stream.receive()
            except StopAsyncIteration:
                return
            if isinstance(item, ServerError):
                if final and not stream.final_sent:  # the step failed: the request ends with its error
                    raise self._named(step, item)
                out.send_error(self._named(step, item))
            elif item is not None:
                branch = dict(tensors)
                store_outputs(step, item, branch)
                await self._walk(request, branch, list(pending), out, lambda: stream.ended and is_last())

    async def _call(self, step: Step, request: InferRequest, tensors: Tensors) -> InferResponse:
        try:
            return await self._ensemble.runtime.infer(self._ensemble.make_request(step, request, tensors))
        except ServerError as exc:
            raise self._named(step, exc) from None

    def _named(self, step: Step, error: ServerError) -> ServerError:
        return ServerError(error.code, f"in ensemble '{self._ensemble.name}', {step.label} failed: {error.message}")
