"""The `triton_python_backend_utils` module that Triton python-backend models import as `pb_utils`.

Real Triton injects Tensor, InferenceRequest, InferenceResponse, TritonError and Logger from C++
into this module; here they are plain Python classes with the same constructors, methods and
errors, so an unmodified `model.py` runs in our worker. The worker installs this module as
`sys.modules["triton_python_backend_utils"]` before it imports the model.

Decoupled responses and BLS requests travel over the worker's channel to the server (`_channel`,
set by the worker): a response sender sends each response as it is produced, and a BLS request is
run by the server's core, in-process there, its answers coming back as responses (errors included,
never raised, as in Triton).
"""

from __future__ import annotations

import asyncio
import ctypes
import datetime
import enum
import json
import mmap
import operator
import os
import sys
import threading
import weakref
from collections.abc import Iterable
from typing import Any

import numpy as np

from transerve.backends.python.channel import BlsCall, Channel
from transerve.backends.python.ipc import OP_CANCEL, OP_LATE_RESPONSE, OP_METRIC, OP_MODEL_CONTROL, Entry
from transerve.core.custom_metrics import Kind as MetricKind
from transerve.core.datatypes import BF16, NUMPY_DTYPES, TRITON_ENUM, deserialize_bytes, serialize_bytes
from transerve.core.log_settings import read_page

TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2

#: numpy dtype -> protocol datatype name, for the dtypes a model may hand to `Tensor`.
_DATATYPE_OF = {dtype: name for name, dtype in NUMPY_DTYPES.items() if name != "BYTES"}
_DATATYPE_OF[np.dtype(np.object_)] = "BYTES"
_DATATYPE_BY_ENUM = {number: name for name, number in TRITON_ENUM.items()}

#: `TYPE_FP32`-style config names -> numpy types, as models pass them to `triton_string_to_numpy`.
_CONFIG_TYPE_TO_NUMPY: dict[str, type] = {
    "TYPE_BOOL": bool,
    "TYPE_UINT8": np.uint8,
    "TYPE_UINT16": np.uint16,
    "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64,
    "TYPE_INT8": np.int8,
    "TYPE_INT16": np.int16,
    "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64,
    "TYPE_FP16": np.float16,
    "TYPE_FP32": np.float32,
    "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
    "TYPE_BF16": BF16.type,
}


class TritonModelException(Exception):
    """What Triton raises from its C++ classes when a model misuses them."""


class TritonError:
    """An error a model attaches to one response; `code` is one of the class constants."""

    class Code(enum.IntEnum):
        """TRITONSERVER_Error_Code values."""

        UNKNOWN = 0
        INTERNAL = 1
        NOT_FOUND = 2
        INVALID_ARG = 3
        UNAVAILABLE = 4
        UNSUPPORTED = 5
        ALREADY_EXISTS = 6
        CANCELLED = 7

    UNKNOWN = Code.UNKNOWN
    INTERNAL = Code.INTERNAL
    NOT_FOUND = Code.NOT_FOUND
    INVALID_ARG = Code.INVALID_ARG
    UNAVAILABLE = Code.UNAVAILABLE
    UNSUPPORTED = Code.UNSUPPORTED
    ALREADY_EXISTS = Code.ALREADY_EXISTS
    CANCELLED = Code.CANCELLED

    __slots__ = ("_message", "_code")

    def __init__(self, message: str, code: int = Code.INTERNAL) -> None:
        if message is None or code is None:
            raise TypeError("TritonError: message and code must not be None")
        self._message = str(message)
        self._code = TritonError.Code(code)

    def message(self) -> str:
        return self._message

    def code(self) -> TritonError.Code:
        return self._code

    def __repr__(self) -> str:
        return f"TritonError({self._message!r}, {self._code.name})"

    __str__ = message


