"""One request through an ensemble whose steps answer once, driven by the callbacks of its steps' futures.

Each step is a server request (`runtime.submit`, through its model's scheduler). When a step's future is done,
its callback stores the outputs and submits every step they make ready, so a request costs no task and no
coroutine, and a chain hands one step's outputs to the next in the callback that receives them (with the
direct scheduler and the python backend, the one that read the worker's reply: no loop turn between steps).
Independent steps run concurrently. The first step to fail ends the request with its error, naming the step, and the
steps still running are cancelled; so does the request's cancellation (its client went away).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from transerve.backends.ensemble.graph import Step
from transerve.backends.runtime import Runtime, Submitted
from transerve.core.errors import ErrorCode, ServerError, internal
from transerve.core.types import InferRequest, InferResponse, Tensor

log = logging.getLogger(__name__)


#: An ensemble tensor by name; None where it is settled but absent (an optional input the request left out, or an
#: output a step did not produce), which the steps reading it run without, as in Triton.
Tensors = dict[str, Tensor | None]


class Ensemble(Protocol):
    """What a walk needs of its ensemble."""

    name: str
    runtime: Runtime

    def start_tensors(self, request: InferRequest) -> Tensors: ...

    def steps_for(self, request: InferRequest) -> list[Step]: ...

    def ready(self, step: Step, tensors: Tensors) -> bool: ...

    def make_request(self, step: Step, request: InferRequest, tensors: Tensors) -> InferRequest: ...

    def respond(self, request: InferRequest, tensors: Tensors) -> InferResponse: ...


def store_outputs(step: Step, response: InferResponse, tensors: Tensors) -> None:
    """Keep a step's outputs under their ensemble names; those it did not send are settled as absent."""
    for output in response.outputs:
        target = step.outputs.get(output.name)
        if target is not None:
            tensors[target] = Tensor(target, output.datatype, output.data)
    if len(response.outputs) < len(step.outputs):
        for target in step.outputs.values():
            tensors.setdefault(target, None)


class Walk:
    """Runs `request` through the ensemble's steps and calls `done` once with its response or error."""

    __slots__ = ("_ensemble", "_request", "_done", "_tensors", "_pending", "_running", "_finished")

    def __init__(
        self, ensemble: Ensemble, request: InferRequest, done: Callable[[InferResponse | ServerError], None]
    ) -> None:
        self._ensemble = ensemble
        self._request = request
        self._done = done
        self._tensors = ensemble.start_tensors(request)
        self._pending = list(ensemble.steps_for(request))
        #: The steps in flight, by their futures.
        self._running: dict[asyncio.Future[InferResponse], tuple[Step, Submitted]] = {}
        self._finished = False

    def start(self) -> None:
        self._advance()

    def cancel(self) -> None:
        """The client went away: end with CANCELLED, cancelling the steps still running."""
        self._finish(ServerError(ErrorCode.CANCELLED, f"ensemble '{self._ensemble.name}' request was cancelled"))

    def _advance(self) -> None:
        """Submit every step whose inputs exist; answer once nothing is left to run."""
        ensemble, tensors = self._ensemble, self._tensors
        ready = [step for step in self._pending if ensemble.ready(step, tensors)]
        for step in ready:
            self._pending.remove(step)
            if not self._submit(step):
                return
        if self._running:
            return
        if self._pending:
            missing = self._pending[0]
            self._finish(internal(f"in ensemble '{ensemble.name}', {missing.label} cannot run: "
                                  "a step before it did not produce its inputs"))
        else:
            self._finish(ensemble.respond(self._request, tensors))

    def _submit(self, step: Step) -> bool:
        step_request = self._ensemble.make_request(step, self._request, self._tensors)
        try:
            call = self._ensemble.runtime.submit(step_request, self._step_done)
        except ServerError as exc:
            self._fail(step, exc)
            return False
        self._running[call.future] = (step, call)
        return True

    def _step_done(self, future: asyncio.Future[InferResponse]) -> None:
        if future.cancelled():  # by `_finish`, whose `cancel()` settled it
            return
        step, call = self._running.pop(future)
        try:
            response = call.result()
        except ServerError as exc:
            self._fail(step, exc)
            return
        if self._finished:  # only the bookkeeping was left
            return
        try:
            store_outputs(step, response, self._tensors)
            self._advance()
        except Exception as exc:  # a bug here must not leave the request waiting forever
            log.exception("ensemble '%s' failed after %s", self._ensemble.name, step.label)
            self._fail(step, internal(repr(exc)))

    def _fail(self, step: Step, error: ServerError) -> None:
        self._finish(ServerError(error.code, f"in ensemble '{self._ensemble.name}', {step.label} failed: "
                                             f"{error.message}"))

    def _finish(self, result: InferResponse | ServerError) -> None:
        if self._finished:
            return
        self._finished = True
        # A step already answered stays until its callback settles it; the others are cancelled here.
        for future, (_, call) in list(self._running.items()):
            if call.cancel():
                del self._running[future]
        self._done(result)
