"""Differential tests of the HTTP request forms and answers beyond plain JSON infer: raw binary bodies, chunked
bodies, response compression, per-version metadata and the generate endpoints in detail. The same requests go to
transerve and to the real Triton 2.51, both serving the repository built here (`http_forms_models/`).

Where transerve deliberately answers otherwise (a 400 where Triton answers 500 or 200 to a failed request), the
test asserts both answers, so that a Triton upgrade that changes its side shows.
"""

from __future__ import annotations

import gzip
import json
import shutil
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from support import ServerProcess, require_triton, start_transerve, start_triton

TIMEOUT_S = 30.0
MODEL_FILES = Path(__file__).resolve().parent / "http_forms_models"


def _io(name: str, data_type: str, dims: str, optional: bool = False) -> str:
    return f'{{ name: "{name}" data_type: {data_type} dims: [ {dims} ]{" optional: true" if optional else ""} }}'


def _echo(data_type: str, dims: str, max_batch_size: int = 8, inputs: int = 1, extra: str = "") -> str:
    ins = ", ".join(_io(f"INPUT{i}", data_type, dims) for i in range(inputs))
    outs = ", ".join(_io(f"OUTPUT{i}", data_type, dims) for i in range(inputs))
    return f"max_batch_size: {max_batch_size}\ninput [ {ins} ]\noutput [ {outs} ]\n{extra}"


QUEUE = ("dynamic_batching { max_queue_delay_microseconds: 1000000 preferred_batch_size: [ 8 ] "
         "default_queue_policy { max_queue_size: 1 } }")
TIMEOUT = ("dynamic_batching { max_queue_delay_microseconds: 1000000 preferred_batch_size: [ 8 ] "
           "default_queue_policy { timeout_action: REJECT default_timeout_microseconds: 100000 } }")
CHAT = (
    "max_batch_size: 0\nmodel_transaction_policy { decoupled: true }\n"
    f"input [ {_io('PROMPT', 'TYPE_STRING', '1, 1')}, {_io('STREAM', 'TYPE_BOOL', '1, 1')}, "
    f"{_io('input_ids', 'TYPE_INT32', '1, -1', optional=True)} ]\n"
    f"output [ {_io('TEXT', 'TYPE_STRING', '1, -1')}, {_io('PARAMETERS', 'TYPE_STRING', '1')} ]"
)

#: name -> (model file, configuration after `backend`, versions)
MODELS: dict[str, tuple[str, str, tuple[int, ...]]] = {
    "raw_float": ("echo.py", _echo("TYPE_FP32", "-1"), (1,)),
    "raw_fixed": ("echo.py", _echo("TYPE_INT16", "2, 3", max_batch_size=0), (1,)),
    "raw_bytes": ("echo.py", _echo("TYPE_STRING", "1"), (1,)),
    "raw_bytes_many": ("echo.py", _echo("TYPE_STRING", "-1"), (1,)),
    "raw_two_variable": ("echo.py", _echo("TYPE_FP16", "-1, -1"), (1,)),
    "raw_pair": ("echo.py", _echo("TYPE_FP32", "-1", inputs=2), (1,)),
    "raw_queue": ("echo.py", _echo("TYPE_FP32", "-1", extra=QUEUE), (1,)),
    "queue_timeout": ("echo.py", _echo("TYPE_FP32", "-1", extra=TIMEOUT), (1,)),
    "pairs": ("echo.py", _echo("TYPE_INT32", "2"), (1,)),
    "versioned": ("echo.py", _echo("TYPE_FP32", "-1", extra="version_policy: { all { } }"), (1, 2, 3)),
    "chat": ("chat.py", CHAT, (1,)),
}


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("http_forms_repository")
    for name, (model_file, config, versions) in MODELS.items():
        (root / name).mkdir()
        (root / name / "config.pbtxt").write_text(f'name: "{name}"\nbackend: "python"\n{config}\n')
        for version in versions:
            (root / name / str(version)).mkdir()
            shutil.copy(MODEL_FILES / model_file, root / name / str(version) / "model.py")
    return root


