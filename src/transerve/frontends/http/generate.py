"""Triton's generate extension: `/generate` and `/generate_stream` (server-sent events).

Top-level keys of the request object that name a model input become that input (its datatype and
shape from the model's configuration); the others, and the keys of `parameters`, become request
parameters. A response is one flat object: `model_name`, `model_version` and each output by name.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import orjson

from transerve.core.errors import ServerError, invalid_arg
from transerve.core.protocol_parameters import SCHEDULING_PARAMETERS, apply_scheduling_parameter
from transerve.core.signature import ModelSignature, TensorSpec
from transerve.core.streams import ResponseStream
from transerve.core.tensors import tensor_from_values
from transerve.core.types import InferRequest, InferResponse, Tensor

SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"


def decode_generate_request(
    name: str, version: str, signature: ModelSignature, body: bytes
) -> InferRequest:
    try:
        document = orjson.loads(body) if body else None
    except orjson.JSONDecodeError as exc:
        raise invalid_arg(f"failed to parse the request JSON buffer: {exc}") from None
    if not isinstance(document, dict):
        raise invalid_arg("the generate request must be a JSON object")
    request = InferRequest(model_name=name, model_version=version, inputs=[])
    parameters = document.get("parameters", {})
    if not isinstance(parameters, dict):
        raise invalid_arg("'parameters' must be a JSON object")
    for key, value in document.items():
        if key == "parameters":
            continue
        spec = signature.inputs.get(key)
        if spec is not None:
            request.inputs.append(_tensor(spec, value, signature.max_batch_size > 0))
        else:
            _parameter(request, key, value)
    for key, value in parameters.items():
        _parameter(request, key, value)
    return request


def _parameter(request: InferRequest, key: str, value: Any) -> None:
    if not isinstance(value, (str, int, float)):  # bool is an int
        raise invalid_arg(f"parameter '{key}' must be a string, a number or a boolean")
    if key in SCHEDULING_PARAMETERS:
        apply_scheduling_parameter(request, key, value)
    else:
        request.parameters[key] = value


def _tensor(spec: TensorSpec, value: Any, batching: bool) -> Tensor:
    """A JSON value as the input's tensor: a scalar is one element, a list its elements, shaped by the config."""
    values = value if isinstance(value, list) else [value]
    count = len(values)
    dims = list(spec.dims)
    fixed = 1
    for dim in dims:
        if dim != -1:
            fixed *= dim
    variable = [i for i, dim in enumerate(dims) if dim == -1]
    if variable:
        if fixed == 0 or count % fixed:
            raise invalid_arg(f"input '{spec.name}' takes a multiple of {fixed} values, got {count}")
        for position, index in enumerate(variable):
            dims[index] = count // fixed if position == 0 else 1
    elif fixed != count:
        raise invalid_arg(f"input '{spec.name}' takes {fixed} values, got {count}")
    shape = tuple(([1] if batching else []) + dims)
    return tensor_from_values(spec.name, spec.datatype, shape, values)


def encode_generate_response(response: InferResponse) -> dict[str, Any]:
    """Triton's flat object: the response's parameters and its outputs by name, next to the model's name."""
    document: dict[str, Any] = {"model_name": response.model_name, "model_version": response.model_version,
                                **response.parameters}
    for tensor in response.outputs:
        document[tensor.name] = _json_value(tensor)
    return document


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


async def single_response(stream: ResponseStream) -> dict[str, Any]:
    """`/generate`: exactly one response is expected, as Triton requires."""
    responses = [response async for response in stream]
    if len(responses) != 1:
        raise invalid_arg(f"the model produced {len(responses)} responses where /generate expects exactly one: "
                          "use /generate_stream")
    return encode_generate_response(responses[0])


async def event_stream(stream: ResponseStream) -> AsyncIterator[bytes]:
    """`/generate_stream`: one `data:` event per response; an error response is an error event, and, as in
    Triton, the stream goes on after it until the model's final flag."""
    try:
        while True:
            try:
                item, _ = await stream.receive()
            except StopAsyncIteration:
                return
            if isinstance(item, ServerError):
                yield b"data: " + orjson.dumps({"error": item.message}) + b"\n\n"
            elif item is not None:
                yield b"data: " + orjson.dumps(encode_generate_response(item)) + b"\n\n"
    finally:
        if not stream.closed:
            stream.cancel()  # the client went away mid-stream: stop the model
