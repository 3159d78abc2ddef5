"""Triton's gRPC ModelInferRequest / ModelInferResponse <-> the core's InferRequest / InferResponse.

Only decoding lives here: which protobuf field carries a tensor's data, and how request parameters
become Python values. Tensors are built by `transerve.core.tensors`, and the request is validated by
the core, so the same bad input gets the same error category over gRPC as over HTTP.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any

import numpy as np
from tritonclient.grpc import service_pb2

from transerve.core.classification import PARAMETER as CLASSIFICATION
from transerve.core.errors import internal, invalid_arg, not_found
from transerve.core.protocol_parameters import SCHEDULING_PARAMETERS, apply_scheduling_parameter
from transerve.core.tensors import (
    check_datatype,
    check_shape,
    tensor_from_bytes,
    tensor_from_values,
    wire_bytes,
    wire_view,
)
from transerve.core.types import InferRequest, InferResponse, RequestedOutput, Tensor
from transerve.server.shared_memory import SharedMemoryRegistry, placement

#: Request parameters the protocol consumes, with the value kinds Triton accepts for each.
PROTOCOL_PARAMETERS: dict[str, tuple[str, ...]] = {
    "sequence_id": ("int64_param", "string_param"),
    "sequence_start": ("bool_param",),
    "sequence_end": ("bool_param",),
    "priority": ("int64_param", "uint64_param"),
    "timeout": ("int64_param",),
    "triton_enable_empty_final_response": ("bool_param",),
}

#: The datatype Triton reads each typed `contents` field as. The 32-bit integer fields also carry the
#: 8- and 16-bit types of their signedness.
_CONTENTS_TYPE = {
    "bool_contents": "BOOL",
    "int_contents": "INT32",
    "int64_contents": "INT64",
    "uint_contents": "UINT32",
    "uint64_contents": "UINT64",
    "fp32_contents": "FP32",
    "fp64_contents": "FP64",
    "bytes_contents": "BYTES",
}
_NARROW_INTEGERS = {"int_contents": ("INT8", "INT16"), "uint_contents": ("UINT8", "UINT16")}

_LENGTH = struct.Struct("<I").pack

#: Above this many bytes of outputs, `encode_infer_response_bytes` appends them in wire format itself.
_APPEND_RAW_ABOVE = 64 * 1024
#: `raw_output_contents` (field 6) as a length-delimited field's tag.
_RAW_OUTPUT_TAG = bytes([service_pb2.ModelInferResponse.RAW_OUTPUT_CONTENTS_FIELD_NUMBER << 3 | 2])


def parse_version(version: str) -> str:
    """A request's model version: "" (the policy's latest) or a positive integer, as Triton parses it."""
    if version and not version.isdigit():
        raise invalid_arg(
            f"failed to get model version from specified version string '{version}', "
            "version should be an integral value > 0"
        )
    return version


def decode_infer_request(
    message: service_pb2.ModelInferRequest, regions: SharedMemoryRegistry | None = None
) -> InferRequest:
    """Decode a ModelInferRequest; tensor data comes from a shared memory region of `regions`, typed `contents`
    or, in input order, `raw_input_contents`."""
    model_name = message.model_name
    raw = message.raw_input_contents
    raw_count = len(raw)
    raw_index = 0
    inputs: list[Tensor] = []
    for tensor in message.inputs:
        name = tensor.name
        datatype = check_datatype(name, tensor.datatype)
        shape = check_shape(name, list(tensor.shape))
        place = placement(name, decode_parameters(tensor.parameters), "input") if tensor.parameters else None
        if place is not None:
            if tensor.HasField("contents"):
                raise invalid_arg(f"input '{name}' has both 'contents' and a shared memory region")
            if regions is None:
                raise not_found(f"Unable to find shared memory region: '{place[0]}'")
            inputs.append(tensor_from_bytes(name, datatype, shape, regions.read(*place), model_name))
        elif tensor.HasField("contents"):
            if raw_count:
                raise invalid_arg(
                    f"contents field must not be specified when using raw_input_contents for '{name}' "
                    f"for model '{model_name}'"
                )
            inputs.append(_from_contents(name, datatype, shape, tensor.contents, model_name))
        elif raw_index < raw_count:
            inputs.append(tensor_from_bytes(name, datatype, shape, raw[raw_index], model_name))
            raw_index += 1
        else:
            raise invalid_arg(f"unable to find data for input tensor '{name}' for model '{model_name}' in request.")
    request = InferRequest(
        model_name=model_name,
        model_version=parse_version(message.model_version),
        id=message.id,
        inputs=inputs,
        outputs=_decode_outputs(message.outputs) if message.outputs else None,
    )
    if message.parameters:
        _decode_request_parameters(request, message.parameters)
    return request


def _from_contents(
    name: str, datatype: str, shape: tuple[int, ...], contents: service_pb2.InferTensorContents, model_name: str
) -> Tensor:
    """A tensor from the one typed field that must match its datatype (Triton has none for FP16 and BF16)."""
    fields = contents.ListFields()  # only non-empty repeated fields, in field-number order as Triton checks them
    if not fields:
        return tensor_from_values(name, datatype, shape, [])
    descriptor, values = fields[0]
    field_type = _CONTENTS_TYPE[descriptor.name]
    if datatype in _NARROW_INTEGERS.get(descriptor.name, ()):
        field_type = datatype
    if field_type != datatype:
        raise invalid_arg(
            f"unexpected explicit tensor data for input tensor '{name}' for model '{model_name}' of type "
            f"'{field_type}', expected datatype '{datatype}'"
        )
    if len(fields) > 1:
        raise invalid_arg(
            f"unexpected explicit tensor data for input tensor '{name}' for model '{model_name}', "
            "binary data was already supplied."
        )
    if datatype == "BYTES":
        serialized = b"".join(part for item in values for part in (_LENGTH(len(item)), item))
        return tensor_from_bytes(name, datatype, shape, serialized, model_name)
    return tensor_from_values(name, datatype, shape, list(values))


def _decode_outputs(
    outputs: Iterable[service_pb2.ModelInferRequest.InferRequestedOutputTensor],
) -> list[RequestedOutput]:
    requested = []
    for output in outputs:
        parameters = decode_parameters(output.parameters) if output.parameters else {}
        if CLASSIFICATION in parameters:
            _check_class_count(output.parameters[CLASSIFICATION])
        placement(output.name, parameters, "output")
        requested.append(RequestedOutput(output.name, parameters))
    return requested


def _check_class_count(parameter: service_pb2.InferParameter) -> None:
    """Triton's checks of an output's `classification` parameter (over gRPC, unlike HTTP, 0 is refused too: the
    client leaves the parameter out instead)."""
    if parameter.WhichOneof("parameter_choice") != "int64_param":
        raise invalid_arg(f"invalid value type for '{CLASSIFICATION}' parameter, expected int64_param")
    if parameter.int64_param <= 0:
        raise invalid_arg(f"invalid value for '{CLASSIFICATION}' parameter, expected > 0, got {parameter.int64_param}")


def _decode_request_parameters(
    request: InferRequest, parameters: Mapping[str, service_pb2.InferParameter]
) -> None:
    """The model's parameters into `request.parameters`; the protocol's checked as Triton does, then consumed."""
    for key, parameter in parameters.items():
        kind = parameter.WhichOneof("parameter_choice")
        allowed = PROTOCOL_PARAMETERS.get(key)
        if allowed is not None:
            if kind not in allowed:
                raise invalid_arg(f"invalid value type for '{key}' parameter, expected {' or '.join(allowed)}.")
            if key in SCHEDULING_PARAMETERS:
                apply_scheduling_parameter(request, key, getattr(parameter, kind))
            continue
        if key.startswith("triton_"):
            raise invalid_arg(
                "parameter keys starting with 'triton_' are reserved for Triton usage. Only the following keys "
                "starting with 'triton_' are allowed: triton_enable_empty_final_response"
            )
        request.parameters[key] = _parameter_value(key, parameter, kind)


def decode_parameters(parameters: Mapping[str, service_pb2.InferParameter]) -> dict[str, Any]:
    """InferParameter values as plain Python values."""
    return {key: _parameter_value(key, p, p.WhichOneof("parameter_choice")) for key, p in parameters.items()}


def _parameter_value(key: str, parameter: service_pb2.InferParameter, kind: str | None) -> Any:
    if kind is None:
        raise invalid_arg(
            f"invalid value type for '{key}' parameter, expected int64_param, bool_param, string_param, "
            "double_param or uint64_param."
        )
    return getattr(parameter, kind)


def encode_parameters(target: MutableMapping[str, service_pb2.InferParameter], values: Mapping[str, Any]) -> None:
    """Python values into an InferParameter map; anything else is a model bug (INTERNAL)."""
    for key, value in values.items():
        parameter = target[key]
        if isinstance(value, bool):
            parameter.bool_param = value
        elif isinstance(value, (int, np.integer)):
            if value > np.iinfo(np.int64).max:
                parameter.uint64_param = int(value)
            else:
                parameter.int64_param = int(value)
        elif isinstance(value, (float, np.floating)):
            parameter.double_param = float(value)
        elif isinstance(value, str):
            parameter.string_param = value
        else:
            raise internal(f"response parameter '{key}' has unsupported type {type(value).__name__}")


def encode_infer_response(response: InferResponse) -> service_pb2.ModelInferResponse:
    """Every output as raw little-endian bytes in `raw_output_contents`, as Triton answers."""
    message = _response_message(response)
    contents = message.raw_output_contents
    for tensor in response.outputs:
        contents.append(b"" if tensor.in_shared_memory else wire_bytes(tensor))
    return message


def encode_infer_response_bytes(response: InferResponse) -> bytes:
    """`encode_infer_response`'s message, serialized. Large outputs are appended to the rest of the message as
    `raw_output_contents` fields in protobuf's wire format: protobuf's serializer takes many times longer over
    large bytes fields than copying them does (benchmarks/README.md, "Figures behind the code")."""
    if sum(tensor.data.nbytes for tensor in response.outputs) <= _APPEND_RAW_ABOVE:
        return encode_infer_response(response).SerializeToString()
    parts = [_response_message(response).SerializeToString()]
    for tensor in response.outputs:
        data = b"" if tensor.in_shared_memory else wire_view(tensor)
        parts += (_RAW_OUTPUT_TAG, _varint(len(data)), data)
    return b"".join(parts)


def _response_message(response: InferResponse) -> service_pb2.ModelInferResponse:
    """A response's message but for its `raw_output_contents`."""
    message = service_pb2.ModelInferResponse(
        model_name=response.model_name, model_version=response.model_version, id=response.id
    )
    outputs = message.outputs
    for tensor in response.outputs:
        output = outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.data.shape)
        if tensor.parameters:
            encode_parameters(output.parameters, tensor.parameters)
    if response.parameters:
        encode_parameters(message.parameters, response.parameters)
    return message


def _varint(value: int) -> bytes:
    """A non-negative integer in protobuf's base-128 varint encoding."""
    encoded = bytearray()
    while value >= 0x80:
        encoded.append(value & 0x7F | 0x80)
        value >>= 7
    encoded.append(value)
    return bytes(encoded)


