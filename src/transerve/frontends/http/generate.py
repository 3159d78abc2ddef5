"""Triton's generate extension: `/generate` and `/generate_stream` (server-sent events).

A request is one JSON object. Each of its members, and each member of its `parameters` object, that names a
model input becomes that input (its datatype and shape from the model's metadata); the others become request
parameters, and `id` is also the request's id. Members are taken in their order, duplicates included, so a
repeated input is refused as Triton refuses it. A response is one flat object: `id` when the request had one,
`model_name`, `model_version`, the response's parameters and each output by name.

A traced request is stamped as Triton stamps these endpoints: INFER_RESPONSE_COMPLETE for every response the model
gives (its final flag alone included), HTTP_SEND_START and _END around every answer written (each event of a
stream).
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import numpy as np
import orjson

from transerve.core.errors import ErrorCode, ServerError, invalid_arg
from transerve.core.protocol_parameters import SCHEDULING_PARAMETERS, apply_scheduling_parameter
from transerve.core.signature import ModelSignature, TensorSpec
from transerve.core.streams import ResponseStream, StreamItem
from transerve.core.tensors import json_strings, tensor_from_values
from transerve.core.tracing import Trace
from transerve.core.types import InferRequest, InferResponse, Tensor

SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"

#: Triton's words when /generate gets other than one response.
EXACTLY_ONE = ("generate expects model to produce exactly 1 response, use generate stream for model that "
               "generates various number of responses")

_PARAMETERS = "parameters"
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class _JsonObject:
    """A JSON object as its members in order, duplicate names kept (a dict would keep only the last)."""

    __slots__ = ("members",)

    def __init__(self, members: list[tuple[str, Any]]) -> None:
        self.members = members


def _parse(body: bytes) -> Any:
    """The document with its objects as `_JsonObject`s, parsed once by the standard parser (the one that keeps
    duplicate members), held to what orjson accepts elsewhere: strict UTF-8, no NaN or Infinity, bounded nesting.
    Only a body with a surrogate escape (`\\ud800`) is also read by orjson, which refuses a lone one. A large body
    is read by orjson alone when that cannot lose a duplicate (`_read_fast`): the standard parser is much slower,
    and it runs on the loop."""
    if len(body) > _FAST_BODY_BYTES:
        document = _read_fast(body)
        if document is not None:
            return document
    try:
        if _SURROGATE_ESCAPE.search(body):
            orjson.loads(body)
        return json.loads(body.decode(), object_pairs_hook=_JsonObject, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, orjson's error
        raise invalid_arg(f"failed to parse the request JSON buffer: {exc}") from None


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
#: Bodies past this size try `_read_fast` first; smaller ones are read as they always were.
_FAST_BODY_BYTES = 64 << 10
#: The most member names `_read_fast` looks for in the body (each a scan of it); a document with more is read by
#: the standard parser.
_FAST_MEMBERS = 64


def _read_fast(body: bytes) -> _JsonObject | None:
    """The document by orjson, or None where the standard parser must read it: orjson refuses it (then the standard
    parser gives the error, or reads what orjson cannot, such as integers past 64 bits), it holds a `\\u` escape
    (a member name may be written two ways), or a member name of any object (reached through objects) occurs in the
    body more than once, so that a duplicate cannot hide behind the dict orjson keeps; past `_FAST_MEMBERS` names."""
    if b"\\u" in body:
        return None
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(document, dict):
        return None
    pending, members = [document], 0
    while pending:
        value = pending.pop()
        members += len(value)
        if members > _FAST_MEMBERS:
            return None
        for key, member in value.items():
            if body.count(orjson.dumps(key)) != 1:
                return None
            if isinstance(member, dict):
                pending.append(member)
    return _as_members(document)


def _as_members(value: dict[str, Any]) -> _JsonObject:
    return _JsonObject([(key, _as_members(member) if isinstance(member, dict) else member)
                        for key, member in value.items()])


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def decode_generate_request(name: str, version: str, signature: ModelSignature, body: bytes) -> InferRequest:
    document = _parse(body)
    if not isinstance(document, _JsonObject):
        raise invalid_arg("the generate request must be a JSON object")
    request = InferRequest(model_name=name, model_version=version, inputs=[])
    request_id = next((value for key, value in document.members if key == "id"), "")
    if not isinstance(request_id, str):
        raise invalid_arg("Unable to parse 'id': attempt to access JSON non-string as string")
    request.id = request_id
    for key, value in document.members:
        if key != _PARAMETERS:
            _member(request, signature, key, value)
            continue
        if _PARAMETERS in signature.inputs:
            raise invalid_arg(f"Keyword '{_PARAMETERS}' for nested schema also given as input tensor name")
        if not isinstance(value, _JsonObject):
            raise invalid_arg(f"Expected JSON object for keyword: '{_PARAMETERS}': "
                              "attempt to access JSON non-object as object")
        try:
            for nested_key, nested_value in value.members:
                _member(request, signature, nested_key, nested_value)
        except ServerError as exc:
            raise ServerError(exc.code, f"Converting keyword: '{_PARAMETERS}': {exc.message}") from None
    return request


def _member(request: InferRequest, signature: ModelSignature, key: str, value: Any) -> None:
    """One member: the input it names, or else a request parameter."""
    spec = signature.inputs.get(key)
    if spec is None:
        _parameter(request, key, value)
        return
    if any(tensor.name == key for tensor in request.inputs):
        raise invalid_arg(f"[request id: {request.id or '<id_unknown>'}] input '{key}' already exists in request")
    request.inputs.append(_tensor(spec, value))


def _parameter(request: InferRequest, key: str, value: Any) -> None:
    if isinstance(value, (_JsonObject, list)) or value is None:
        raise invalid_arg(f"parameter '{key}' has invalid type. It should be either 'int', 'bool', or 'string'.")
    if isinstance(value, int) and not isinstance(value, bool) and not _INT64_MIN <= value <= _INT64_MAX:
        value = float(value)  # as Triton: a number that is no int64 is a double parameter
    if key in SCHEDULING_PARAMETERS:
        apply_scheduling_parameter(request, key, value)
    else:
        request.parameters.setdefault(key, value)  # as in Triton, a repeated parameter keeps its first value


def _tensor(spec: TensorSpec, value: Any) -> Tensor:
    """A JSON value as the input's tensor: a scalar is one element, an array its elements, shaped as Triton
    shapes them from the metadata shape: fixed dimensions divide the count, the innermost variable one takes
    the rest and other variable ones (the batch dimension among them) are 1."""
    values = value if isinstance(value, list) else [value]
    if spec.datatype == "BYTES":
        json_strings(spec.name, values)  # Triton checks the strings before the shape
    remaining = len(values)
    dims = list(spec.shape)
    for dim in reversed(dims):
        if dim != -1:
            if dim == 0 or remaining % dim:
                raise _unshapeable(spec)
            remaining //= dim
    for index in reversed(range(len(dims))):
        if dims[index] == -1:
            dims[index], remaining = remaining, 1
    if remaining != 1:
        raise _unshapeable(spec)
    return tensor_from_values(spec.name, spec.datatype, tuple(dims), values)


def _unshapeable(spec: TensorSpec) -> ServerError:
    return invalid_arg(f"The schema can not convert input '{spec.name}' to tensor with proper shape")


def encode_generate_response(response: InferResponse) -> dict[str, Any]:
    """Triton's flat object: the response's parameters and its outputs by name, next to the request's id and the
    model's name, in Triton's order (by name)."""
    document: dict[str, Any] = {"model_name": response.model_name, "model_version": response.model_version,
                                **response.parameters}
    if response.id:
        document["id"] = response.id
    for tensor in response.outputs:
        document[tensor.name] = _json_value(tensor)
    return dict(sorted(document.items()))


def _json_value(tensor: Tensor) -> Any:
    data = tensor.data.reshape(-1)
    if tensor.datatype == "BYTES":
        values: list[Any] = [item.decode("utf-8", errors="replace") if isinstance(item, bytes) else str(item)
                             for item in data]
    elif tensor.datatype in ("FP16", "BF16"):
        values = data.astype(np.float32).tolist()
    else:
        values = data.tolist()
    return values[0] if len(values) == 1 else values


def refused(item: StreamItem) -> bool:
    """Whether a stream's first item is a refusal before the model ran (a full queue, a server shutting down):
    Triton answers those before it starts its answer, as a plain error with their own status (503)."""
    return isinstance(item, ServerError) and item.code is ErrorCode.UNAVAILABLE


def as_answer_error(error: ServerError) -> ServerError:
    """An error that answers a generate request: a refusal keeps its code; any other is a 400, as Triton 2.51
    answers every error response of a model on these endpoints, whatever its code."""
    return error if refused(error) else ServerError(ErrorCode.INVALID_ARG, error.message)


class TracedResponses:
    """A request's stream for the generate endpoints, stamping INFER_RESPONSE_COMPLETE as each item is taken."""

    __slots__ = ("_stream", "_trace")

    def __init__(self, stream: ResponseStream, trace: Trace) -> None:
        self._stream = stream
        self._trace = trace

    @property
    def closed(self) -> bool:
        return self._stream.closed

    def cancel(self) -> None:
        self._stream.cancel()

    async def receive(self) -> tuple[StreamItem, bool]:
        taken = await self._stream.receive()
        self._trace.capture("INFER_RESPONSE_COMPLETE")
        return taken