class Tensor:
    """A named tensor held as a numpy array (CPU only, as our worker has no GPU memory)."""

    __slots__ = ("_name", "_array", "_datatype")

    def __init__(self, name: str, numpy_array: Any) -> None:
        _require(name, str, "Tensor", "name")
        if numpy_array is None:
            raise TypeError("Tensor(): numpy_array must be an array, not None")
        if not name:
            raise TritonModelException("Tensor name cannot be an empty string.")
        array = numpy_array if isinstance(numpy_array, np.ndarray) else np.asarray(numpy_array)
        self._datatype = _datatype_of(array.dtype)
        if not array.flags.c_contiguous:
            array = np.ascontiguousarray(array)
        self._name = name
        self._array = array

    @classmethod
    def _wrap(cls, name: str, datatype: str, array: np.ndarray) -> Tensor:
        """Build an input tensor the worker decoded, skipping the checks a model's arrays need."""
        tensor = cls.__new__(cls)
        tensor._name = name
        tensor._datatype = datatype
        tensor._array = array
        return tensor

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array

    def triton_dtype(self) -> int:
        return TRITON_ENUM[self._datatype]

    def shape(self) -> list[int]:
        return list(self._array.shape)

    def is_cpu(self) -> bool:
        return True

    def to_dlpack(self) -> Any:
        """A DLPack capsule over the same memory (BYTES tensors have no DLPack form)."""
        if self._datatype == "BYTES":
            raise TritonModelException("DLPack does not have support for string tensors.")
        return self._array.__dlpack__()

    def __dlpack__(self, stream: Any = None, **kwargs: Any) -> Any:
        if self._datatype == "BYTES":
            raise TritonModelException("DLPack does not have support for string tensors.")
        return self._array.__dlpack__(stream=stream, **kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._array.__dlpack_device__()

    @staticmethod
    def from_dlpack(name: str, tensor: Any) -> Tensor:
        """A tensor sharing the memory of a DLPack capsule or of any object with `__dlpack__`."""
        if not name:
            raise TritonModelException("Tensor name cannot be an empty string.")
        if not hasattr(tensor, "__dlpack__"):
            if type(tensor).__name__ != "PyCapsule":
                raise TritonModelException(
                    "Provided tensor is not supported. Tensor must be a DLPack capsule or have a `__dlpack__` attribute"
                )
            tensor = _Capsule(tensor)
        try:
            array = np.from_dlpack(tensor)
        except (BufferError, RuntimeError, TypeError, ValueError) as exc:
            raise TritonModelException(f"failed to import the DLPack tensor: {exc}") from None
        if _NUMPY_1 and not array.flags.writeable:
            array = np.asarray(_Writable(array))
        return Tensor(name, array)

    def __repr__(self) -> str:
        return f"Tensor({self._name!r}, {self._datatype}, shape={list(self._array.shape)})"


def _datatype_of(dtype: np.dtype) -> str:
    """The protocol datatype of a numpy dtype a model used, rejected as Triton rejects it."""
    datatype = _DATATYPE_OF.get(dtype)
    if datatype is not None:
        return datatype
    if dtype.kind == "S":
        return "BYTES"
    if dtype.kind == "U":
        raise TritonModelException(
            f"NumPy dtype is not supported: str arrays ({dtype}) cannot be tensors; "
            "use dtype=np.object_ (str or bytes elements) or np.bytes_"
        )
    raise TritonModelException(f"NumPy dtype is not supported: {dtype}")


#: NumPy 1.x imports every DLPack tensor read-only (DLPack had no read-only flag then) and cannot export such an
#: array again; Triton's DLPack tensors are writable, as NumPy 2 imports them.
_NUMPY_1 = np.lib.NumpyVersion(np.__version__) < "2.0.0"


class _Writable:
    """The memory of a read-only imported array as a writable one (NumPy 1.x); keeps the import alive."""

    __slots__ = ("_array", "__array_interface__")

    def __init__(self, array: np.ndarray) -> None:
        self._array = array
        interface = dict(array.__array_interface__)
        interface["data"] = (interface["data"][0], False)
        self.__array_interface__ = interface


class _DLTensorHead(ctypes.Structure):
    """The start of DLPack's DLManagedTensor: enough to read the device of a raw capsule."""

    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _Capsule:
    """Lets `np.from_dlpack` consume a bare capsule, which carries no `__dlpack_device__` of its own."""

    __slots__ = ("_capsule",)

    def __init__(self, capsule: Any) -> None:
        self._capsule = capsule

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        head = _DLTensorHead.from_address(_capsule_pointer(self._capsule, b"dltensor"))
        return head.device_type, head.device_id


#: PyCapsule_GetPointer with its own prototype (configuring `ctypes.pythonapi`'s would be process-wide).
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi)
)


def _require(value: Any, kind: type, where: str, name: str) -> None:
    """TypeError for an argument of the wrong type, as Triton's C++ bindings raise it."""
    if not isinstance(value, kind):
        raise TypeError(f"{where}(): {name} must be {kind.__name__}, not {type(value).__name__}")