@pytest.fixture(scope="module")
def servers(repository: Path) -> Iterator[dict[str, ServerProcess]]:
    install = require_triton()
    with start_triton(repository, install=install) as triton, start_transerve(repository) as transerve:
        yield {"triton": triton, "transerve": transerve}


def both(servers: dict[str, ServerProcess], method: str, path: str, **kwargs: Any) -> dict[str, requests.Response]:
    return {name: requests.request(method, server.base_url + path, timeout=TIMEOUT_S, **kwargs)
            for name, server in servers.items()}


def error_of(response: requests.Response) -> str:
    return json.loads(response.content)["error"]


def binary_outputs(response: requests.Response) -> dict[str, np.ndarray]:
    length = response.headers.get("Inference-Header-Content-Length")
    result = httpclient.InferResult.from_response_body(response.content,
                                                        header_length=int(length) if length else None)
    return {output["name"]: result.as_numpy(output["name"]) for output in result.get_response()["outputs"]}


def assert_same_outputs(responses: dict[str, requests.Response]) -> dict[str, np.ndarray]:
    for name, response in responses.items():
        assert response.status_code == 200, f"{name}: {response.status_code} {response.text[:300]}"
    assert (responses["transerve"].headers.get("Inference-Header-Content-Length") is None) == (
        responses["triton"].headers.get("Inference-Header-Content-Length") is None)
    ours, theirs = binary_outputs(responses["transerve"]), binary_outputs(responses["triton"])
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert ours[key].dtype == value.dtype and ours[key].shape == value.shape, key
        np.testing.assert_array_equal(ours[key], value, err_msg=key)
    return ours


def assert_same_error(responses: dict[str, requests.Response], status: int, *fragments: str) -> None:
    for name, response in responses.items():
        assert response.status_code == status, f"{name}: {response.status_code} {response.text[:300]}"
        for fragment in fragments:
            assert fragment in error_of(response), f"{name}: {fragment!r} not in {error_of(response)!r}"


RAW = {"Inference-Header-Content-Length": "0"}


# ---------------------------------------------------------------------------------------------- raw bodies


@pytest.mark.parametrize(
    ("model", "body", "headers"),
    [
        ("raw_float", np.arange(8, dtype=np.float32).tobytes(), RAW),
        ("raw_float", np.arange(32, dtype=np.float32).tobytes(), RAW),
        ("raw_float", b"", RAW),
        ("raw_float", b"", {}),  # an empty body without the header is raw too
        ("raw_fixed", np.arange(6, dtype=np.int16).tobytes(), RAW),
        ("raw_bytes", b"427", RAW),
        ("raw_bytes", "안녕 😀".encode(), RAW),
        ("raw_bytes", b"", RAW),
    ],
    ids=["float8", "float32", "empty", "empty_without_header", "fixed_shape", "bytes", "bytes_unicode",
         "bytes_empty"],
)
def test_raw_body_is_the_one_input(servers: dict[str, ServerProcess], model: str, body: bytes,
                                   headers: dict[str, str]) -> None:
    """Triton deduces the shape from the configuration and answers every output in binary."""
    responses = both(servers, "POST", f"/v2/models/{model}/infer", data=body, headers=headers)
    outputs = assert_same_outputs(responses)
    if model == "raw_bytes":
        assert outputs["OUTPUT0"].tolist() == [[body]]
    else:
        assert outputs["OUTPUT0"].tobytes() == body
    if body:  # binary outputs; an empty one leaves a plain JSON answer
        assert "binary_data_size" in json.loads(responses["transerve"].content[
            :int(responses["transerve"].headers["Inference-Header-Content-Length"])])["outputs"][0]["parameters"]


