"""pb_utils.InferenceRequest: a request handed to `execute` (built by the worker) or one a model builds and runs
as a BLS call; its trace, its cancellation and its response sender."""

from __future__ import annotations

import json
from typing import Any

from transerve.backends.python._pb_utils import link
from transerve.backends.python._pb_utils.bls import ResponseIterator, _arrival, _finish_single
from transerve.backends.python._pb_utils.errors import (
    TritonModelException,
    _check_parameters,
    _integer,
    _require,
    _require_list,
)
from transerve.backends.python._pb_utils.link import _require_channel
from transerve.backends.python._pb_utils.responses import InferenceResponse, InferenceResponseSender
from transerve.backends.python._pb_utils.tensors import Tensor, _find_tensor, _tensor_list
from transerve.backends.python.channel import BlsCall

TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2


class InferenceTrace:
    """What `request.trace()` gives: a BLS request built with `trace=request.trace()` is traced as a child of that
    request, as in Triton, when the request is traced (and still running); otherwise the call is not traced."""

    __slots__ = ("_id", "_context")

    def __init__(self) -> None:
        #: The request's trace id on the server (0: not traced).
        self._id = 0
        self._context: str | None = None

    @classmethod
    def _of(cls, trace: tuple[int, str | None]) -> InferenceTrace:
        """The trace of a received request, from what the server said of it."""
        made = cls()
        made._id, made._context = trace
        return made

    def get_context(self) -> str | None:
        """In OpenTelemetry mode, the W3C context of the request's span as JSON (`{"traceparent": ...}`), for spans
        of the model's own; None in Triton's mode and for a request that is not traced."""
        return self._context


#: The trace of a request that is not traced (and of a BLS request built without one).
_UNTRACED = InferenceTrace()