def _integer(value: Any, where: str, name: str) -> int:
    """An integer argument: a Python or NumPy integer, as the C++ bindings convert them."""
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{where}(): {name} must be an integer, not {type(value).__name__}") from None


def _require_list(values: Any, kind: type, where: str, name: str) -> list[Any]:
    if values is None or isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"{where}(): {name} must be a list, not {type(values).__name__}")
    values = list(values)
    for value in values:
        _require(value, kind, where, f"every item of {name}")
    return values


def _tensor_list(tensors: Any, where: str, name: str) -> list[Tensor]:
    """A list of Tensors; None in it is the model's mistake (TritonModelException), another type a TypeError."""
    if tensors is None or not isinstance(tensors, Iterable):
        raise TypeError(f"{where}(): {name} must be a list of pb_utils.Tensor, not {type(tensors).__name__}")
    tensors = list(tensors)
    for tensor in tensors:
        if tensor is None:
            raise TritonModelException(f"{where}: {name} must not contain None")
        _require(tensor, Tensor, where, f"every item of {name}")
    return tensors


def _check_parameters(parameters: Any) -> dict[str, Any]:
    """Parameters a model attaches to a request or response, with Triton's key and value checks."""
    if parameters is None:
        return {}
    if not isinstance(parameters, dict):
        raise TritonModelException(f"Expect parameters to be a dict, found type {type(parameters)}")
    for key, value in parameters.items():
        if not isinstance(key, str):
            raise TritonModelException(f"Expect parameters keys to have type str, found type {type(key)}")
        if not isinstance(value, (bool, int, str, float)):
            raise TritonModelException(f"Expect parameters values to have type bool/int/str, found type {type(value)}")
    return parameters


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
        channel = _channel
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


class InferenceResponseSender:
    """Sends one request's responses to the server, from any thread, with Triton's rules.

    A decoupled model's responses go out as they are sent. A non-decoupled model sends one response and
    nothing after it: sent before `execute` returns, it is held and travels in the execute's reply; sent later,
    it goes out at once under the id the reply gave the request (`_late`).
    """

    __slots__ = ("_request", "_lock", "_sent", "_closed", "_held", "_late")

    def __init__(self, request: InferenceRequest) -> None:
        self._request = request
        self._lock = threading.Lock()
        self._sent = 0
        self._closed = False
        #: A non-decoupled request's response sent before the reply: (error, parameters, tensors).
        self._held: Outcome | None = None
        #: The id its response is sent under once the reply has gone without it.
        self._late: int | None = None

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        """Send a response; `flags=TRITONSERVER_RESPONSE_COMPLETE_FINAL` marks the last one (with or
        without a response). Sending after that raises, as in Triton."""
        if flags not in (0, TRITONSERVER_RESPONSE_COMPLETE_FINAL):
            raise TritonModelException("Unable to send response. Unsupported flag provided.")
        if response is None and flags == 0:
            raise TritonModelException(
                "Inference Response object must be provided when the response flags is set to zero."
            )
        if response is not None and not isinstance(response, InferenceResponse):
            raise TritonModelException(f"Expected an 'InferenceResponse' object, found type '{type(response)}'.")
        request = self._request
        if not request._served:
            raise TritonModelException(
                "Unable to send response. Response sender has no reference to the decoupled state of the model."
            )
        final = flags == TRITONSERVER_RESPONSE_COMPLETE_FINAL
        outcome = None if response is None else _outcome(response, request._requested_output_names)
        if not request._decoupled:
            self._send_single(outcome, final)
            return
        error, parameters, entries = outcome or (None, None, [])
        body = (final, response is not None, error, parameters)
        if not _require_channel().send_response(request._token, final, body, entries):
            raise TritonModelException("Unable to send response. Response sender has been closed.")

    def _send_single(self, outcome: Outcome | None, final: bool) -> None:
        with self._lock:
            self._count(outcome is not None, final)
            if outcome is None:
                return
            if self._late is None:
                self._held = outcome
                return
            error, parameters, entries = outcome
            channel = _require_channel()
            channel.send(OP_LATE_RESPONSE, self._late, (error, parameters), [entries])
            if self._request._token is not None:
                channel.close_tokens([self._request._token])  # the request is done: no cancellation to hear of

    def _count(self, has_response: bool, final: bool) -> None:
        """Triton's checks of a non-decoupled request's sends (a response returned from `execute` counts too)."""
        if has_response and self._sent > 0:
            raise TritonModelException(
                "Unable to send response. Non-decoupled model cannot send more than one response."
            )
        if not has_response and final and self._sent == 0:
            raise TritonModelException(
                "Unable to send response. Non-decoupled model cannot send complete final before sending a response."
            )
        if self._closed:
            raise TritonModelException("Unable to send response. Response sender has been closed.")
        self._closed = final
        self._sent += 1

    def _returned(self) -> None:
        """`execute` returned a response for this request: it is its final one."""
        with self._lock:
            self._count(True, True)

    def _reply(self, late_id: int) -> Outcome | int:
        """At the execute's reply: the held response, else the id a later one will be sent under (a sender
        closes only after a response, so one that sent nothing is open)."""
        with self._lock:
            if self._held is not None:
                held, self._held = self._held, None
                return held
            self._late = late_id
            return late_id

    def _close(self) -> Outcome | None:
        """The execute failed: no more sends; a response sent before the failure still stands (Triton's first
        response reaches the client)."""
        with self._lock:
            self._closed = True
            held, self._held = self._held, None
            return held

    def is_cancelled(self) -> bool:
        return self._request.is_cancelled()