@pytest.mark.parametrize(
    ("model", "body", "status", "fragments"),
    [
        ("raw_bytes_many", b"427", 400, ("For BYTE datatype raw input 'INPUT0', the model must have input shape [1]",)),
        ("raw_two_variable", np.ones(4, np.float16).tobytes(), 400,
         ("The shape of the raw input 'INPUT0' can not be deduced because there are more than one variable-sized "
          "dimension",)),
        ("raw_pair", np.arange(8, dtype=np.float32).tobytes(), 400,
         ("Raw request must only have 1 input (found 1) to be deduced but got 2 inputs in 'raw_pair' model "
          "configuration",)),
        ("raw_float", b"\0" * 10, 400, ("input byte size mismatch for input", "'raw_float'. Expected 8, got 10")),
        ("raw_fixed", b"\0" * 10, 400, ("input byte size mismatch for input", "'raw_fixed'. Expected 12, got 10")),
        ("no_such_model", b"\0" * 4, 404, ("'no_such_model'",)),
    ],
    ids=["bytes_not_one_element", "two_variable_dims", "two_inputs", "bytes_not_a_multiple", "fixed_size_mismatch",
         "unknown_model"],
)
def test_raw_body_refusals(servers: dict[str, ServerProcess], model: str, body: bytes, status: int,
                           fragments: tuple[str, ...]) -> None:
    assert_same_error(both(servers, "POST", f"/v2/models/{model}/infer", data=body, headers=RAW), status, *fragments)


@pytest.mark.parametrize(
    ("route", "body", "headers"),
    [("infer", np.arange(8, dtype=np.float32).tobytes(), RAW),
     ("generate", json.dumps({"INPUT0": [1.0, 2.0]}).encode(), {}),
     ("generate_stream", json.dumps({"INPUT0": [1.0, 2.0]}).encode(), {})],
)
def test_full_queue_is_503(servers: dict[str, ServerProcess], route: str, body: bytes,
                           headers: dict[str, str]) -> None:
    """The queue holds one request (it waits a second for a batch of 8): the next is refused as unavailable."""
    for name, server in servers.items():
        url = f"{server.base_url}/v2/models/raw_queue/{route}"
        first: dict[str, requests.Response] = {}

        def send(url: str = url, first: dict[str, requests.Response] = first) -> None:
            first["answer"] = requests.post(url, data=body, headers=headers, timeout=TIMEOUT_S)

        waiting = threading.Thread(target=send)
        waiting.start()
        time.sleep(0.5)
        second = requests.post(url, data=body, headers=headers, timeout=TIMEOUT_S)
        waiting.join()
        assert second.status_code == 503, f"{name}: {second.text}"
        assert "Exceeds maximum queue size" in error_of(second), name
        assert first["answer"].status_code == 200, f"{name}: {first['answer'].text}"


# ------------------------------------------------------------------------------------------ chunked bodies


def chunked(body: bytes, size: int = 5) -> bytes:
    pieces = [body[i:i + size] for i in range(0, len(body), size)]
    return b"".join(b"%X\r\n%s\r\n" % (len(piece), piece) for piece in pieces) + b"0\r\n\r\n"


def test_chunked_raw_body_framed_by_hand(servers: dict[str, ServerProcess]) -> None:
    """`requests` sends Content-Length next to the caller's Transfer-Encoding: the chunks frame the body."""
    values = np.arange(8, dtype=np.float32)
    responses = both(servers, "POST", "/v2/models/raw_float/infer", data=chunked(values.tobytes()),
                     headers={**RAW, "Transfer-Encoding": "chunked"})
    np.testing.assert_array_equal(assert_same_outputs(responses)["OUTPUT0"], values.reshape(1, -1))


