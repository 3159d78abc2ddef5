"""KServe v2 JSON and Triton's binary extension, both directions."""

import struct

import numpy as np
import orjson
import pytest
from tritonclient.grpc import model_config_pb2

from transerve.core.errors import ServerError
from transerve.core.signature import ModelSignature
from transerve.core.types import InferResponse, RequestedOutput, Tensor
from transerve.frontends.http.codec import (
    decode_infer_request,
    decode_raw_request,
    encode_infer_response,
    is_raw_body,
)
from transerve.frontends.http.encoding import UnsupportedEncoding, decompress_body, response_encoding


def binary_body(header: dict, *blobs: bytes) -> tuple[bytes, str]:
    encoded = orjson.dumps(header)
    return encoded + b"".join(blobs), str(len(encoded))


def test_json_request_with_parameters_id_and_outputs():
    body = orjson.dumps({
        "id": "r1", "parameters": {"scale": 3, "binary_data_output": True, "priority": 1},
        "inputs": [{"name": "A", "shape": [1, 2], "datatype": "INT64", "data": [[1, 2]]}],
        "outputs": [{"name": "B", "parameters": {"binary_data": False}}],
    })
    request, binary_default = decode_infer_request("m", "2", body, None)
    assert (request.model_name, request.model_version, request.id) == ("m", "2", "r1")
    assert request.parameters == {"scale": 3}  # protocol parameters are not the model's
    assert request.priority == 1
    assert binary_default is False  # listed outputs choose for themselves, as in Triton
    assert request.outputs == [RequestedOutput("B", {"binary_data": False})]
    np.testing.assert_array_equal(request.inputs[0].data, [[1, 2]])


def test_binary_inputs_including_bytes():
    floats = np.arange(4, dtype=np.float32)
    strings = struct.pack("<I", 2) + b"hi" + struct.pack("<I", 0)
    body, length = binary_body({"inputs": [
        {"name": "F", "shape": [4], "datatype": "FP32", "parameters": {"binary_data_size": 16}},
        {"name": "S", "shape": [2], "datatype": "BYTES", "parameters": {"binary_data_size": len(strings)}},
    ]}, floats.tobytes(), strings)
    request, _ = decode_infer_request("m", "", body, length)
    np.testing.assert_array_equal(request.inputs[0].data, floats)
    assert request.inputs[1].data.tolist() == [b"hi", b""]


SHORT_BINARY = b'{"inputs":[{"name":"A","shape":[1],"datatype":"FP32","parameters":{"binary_data_size":4}}]}'


@pytest.mark.parametrize(
    ("body", "length", "fragment"),
    [
        (b"", None, "failed to parse the request JSON"),
        (b"{", None, "failed to parse the request JSON"),
        (b"[]", None, "JSON object"),
        (b"{}", None, "'inputs'"),
        (b'{"inputs":[{"shape":[1],"datatype":"FP32","data":[1]}]}', None, "'name'"),
        (b'{"inputs":[{"name":"A","datatype":"FP32","data":[1]}]}', None, "'shape'"),
        (b'{"inputs":[{"name":"A","shape":[1],"data":[1]}]}', None, "'datatype'"),
        (b'{"inputs":[{"name":"A","shape":[1],"datatype":"FP32"}]}', None, "only one of"),
        (b'{"inputs":[]}', "500", "inference header size"),
        (b'{"inputs":[]}', "abc", "Inference-Header-Content-Length"),
        (SHORT_BINARY + b"xx", str(len(SHORT_BINARY)), "expecting 4 additional bytes"),
        (b'{"inputs":[]}extra', "13", "unexpected additional input data"),
        (b'{"inputs":[],"parameters":{"p":[1]}}', None, "parameter 'p' has invalid type"),
        (b'{"inputs":[],"parameters":{"priority":-1}}', None, "'priority' must be a non-negative integer"),
        (b'{"inputs":[],"parameters":{"sequence_start":1}}', None, "'sequence_start' must be true or false"),
        (b'{"inputs":[],"parameters":{"sequence_id":1.5}}', None, "'sequence_id' must be an integer or a string"),
        (b'{"inputs":[],"outputs":[{"name":"B","parameters":{"classification":"2"}}]}', None,
         "Unable to set 'classification' of output 'B': it must be a non-negative integer"),
    ],
)
def test_malformed_requests_are_invalid_arguments(body, length, fragment):
    with pytest.raises(ServerError) as info:
        decode_infer_request("m", "", body, length)
    assert fragment in info.value.message
    assert info.value.code.name in ("INVALID_ARG", "UNSUPPORTED")