class InferenceRequest:
    """A request handed to `execute`, or one a model builds for a BLS call."""

    __slots__ = (
        "_request_id",
        "_correlation_id",
        "_inputs",
        "_requested_output_names",
        "_model_name",
        "_model_version",
        "_flags",
        "_timeout",
        "_parameters",
        "_parameters_json",
        "_token",
        "_decoupled",
        "_sender",
        "_served",
        "_release_flags",
        "_trace",
    )

    def __init__(
        self,
        request_id: str = "",
        correlation_id: int | str = 0,
        inputs: list[Tensor] | None = None,
        requested_output_names: list[str] | None = None,
        model_name: str | None = None,
        model_version: int = -1,
        flags: int = 0,
        timeout: int = 0,
        preferred_memory: Any = None,
        trace: InferenceTrace = _UNTRACED,
        parameters: dict[str, Any] | None = None,
    ) -> None:
        """The BLS form; like Triton's, `inputs`, `requested_output_names` and `model_name` are required, and
        arguments of the wrong type raise TypeError as its C++ bindings do."""
        _require(request_id, str, "InferenceRequest", "request_id")
        if correlation_id is None:
            raise TypeError("InferenceRequest(): correlation_id must not be None")
        if not isinstance(correlation_id, (int, str)):
            raise TritonModelException("Correlation ID must be integer or string")
        _require(model_name, str, "InferenceRequest", "model_name")
        model_version, flags, timeout = (
            _integer(value, "InferenceRequest", name)
            for name, value in (("model_version", model_version), ("flags", flags), ("timeout", timeout))
        )
        self._request_id = request_id
        self._correlation_id = correlation_id
        self._inputs = _tensor_list(inputs, "InferenceRequest", "inputs")
        self._requested_output_names = _require_list(requested_output_names, str, "InferenceRequest",
                                                     "requested_output_names")
        self._model_name = model_name
        self._model_version = model_version
        self._flags = flags
        self._timeout = timeout
        _require(trace, InferenceTrace, "InferenceRequest", "trace")
        self._parameters = _check_parameters(parameters)
        self._parameters_json: str | None = None
        self._trace = trace
        self._token: int | None = None
        self._decoupled = False
        self._sender: InferenceResponseSender | None = None
        self._served = False
        self._release_flags = TRITONSERVER_REQUEST_RELEASE_ALL

    @classmethod
    def _received(
        cls,
        request_id: str,
        correlation_id: int | str,
        flags: int,
        parameters: dict[str, Any],
        requested_output_names: list[str],
        inputs: list[Tensor],
        model_name: str,
        model_version: int,
        token: int | None,
        decoupled: bool,
        trace: tuple[int, str | None] | None = None,
    ) -> InferenceRequest:
        """A request as the worker receives it; its parameters become JSON only if the model asks.

        `token` names the request on the server: the server cancels it under that token, and a decoupled model's
        responses go to its stream under it. `trace` is its trace id and OpenTelemetry context when it is traced.
        """
        request = cls.__new__(cls)
        request._request_id = request_id
        request._correlation_id = correlation_id
        request._inputs = inputs
        request._requested_output_names = requested_output_names
        request._model_name = model_name
        request._model_version = model_version
        request._flags = flags
        timeout = parameters.get("timeout", 0)
        request._timeout = timeout if isinstance(timeout, int) else 0
        request._parameters = parameters
        request._parameters_json = None
        request._token = token
        request._decoupled = decoupled
        request._sender = None
        request._served = True
        request._release_flags = TRITONSERVER_REQUEST_RELEASE_ALL
        request._trace = _UNTRACED if trace is None else InferenceTrace._of(trace)
        return request

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def request_id(self) -> str:
        return self._request_id

    def correlation_id(self) -> int | str:
        return self._correlation_id

    def flags(self) -> int:
        return self._flags

    def timeout(self) -> int:
        return self._timeout

    def parameters(self) -> str:
        if self._parameters_json is None:
            self._parameters_json = json.dumps(self._parameters)
        return self._parameters_json

    def requested_output_names(self) -> list[str]:
        return self._requested_output_names

    def trace(self) -> InferenceTrace:
        """The request's trace, which models pass as a BLS request's `trace=` to trace the call under it."""
        return self._trace

    def is_cancelled(self) -> bool:
        """Whether the client went away (the server tells the worker at once, as Triton's stub asks its server)."""
        channel = link._channel
        if self._token is None or channel is None:
            return False
        channel.poll()
        return self._token in channel.cancelled

    def get_response_sender(self) -> InferenceResponseSender:
        """The sender of this request's responses (the same one on every call). A decoupled model sends any
        number of responses with it; any other model may send its one response with it instead of returning it
        from `execute`, before, during or after `execute` returns (Triton 24.x)."""
        if self._sender is None:
            self._sender = InferenceResponseSender(self)
        return self._sender

    def set_release_flags(self, flags: int) -> None:
        """`TRITONSERVER_REQUEST_RELEASE_RESCHEDULE` runs the request again once `execute` returns (models with
        `sequence_batching { iterative_sequence: true }`); for it `execute` returns None, not a response."""
        if flags is None:
            raise TypeError("set_release_flags(): flags must be an integer, not None")
        self._release_flags = int(flags)

    def exec(self, decoupled: bool = False) -> InferenceResponse | ResponseIterator:
        """Run this request on its model and wait: one response, or with `decoupled` an iterator of
        them ending after the final one. Errors come back as responses with `has_error()`."""
        call_id, call = self._start(decoupled)
        if decoupled:
            return ResponseIterator(call_id, call)
        _require_channel().wait_until(lambda: bool(call.items))
        return _finish_single(call_id, call)

    async def async_exec(self, decoupled: bool = False) -> InferenceResponse | ResponseIterator:
        """`exec` for `async def execute`: several may run at once (e.g. under `asyncio.gather`)."""
        call_id, call = self._start(decoupled)
        await _arrival(call)
        if decoupled:
            return ResponseIterator(call_id, call)
        return _finish_single(call_id, call)

    def _start(self, decoupled: bool) -> tuple[int, BlsCall]:
        if self._served:
            raise TritonModelException("only a request built with pb_utils.InferenceRequest(...) can be executed")
        inputs = []
        for tensor in self._inputs:
            if not isinstance(tensor, Tensor):
                raise TritonModelException(f"inputs must hold pb_utils.Tensor objects, found type '{type(tensor)}'")
            inputs.append((tensor._name, tensor._datatype, tensor._array))
        body = (
            self._model_name,
            self._model_version,
            self._request_id,
            self._correlation_id,
            self._flags,
            self._timeout,
            self._parameters,
            self._requested_output_names,
            bool(decoupled),
            self._trace._id,
        )
        return _require_channel().start_bls(body, inputs)


def get_input_tensor_by_name(inference_request: InferenceRequest, name: str) -> Tensor | None:
    return _find_tensor(inference_request.inputs(), name)
