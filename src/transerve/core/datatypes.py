"""Triton's 13 tensor datatypes and their numpy counterparts.

BYTES tensors are numpy object arrays whose elements are `bytes`; BF16 uses the
`ml_dtypes.bfloat16` numpy dtype (a dependency of tritonclient itself).
"""

from __future__ import annotations

import struct

import numpy as np

from transerve.core.errors import invalid_arg

try:
    import ml_dtypes
except ImportError:  # a python-backend worker in a model's own environment (EXECUTION_ENV_PATH) may lack it
    ml_dtypes = None

#: Without ml_dtypes, BF16 values are their raw 16 bits (a one-field record), which still travel unchanged.
BF16 = np.dtype(ml_dtypes.bfloat16) if ml_dtypes is not None else np.dtype([("bfloat16", "<u2")])

#: Protocol datatype name -> numpy dtype.
NUMPY_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BF16": BF16,
    "BYTES": np.dtype(np.object_),
}

#: Bytes per element; BYTES has no fixed size.
ELEMENT_SIZE: dict[str, int] = {name: dt.itemsize for name, dt in NUMPY_DTYPES.items() if name != "BYTES"}

#: Triton's numeric enum (TRITONSERVER_DataType), used by the python backend's `triton_dtype()`.
TRITON_ENUM: dict[str, int] = {
    "BOOL": 1, "UINT8": 2, "UINT16": 3, "UINT32": 4, "UINT64": 5, "INT8": 6, "INT16": 7,
    "INT32": 8, "INT64": 9, "FP16": 10, "FP32": 11, "FP64": 12, "BYTES": 13, "BF16": 14,
}


def config_to_protocol(config_type: str) -> str:
    """`TYPE_FP32` -> `FP32`; `TYPE_STRING` -> `BYTES` (Triton names it STRING in configs)."""
    name = config_type[5:] if config_type.startswith("TYPE_") else config_type
    return "BYTES" if name == "STRING" else name


def protocol_to_config(datatype: str) -> str:
    """`FP32` -> `TYPE_FP32`; `BYTES` -> `TYPE_STRING`."""
    return "TYPE_STRING" if datatype == "BYTES" else "TYPE_" + datatype


def numpy_to_protocol(dtype: np.dtype) -> str | None:
    """The protocol datatype for a numpy dtype, or None where there is none (e.g. complex)."""
    dtype = np.dtype(dtype)
    if dtype == BF16:
        return "BF16"
    if dtype.kind in ("O", "S", "U"):
        return "BYTES"
    for name, candidate in NUMPY_DTYPES.items():
        if candidate == dtype:
            return name
    return None


def serialize_bytes(array: np.ndarray) -> bytes:
    """A BYTES tensor in Triton's wire form: each element as a 4-byte little-endian length and its bytes."""
    pack = struct.Struct("<I").pack
    parts: list[bytes] = []
    for item in array.reshape(-1):
        if isinstance(item, str):
            item = item.encode("utf-8")
        elif not isinstance(item, (bytes, bytearray, memoryview)):
            item = str(item).encode("utf-8")
        parts.append(pack(len(item)))
        parts.append(bytes(item))
    return b"".join(parts)


def deserialize_bytes(buffer: bytes | memoryview, count: int | None = None) -> np.ndarray:
    """Parse length-prefixed BYTES elements into a 1-D object array of `bytes`.

    With `count`, exactly that many elements must be present and fill the buffer.
    """
    view = memoryview(buffer)
    total = len(view)
    items: list[bytes] = []
    offset = 0
    unpack = struct.Struct("<I").unpack_from
    while offset < total:
        if offset + 4 > total:
            raise invalid_arg("malformed BYTES tensor: truncated element length")
        (length,) = unpack(view, offset)
        offset += 4
        end = offset + length
        if end > total:
            raise invalid_arg("malformed BYTES tensor: element length exceeds the data")
        items.append(bytes(view[offset:end]))
        offset = end
    if count is not None and len(items) != count:
        raise invalid_arg(f"BYTES tensor holds {len(items)} elements but its shape declares {count}")
    result = np.empty(len(items), dtype=np.object_)
    result[:] = items
    return result