def test_response_json_and_binary_outputs():
    response = InferResponse("m", "1", [
        Tensor("J", "FP16", np.array([1.5, 2], np.float16)),
        Tensor("B", "BYTES", np.array([b"x", "é".encode()], dtype=object)),
    ], id="r1")
    request, _ = decode_infer_request("m", "", b'{"inputs":[],"outputs":[{"name":"J"},'
                                      b'{"name":"B","parameters":{"binary_data":true}}]}', None)
    body, header_length = encode_infer_response(response, request, binary_default=False)
    header = orjson.loads(body[:header_length])
    assert header["id"] == "r1" and header["model_version"] == "1"
    assert header["outputs"][0]["data"] == [1.5, 2.0]
    size = header["outputs"][1]["parameters"]["binary_data_size"]
    assert body[header_length:] == struct.pack("<I", 1) + b"x" + struct.pack("<I", 2) + "é".encode()
    assert size == len(body) - header_length


def test_response_all_json_when_nothing_binary():
    response = InferResponse("m", "1", [Tensor("B", "BYTES", np.array(["é".encode()], dtype=object))])
    request, _ = decode_infer_request("m", "", b'{"inputs":[]}', None)
    body, header_length = encode_infer_response(response, request, binary_default=False)
    assert header_length is None
    assert orjson.loads(body)["outputs"][0]["data"] == ["é"]


def test_bytes_that_are_not_utf8_cannot_go_as_json():
    response = InferResponse("m", "1", [Tensor("B", "BYTES", np.array([b"\xff"], dtype=object))])
    request, _ = decode_infer_request("m", "", b'{"inputs":[]}', None)
    with pytest.raises(ServerError, match="output 'B' holds bytes that are not valid UTF-8"):
        encode_infer_response(response, request, binary_default=False)


def test_decompression_limits():
    import gzip
    import zlib

    assert decompress_body(gzip.compress(b"abc"), "gzip", 10) == b"abc"
    assert decompress_body(zlib.compress(b"abc"), "deflate", 10) == b"abc"
    with pytest.raises(ValueError, match="exceeds the limit"):
        decompress_body(gzip.compress(b"a" * 100), "gzip", 10)
    with pytest.raises(UnsupportedEncoding, match="Unsupported compression type"):
        decompress_body(b"abc", "br", 10)
    with pytest.raises(ValueError, match="cannot decompress"):
        decompress_body(b"not gzip", "gzip", 10)


def test_every_gzip_member_counts_and_the_limit_covers_them_all():
    import gzip

    members = gzip.compress(b"ab") + b"\0\0" + gzip.compress(b"cd") + gzip.compress(b"") + b"\0"
    assert decompress_body(members, "gzip", 10) == b"abcd"
    with pytest.raises(ValueError, match="exceeds the limit of 3 bytes"):
        decompress_body(members, "gzip", 3)
    with pytest.raises(ValueError, match="after its last member"):
        decompress_body(members + b"junk", "gzip", 10)
    with pytest.raises(ValueError, match="too many gzip members"):
        decompress_body(gzip.compress(b"") * 2000, "gzip", 10)


def test_large_bodies_finish_inflating_in_a_thread(monkeypatch):
    import asyncio
    import gzip
    import threading
    import zlib

    from transerve.frontends.http import encoding

    data = np.random.default_rng(0).random(300_000).astype(np.float32).tobytes()
    threads = set()
    join = encoding._join
    monkeypatch.setattr(encoding, "_join", lambda first, rest: threads.add(threading.current_thread()) or
                        join(first, rest))
    assert asyncio.run(encoding.decompress_body_async(gzip.compress(data) * 2, "gzip", 10**7)) == data * 2
    assert threads and threading.main_thread() not in threads
    raw = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    assert asyncio.run(encoding.decompress_body_async(raw.compress(data) + raw.flush(), "deflate", 10**7)) == data
    assert asyncio.run(encoding.decompress_body_async(gzip.compress(b"abc"), "gzip", 10)) == b"abc"
    with pytest.raises(ValueError, match="exceeds the limit"):
        asyncio.run(encoding.decompress_body_async(gzip.compress(bytes(10**7)), "gzip", 10**6))


