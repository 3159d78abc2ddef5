"""Padding, merging and splitting tensors of a batch (core/batching.py)."""

from __future__ import annotations

import numpy as np
import pytest

from transerve.core.batching import (
    MaskSpec,
    common_shape,
    length_mask,
    merge_inputs,
    pad,
    pad_requests,
    split_outputs,
)
from transerve.core.types import InferRequest, Tensor


def request(**tensors: np.ndarray) -> InferRequest:
    return InferRequest("m", [Tensor(name, "INT64", array) for name, array in tensors.items()])


def test_common_shape_is_the_largest_of_each_axis_but_the_batch_axis():
    assert common_shape([(2, 3, 4), (1, 5, 1)]) == (5, 4)
    with pytest.raises(ValueError, match="different ranks"):
        common_shape([(1, 2), (1, 2, 3)])
    with pytest.raises(ValueError):
        common_shape([])


def test_pad_grows_the_end_of_each_axis_and_keeps_the_dtype():
    array = np.arange(6, dtype=np.float16).reshape(2, 3)
    padded = pad(array, (2, 5), -1)
    assert padded.dtype == np.float16
    assert padded.tolist() == [[0, 1, 2, -1, -1], [3, 4, 5, -1, -1]]
    assert pad(array, (2, 3), 0) is array  # nothing to do: no copy
    with pytest.raises(ValueError, match="smaller"):
        pad(array, (2, 2), 0)
    text = pad(np.array([[b"a"]], dtype=object), (1, 3), b"")
    assert text.tolist() == [[b"a", b"", b""]]


def test_length_mask():
    assert length_mask(2, 2, 4, np.int32).tolist() == [[1, 1, 0, 0], [1, 1, 0, 0]]


def test_merge_pads_to_the_longest_and_split_gives_every_request_its_rows():
    requests = [
        request(IDS=np.array([[1, 2]]), TYPE=np.array([[0, 0]])),
        request(IDS=np.array([[3, 4, 5], [6, 7, 8]]), TYPE=np.array([[1, 1, 1], [1, 1, 1]])),
        request(TYPE=np.array([[2]]), IDS=np.array([[9]])),  # input order may differ between requests
    ]
    merged, sizes = merge_inputs(requests, value=0)
    assert sizes == [1, 2, 1]
    assert merged["IDS"].tolist() == [[1, 2, 0], [3, 4, 5], [6, 7, 8], [9, 0, 0]]
    assert merged["TYPE"].shape == (4, 3)
    outputs = {"EMB": merged["IDS"] * 10, "POOLED": np.arange(4)}
    parts = split_outputs(outputs, sizes)
    assert [part["POOLED"].tolist() for part in parts] == [[0], [1, 2], [3]]
    assert parts[1]["EMB"].tolist() == [[30, 40, 50], [60, 70, 80]]


def test_merge_and_split_refuse_what_does_not_fit():
    with pytest.raises(ValueError, match="different inputs"):
        merge_inputs([request(A=np.zeros((1, 1))), request(B=np.zeros((1, 1)))])
    with pytest.raises(ValueError, match="no requests"):
        merge_inputs([])
    with pytest.raises(ValueError, match="rows where the batch has 3"):
        split_outputs({"OUT": np.zeros((2, 4))}, [1, 2])


def test_pad_requests_in_place_with_a_mask_built_or_padded():
    built = request(IDS=np.array([[5, 6]]))
    own = request(IDS=np.array([[7, 8, 9, 10]]), MASK=np.array([[1, 1, 1, 0]]))
    mask = MaskSpec("MASK", "INT32", "IDS", 1)
    pad_requests([built, own], ["IDS"], 99, mask)
    tensors = {t.name: t for t in built.inputs}
    assert tensors["IDS"].data.tolist() == [[5, 6, 99, 99]]
    assert tensors["MASK"].data.tolist() == [[1, 1, 0, 0]]
    assert tensors["MASK"].datatype == "INT32" and tensors["MASK"].data.dtype == np.int32
    assert {t.name: t.data.tolist() for t in own.inputs} == {"IDS": [[7, 8, 9, 10]], "MASK": [[1, 1, 1, 0]]}


def test_pad_requests_leaves_a_lone_request_alone():
    lone = request(IDS=np.array([[1]]))
    pad_requests([lone], ["IDS"], 0)
    assert lone.inputs[0].data.tolist() == [[1]]
