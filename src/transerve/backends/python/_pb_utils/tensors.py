"""pb_utils.Tensor: a named numpy array, its DLPack forms, and the helpers that find or encode tensors."""

from __future__ import annotations

import ctypes
from collections.abc import Iterable
from typing import Any

import numpy as np

from transerve.backends.python._pb_utils.errors import TritonModelException, _require
from transerve.core.datatypes import NUMPY_DTYPES, TRITON_ENUM, deserialize_bytes, serialize_bytes

#: numpy dtype -> protocol datatype name, for the dtypes a model may hand to `Tensor`.
_DATATYPE_OF = {dtype: name for name, dtype in NUMPY_DTYPES.items() if name != "BYTES"}
_DATATYPE_OF[np.dtype(np.object_)] = "BYTES"


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


def _find_tensor(tensors: Iterable[Tensor], name: str) -> Tensor | None:
    for tensor in tensors:
        if tensor.name() == name:
            return tensor