def test_chunked_and_compressed_bodies(servers: dict[str, ServerProcess]) -> None:
    values = np.arange(8, dtype=np.float32)
    body = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 8], "datatype": "FP32",
                                   "data": values.tolist()}]}).encode()
    for encoding, compressed in (("gzip", gzip.compress(body)), ("deflate", zlib.compress(body))):
        responses = both(servers, "POST", "/v2/models/raw_float/infer", data=chunked(compressed, 7),
                         headers={"Transfer-Encoding": "chunked", "Content-Encoding": encoding})
        np.testing.assert_array_equal(assert_same_outputs(responses)["OUTPUT0"], values.reshape(1, -1))
        # and chunked by the client itself (no Content-Length at all), one generator per server
        responses = {name: requests.post(f"{server.base_url}/v2/models/raw_float/infer", timeout=TIMEOUT_S,
                                         data=iter([compressed[:9], compressed[9:]]),
                                         headers={"Content-Encoding": encoding})
                     for name, server in servers.items()}
        np.testing.assert_array_equal(assert_same_outputs(responses)["OUTPUT0"], values.reshape(1, -1))


# ------------------------------------------------------------------------------------ response compression


INFER_BODY = {"inputs": [{"name": "INPUT0", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]}


@pytest.mark.parametrize(
    "accept",
    ["gzip", "deflate", "gzip, deflate", "deflate, gzip", "gzip;q=0.5, deflate", "identity", "br", "gzip;q=0",
     "identity;q=0.5, gzip;q=0.8", "gzip;q=0.5, identity"],
)
def test_infer_answers_are_compressed_as_accept_encoding_ranks(servers: dict[str, ServerProcess],
                                                                accept: str) -> None:
    responses = both(servers, "POST", "/v2/models/raw_float/infer", json=INFER_BODY,
                     headers={"Accept-Encoding": accept})
    assert_same_outputs(responses)  # requests undoes the encoding
    encodings = {name: r.headers.get("Content-Encoding") for name, r in responses.items()}
    assert encodings["transerve"] == encodings["triton"], encodings


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/v2", None),
        ("GET", "/v2/health/ready", None),
        ("GET", "/v2/models/raw_float", None),
        ("GET", "/v2/models/raw_float/config", None),
        ("GET", "/v2/models/raw_float/stats", None),
        ("GET", "/v2/models/stats", None),
        ("POST", "/v2/repository/index", {}),
        ("GET", "/v2/systemsharedmemory/status", None),
        ("GET", "/v2/cudasharedmemory/status", None),
        ("GET", "/v2/logging", None),
        ("POST", "/v2/models/chat/generate", {"PROMPT": "hi", "STREAM": False}),
        ("POST", "/v2/models/chat/generate_stream", {"PROMPT": "hi", "STREAM": False}),
        ("POST", "/v2/models/raw_float/infer", {"inputs": []}),  # an error answer
    ],
)
def test_only_inference_answers_are_compressed(servers: dict[str, ServerProcess], method: str, path: str,
                                               body: Any) -> None:
    """Clients that read bodies raw (tritonclient.http.aio) rely on it: everything else comes as it is."""
    responses = both(servers, method, path, json=body, headers={"Accept-Encoding": "gzip, deflate"})
    for name, response in responses.items():
        assert "Content-Encoding" not in response.headers, f"{name} {path}: {response.headers}"
    assert responses["transerve"].status_code == responses["triton"].status_code


def test_sync_client_compression_both_ways(servers: dict[str, ServerProcess]) -> None:
    values = np.arange(6, dtype=np.float32).reshape(2, 3)
    for name, server in servers.items():
        with httpclient.InferenceServerClient(server.http_url, network_timeout=TIMEOUT_S) as client:
            for algorithm in ("gzip", "deflate", None):
                tensor = httpclient.InferInput("INPUT0", [2, 3], "FP32")
                tensor.set_data_from_numpy(values)
                result = client.infer("raw_float", [tensor], request_compression_algorithm=algorithm,
                                      response_compression_algorithm=algorithm)
                np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), values, err_msg=f"{name} {algorithm}")