class ResponseIterator:
    """The responses of a BLS request to a decoupled model, as they arrive; ends after the final one.

    Iterate it with `for` (blocking) or `async for`; as in Triton, iterating it again once it has
    ended starts over from the first response.
    """

    __slots__ = ("_call_id", "_call", "_responses", "_index", "_finished")

    def __init__(self, call_id: int, call: BlsCall) -> None:
        self._call_id = call_id
        self._call = call
        self._responses: list[InferenceResponse] = []
        self._index = 0
        self._finished = False

    def __iter__(self) -> ResponseIterator:
        if self._finished and self._index >= len(self._responses):
            self._index = 0
        return self

    def __next__(self) -> InferenceResponse:
        if self._index < len(self._responses):
            self._index += 1
            return self._responses[self._index - 1]
        if self._finished:
            raise StopIteration
        call = self._call
        _require_channel().wait_until(lambda: bool(call.items))
        return self._take()

    def __aiter__(self) -> ResponseIterator:
        return self.__iter__()

    async def __anext__(self) -> InferenceResponse:
        if self._index < len(self._responses):
            self._index += 1
            return self._responses[self._index - 1]
        if self._finished:
            raise StopAsyncIteration
        await _arrival(self._call)
        return self._take()

    def _take(self) -> InferenceResponse:
        body, tensors = self._call.items.popleft()
        response = _bls_response(body, tensors)
        self._responses.append(response)
        self._index += 1
        if body[0]:
            self._finished = True
            _require_channel().finish_bls(self._call_id)
        return response

    def cancel(self) -> None:
        """Cancel the request (as later Triton python backends do; 2.51's has no `cancel`): the called model
        sees `is_cancelled()`, and the iterator ends with a final response carrying a CANCELLED error, after
        any responses already received."""
        if not self._finished:
            _require_channel().cancel_bls(self._call_id)

    def __del__(self) -> None:
        if not self._finished:
            # No lock here (a finalizer may run while this thread holds one): the flag, deque.clear() and
            # deque.append() are atomic; dropping the answers frees the shared memory their tensors hold, and
            # the cancellation goes out with the next message the worker sends.
            self._call.abandoned = True
            self._call.items.clear()
            if _channel is not None:
                _channel.later.append((OP_CANCEL, self._call_id, None))


def _require_channel() -> Channel:
    if _channel is None:
        raise TritonModelException("BLS and response senders work only inside a model served by transerve")
    return _channel


async def _arrival(call: BlsCall) -> None:
    """Wait for a BLS call's next answer: on the loop that reads the worker's socket, await it; on any
    other loop, let a thread wait (and read the socket itself if nobody is)."""
    if call.items:
        return
    channel = _require_channel()
    loop = asyncio.get_running_loop()
    if channel.loop is loop:
        await call.wait()
    else:
        await loop.run_in_executor(None, channel.wait_until, lambda: bool(call.items))


def _finish_single(call_id: int, call: BlsCall) -> InferenceResponse:
    _require_channel().finish_bls(call_id)
    return _bls_response(*call.items.popleft())