async def traced_events(events: AsyncGenerator[bytes, None], trace: Trace) -> AsyncIterator[bytes]:
    """`/generate_stream`'s events, each between HTTP_SEND_START and HTTP_SEND_END (the connection writes an
    event before it asks for the next); the trace is done with the stream, however it ends."""
    try:
        async for event in events:
            trace.capture("HTTP_SEND_START")
            yield event
            trace.capture("HTTP_SEND_END")
    finally:
        await events.aclose()  # the client went away: stop the model now
        trace.finish()


async def single_response(stream: ResponseStream | TracedResponses) -> dict[str, Any]:
    """`/generate`: exactly one response is expected, as Triton requires; the others are counted, not kept."""
    first: StreamItem = None
    count = 0
    while True:
        try:
            item, _ = await stream.receive()
        except StopAsyncIteration:
            break
        if item is not None:
            if count == 0:
                first = item
            count += 1
    if count != 1 or first is None:
        raise invalid_arg(EXACTLY_ONE)
    if isinstance(first, ServerError):
        raise as_answer_error(first)
    return encode_generate_response(first)


async def first_event(stream: ResponseStream | TracedResponses) -> StreamItem:
    """The first response (or error) of a stream, None when there is none; Triton waits for it before it
    answers, so that an error there sets the status."""
    while True:
        try:
            item, _ = await stream.receive()
        except StopAsyncIteration:
            return None
        if item is not None:
            return item


async def event_stream(stream: ResponseStream | TracedResponses, first: StreamItem) -> AsyncGenerator[bytes, None]:
    """`/generate_stream`: one `data:` event per response, starting with `first`; an error response is an error
    event, and, as in Triton, the stream goes on after it until the model's final flag."""
    try:
        item = first
        while True:
            if isinstance(item, ServerError):
                yield b"data: " + orjson.dumps({"error": item.message}) + b"\n\n"
            elif item is not None:
                yield b"data: " + orjson.dumps(encode_generate_response(item)) + b"\n\n"
            try:
                item, _ = await stream.receive()
            except StopAsyncIteration:
                return
    finally:
        if not stream.closed:
            stream.cancel()  # the client went away mid-stream: stop the model