def test_unknown_content_encoding(servers: dict[str, ServerProcess]) -> None:
    """Triton answers 501 and names the encodings it takes."""
    responses = both(servers, "POST", "/v2/models/raw_float/infer", data=b"{}", headers={"Content-Encoding": "br"})
    assert_same_error(responses, 501, "Unsupported compression type")
    for name, response in responses.items():
        assert response.headers["Accept-Encoding"] == "gzip, deflate", name


# ------------------------------------------------------------------------------------------ model metadata


@pytest.mark.parametrize("version", ["", "1", "2", "3"])
def test_metadata_of_a_version_lists_that_version(servers: dict[str, ServerProcess], version: str) -> None:
    path = "/v2/models/versioned" + (f"/versions/{version}" if version else "")
    responses = both(servers, "GET", path)
    documents = {name: r.json() for name, r in responses.items()}
    assert documents["transerve"] == documents["triton"]
    assert documents["transerve"]["versions"] == ([version] if version else ["1", "2", "3"])
    grpc_versions = {}
    for name, server in servers.items():
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            grpc_versions[name] = list(client.get_model_metadata("versioned", version).versions)
    assert grpc_versions["transerve"] == grpc_versions["triton"] == documents["triton"]["versions"]


# ---------------------------------------------------------------------------------------- generate


def generate(servers: dict[str, ServerProcess], body: Any, stream: bool = False, model: str = "chat",
             **kwargs: Any) -> dict[str, requests.Response]:
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return both(servers, "POST", f"/v2/models/{model}/generate{'_stream' if stream else ''}", data=data, **kwargs)


def events(response: requests.Response) -> list[dict[str, Any]]:
    assert response.content == b"" or response.content.endswith(b"\n\n")
    return [json.loads(block[len(b"data: "):]) for block in response.content.split(b"\n\n") if block]


@pytest.mark.parametrize("stream", [False, True], ids=["generate", "generate_stream"])
@pytest.mark.parametrize(
    "body",
    [
        {"PROMPT": "hi", "STREAM": False, "id": "42"},
        {"PROMPT": "hi", "STREAM": False, "id": ""},
        {"PROMPT": "hi", "STREAM": False},
        {"PROMPT": ["hi"], "STREAM": [False], "input_ids": [1, 2, 3], "temperature": 0.5, "top": 3, "flag": True,
         "word": "x"},
        {"PROMPT": "hi", "parameters": {"STREAM": True, "depth": 2}},  # `parameters` may hold inputs
        {"PROMPT": "hi", "STREAM": False, "big": 2**64},  # a number beyond int64 is a double
        '{"PROMPT": "hi", "STREAM": false, "x": 1, "x": 2}',  # a repeated parameter: the first counts
    ],
    ids=["id", "empty_id", "no_id", "types", "nested_input", "big_number", "repeated_parameter"],
)
def test_generate_answers_match(servers: dict[str, ServerProcess], body: Any, stream: bool) -> None:
    """The same document (id echoed when not empty, outputs by name) and the same parameters reach the model."""
    responses = generate(servers, body, stream)
    for name, response in responses.items():
        assert response.status_code == 200, f"{name}: {response.text}"
    if stream:
        ours, theirs = events(responses["transerve"]), events(responses["triton"])
    else:
        ours, theirs = [responses["transerve"].json()], [responses["triton"].json()]
    assert len(ours) == len(theirs) == 1
    seen = [{**document, "PARAMETERS": json.loads(document["PARAMETERS"])} for document in (ours[0], theirs[0])]
    assert seen[0] == seen[1]


