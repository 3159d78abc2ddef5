"""One sampled request and the requests it spawns (ensemble steps, BLS calls): what each stamps while it runs.

Stamping only appends a tuple (monotonic nanoseconds, Triton's activity names); the trace is rendered, as Triton's
JSON or as OpenTelemetry spans, once the frontend has sent the answer and every request of the trace has ended.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from transerve.core.tracing.options import TENSORS, TIMESTAMPS

if TYPE_CHECKING:
    from transerve.core.tracing.settings import Setting
    from transerve.core.types import InferResponse, Tensor

#: Kinds of entries: a request's own timestamp, a frontend's timestamp, the request's header (model, ids) and a
#: tensor activity.
STAMP, CAPTURE, HEADER, TENSOR = range(4)

Entry = tuple[int, str, int] | tuple[int, str, dict[str, str]]


class Trace:
    """Triton's Trace: the frontend holds it from sampling until its answer is sent, each request while it runs."""

    __slots__ = ("setting", "root", "requests", "started_ns", "finished_ns", "parent", "otel_trace_id", "_new_id",
                 "_done", "_pending", "_running", "_context")

    def __init__(self, setting: Setting, new_id: Callable[[], int], done: Callable[[Trace], None],
                 parent: Any = None, running: dict[int, RequestTrace] | None = None,
                 context: Callable[[RequestTrace], str] | None = None) -> None:
        self.setting = setting
        self._new_id = new_id
        self._done = done
        #: The tracer's requests between their start and end, by trace id (where a BLS call finds its parent).
        self._running: dict[int, RequestTrace] = {} if running is None else running
        #: What gives a request's OpenTelemetry context to its model (None in Triton's mode: it has none).
        self._context = context
        #: A propagated OpenTelemetry context the trace's spans continue (None: a trace of its own).
        self.parent = parent
        #: The OpenTelemetry trace id once a context was given out (0: the exporter picks one).
        self.otel_trace_id = 0
        self.started_ns = time.monotonic_ns()
        self.finished_ns = 0
        self.root = RequestTrace(self, new_id(), 0)
        #: Every request of the trace, the sampled one first, in the order they were spawned.
        self.requests = [self.root]
        self._pending = 1

    def capture(self, name: str, ns: int = 0) -> None:
        """A frontend's timestamp (HTTP_RECV_START, GRPC_SEND_END, INFER_RESPONSE_COMPLETE, ...), on the root."""
        if self.setting.level & TIMESTAMPS:
            self.root.entries.append((CAPTURE, name, ns or time.monotonic_ns()))

    def finish(self) -> None:
        """The frontend is done with the trace (answer sent, or the request failed before it ran)."""
        self.finished_ns = time.monotonic_ns()
        self._release()

    def _hold(self) -> None:
        self._pending += 1

    def _release(self) -> None:
        self._pending -= 1
        if self._pending == 0:
            self._done(self)


class RequestTrace:
    """The activities of one request of a trace, under its own trace id (`parent_id` 0 for the sampled request)."""

    __slots__ = ("trace", "id", "parent_id", "model_name", "model_version", "request_id", "entries", "span_id",
                 "_compute_ns")

    def __init__(self, trace: Trace, trace_id: int, parent_id: int) -> None:
        self.trace = trace
        self.id = trace_id
        self.parent_id = parent_id
        self.model_name = ""
        self.model_version = ""
        self.request_id = ""
        self.entries: list[Entry] = []
        #: The id of the request's OpenTelemetry span once its context was given out (0: the exporter picks one).
        self.span_id = 0
        #: When the request's execution began; -1 for a request that computes nothing itself (an ensemble).
        self._compute_ns = 0

    @property
    def begun(self) -> bool:
        """Whether the core took the request (one refused before that has no activity of its own)."""
        return bool(self.model_name)

    def for_model(self) -> tuple[int, str | None]:
        """What a python-backend model is told of its request's trace: the trace id its BLS calls name as their
        parent, and the OpenTelemetry context `get_context()` gives (W3C `traceparent` of the request's span, as
        JSON; None in Triton's mode)."""
        context = self.trace._context
        return self.id, None if context is None else context(self)

    def child(self) -> RequestTrace:
        """The trace of a request this one spawns (an ensemble step, a BLS call)."""
        trace = self.trace
        child = RequestTrace(trace, trace._new_id(), self.id)
        trace.requests.append(child)
        return child

    def started(self, model_name: str, model_version: str, request_id: str, inputs: Iterable[Tensor],
                computes: bool = True) -> None:
        """The core accepted the request and queues it (REQUEST_START, QUEUE_START, its inputs)."""
        trace = self.trace
        trace._hold()
        trace._running[self.id] = self
        self.model_name, self.model_version, self.request_id = model_name, model_version, request_id
        if not computes:
            self._compute_ns = -1
        level = trace.setting.level
        now = time.monotonic_ns()
        if level & TIMESTAMPS:
            self.entries += [(HEADER, "", 0), (STAMP, "REQUEST_START", now), (STAMP, "QUEUE_START", now)]
        if level & TENSORS:
            self.entries += [(TENSOR, "TENSOR_QUEUE_INPUT", tensor_fields(tensor)) for tensor in inputs]

    def compute_started(self, ns: int) -> None:
        """The scheduler handed the request (in a batch) to an instance at `ns`."""
        if self._compute_ns == 0:
            self._compute_ns = ns

    def compute_ended(self, input_ns: int, output_ns: int) -> None:
        """The execution ended now; it spent `input_ns` taking its inputs and `output_ns` giving its outputs (the
        backend's own measures, which statistics report as compute_input and compute_output)."""
        start = self._compute_ns
        if start <= 0 or not self.trace.setting.level & TIMESTAMPS:
            return
        end = time.monotonic_ns()
        input_end = min(start + input_ns, end)
        self.entries += [(STAMP, "COMPUTE_START", start), (STAMP, "COMPUTE_INPUT_END", input_end),
                         (STAMP, "COMPUTE_OUTPUT_START", max(end - output_ns, input_end)),
                         (STAMP, "COMPUTE_END", end)]

    def ended(self, response: InferResponse | None) -> None:
        """The request is done (its outputs, when it has a response, then REQUEST_END); no BLS call joins it now."""
        level = self.trace.setting.level
        if response is not None and level & TENSORS:
            self.entries += [(TENSOR, "TENSOR_BACKEND_OUTPUT", tensor_fields(tensor)) for tensor in response.outputs]
        if level & TIMESTAMPS:
            self.entries.append((STAMP, "REQUEST_END", time.monotonic_ns()))
        trace = self.trace
        trace._running.pop(self.id, None)
        trace._release()


def tensor_fields(tensor: Tensor) -> dict[str, str]:
    """A tensor as Triton's trace shows it: values joined by commas (strings quoted; FP16/BF16 left out as
    Triton leaves them), shape joined by commas, datatype."""
    datatype = tensor.datatype
    values = tensor.data.reshape(-1).tolist() if datatype not in ("FP16", "BF16") else []
    if datatype == "BYTES":
        text = ",".join('"' + _text(value) + '"' for value in values)
    elif datatype in ("FP32", "FP64"):
        text = ",".join(format(value, "g") for value in values)
    elif datatype == "BOOL":
        text = ",".join("1" if value else "0" for value in values)
    else:
        text = ",".join(str(value) for value in values)
    return {"name": tensor.name, "data": text, "shape": ",".join(str(d) for d in tensor.data.shape),
            "dtype": datatype}


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
