"""KServe v2 JSON bodies and Triton's binary tensor extension <-> InferRequest/InferResponse."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson

from transerve.core.classification import PARAMETER as CLASSIFICATION
from transerve.core.datatypes import ELEMENT_SIZE
from transerve.core.errors import invalid_arg, not_found
from transerve.core.protocol_parameters import (
    FRONTEND_PARAMETERS,
    SCHEDULING_PARAMETERS,
    apply_scheduling_parameter,
)
from transerve.core.signature import ModelSignature
from transerve.core.tensors import check_datatype, check_shape, tensor_from_bytes, tensor_from_values, wire_bytes
from transerve.core.types import InferRequest, InferResponse, RequestedOutput, Tensor
from transerve.server.shared_memory import SharedMemoryRegistry, placement

_JSON_NUMPY = orjson.OPT_SERIALIZE_NUMPY
RESERVED_PARAMETER = "parameter keys starting with 'triton_' are reserved for Triton usage and should not be specified."


def is_raw_body(body: bytes, header_length: str | None) -> bool:
    """Whether an infer body is Triton's raw form, the data of the model's one input with no JSON at all:
    `Inference-Header-Content-Length: 0`, or an empty body without that header."""
    if header_length is None:
        return not body
    try:
        return int(header_length) == 0
    except ValueError:
        return False  # decode_infer_request refuses the header


def decode_raw_request(model_name: str, model_version: str, signature: ModelSignature, body: bytes) -> InferRequest:
    """A raw body as the model's only input, shaped as Triton deduces it from the configuration: the batch
    dimension 1, and the one variable dimension (at most one) whatever the bytes fill; a BYTES input takes the
    whole body as its single element. Its outputs are answered in binary (`binary_default`), as Triton does."""
    prefix = "[request id: <id_unknown>] "
    if len(signature.inputs) != 1:
        raise invalid_arg(f"{prefix}Raw request must only have 1 input (found 1) to be deduced but got "
                          f"{len(signature.inputs)} inputs in '{model_name}' model configuration")
    spec = next(iter(signature.inputs.values()))
    shape = [1] if signature.max_batch_size > 0 else []
    variable, count = None, 1
    for dim in spec.dims:
        if dim == -1:
            if variable is not None:
                raise invalid_arg(f"{prefix}The shape of the raw input '{spec.name}' can not be deduced because "
                                  "there are more than one variable-sized dimension")
            variable = len(shape)
        else:
            count *= dim
        shape.append(dim)
    if spec.datatype == "BYTES":
        if variable is not None or count != 1:
            raise invalid_arg(f"{prefix}For BYTE datatype raw input '{spec.name}', the model must have input "
                              "shape [1]")
        element = np.empty(1, dtype=np.object_)
        element[0] = bytes(body)
        tensor = Tensor(spec.name, "BYTES", element.reshape(shape))
    else:
        if variable is not None:  # a zero-sized fixed dimension leaves nothing to fill
            shape[variable] = len(body) // (count * ELEMENT_SIZE[spec.datatype]) if count else 0
        tensor = tensor_from_bytes(spec.name, spec.datatype, tuple(shape), body, model_name)
    return InferRequest(model_name=model_name, model_version=model_version, inputs=[tensor])


def decode_infer_request(
    model_name: str, model_version: str, body: bytes, header_length: str | None,
    regions: SharedMemoryRegistry | None = None,
) -> tuple[InferRequest, bool]:
    """Parse an infer body: JSON alone, or a JSON header followed by binary tensor data; inputs placed in shared
    memory are read from `regions`.

    Also returns the request's `binary_data_output` flag: whether outputs default to binary.
    """
    if header_length is not None:
        try:
            split = int(header_length)
        except ValueError:
            raise invalid_arg(f"invalid Inference-Header-Content-Length '{header_length}'") from None
        if split <= 0 or split > len(body):
            raise invalid_arg(f"inference header size should be in range (0, {len(body)}], got: {split}")
        header, binary = memoryview(body)[:split], memoryview(body)[split:]
    else:
        header, binary = body, memoryview(b"")
    try:
        document = orjson.loads(header)
    except orjson.JSONDecodeError as exc:
        raise invalid_arg(f"failed to parse the request JSON buffer: {exc}") from None
    if not isinstance(document, dict):
        raise invalid_arg("the inference request must be a JSON object")
    raw_inputs = document.get("inputs")
    if not isinstance(raw_inputs, list):
        raise invalid_arg("Unable to parse 'inputs': the request needs an 'inputs' array")
    request_id = document.get("id", "")
    if not isinstance(request_id, str):
        raise invalid_arg("Unable to parse 'id': it must be a string")
    parameters = _parameters(document.get("parameters"), "request")
    for key, value in parameters.items():
        if not isinstance(value, (str, int, float)):  # bool is an int
            raise invalid_arg(f"parameter '{key}' has invalid type. It should be either 'int', 'bool', 'double' "
                              "or 'string'.")
    offset = 0
    inputs: list[Tensor] = []
    for raw in raw_inputs:
        tensor, offset = _decode_input(raw, binary, offset, model_name, regions)
        inputs.append(tensor)
    if offset != len(binary):
        raise invalid_arg(f"unexpected additional input data for model '{model_name}'")
    outputs = _decode_outputs(document.get("outputs"))
    request = InferRequest(model_name=model_name, model_version=model_version, id=request_id, inputs=inputs,
                           outputs=outputs)
    for key, value in parameters.items():
        if key in SCHEDULING_PARAMETERS:
            apply_scheduling_parameter(request, key, value)
        elif key.startswith("triton_"):  # Triton's HTTP frontend allows none of them, unlike its gRPC one
            raise invalid_arg(RESERVED_PARAMETER)
        elif key not in FRONTEND_PARAMETERS:
            request.parameters[key] = value
    # As in Triton, binary_data_output is the default only when the request lists no outputs.
    return request, outputs is None and bool(parameters.get("binary_data_output", False))


def _parameters(raw: Any, where: str) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise invalid_arg(f"Unable to parse 'parameters' of the {where}: it must be a JSON object")
    return raw


def _decode_input(
    raw: Any, binary: memoryview, offset: int, model_name: str, regions: SharedMemoryRegistry | None
) -> tuple[Tensor, int]:
    if not isinstance(raw, dict):
        raise invalid_arg("Unable to parse 'inputs': each input must be a JSON object")
    name = raw.get("name")
    if not isinstance(name, str):
        raise invalid_arg("Unable to parse 'name': each input needs a string 'name'")
    if "shape" not in raw:
        raise invalid_arg(f"Unable to parse 'shape': input '{name}' has no 'shape'")
    if "datatype" not in raw:
        raise invalid_arg(f"Unable to parse 'datatype': input '{name}' has no 'datatype'")
    shape = check_shape(name, raw["shape"])
    datatype = check_datatype(name, raw["datatype"])
    parameters = _parameters(raw.get("parameters"), f"input '{name}'")
    size = parameters.get("binary_data_size")
    has_data = "data" in raw
    place = placement(name, parameters, "input")
    if has_data + (size is not None) + (place is not None) != 1:
        sources = [label for label, given in (("'data'", has_data), ("'binary_data_size'", size is not None),
                                              ("'shared_memory_region'", place is not None)) if given]
        raise invalid_arg(
            "Input must set only one of the following fields: 'data', 'binary_data_size' in 'parameters', "
            f"'shared_memory_region' in 'parameters'. Input '{name}' sets " + (" ".join(sources) or "none")
        )
    if place is not None:
        if regions is None:
            raise not_found(f"Unable to find shared memory region: '{place[0]}'")
        return tensor_from_bytes(name, datatype, shape, regions.read(*place), model_name), offset
    if has_data:
        return tensor_from_values(name, datatype, shape, raw["data"]), offset
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise invalid_arg(f"input '{name}': 'binary_data_size' must be a non-negative integer")
    if offset + size > len(binary):
        raise invalid_arg(
            f"unexpected size for input '{name}', expecting {size} additional bytes for model '{model_name}'"
        )
    tensor = tensor_from_bytes(name, datatype, shape, binary[offset:offset + size], model_name)
    return tensor, offset + size


def _decode_outputs(raw: Any) -> list[RequestedOutput] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise invalid_arg("Unable to parse 'outputs': it must be an array")
    outputs = []
    for item in raw:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise invalid_arg("Unable to parse 'outputs': each output needs a string 'name'")
        parameters = _parameters(item.get("parameters"), f"output '{item['name']}'")
        count = parameters.get(CLASSIFICATION)
        if count is not None and (not isinstance(count, int) or isinstance(count, bool) or count < 0):
            raise invalid_arg(f"Unable to set '{CLASSIFICATION}' of output '{item['name']}': it must be a "
                              f"non-negative integer, not {orjson.dumps(count).decode()}")
        if placement(item["name"], parameters, "output") is not None and parameters.get("binary_data"):
            raise invalid_arg("Output can't set both 'shared_memory_region' and 'binary_data'")
        outputs.append(RequestedOutput(item["name"], parameters))
    return outputs


def encode_infer_response(
    response: InferResponse, request: InferRequest, binary_default: bool
) -> tuple[bytes, int | None]:
    """The response body and, when any output travels as binary, the JSON header's length."""
    wants_binary = {o.name: bool(o.parameters.get("binary_data", binary_default)) for o in request.outputs or ()}
    outputs_json: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for tensor in response.outputs:
        entry: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.data.shape)}
        if tensor.in_shared_memory:
            pass  # as Triton answers: the shape alone
        elif wants_binary.get(tensor.name, binary_default):
            blob = wire_bytes(tensor)
            entry["parameters"] = {**tensor.parameters, "binary_data_size": len(blob)}
            if blob:  # as Triton: an answer whose binary outputs are all empty is plain JSON
                blobs.append(blob)
        else:
            if tensor.parameters:
                entry["parameters"] = tensor.parameters
            entry["data"] = _json_data(tensor)
        outputs_json.append(entry)
    document: dict[str, Any] = {}
    if response.id:
        document["id"] = response.id
    document["model_name"] = response.model_name
    document["model_version"] = response.model_version
    if response.parameters:
        document["parameters"] = response.parameters
    document["outputs"] = outputs_json
    header = orjson.dumps(document, option=_JSON_NUMPY)
    if not blobs:
        return header, None
    return b"".join([header, *blobs]), len(header)


def _json_data(tensor: Tensor) -> Any:
    data = tensor.data
    if tensor.datatype == "BYTES":
        try:
            return [item.decode() if isinstance(item, (bytes, bytearray)) else str(item) for item in data.reshape(-1)]
        except UnicodeDecodeError:
            # Triton writes the bytes into the JSON as they are, which JSON parsers then refuse.
            raise invalid_arg(f"output '{tensor.name}' holds bytes that are not valid UTF-8, which JSON cannot "
                              "carry: request it with binary_data") from None
    if tensor.datatype == "BF16":
        return data.astype(np.float32).reshape(-1)
    return np.ascontiguousarray(data.reshape(-1))