def _bls_response(body: tuple[bool, tuple[str, str] | None, dict[str, Any] | None], tensors: list[Entry]
                  ) -> InferenceResponse:
    """A BLS answer as the model sees it: outputs, or an error with its code."""
    _, error, parameters = body
    response = InferenceResponse.__new__(InferenceResponse)
    response._output_tensors = [Tensor._wrap(name, datatype, data) for name, datatype, data in tensors]
    response._error = None if error is None else TritonError(error[1], TritonError.Code[error[0]])
    response._parameters = parameters or {}
    return response


#: A response as the server gets it: (error code name and message, or None; parameters or None; output tensors).
Outcome = tuple[tuple[str, str] | None, dict[str, Any] | None, list[Entry]]


def _outcome(response: InferenceResponse, wanted: list[str]) -> Outcome:
    if response._error is not None:
        return (response._error.code().name, response._error.message()), None, []
    return None, response._parameters or None, _response_entries(response, wanted)


def _response_entries(response: InferenceResponse, wanted: list[str]) -> list[Entry]:
    """A response's output tensors, pruned to the requested outputs as Triton does."""
    entries = []
    for tensor in response._output_tensors:
        if not isinstance(tensor, Tensor):
            raise TypeError(f"output_tensors must hold pb_utils.Tensor objects, found type '{type(tensor)}'")
        if not wanted or tensor._name in wanted:
            entries.append((tensor._name, tensor._datatype, tensor._array))
    return entries


class InferenceResponse:
    """A model's response to one request: output tensors, or an error for that request alone."""

    __slots__ = ("_output_tensors", "_error", "_parameters")

    def __init__(
        self,
        output_tensors: Iterable[Tensor] = (),
        error: TritonError | None = None,
        parameters: dict[str, Any] | None = None,
    ) -> None:
        if error is not None and not isinstance(error, TritonError):
            raise TypeError(f"InferenceResponse: error must be a pb_utils.TritonError, got {type(error)}")
        self._output_tensors = _tensor_list(output_tensors, "InferenceResponse", "output_tensors")
        self._error = error
        self._parameters = _check_parameters(parameters)

    def output_tensors(self) -> list[Tensor]:
        return self._output_tensors

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def parameters(self) -> str:
        return json.dumps(self._parameters)


class Logger:
    """Writes a model's log lines to the worker's stderr, which the server shares."""

    class LogLevel(enum.IntEnum):
        INFO = 0
        WARNING = 1
        ERROR = 2
        VERBOSE = 3

    INFO = LogLevel.INFO
    WARNING = LogLevel.WARNING
    ERROR = LogLevel.ERROR
    VERBOSE = LogLevel.VERBOSE

    #: The server's log settings page (set by the worker), read at every call so that changes made while the
    #: server runs (`/v2/logging`) apply; without one, everything but verbose lines is written.
    settings_page: mmap.mmap | None = None

    @staticmethod
    def log(message: str, level: LogLevel = LogLevel.INFO) -> None:
        _require(message, str, "Logger.log", "message")
        if not isinstance(level, Logger.LogLevel):  # Triton's binding takes the enum only, not a number
            raise TypeError(f"Logger.log(): level must be a pb_utils.Logger.LogLevel, not {type(level).__name__}")
        verbose, *switches = read_page(Logger.settings_page) if Logger.settings_page is not None else (
            0, True, True, True)
        if not (verbose > 0 if level == Logger.LogLevel.VERBOSE else switches[level]):
            return
        caller = sys._getframe(1)
        if caller.f_code.co_filename == __file__:
            caller = caller.f_back or caller
        stamp = datetime.datetime.now().strftime("%m%d %H:%M:%S.%f")
        where = f"{os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}"
        sys.stderr.write(f"{'IWEV'[level]}{stamp} {os.getpid()} {where}] {message}\n")
        sys.stderr.flush()

    @staticmethod
    def log_info(message: str) -> None:
        Logger.log(message, Logger.LogLevel.INFO)

    @staticmethod
    def log_warn(message: str) -> None:
        Logger.log(message, Logger.LogLevel.WARNING)

    @staticmethod
    def log_error(message: str) -> None:
        Logger.log(message, Logger.LogLevel.ERROR)

    @staticmethod
    def log_verbose(message: str) -> None:
        Logger.log(message, Logger.LogLevel.VERBOSE)