@pytest.mark.parametrize("stream", [False, True], ids=["generate", "generate_stream"])
@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('{"PROMPT": "hello", "STREAM": false, "PROMPT": "again"}',
         "[request id: <id_unknown>] input 'PROMPT' already exists in request"),
        ('{"id": "7", "PROMPT": "hello", "STREAM": false, "STREAM": true, "PROMPT": "again"}',
         "[request id: 7] input 'STREAM' already exists in request"),
        ({"PROMPT": "hi", "STREAM": False, "parameters": {"STREAM": False}},
         "Converting keyword: 'parameters': [request id: <id_unknown>] input 'STREAM' already exists in request"),
        ({}, "expected number of inputs between 2 and 3 but got 0 inputs for model 'chat'"),
        ({"STREAM": False, "other": "x"}, "expected number of inputs between 2 and 3 but got 1 inputs for model "
                                          "'chat'. Got input(s) ['STREAM'], but missing required input(s) "
                                          "['PROMPT']. Please provide all required input(s)."),
        ({"PROMPT": "hi", "STREAM": False, "p": {"a": 1}},
         "parameter 'p' has invalid type. It should be either 'int', 'bool', or 'string'."),
        ({"PROMPT": "hi", "STREAM": False, "p": None}, "parameter 'p' has invalid type"),
        ({"PROMPT": "hi", "STREAM": False, "parameters": {"nested": {"twice": 1}}},
         "Converting keyword: 'parameters': parameter 'nested' has invalid type."),
        ({"PROMPT": ["a", "b"], "STREAM": False}, "The schema can not convert input 'PROMPT' to tensor with proper "
                                                  "shape"),
        ({"PROMPT": [], "STREAM": False}, "can not convert input 'PROMPT'"),
    ],
    ids=["repeated_input", "repeated_input_with_id", "repeated_in_parameters", "no_inputs", "missing_input",
         "object_parameter", "null_parameter", "nested_object_parameter", "too_many_values", "no_values"],
)
def test_generate_refusals_match(servers: dict[str, ServerProcess], body: Any, message: str, stream: bool) -> None:
    responses = generate(servers, body, stream)
    assert_same_error(responses, 400, message)
    for name, response in responses.items():
        assert response.headers["Content-Type"] == "application/json", name


@pytest.mark.parametrize("stream", [False, True], ids=["generate", "generate_stream"])
@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"PROMPT": 123, "STREAM": False}, "attempt to access JSON non-string as string"),
        ({"PROMPT": {"USER": "a"}, "STREAM": False}, "attempt to access JSON non-string as string"),
        ({"PROMPT": "hi", "STREAM": "false"}, "attempt to access JSON non-boolean as boolean"),
        ({"STREAM": 123, "PROMPT": True}, "attempt to access JSON non-boolean as boolean"),  # in member order
        ({"PROMPT": "hi", "STREAM": False, "input_ids": [1.5]},
         "attempt to access JSON non-signed-integer as signed-integer"),
        ({"PROMPT": "hi", "STREAM": False, "id": 42}, "Unable to parse 'id': attempt to access JSON non-string as "
                                                      "string"),
        ({"PROMPT": "hi", "STREAM": False, "parameters": 1},
         "Expected JSON object for keyword: 'parameters': attempt to access JSON non-object as object"),
        ("{", "failed to parse the request JSON buffer"),
    ],
    ids=["number_for_bytes", "object_for_bytes", "string_for_bool", "number_for_bool", "float_for_int",
         "number_id", "parameters_not_an_object", "malformed"],
)
def test_generate_wrong_types_are_400_where_triton_answers_500(servers: dict[str, ServerProcess], body: Any,
                                                               message: str, stream: bool) -> None:
    """Deliberate: Triton's JSON accessors fail with INTERNAL (500); the mistake is the client's, so 400."""
    responses = generate(servers, body, stream)
    assert responses["triton"].status_code == 500, f"the reference changed: {responses['triton'].text}"
    assert responses["transerve"].status_code == 400, responses["transerve"].text
    for name, response in responses.items():
        assert message in error_of(response), f"{name}: {error_of(response)}"


