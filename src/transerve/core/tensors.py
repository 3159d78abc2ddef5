"""Turning wire data into numpy tensors, with the checks every frontend must apply the same way.

Both frontends call these, so the same bad input gets the same error over HTTP and gRPC.
No allocation is ever sized from a client's declared shape: shapes are checked against the
bytes or values actually received.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from transerve.core.datatypes import ELEMENT_SIZE, NUMPY_DTYPES, deserialize_bytes, serialize_bytes
from transerve.core.errors import invalid_arg
from transerve.core.types import Tensor

_INT_KINDS = ("i", "u")


def check_datatype(name: str, datatype: Any) -> str:
    if not isinstance(datatype, str) or datatype not in NUMPY_DTYPES:
        raise invalid_arg(f"invalid datatype for input {name}")
    return datatype


#: The most dimensions a tensor may have: NumPy's own limit (NPY_MAXDIMS, 64 since NumPy 2).
MAX_DIMS = 64
#: NumPy refuses a shape whose non-zero dimensions multiply, in bytes, past 2^63-1, even when another dimension is 0
#: and the tensor is empty; 8 bytes is the widest element.
MAX_EXTENT = (2**63 - 1) // 8


def check_shape(name: str, shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, (list, tuple)) or not all(
        isinstance(dim, int) and not isinstance(dim, bool) and dim >= 0 for dim in shape
    ):
        raise invalid_arg(f"invalid shape for input '{name}': {shape!r} (expected a list of non-negative integers)")
    if len(shape) > MAX_DIMS:
        raise invalid_arg(f"invalid shape for input '{name}': {len(shape)} dimensions, at most {MAX_DIMS} are "
                          "supported")
    extent = 1
    for dim in shape:
        extent *= dim or 1
    if extent > MAX_EXTENT:
        raise invalid_arg(f"invalid shape for input '{name}': {list(shape)} is larger than any tensor can be")
    return tuple(shape)


def element_count(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def tensor_from_bytes(
    name: str, datatype: str, shape: tuple[int, ...], buffer: bytes | bytearray | memoryview, model_name: str
) -> Tensor:
    """A tensor from its raw little-endian bytes (binary HTTP extension, gRPC raw contents)."""
    count = element_count(shape)
    if datatype == "BYTES":
        array = deserialize_bytes(buffer, count) if count or len(buffer) else np.empty(0, dtype=np.object_)
        return Tensor(name, datatype, array.reshape(shape))
    expected = count * ELEMENT_SIZE[datatype]
    if len(buffer) != expected:
        raise invalid_arg(
            f"input byte size mismatch for input '{name}' for model '{model_name}'. "
            f"Expected {expected}, got {len(buffer)}"
        )
    array = np.frombuffer(buffer, dtype=NUMPY_DTYPES[datatype]).reshape(shape)
    return Tensor(name, datatype, array)


def tensor_from_values(name: str, datatype: str, shape: tuple[int, ...], values: Any) -> Tensor:
    """A tensor from JSON-style values, flat or nested; the element count must match the shape.

    Values are checked against the datatype rather than silently converted: a float for an
    integer type, an out-of-range integer or a number for BYTES is an error, not a wrap-around.
    """
    if not isinstance(values, list):
        values = [values]
    count = element_count(shape)
    if datatype == "BYTES":
        flat = json_strings(name, values)
        if len(flat) != count:
            raise _count_mismatch(name, shape, len(flat))
        array = np.empty(count, dtype=np.object_)
        array[:] = flat
        return Tensor(name, datatype, array.reshape(shape))
    try:
        raw = np.asarray(values)
    except (ValueError, OverflowError):
        raise invalid_arg(f"Unable to parse 'data' of input '{name}': values are not a regular array") from None
    if raw.size != count:
        raise _count_mismatch(name, shape, raw.size)
    return Tensor(name, datatype, _convert(name, datatype, raw, values).reshape(shape))


def _count_mismatch(name: str, shape: tuple[int, ...], got: int) -> Exception:
    return invalid_arg(
        f"Unable to parse 'data' of input '{name}': Shape does not match true shape of 'data' field: shape "
        f"{list(shape)} needs {element_count(shape)} elements but 'data' holds {got}"
    )


def _convert(name: str, datatype: str, raw: np.ndarray, values: list[Any]) -> np.ndarray:
    dtype = NUMPY_DTYPES[datatype]
    kind = raw.dtype.kind
    if raw.size == 0:
        return np.empty(0, dtype=dtype)
    if datatype == "BOOL":
        if kind != "b":
            raise _not_json(name, "boolean as boolean")
        return raw
    if dtype.kind in _INT_KINDS:
        if kind not in _INT_KINDS:
            raw = _exact_integers(name, datatype, values)
        info = np.iinfo(dtype)
        if int(raw.min()) < info.min or int(raw.max()) > info.max:
            raise invalid_arg(f"Unable to parse 'data' of input '{name}': a value is out of range for {datatype}")
        return raw.astype(dtype, copy=False)
    if kind not in ("i", "u", "f"):
        raise _not_json(name, "number as double")
    return raw.astype(dtype, copy=False)


def _not_json(name: str, expected: str) -> Exception:
    """Triton's (TritonJson's) words for a JSON value of the wrong type, naming the input."""
    return invalid_arg(f"Unable to parse 'data' of input '{name}': attempt to access JSON non-{expected}")


def _exact_integers(name: str, datatype: str, values: list[Any]) -> np.ndarray:
    """numpy turns integers beyond int64 (UINT64's upper half) into floats; keep them exact as Python ints."""
    try:
        items = np.array(values, dtype=object).reshape(-1)
    except ValueError:
        items = np.empty(0, dtype=object)
    if items.size and all(type(item) is int for item in items):
        return items
    signed = np.dtype(NUMPY_DTYPES[datatype]).kind == "i"
    raise _not_json(name, "signed-integer as signed-integer" if signed else "unsigned-integer as unsigned-integer")


def json_strings(name: str, values: list[Any]) -> list[bytes]:
    """The strings of a JSON array, flat or nested, as UTF-8; anything else in it is an error."""
    flat: list[bytes] = []
    stack = [iter(values)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, str):
                flat.append(item.encode("utf-8"))
            elif isinstance(item, list):
                stack.append(iter(item))
                break
            else:
                raise _not_json(name, "string as string")
        else:
            stack.pop()
    return flat


def wire_view(tensor: Tensor) -> memoryview:
    """`wire_bytes` without the copy where the array already lies in memory as the wire has it."""
    if tensor.datatype == "BYTES" or tensor.data.dtype.byteorder == ">":
        return memoryview(wire_bytes(tensor))
    return memoryview(np.ascontiguousarray(tensor.data).reshape(-1).view(np.uint8))


def wire_bytes(tensor: Tensor) -> bytes:
    """The tensor's bytes as both protocols carry them: row-major and little-endian; BYTES elements each
    behind a 4-byte little-endian length."""
    if tensor.datatype == "BYTES":
        return serialize_bytes(tensor.data)
    data = tensor.data
    if data.dtype.byteorder == ">":
        data = data.astype(data.dtype.newbyteorder("<"))
    return data.tobytes()