LogLevel = Logger.LogLevel
#: pybind11 exports an enum's values into its module too.
COUNTER, GAUGE, HISTOGRAM = MetricKind.COUNTER, MetricKind.GAUGE, MetricKind.HISTOGRAM

#: Set by the worker: the folder holding the model file, as Triton's `get_model_dir()` returns.
_model_dir = ""
#: Set by the worker: the name of the model instance it runs (Triton's stub names it in some errors).
_instance_name = ""
#: Set by the worker: its channel to the server.
_channel: Channel | None = None


def get_model_dir() -> str:
    return _model_dir


def load_model(model_name: str, config: str = "", files: dict[str, bytes] | None = None) -> None:
    """Load (or reload) a model, as a model-control request would (explicit mode); returns once it is loaded.
    `config` is a JSON model config; `files` maps `file:<version>/<name>` to contents, as in a load request."""
    _require(model_name, str, "load_model", "model_name")
    _require(config, str, "load_model", "config")
    if files is not None and not isinstance(files, dict):
        raise TritonModelException(
            f"failed to load model '{model_name}', files should be a dictionary of file paths and file contents"
        )
    contents = {str(path): bytes(content) for path, content in (files or {}).items()}
    _model_control("load", model_name, config, contents, "Failed to load model")


def unload_model(model_name: str, unload_dependents: bool = False) -> None:
    """Unload a model (explicit mode); returns once the unload has begun, as Triton's does."""
    _require(model_name, str, "unload_model", "model_name")
    _require(unload_dependents, bool, "unload_model", "unload_dependents")
    _model_control("unload", model_name, unload_dependents, None, "Failed to unload model")


def is_model_ready(model_name: str, model_version: str = "") -> bool:
    _require(model_name, str, "is_model_ready", "model_name")
    _require(model_version, str, "is_model_ready", "model_version")
    if model_version and not (model_version.isdigit() and model_version.isascii()):
        raise TritonModelException(
            "Failed to check model readiness: failed to get model version from specified version string "
            f"'{model_version}', version should be an integral value > 0"
        )
    return bool(_model_control("ready", model_name, model_version, None, "Failed to check model readiness"))


def _model_control(action: str, name: str, argument: Any, files: Any, failure: str) -> Any:
    return _ask_server(OP_MODEL_CONTROL, (action, name, argument, files), failure)


def _ask_server(op: int, body: Any, failure: str) -> Any:
    """Call the server and wait for its answer; its error raises TritonModelException with Triton's wording."""
    channel = _require_channel()
    call_id, call = channel.start_bls(body, [], op)
    channel.wait_until(lambda: bool(call.items))
    channel.finish_bls(call_id)
    (_, error, value), _ = call.items.popleft()
    if error is not None:
        raise TritonModelException(
            f"{failure}: Failed to process the request for model '{_instance_name}', message: {error[1]}"
        )
    return value


class MetricFamily:
    """A family of custom metrics on the server's /metrics (its values live in the server). As in Triton, a
    family deleted before its metrics makes them unusable."""

    COUNTER = MetricKind.COUNTER
    GAUGE = MetricKind.GAUGE
    HISTOGRAM = MetricKind.HISTOGRAM

    __slots__ = ("_handle", "_kind", "_metrics", "__weakref__")

    def __init__(self, name: str, description: str, kind: MetricKind) -> None:
        self._handle: int | None = None
        _require(name, str, "MetricFamily", "name")
        _require(description, str, "MetricFamily", "description")
        if not isinstance(kind, MetricKind):
            raise TypeError(f"MetricFamily(): kind must be a pb_utils.MetricKind, not {type(kind).__name__}")
        self._kind = kind
        self._metrics: weakref.WeakSet[Metric] = weakref.WeakSet()
        self._handle = _ask_server(
            OP_METRIC, ("family", name, description, int(kind)), "Error when creating MetricFamily"
        )

    def Metric(self, labels: dict[str, str] | None = None, buckets: list[float] | None = None) -> Metric:  # noqa: N802
        """A metric of this family with these labels (the same labels share one value); a histogram needs its
        bucket boundaries."""
        if labels is not None and not isinstance(labels, dict):
            raise TritonModelException("Failed to create metric. Labels must be a dictionary.")
        if buckets is not None:
            if not isinstance(buckets, list):
                raise TritonModelException("Failed to create metric. Buckets must be a list.")
            if self._kind != MetricKind.HISTOGRAM:
                raise TritonModelException("Failed to create metric. Unexpected buckets found.")
            buckets = [_number(bound, "buckets") for bound in buckets]
        elif self._kind == MetricKind.HISTOGRAM:
            raise TritonModelException("Failed to create metric. Missing required buckets.")
        metric = Metric(_ask_server(OP_METRIC, ("metric", self._handle, labels or {}, buckets),
                                    "Error when creating Metric"))
        self._metrics.add(metric)
        return metric

    def __del__(self) -> None:
        for metric in list(self._metrics):
            metric._clear()
        if self._handle is not None and _channel is not None:
            _channel.later.append((OP_METRIC, 0, ("delete", self._handle)))


