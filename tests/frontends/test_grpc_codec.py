"""Triton's gRPC ModelInferRequest / ModelInferResponse, both directions, without a server."""

from __future__ import annotations

import struct
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from support.grpc_tensors import InputTensor, typed
from tritonclient.grpc import service_pb2

from transerve.core.errors import ErrorCode, ServerError
from transerve.core.protocol_parameters import SEQUENCE_END, SEQUENCE_START
from transerve.core.types import InferResponse, RequestedOutput, Tensor
from transerve.frontends.grpc.codec import (
    decode_infer_request,
    encode_infer_response,
    parse_version,
)


def request(*inputs: InputTensor, raw: list[bytes] | None = None, **fields: Any) -> service_pb2.ModelInferRequest:
    message = service_pb2.ModelInferRequest(model_name="m", inputs=list(inputs), **fields)
    message.raw_input_contents.extend(raw or [])
    return message


def error_of(message: service_pb2.ModelInferRequest) -> ServerError:
    with pytest.raises(ServerError) as caught:
        decode_infer_request(message)
    return caught.value


# ------------------------------------------------------------------------------------------- decoding


def test_raw_inputs_in_order_zero_copy_from_the_message_bytes():
    a, b = np.arange(4, dtype=np.float32), np.array([1, -1], dtype=np.int64)
    decoded = decode_infer_request(request(
        InputTensor(name="A", datatype="FP32", shape=[1, 4]),
        InputTensor(name="B", datatype="INT64", shape=[2]),
        raw=[a.tobytes(), b.tobytes()], id="r1", model_version="3",
    ))
    assert (decoded.model_name, decoded.model_version, decoded.id) == ("m", "3", "r1")
    assert [t.name for t in decoded.inputs] == ["A", "B"]
    np.testing.assert_array_equal(decoded.inputs[0].data, a.reshape(1, 4))
    np.testing.assert_array_equal(decoded.inputs[1].data, b)
    assert decoded.outputs is None and decoded.parameters == {}


def test_raw_bytes_fp16_bf16_and_bool():
    strings = struct.pack("<I", 5) + "héll".encode() + struct.pack("<I", 0)
    half = np.array([1.5, -0.0], dtype=np.float16)
    brain = np.array([1.0, 3.0], dtype=ml_dtypes.bfloat16)
    decoded = decode_infer_request(request(
        InputTensor(name="S", datatype="BYTES", shape=[2]),
        InputTensor(name="H", datatype="FP16", shape=[2]),
        InputTensor(name="B", datatype="BF16", shape=[2]),
        InputTensor(name="Q", datatype="BOOL", shape=[3]),
        raw=[strings, half.tobytes(), brain.tobytes(), b"\x01\x00\x01"],
    ))
    assert decoded.inputs[0].data.tolist() == ["héll".encode(), b""]
    assert decoded.inputs[1].data.dtype == np.float16
    assert decoded.inputs[2].data.dtype == ml_dtypes.bfloat16
    assert decoded.inputs[3].data.tolist() == [True, False, True]


def test_extra_raw_contents_are_ignored_as_in_triton():
    decoded = decode_infer_request(request(InputTensor(name="A", datatype="INT8", shape=[1]), raw=[b"\x07", b"xx"]))
    assert decoded.inputs[0].data.tolist() == [7]


@pytest.mark.parametrize(
    ("datatype", "field", "values"),
    [
        ("BOOL", "bool_contents", [True, False]),
        ("INT8", "int_contents", [-128, 127]),
        ("INT16", "int_contents", [-(2**15), 2**15 - 1]),
        ("INT32", "int_contents", [-(2**31), 2**31 - 1]),
        ("INT64", "int64_contents", [-(2**63), 2**63 - 1]),
        ("UINT8", "uint_contents", [0, 255]),
        ("UINT16", "uint_contents", [0, 65535]),
        ("UINT32", "uint_contents", [0, 2**32 - 1]),
        ("UINT64", "uint64_contents", [0, 2**64 - 1]),
        ("FP32", "fp32_contents", [1.5, -3.25]),
        ("FP64", "fp64_contents", [1e300, -5e-324]),
    ],
)
def test_typed_contents_for_every_field(datatype: str, field: str, values: list[Any]):
    decoded = decode_infer_request(request(typed("X", datatype, [1, 2], **{field: values})))
    data = decoded.inputs[0].data
    assert data.shape == (1, 2) and decoded.inputs[0].datatype == datatype
    assert data.reshape(-1).tolist() == values