def test_scheduling_parameters_land_on_the_request():
    body = b'{"inputs":[],"parameters":{"sequence_id":"abc","sequence_start":true,"sequence_end":true,"timeout":5}}'
    request, _ = decode_infer_request("m", "", body, None)
    assert (request.correlation_id, request.flags, request.timeout_us, request.parameters) == ("abc", 3, 5, {})


@pytest.mark.parametrize(
    ("accept", "chosen"),
    [
        ("gzip", "gzip"),
        ("deflate", "deflate"),
        ("gzip, deflate", "gzip"),  # equal weights: the first named
        ("deflate, gzip", "deflate"),
        ("gzip;q=0.5, deflate", "deflate"),
        ("gzip;q=0.5, deflate;q=0.8", "deflate"),
        ("gzip;q=0.5, identity", None),
        ("identity;q=0.9, gzip;q=1.0", "gzip"),
        ("gzip;q=0", None),
        ("gzip;q=abc, deflate;q=0.1", "deflate"),
        ("br", None),
        ("br, gzip;q=0.2", "gzip"),
        ("*", None),
        ("", None),
    ],
)
def test_response_encoding_ranks_as_triton(accept, chosen):
    assert response_encoding(accept) == chosen


def signature(inputs: list[tuple[str, str, list[int]]], max_batch_size: int = 0) -> ModelSignature:
    config = model_config_pb2.ModelConfig(name="m", max_batch_size=max_batch_size)
    for name, data_type, dims in inputs:
        config.input.add(name=name, data_type=model_config_pb2.DataType.Value(data_type), dims=dims)
    return ModelSignature("m", config)


def test_raw_body_is_chosen_by_a_zero_header_or_an_empty_body():
    assert is_raw_body(b"abc", "0") and is_raw_body(b"", None)
    assert not is_raw_body(b"{}", None) and not is_raw_body(b"{}", "2") and not is_raw_body(b"{}", "x")


@pytest.mark.parametrize(
    ("data_type", "dims", "max_batch_size", "body", "shape"),
    [
        ("TYPE_FP32", [-1], 8, np.arange(8, dtype=np.float32).tobytes(), (1, 8)),
        ("TYPE_FP32", [2, -1], 0, np.arange(8, dtype=np.float32).tobytes(), (2, 4)),
        ("TYPE_INT8", [3], 0, b"\x01\x02\x03", (3,)),
        ("TYPE_FP32", [-1], 8, b"", (1, 0)),
        ("TYPE_FP32", [0, -1], 0, b"", (0, 0)),
    ],
)
def test_raw_body_shape_is_deduced_from_the_config(data_type, dims, max_batch_size, body, shape):
    request = decode_raw_request("m", "", signature([("IN", data_type, dims)], max_batch_size), body)
    (tensor,) = request.inputs
    assert (tensor.name, tensor.data.shape, tensor.data.tobytes()) == ("IN", shape, body)


def test_raw_bytes_body_is_one_element():
    request = decode_raw_request("m", "1", signature([("S", "TYPE_STRING", [1])], 4), b"427")
    assert request.inputs[0].data.tolist() == [[b"427"]] and request.model_version == "1"


@pytest.mark.parametrize(
    ("inputs", "body", "fragment"),
    [
        ([("A", "TYPE_FP32", [-1]), ("B", "TYPE_FP32", [-1])], b"", "Raw request must only have 1 input (found 1) "
                                                                   "to be deduced but got 2 inputs in 'm'"),
        ([("A", "TYPE_FP32", [-1, -1])], b"", "more than one variable-sized dimension"),
        ([("S", "TYPE_STRING", [-1])], b"x", "For BYTE datatype raw input 'S', the model must have input shape [1]"),
        ([("S", "TYPE_STRING", [2])], b"x", "For BYTE datatype raw input 'S'"),
        ([("A", "TYPE_FP32", [-1])], b"abcde", "input byte size mismatch for input 'A'"),
        ([("A", "TYPE_FP32", [2])], b"abcd", "Expected 8, got 4"),
    ],
)
def test_raw_body_refusals(inputs, body, fragment):
    with pytest.raises(ServerError) as info:
        decode_raw_request("m", "", signature(inputs), body)
    assert fragment in info.value.message and info.value.code.name == "INVALID_ARG"