class Metric:
    """One metric of a MetricFamily (made by `MetricFamily.Metric`)."""

    __slots__ = ("_handle", "_cleared", "__weakref__")

    def __init__(self, handle: int) -> None:
        self._handle = handle
        self._cleared = False

    def increment(self, value: float) -> None:
        self._operate("increment", value, "Failed to increment metric value")

    def set(self, value: float) -> None:
        self._operate("set", value, "Failed to set metric value")

    def observe(self, value: float) -> None:
        self._operate("observe", value, "Failed to observe metric value")

    def value(self) -> float:
        return float(self._operate("value", None, "Failed to get metric value"))

    def _operate(self, action: str, value: float | None, failure: str) -> Any:
        body = (action, self._handle) if value is None else (action, self._handle, _number(value, "value"))
        if self._cleared:
            raise TritonModelException(
                f"{failure}: Invalid metric operation as the corresponding 'MetricFamily' has been deleted. The "
                "'MetricFamily' object should be deleted AFTER its corresponding 'Metric' objects have been deleted."
            )
        return _ask_server(OP_METRIC, body, failure)

    def _clear(self) -> None:
        if not self._cleared:
            self._cleared = True
            if _channel is not None:
                _channel.later.append((OP_METRIC, 0, ("delete", self._handle)))

    def __del__(self) -> None:
        self._clear()


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, not {type(value).__name__}")
    return float(value)


def serialize_byte_tensor(input_tensor: np.ndarray) -> bytes | tuple[()] | None:
    """A BYTES array as 4-byte-length-prefixed elements in C order (None if it is not BYTES)."""
    if input_tensor.size == 0:
        return ()
    if input_tensor.dtype != np.object_ and input_tensor.dtype.type != np.bytes_:
        return None
    return serialize_bytes(input_tensor)


def deserialize_bytes_tensor(encoded_tensor: Any) -> np.ndarray:
    """The inverse of `serialize_byte_tensor`: a 1-D object array of `bytes`."""
    return deserialize_bytes(memoryview(encoded_tensor).cast("B"))


def get_input_tensor_by_name(inference_request: InferenceRequest, name: str) -> Tensor | None:
    return _find_tensor(inference_request.inputs(), name)


def get_output_tensor_by_name(inference_response: InferenceResponse, name: str) -> Tensor | None:
    return _find_tensor(inference_response.output_tensors(), name)


def _find_tensor(tensors: Iterable[Tensor], name: str) -> Tensor | None:
    for tensor in tensors:
        if tensor.name() == name:
            return tensor
    return None


def get_input_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    return _find_config(model_config.get("input", ()), name)


def get_output_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    return _find_config(model_config.get("output", ()), name)


def _find_config(entries: Iterable[dict[str, Any]], name: str) -> dict[str, Any] | None:
    for entry in entries:
        if entry["name"] == name:
            return entry
    return None


def using_decoupled_model_transaction_policy(model_config: dict[str, Any]) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


def triton_to_numpy_type(data_type: int) -> type | None:
    """Triton's numeric datatype enum -> numpy type (None for an unknown number)."""
    name = _DATATYPE_BY_ENUM.get(data_type)
    return None if name is None else NUMPY_DTYPES[name].type


def numpy_to_triton_type(data_type: Any) -> int | None:
    """numpy type -> Triton's numeric datatype enum (None for an unsupported type)."""
    try:
        dtype = np.dtype(data_type)
    except TypeError:
        return None
    if dtype.kind == "S":
        return TRITON_ENUM["BYTES"]
    name = _DATATYPE_OF.get(dtype)
    return None if name is None else TRITON_ENUM[name]


def triton_string_to_numpy(triton_type_string: str) -> type:
    return _CONFIG_TYPE_TO_NUMPY[triton_type_string]


