"""What a backend may ask of the server it runs in: the seam between the backends and the server layer.

Backends sit below the server (the server imports every backend), so they cannot import it; they receive an
object with this face as `ModelContext.runtime` instead. Ensembles run their steps through it, the python
backend its BLS calls, model control, custom metrics, the trace of a BLS call and the log settings page. The
server implements it (`transerve.server.Server`); tests may hand a backend anything with the same face.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from tritonclient.grpc import model_config_pb2

from transerve.core.custom_metrics import CustomMetrics
from transerve.core.log_settings import ServerLog
from transerve.core.signature import ModelSignature
from transerve.core.streams import ResponseStream
from transerve.core.tracing import Tracer
from transerve.core.types import InferRequest, InferResponse

#: Called with a submitted request's future once it is done (`scheduling.OnDone`).
StepDone = Callable[["asyncio.Future[InferResponse]"], None]


class ServedModel(Protocol):
    """A loaded, servable model version, as a backend may read it."""

    @property
    def name(self) -> str: ...

    @property
    def version(self) -> str: ...

    @property
    def config(self) -> model_config_pb2.ModelConfig: ...

    @property
    def signature(self) -> ModelSignature: ...


class Submitted(Protocol):
    """A request `Runtime.submit` scheduled. It is counted in flight until `result()` or `cancel()` settles it,
    and it owns that accounting: a caller never cancels `future` itself."""

    @property
    def future(self) -> asyncio.Future[InferResponse]: ...

    def result(self) -> InferResponse:
        """Once `future` is done: the response shaped to what the request asked for, or its error raised
        (ServerError; CancelledError if it was cancelled), counted in the model's statistics."""
        ...

    def cancel(self) -> bool:
        """Give the request up (still queued, its scheduler skips it); False if its future was already done, and
        `result()` then still settles it."""
        ...


class Runtime(Protocol):
    """The server, as the backends may call it."""

    @property
    def tracing(self) -> Tracer: ...

    @property
    def custom_metrics(self) -> CustomMetrics: ...

    @property
    def log(self) -> ServerLog: ...

    @property
    def explicit_model_control(self) -> bool:
        """Whether clients (and model code) may load and unload models (`--model-control-mode=explicit`)."""
        ...

    def get_version(self, name: str, version: str = "") -> ServedModel:
        """The serving version a request names; ServerError (NOT_FOUND, UNAVAILABLE) as Triton gives it."""
        ...

    def model_ready(self, name: str, version: str = "") -> bool: ...

    async def infer(self, request: InferRequest) -> InferResponse: ...

    def infer_stream(self, request: InferRequest) -> ResponseStream: ...

    def submit(self, request: InferRequest, on_done: StepDone) -> Submitted:
        """`infer` for callers that finish in a callback: validated and scheduled now, `on_done(future)` called
        once the future is done (never from inside `submit`), then `result()` gives the response."""
        ...

    async def load_model(
        self, name: str, config_json: str | bytes | None = None, files: dict[str, bytes] | None = None
    ) -> None: ...

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None: ...