def test_typed_bytes_contents_keep_non_ascii_and_empty():
    decoded = decode_infer_request(request(typed("S", "BYTES", [3], bytes_contents=["안녕".encode(), b"", b"\xff"])))
    assert decoded.inputs[0].data.tolist() == ["안녕".encode(), b"", b"\xff"]


def test_present_but_empty_contents_is_an_empty_tensor():
    decoded = decode_infer_request(request(typed("X", "INT32", [1, 0])))
    assert decoded.inputs[0].data.shape == (1, 0)


@pytest.mark.parametrize(
    ("message", "code", "fragment"),
    [
        (request(InputTensor(name="X", datatype="FP32", shape=[1])), ErrorCode.INVALID_ARG,
         "unable to find data for input tensor 'X' for model 'm'"),
        (request(typed("X", "FP32", [1], fp32_contents=[1.0]), raw=[b"\0" * 4]), ErrorCode.INVALID_ARG,
         "contents field must not be specified when using raw_input_contents for 'X'"),
        (request(typed("X", "FP16", [1], fp32_contents=[1.0])), ErrorCode.INVALID_ARG,
         "of type 'FP32', expected datatype 'FP16'"),
        (request(typed("X", "BF16", [1], fp32_contents=[1.0])), ErrorCode.INVALID_ARG,
         "of type 'FP32', expected datatype 'BF16'"),
        (request(typed("X", "FP32", [1], int_contents=[1])), ErrorCode.INVALID_ARG,
         "of type 'INT32', expected datatype 'FP32'"),
        (request(typed("X", "INT64", [1], int_contents=[1])), ErrorCode.INVALID_ARG,
         "of type 'INT32', expected datatype 'INT64'"),
        (request(typed("X", "INT32", [1], int_contents=[1], fp32_contents=[1.0])), ErrorCode.INVALID_ARG,
         "binary data was already supplied"),
        (request(typed("X", "INT8", [1], int_contents=[300])), ErrorCode.INVALID_ARG, "out of range for INT8"),
        (request(typed("X", "FP32", [1, 4], fp32_contents=[1.0, 2.0])), ErrorCode.INVALID_ARG, "'X'"),
        (request(typed("S", "BYTES", [3], bytes_contents=[b"a"])), ErrorCode.INVALID_ARG, "BYTES"),
        (request(InputTensor(name="X", datatype="FP32", shape=[1, 4]), raw=[b"\0" * 12]), ErrorCode.INVALID_ARG,
         "input byte size mismatch for input 'X' for model 'm'. Expected 16, got 12"),
        (request(InputTensor(name="X", datatype="FLOAT", shape=[1]), raw=[b"\0" * 4]), ErrorCode.INVALID_ARG,
         "invalid datatype for input X"),
        (request(InputTensor(name="X", datatype="FP32", shape=[-1]), raw=[b"\0" * 4]), ErrorCode.INVALID_ARG,
         "invalid shape"),
        (request(InputTensor(name="X", datatype="FP32", shape=[1]), raw=[b"\0" * 4], model_version="v1"),
         ErrorCode.INVALID_ARG, "version should be an integral value > 0"),
    ],
    ids=["no_data", "raw_and_typed", "fp16_typed", "bf16_typed", "field_type", "int64_from_int_field",
         "two_fields", "int8_out_of_range", "typed_count", "bytes_count", "raw_byte_size", "bad_datatype",
         "negative_dim", "bad_version"],
)
def test_decode_errors(message: service_pb2.ModelInferRequest, code: ErrorCode, fragment: str):
    error = error_of(message)
    assert error.code is code
    assert fragment in error.message


P = service_pb2.InferParameter