def test_generate_shapes_values_as_triton(servers: dict[str, ServerProcess]) -> None:
    """Fixed dimensions divide the values, the innermost variable one (here the batch) takes the rest."""
    responses = generate(servers, {"INPUT0": [1, 2, 3, 4]}, model="pairs")
    documents = {name: r.json() for name, r in responses.items()}
    assert documents["transerve"] == documents["triton"]
    assert documents["transerve"]["OUTPUT0"] == [1, 2, 3, 4]
    assert_same_error(generate(servers, {"INPUT0": [1, 2, 3]}, model="pairs"), 400,
                      "The schema can not convert input 'INPUT0' to tensor with proper shape")


@pytest.mark.parametrize("repeat", [0, 2])
def test_generate_wants_exactly_one_response(servers: dict[str, ServerProcess], repeat: int) -> None:
    """Deliberate: Triton answers 200 with an error body (it has begun its answer); transerve 400, same words."""
    responses = generate(servers, {"PROMPT": "hi", "STREAM": True, "repeat": repeat})
    assert responses["triton"].status_code == 200, f"the reference changed: {responses['triton'].text}"
    assert responses["transerve"].status_code == 400
    for name, response in responses.items():
        assert error_of(response) == ("generate expects model to produce exactly 1 response, use generate stream "
                                      "for model that generates various number of responses"), name


def test_generate_error_response_is_400(servers: dict[str, ServerProcess]) -> None:
    assert_same_error(generate(servers, {"PROMPT": "hi", "STREAM": True, "repeat": 0, "error": "boom"}), 400, "boom")


@pytest.mark.parametrize(
    ("parameters", "status"),
    [({"repeat": 0, "error": "boom"}, 400), ({"repeat": 1, "error": "boom"}, 200), ({"repeat": 0}, 200),
     ({"repeat": 3}, 200)],
    ids=["error_first", "error_after_one", "no_response", "three"],
)
def test_generate_stream_status_is_set_by_the_first_response(servers: dict[str, ServerProcess],
                                                              parameters: dict[str, Any], status: int) -> None:
    responses = generate(servers, {"PROMPT": "hi", "STREAM": True, **parameters}, stream=True)
    for name, response in responses.items():
        assert response.status_code == status, f"{name}: {response.text}"
        assert response.headers["Content-Type"] == "text/event-stream; charset=utf-8", name
    ours, theirs = events(responses["transerve"]), events(responses["triton"])
    for document in (*ours, *theirs):
        document.pop("PARAMETERS", None)
    assert ours == theirs
    assert len(ours) == parameters["repeat"] + ("error" in parameters)


@pytest.mark.parametrize("stream", [False, True], ids=["generate", "generate_stream"])
def test_generate_queue_timeout_is_503_where_triton_answers_400(servers: dict[str, ServerProcess],
                                                                stream: bool) -> None:
    """Deliberate: a request that times out in its queue is unavailable, as on /infer (503 on both servers
    there); Triton's generate endpoints answer it 400, as every error that reaches them as a response."""
    responses = generate(servers, {"INPUT0": [1.0]}, stream, model="queue_timeout")
    assert responses["triton"].status_code == 400, f"the reference changed: {responses['triton'].text}"
    assert responses["transerve"].status_code == 503, responses["transerve"].text
    assert responses["transerve"].headers["Content-Type"] == "application/json"
    assert error_of(responses["transerve"]) == "Request timeout expired"
    infer = both(servers, "POST", "/v2/models/queue_timeout/infer", json=INFER_BODY)
    assert_same_error(infer, 503, "Request timeout expired")


def test_generate_refuses_compressed_bodies_and_answers_plain(servers: dict[str, ServerProcess]) -> None:
    body = json.dumps({"PROMPT": "hi", "STREAM": False}).encode()
    for stream in (False, True):
        responses = generate(servers, gzip.compress(body), stream, headers={"Content-Encoding": "gzip"})
        assert_same_error(responses, 400, "Unsupported content-encoding, only 'identity' is supported.")
