"""The classification extension's ranking and printing (core.classification), where the end-to-end tests against
Triton do not reach: integer extremes, ties, which outputs a request asks to classify, label files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2

from transerve.core.classification import class_count, classify, classify_response, load_labels
from transerve.core.errors import ErrorCode, ServerError
from transerve.core.types import InferRequest, InferResponse, RequestedOutput, Tensor


def strings(tensor: Tensor) -> list:
    return [[entry.decode() for entry in row] for row in tensor.data.tolist()] if tensor.data.ndim == 2 else [
        entry.decode() for entry in tensor.data.tolist()]


@pytest.mark.parametrize(("dtype", "values", "expected"), [
    ("UINT64", [0, 2**64 - 1, 2**63], ["18446744073709551615:1", "9223372036854775808:2", "0:0"]),
    ("INT64", [0, -(2**63), 2**63 - 1], ["9223372036854775807:2", "0:0", "-9223372036854775808:1"]),
    ("INT8", [-128, 127, -1], ["127:1", "-1:2", "-128:0"]),
    ("UINT8", [255, 0, 254], ["255:0", "254:2", "0:1"]),
    ("FP64", [1e300, -0.5, 5e-324], [f"{1e300:f}:0", "0.000000:2", "-0.500000:1"]),
])
def test_extremes_rank_and_print_exactly(dtype: str, values: list, expected: list[str]) -> None:
    numpy_type = {"UINT64": np.uint64, "INT64": np.int64, "INT8": np.int8, "UINT8": np.uint8, "FP64": np.float64}
    tensor = Tensor("OUT", dtype, np.array([values], dtype=numpy_type[dtype]))
    result = classify(tensor, 3, [], batching=True)
    assert result.datatype == "BYTES" and result.shape == [1, 3]
    assert strings(result) == [expected]


def test_ties_go_to_the_lower_index_and_labels_only_where_a_line_has_one() -> None:
    tensor = Tensor("OUT", "FP32", np.array([[0.5, 0.25, 0.5, 0.25]], np.float32))
    result = classify(tensor, 4, ["zero", "", "two"], batching=True)
    assert strings(result) == [["0.500000:0:zero", "0.500000:2:two", "0.250000:1", "0.250000:3"]]


def test_without_batching_the_whole_tensor_is_ranked() -> None:
    tensor = Tensor("OUT", "INT32", np.array([[1, 9], [5, 7]], np.int32))
    result = classify(tensor, 3, [], batching=False)
    assert result.shape == [3] and strings(result) == ["9:1", "7:3", "5:2"]


def test_unclassifiable_datatypes_are_refused() -> None:
    for dtype, data in (("FP16", np.zeros((1, 2), np.float16)), ("BOOL", np.zeros((1, 2), bool)),
                        ("BYTES", np.array([[b"a", b"b"]], dtype=np.object_))):
        with pytest.raises(ServerError) as raised:
            classify(Tensor("OUT", dtype, data), 1, [], batching=True)
        assert raised.value.code is ErrorCode.INVALID_ARG
        assert raised.value.message == f"class result not available for output due to unsupported type '{dtype}'"


def test_only_outputs_asked_with_a_positive_count_are_classified() -> None:
    request = InferRequest("m", [], outputs=[
        RequestedOutput("A", {"classification": 2}), RequestedOutput("B", {"classification": 0}),
        RequestedOutput("C", {"binary_data": True}),
    ])
    counts = class_count(request)
    assert counts == {"A": 2}
    assert class_count(InferRequest("m", [])) == {}
    response = InferResponse("m", "1", [Tensor(name, "FP32", np.array([[1.0, 2.0]], np.float32)) for name in "ABC"])
    classify_response(response, counts, {"A": ["x", "y"]}, batching=True)
    assert [(t.name, t.datatype) for t in response.outputs] == [("A", "BYTES"), ("B", "FP32"), ("C", "FP32")]
    assert strings(response.outputs[0]) == [["2.000000:1:y", "1.000000:0:x"]]


def test_labels_are_read_per_output_relative_to_the_model_folder(tmp_path: Path) -> None:
    (tmp_path / "labels").mkdir()
    (tmp_path / "labels" / "classes.txt").write_text("cat\ndog\n", encoding="utf-8")
    config = model_config_pb2.ModelConfig(output=[
        model_config_pb2.ModelOutput(name="LOGITS", label_filename="labels/classes.txt"),
        model_config_pb2.ModelOutput(name="HIDDEN"),
    ])
    assert load_labels(tmp_path, config) == {"LOGITS": ["cat", "dog"]}
    config.output[1].label_filename = "missing.txt"
    with pytest.raises(ServerError) as raised:
        load_labels(tmp_path, config)
    assert raised.value.message == (
        f"failed to open text file for read {tmp_path / 'missing.txt'}: No such file or directory")


@pytest.mark.parametrize(("name", "message"), [
    ("/etc/hostname", "must be a relative path inside the folder"),
    ("../labels.txt", "points outside the folder"),
    ("escape.txt", "leads outside the folder 'm' through a symbolic link"),
])
def test_a_label_file_outside_the_model_folder_fails_the_load(tmp_path: Path, name: str, message: str) -> None:
    (tmp_path / "labels.txt").write_text("cat\n", encoding="utf-8")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "escape.txt").symlink_to(tmp_path / "labels.txt")
    config = model_config_pb2.ModelConfig(output=[model_config_pb2.ModelOutput(name="LOGITS", label_filename=name)])
    with pytest.raises(ServerError) as raised:
        load_labels(tmp_path / "m", config)
    assert raised.value.code is ErrorCode.INVALID_ARG
    assert f"output 'LOGITS' label_filename '{name}' {message}" in raised.value.message