def test_parameters_become_python_values_and_protocol_ones_are_consumed():
    message = request(InputTensor(name="X", datatype="INT8", shape=[1]), raw=[b"\x01"], parameters={
        "flag": P(bool_param=True), "count": P(int64_param=-7), "label": P(string_param="héllo"),
        "scale": P(double_param=0.5), "big": P(uint64_param=2**64 - 1), "sequence_id": P(string_param="seq-1"),
        "sequence_start": P(bool_param=True), "sequence_end": P(bool_param=False), "priority": P(uint64_param=2),
        "timeout": P(int64_param=100),
    })
    decoded = decode_infer_request(message)
    assert decoded.parameters == {"flag": True, "count": -7, "label": "héllo", "scale": 0.5, "big": 2**64 - 1}
    assert decoded.correlation_id == "seq-1"
    assert decoded.flags == SEQUENCE_START
    message.parameters["sequence_end"].bool_param = True
    message.parameters["sequence_id"].int64_param = 42
    decoded = decode_infer_request(message)
    assert (decoded.correlation_id, decoded.flags) == (42, SEQUENCE_START | SEQUENCE_END)


@pytest.mark.parametrize(
    ("key", "parameter", "fragment"),
    [
        ("sequence_id", P(bool_param=True), "expected int64_param or string_param"),
        ("sequence_start", P(int64_param=1), "expected bool_param"),
        ("priority", P(string_param="high"), "expected int64_param or uint64_param"),
        ("timeout", P(double_param=1.0), "expected int64_param"),
        ("triton_secret", P(bool_param=True), "reserved for Triton usage"),
        ("unset", P(), "invalid value type for 'unset' parameter"),
    ],
)
def test_parameter_errors(key: str, parameter: service_pb2.InferParameter, fragment: str):
    message = request(InputTensor(name="X", datatype="INT8", shape=[1]), raw=[b"\x01"])
    message.parameters[key].CopyFrom(parameter)
    error = error_of(message)
    assert error.code is ErrorCode.INVALID_ARG
    assert fragment in error.message


def test_requested_outputs_with_parameters():
    message = request(InputTensor(name="X", datatype="INT8", shape=[1]), raw=[b"\x01"])
    output = message.outputs.add(name="Y")
    output.parameters["binary_data"].bool_param = True
    message.outputs.add(name="Z")
    assert decode_infer_request(message).outputs == [RequestedOutput("Y", {"binary_data": True}),
                                                     RequestedOutput("Z", {})]


def test_shared_memory_placements():
    """An input in a region no registry holds is not found; an output's placement is checked and kept."""
    message = request(InputTensor(name="X", datatype="INT8", shape=[1]))
    message.inputs[0].parameters["shared_memory_region"].string_param = "region"
    assert error_of(message).code is ErrorCode.NOT_FOUND
    message = request(InputTensor(name="X", datatype="INT8", shape=[1]), raw=[b"\x01"])
    placed = message.outputs.add(name="Y")
    placed.parameters["shared_memory_region"].string_param = "region"
    placed.parameters["shared_memory_byte_size"].int64_param = 8
    assert decode_infer_request(message).outputs == [
        RequestedOutput("Y", {"shared_memory_region": "region", "shared_memory_byte_size": 8})]
    placed.parameters["shared_memory_byte_size"].int64_param = -8
    assert "'shared_memory_byte_size' must be a non-negative integer" in error_of(message).message


@pytest.mark.parametrize(("parameter", "error"), [
    (service_pb2.InferParameter(int64_param=3), None),
    (service_pb2.InferParameter(int64_param=0), "invalid value for 'classification' parameter, expected > 0, got 0"),
    (service_pb2.InferParameter(uint64_param=3), "invalid value type for 'classification' parameter"),
    (service_pb2.InferParameter(string_param="3"), "invalid value type for 'classification' parameter"),
])
def test_classification_parameter(parameter: service_pb2.InferParameter, error: str | None):
    message = request(InputTensor(name="X", datatype="INT8", shape=[1]), raw=[b"\x01"])
    message.outputs.add(name="Y").parameters["classification"].CopyFrom(parameter)
    if error is None:
        assert decode_infer_request(message).outputs == [RequestedOutput("Y", {"classification": 3})]
    else:
        assert error_of(message).code is ErrorCode.INVALID_ARG
        assert error in error_of(message).message