class ModelConfig:
    """The config handed to `auto_complete_config`: a model may fill in only what Triton lets it,
    and each setter refuses to contradict what config.pbtxt already says."""

    def __init__(self, model_config: str | dict[str, Any]) -> None:
        self._model_config = json.loads(model_config) if isinstance(model_config, str) else model_config
        self._model_config.setdefault("input", [])
        self._model_config.setdefault("output", [])
        self._model_config.setdefault("max_batch_size", 0)

    def as_dict(self) -> dict[str, Any]:
        return self._model_config

    @property
    def _name(self) -> str:
        return self._model_config.get("name", "")

    def set_max_batch_size(self, max_batch_size: int) -> None:
        configured = self._model_config["max_batch_size"]
        if configured > max_batch_size:
            raise ValueError(
                f"configuration specified max_batch_size {configured}, but in auto-complete-config function "
                f"for model '{self._name}' specified max_batch_size {max_batch_size}"
            )
        self._model_config["max_batch_size"] = max_batch_size

    def set_dynamic_batching(self) -> None:
        for other in ("sequence_batching", "ensemble_scheduling"):
            if other in self._model_config:
                raise ValueError(
                    f"Configuration specified scheduling_choice as '{other}', but auto-complete-config function "
                    f"for model '{self._name}' tries to set scheduling_choice as 'dynamic_batching'"
                )
        self._model_config.setdefault("dynamic_batching", {})

    def add_input(self, input: dict[str, Any]) -> None:
        self._add_tensor("input", input, ("name", "data_type", "dims", "optional"))

    def add_output(self, output: dict[str, Any]) -> None:
        self._add_tensor("output", output, ("name", "data_type", "dims"))

    def _add_tensor(self, kind: str, tensor: dict[str, Any], allowed: tuple[str, ...]) -> None:
        """Add an input/output, or complete the one config.pbtxt declares under the same name."""
        label = f"{kind} '{tensor.get('name', '')}' in auto-complete-config function for model '{self._name}'"
        unknown = [key for key in tensor if key not in allowed]
        if unknown:
            raise ValueError(f"{label} contains property other than {', '.join(repr(a) for a in allowed)}.")
        for required in ("name", "data_type", "dims"):
            if required not in tensor:
                raise ValueError(f"{label} is missing '{required}' property.")
        for current in self._model_config[kind]:
            if current["name"] == tensor["name"]:
                self._merge_tensor(kind, current, tensor)
                return
        self._model_config[kind].append(tensor)

    def _merge_tensor(self, kind: str, current: dict[str, Any], tensor: dict[str, Any]) -> None:
        name = tensor["name"]
        configured_type = current.get("data_type", "TYPE_INVALID")
        if configured_type != "TYPE_INVALID" and configured_type != tensor["data_type"]:
            raise ValueError(
                f"unable to load model '{self._name}', configuration expects datatype {configured_type} "
                f"for {kind} '{name}', model provides {tensor['data_type']}"
            )
        if current.get("dims") and list(current["dims"]) != list(tensor["dims"]):
            raise ValueError(
                f"model '{self._name}', tensor '{name}': the model expects dims {tensor['dims']} "
                f"but the model configuration specifies dims {current['dims']}"
            )
        if "optional" in current and "optional" in tensor and current["optional"] != tensor["optional"]:
            raise ValueError(
                f"model '{self._name}', tensor '{name}': the model expects optional {tensor['optional']} "
                f"but the model configuration specifies optional {current['optional']}"
            )
        current["data_type"] = tensor["data_type"]
        current["dims"] = tensor["dims"]
        if "optional" in tensor:
            current["optional"] = tensor["optional"]

    def set_model_transaction_policy(self, transaction_policy_dict: dict[str, Any]) -> None:
        if any(key != "decoupled" for key in transaction_policy_dict):
            raise ValueError(
                f"model transaction property in auto-complete-config function for model '{self._name}' "
                "contains property other than 'decoupled'."
            )
        policy = self._model_config.setdefault("model_transaction_policy", {})
        if "decoupled" not in transaction_policy_dict:
            return
        wanted = transaction_policy_dict["decoupled"]
        if "decoupled" in policy and policy["decoupled"] != wanted:
            raise ValueError(
                f"trying to change decoupled property in auto-complete-config for model '{self._name}', "
                f"which is already set to '{policy['decoupled']}'."
            )
        policy["decoupled"] = wanted
