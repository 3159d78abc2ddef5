"""How the gRPC tests spell a tensor in a ModelInferRequest: typed `contents` by datatype, and the identity
example's tensor names."""

from __future__ import annotations

from typing import Any

from tritonclient.grpc import service_pb2

InputTensor = service_pb2.ModelInferRequest.InferInputTensor

TYPED_FIELDS = {
    "BOOL": "bool_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}
"""The typed `contents` field for each datatype that has one (Triton has none for FP16 and BF16)."""


def suffix(datatype: str) -> str:
    """identity names its BYTES tensors INPUT_STRING/OUTPUT_STRING (after TYPE_STRING), the others by datatype."""
    return "STRING" if datatype == "BYTES" else datatype


def typed(name: str, datatype: str, shape: list[int], **contents: list[Any]) -> InputTensor:
    """An input tensor carrying its values in typed `contents` (set even when empty)."""
    tensor = InputTensor(name=name, datatype=datatype, shape=shape)
    tensor.contents.SetInParent()
    for field, values in contents.items():
        getattr(tensor.contents, field).extend(values)
    return tensor