@pytest.mark.parametrize(("text", "ok"), [("", True), ("1", True), ("12", True), ("abc", False), ("-1", False)])
def test_parse_version(text: str, ok: bool):
    if ok:
        assert parse_version(text) == text
    else:
        with pytest.raises(ServerError, match="integral value"):
            parse_version(text)


# ------------------------------------------------------------------------------------------- encoding


def test_every_output_as_raw_little_endian_bytes():
    outputs = [
        Tensor("F", "FP32", np.array([[1.5, -2.0]], dtype=">f4")),  # big-endian data goes out little-endian
        Tensor("H", "FP16", np.array([0.5], dtype=np.float16)),
        Tensor("B", "BF16", np.array([2.0], dtype=ml_dtypes.bfloat16)),
        Tensor("Q", "BOOL", np.array([True, False])),
        Tensor("U", "UINT64", np.array([2**64 - 1], dtype=np.uint64)),
        Tensor("S", "BYTES", np.array(["안녕".encode(), b""], dtype=np.object_)),
        Tensor("T", "INT32", np.arange(6, dtype=np.int32).reshape(2, 3).T),  # not contiguous
    ]
    message = encode_infer_response(InferResponse("m", "1", outputs, id="r9"))
    assert (message.model_name, message.model_version, message.id) == ("m", "1", "r9")
    assert [(o.name, o.datatype, list(o.shape)) for o in message.outputs] == [
        ("F", "FP32", [1, 2]), ("H", "FP16", [1]), ("B", "BF16", [1]), ("Q", "BOOL", [2]), ("U", "UINT64", [1]),
        ("S", "BYTES", [2]), ("T", "INT32", [3, 2]),
    ]
    raw = message.raw_output_contents
    assert raw[0] == np.array([1.5, -2.0], dtype="<f4").tobytes()
    assert raw[1] == np.float16(0.5).tobytes()
    assert raw[2] == np.array([2.0], dtype=ml_dtypes.bfloat16).tobytes()
    assert raw[3] == b"\x01\x00"
    assert raw[4] == b"\xff" * 8
    assert raw[5] == struct.pack("<I", 6) + "안녕".encode() + struct.pack("<I", 0)
    assert np.frombuffer(raw[6], dtype=np.int32).tolist() == [0, 3, 1, 4, 2, 5]


def test_response_and_output_parameters():
    output = Tensor("X", "INT8", np.array([1], dtype=np.int8), parameters={"note": "ok", "n": np.int64(3)})
    response = InferResponse("m", "1", [output], parameters={"flag": True, "big": 2**64 - 1, "ratio": 0.25, "n": -1})
    message = encode_infer_response(response)
    assert message.outputs[0].parameters["note"].string_param == "ok"
    assert message.outputs[0].parameters["n"].int64_param == 3
    kinds = {k: p.WhichOneof("parameter_choice") for k, p in message.parameters.items()}
    assert kinds == {"flag": "bool_param", "big": "uint64_param", "ratio": "double_param", "n": "int64_param"}


def test_a_response_parameter_of_another_type_is_a_model_bug():
    with pytest.raises(ServerError) as caught:
        encode_infer_response(InferResponse("m", "1", [], parameters={"bad": [1, 2]}))
    assert caught.value.code is ErrorCode.INTERNAL


@pytest.mark.parametrize("elements", [4, 1 << 18])
def test_serialized_responses_parse_as_the_message(elements: int):
    """Large outputs are appended in protobuf's wire format by hand; the bytes must parse as the message would."""
    from transerve.frontends.grpc.codec import encode_infer_response_bytes

    placed = Tensor("PLACED", "FP32", np.ones(3, np.float32))
    placed.in_shared_memory = True
    response = InferResponse("m", "1", [
        Tensor("BIG", "FP32", np.arange(elements, dtype=np.float32).reshape(2, -1)[:, ::2]),  # not contiguous
        placed,
        Tensor("TEXT", "BYTES", np.array([b"a", b"\xff" * 300], dtype=np.object_), {"note": "kept"}),
    ], id="r1", parameters={"p": 3})
    serialized = encode_infer_response_bytes(response)
    assert service_pb2.ModelInferResponse.FromString(serialized) == encode_infer_response(response)
