"""Wire data into tensors: the checks both frontends rely on."""

import numpy as np
import pytest

from transerve.core.datatypes import NUMPY_DTYPES, deserialize_bytes, serialize_bytes
from transerve.core.errors import ErrorCode, ServerError
from transerve.core.tensors import check_datatype, check_shape, tensor_from_bytes, tensor_from_values


def test_every_datatype_round_trips_through_bytes():
    for datatype, dtype in NUMPY_DTYPES.items():
        if datatype == "BYTES":
            continue
        array = np.arange(6).astype(dtype).reshape(2, 3)
        tensor = tensor_from_bytes("x", datatype, (2, 3), array.tobytes(), "m")
        assert tensor.data.dtype == dtype
        np.testing.assert_array_equal(tensor.data.astype(np.float64), array.astype(np.float64))


def test_bytes_tensor_round_trip_keeps_empty_and_non_ascii():
    values = np.array(["안녕 😀".encode(), b"", b"\x00\xff"], dtype=np.object_)
    tensor = tensor_from_bytes("t", "BYTES", (3,), serialize_bytes(values), "m")
    assert list(tensor.data) == list(values)


def test_byte_size_mismatch_names_input_model_and_sizes():
    with pytest.raises(ServerError) as info:
        tensor_from_bytes("INPUT0", "FP32", (1, 4), b"\0" * 12, "add_sub")
    assert info.value.code is ErrorCode.INVALID_ARG
    assert "Expected 16, got 12" in info.value.message and "'add_sub'" in info.value.message


def test_huge_declared_shape_is_refused_without_allocating():
    with pytest.raises(ServerError, match="needs 400000000000 elements"):
        tensor_from_values("x", "FP32", (100_000_000_000, 4), [1.0])
    with pytest.raises(ServerError, match="byte size mismatch"):
        tensor_from_bytes("x", "FP32", (100_000_000_000, 4), b"\0" * 4, "m")


def test_bytes_count_must_match_shape():
    with pytest.raises(ServerError, match="holds 1 elements"):
        tensor_from_bytes("t", "BYTES", (2,), serialize_bytes(np.array([b"a"], dtype=object)), "m")


def test_truncated_bytes_element_is_an_error():
    with pytest.raises(ServerError, match="malformed BYTES"):
        deserialize_bytes(b"\x05\x00\x00\x00ab")


@pytest.mark.parametrize(
    ("datatype", "values", "message"),
    [
        ("INT8", [300, 1], "out of range"),
        ("UINT8", [-1, 1], "out of range"),
        ("INT32", [1.5, 1], "attempt to access JSON non-signed-integer as signed-integer"),
        ("UINT32", [1.5, 1], "attempt to access JSON non-unsigned-integer as unsigned-integer"),
        ("BOOL", [1, 0], "attempt to access JSON non-boolean as boolean"),
        ("FP32", ["a", 1], "attempt to access JSON non-number as double"),
        ("FP32", [True, False], "attempt to access JSON non-number as double"),
        ("BYTES", ["a", 5], "attempt to access JSON non-string as string"),
        ("FP32", [[1, 2], [3]], "not a regular array"),
    ],
)
def test_json_values_are_checked_not_coerced(datatype, values, message):
    with pytest.raises(ServerError, match=message):
        tensor_from_values("x", datatype, (2,), values)


def test_json_values_flat_or_nested():
    flat = tensor_from_values("x", "FP32", (2, 2), [1, 2, 3, 4])
    nested = tensor_from_values("x", "FP32", (2, 2), [[1, 2], [3, 4]])
    np.testing.assert_array_equal(flat.data, nested.data)
    assert flat.data.dtype == np.float32
    uint64 = tensor_from_values("x", "UINT64", (1,), [18446744073709551615])
    assert int(uint64.data[0]) == 18446744073709551615
    text = tensor_from_values("x", "BYTES", (1, 2), [["é", ""]])
    assert text.data.tolist() == [["é".encode(), b""]]


def test_datatype_and_shape_checks():
    assert check_datatype("x", "BF16") == "BF16"
    with pytest.raises(ServerError, match="invalid datatype for input x"):
        check_datatype("x", "FP99")
    assert check_shape("x", [0, 3]) == (0, 3)
    for bad in ([1, -4], "3", [1.5], [True]):
        with pytest.raises(ServerError, match="invalid shape"):
            check_shape("x", bad)


@pytest.mark.parametrize("shape", [[0, 2**63 - 1], [0, 2**62, 2], [2**40, 0, 2**40]])
@pytest.mark.parametrize("datatype", ["UINT8", "BF16", "FP64", "BYTES"])
def test_an_empty_tensor_numpy_cannot_shape_is_invalid_arg(shape: list[int], datatype: str) -> None:
    """Found by tests/fuzz/test_fuzz_codecs.py: NumPy refused such shapes (ValueError, a 500) though no element
    is declared, as its size check multiplies the non-zero dimensions."""
    with pytest.raises(ServerError) as caught:
        shape_checked = check_shape("x", shape)
        tensor_from_values("x", datatype, shape_checked, [])
    assert caught.value.code == ErrorCode.INVALID_ARG and "larger than any tensor" in caught.value.message
