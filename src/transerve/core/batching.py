"""Tensor plumbing for batches: padding requests to a common shape, merging them into one tensor per
input, and splitting a merged output back per request.

The python backend hands a model its requests one by one (Triton's contract), so it needs none of the
merging; backends that run one tensor per input (onnxruntime, pytorch) do. Padding serves both: the
dynamic batcher pads the requests of a batch in place when a model asks for it (`pad_inputs`), so that a
python model can concatenate them as they are. It lives in the core because both the schedulers (padding) and
the threaded backends (merging, splitting) use it, and backends may not import the schedulers.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from transerve.core.datatypes import NUMPY_DTYPES
from transerve.core.types import InferRequest, Tensor


def common_shape(shapes: Iterable[Sequence[int]]) -> tuple[int, ...]:
    """The smallest shape every one of `shapes` fits in, batch axis excluded (axis 0 is kept as given)."""
    shapes = [tuple(shape) for shape in shapes]
    if not shapes:
        raise ValueError("no shapes to combine")
    rank = len(shapes[0])
    if any(len(shape) != rank for shape in shapes):
        raise ValueError(f"tensors of different ranks cannot share a batch: {shapes}")
    return tuple(max(shape[axis] for shape in shapes) for axis in range(1, rank))


def pad(array: np.ndarray, shape: Sequence[int], value: object) -> np.ndarray:
    """`array` grown at the end of every axis to `shape`, the new cells set to `value`."""
    if array.shape == tuple(shape):
        return array
    if any(have > want for have, want in zip(array.shape, shape, strict=True)):
        raise ValueError(f"cannot pad shape {list(array.shape)} to the smaller {list(shape)}")
    padded = np.full(shape, value, dtype=array.dtype)
    padded[tuple(slice(0, size) for size in array.shape)] = array
    return padded


def length_mask(batch: int, length: int, padded_length: int, dtype: np.dtype) -> np.ndarray:
    """An attention mask of shape [batch, padded_length]: 1 for the first `length` positions, 0 after."""
    mask = np.zeros((batch, padded_length), dtype=dtype)
    mask[:, :length] = 1
    return mask


@dataclass(frozen=True, slots=True)
class MaskSpec:
    """An attention-mask input: 1 over each request's real positions of `length_input`, 0 over padding."""

    name: str
    datatype: str
    length_input: str
    #: The axis of `length_input` (batch axis included) that holds the length.
    axis: int


def _find(request: InferRequest, name: str) -> Tensor | None:
    return next((tensor for tensor in request.inputs if tensor.name == name), None)


def pad_requests(
    requests: Sequence[InferRequest], names: Iterable[str], value: object, mask: MaskSpec | None = None
) -> None:
    """Pad, in place, each named input of every request to the batch's longest (batch axis untouched).

    With `mask`, every request carries the mask input afterwards: its own padded with 0 if it sent one,
    else one built from its length input.
    """
    if mask is not None:
        dtype = NUMPY_DTYPES[mask.datatype]
        for request in requests:
            source = _find(request, mask.length_input)
            if source is not None and _find(request, mask.name) is None:
                batch, length = source.data.shape[0], source.data.shape[mask.axis]
                request.inputs.append(Tensor(mask.name, mask.datatype, length_mask(batch, length, length, dtype)))
        _pad_input(requests, mask.name, 0)
    for name in names:
        _pad_input(requests, name, value)


def _pad_input(requests: Sequence[InferRequest], name: str, value: object) -> None:
    tensors = [tensor for request in requests if (tensor := _find(request, name)) is not None]
    if len(tensors) < 2:
        return
    inner = common_shape(tensor.data.shape for tensor in tensors)
    for tensor in tensors:
        tensor.data = pad(tensor.data, (tensor.data.shape[0], *inner), value)


def merge_inputs(requests: Sequence[InferRequest], value: object = 0) -> tuple[dict[str, np.ndarray], list[int]]:
    """One array per input, the requests' tensors padded to a common shape and stacked along the batch axis,
    plus each request's batch size (what `split_outputs` needs to give every request its own rows back)."""
    if not requests:
        raise ValueError("no requests to merge")
    names = [tensor.name for tensor in requests[0].inputs]
    per_input: dict[str, list[np.ndarray]] = {name: [] for name in names}
    sizes = []
    for request in requests:
        tensors = {tensor.name: tensor.data for tensor in request.inputs}
        if sorted(tensors) != sorted(names):
            raise ValueError(f"requests with different inputs cannot be merged: {sorted(tensors)} vs {sorted(names)}")
        sizes.append(int(tensors[names[0]].shape[0]))
        for name in names:
            per_input[name].append(tensors[name])
    merged = {}
    for name, arrays in per_input.items():
        inner = common_shape(array.shape for array in arrays)
        merged[name] = np.concatenate([pad(array, (array.shape[0], *inner), value) for array in arrays])
    return merged, sizes


def split_outputs(outputs: dict[str, np.ndarray], sizes: Sequence[int]) -> list[dict[str, np.ndarray]]:
    """Each request's rows of every merged output, in request order (views, not copies)."""
    total = sum(sizes)
    for name, array in outputs.items():
        if array.ndim == 0 or array.shape[0] != total:
            raise ValueError(f"output '{name}' has {array.shape[:1]} rows where the batch has {total}")
    bounds = np.cumsum([0, *sizes])
    return [
        {name: array[start:stop] for name, array in outputs.items()}
        for start, stop in zip(bounds[:-1], bounds[1:], strict=True)
    ]
