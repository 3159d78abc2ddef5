"""Differential tests: the same KServe v2 HTTP requests go to transerve and to the real Triton 2.51, and the
answers must match: status codes exactly, output names, datatypes, shapes and values exactly, error messages
by a distinctive substring of Triton's wording.

Triton is the specification here, so when the two disagree the fix belongs in transerve, with one exception:
the cases in DELIBERATE_DIVERGENCES, where Triton 2.51 answers 500 to a malformed request and transerve
answers 400, because in transerve only a bug may produce a 500 (docs: ARCHITECTURE.md, "Errors are values").

Values are compared after casting to the declared datatype, not as JSON text: Triton writes an FP32 as the
shortest repr of its double widening (1.100000023841858), and a server that writes the shortest FP32 repr
(1.1) sends the same tensor.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import requests
import tritonclient.http as httpclient
import tritonclient.http.aio as aioclient
from support import ServerProcess
from tritonclient.utils import InferenceServerException

TIMEOUT_S = 30.0
"""Per request; generous for a loaded 2-core CI machine, yet a hung server fails the test instead of the job."""

NUMPY_DTYPES: dict[str, Any] = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
    "BYTES": np.object_,
}

# Values for the identity model, chosen at each type's edges: extremes, zero, negative zero, a denormal,
# non-ASCII and empty strings. JSON cannot carry NaN or infinity, so those are only sent in binary.
JSON_VALUES: dict[str, list[Any]] = {
    "BOOL": [True, False, True],
    "UINT8": [0, 1, 255],
    "UINT16": [0, 1, 65535],
    "UINT32": [0, 1, 2**32 - 1],
    "UINT64": [0, 1, 2**64 - 1],
    "INT8": [-128, 0, 127],
    "INT16": [-(2**15), 0, 2**15 - 1],
    "INT32": [-(2**31), 0, 2**31 - 1],
    "INT64": [-(2**63), 0, 2**63 - 1],
    "FP32": [0.0, -0.0, 1.1, -3.4e38, 1e-45],
    "FP64": [0.0, -0.1, 1e300, -1.7976931348623157e308, 5e-324],
    "BYTES": ["", "plain", "héllo wörld", "안녕하세요", "😀 emoji", ""],
}
BINARY_VALUES: dict[str, np.ndarray] = {
    **{dt: np.array(values, dtype=NUMPY_DTYPES[dt]) for dt, values in JSON_VALUES.items() if dt != "BYTES"},
    "FP16": np.array([0.0, -0.0, 1.5, 65504.0, -6e-8, np.inf, -np.inf, np.nan], dtype=np.float16),
    "FP32": np.array([0.0, -0.0, 1.1, -3.4e38, 1e-45, np.inf, np.nan], dtype=np.float32),
    "FP64": np.array([0.0, -0.1, 1e300, 5e-324, -np.inf, np.nan], dtype=np.float64),
    "BYTES": np.array([b"", b"plain", "안녕하세요".encode(), "😀".encode(), b"\x00\xff\xfe raw"], dtype=np.object_),
}


# --------------------------------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def servers(triton_server: ServerProcess, transerve_server: ServerProcess) -> dict[str, ServerProcess]:
    """Both servers by name; Triton's fixture runs first so that a machine without Triton skips before starting."""
    return {"triton": triton_server, "transerve": transerve_server}


def both(servers: dict[str, ServerProcess], method: str, path: str, **kwargs: Any) -> dict[str, requests.Response]:
    """Send one raw HTTP request to each server."""
    return {
        name: requests.request(method, server.base_url + path, timeout=TIMEOUT_S, **kwargs)
        for name, server in servers.items()
    }


def json_body(response: requests.Response) -> Any:
    """The body as JSON whatever the Content-Type (Triton labels some JSON errors text/plain)."""
    return json.loads(response.content)


def decode_json_outputs(body: dict[str, Any]) -> dict[str, Any]:
    """An infer response reduced to what a client sees: ids, and per output its datatype, shape and typed values."""
    outputs = {}
    for output in body["outputs"]:
        datatype, shape = output["datatype"], output["shape"]
        if datatype == "BYTES":
            values = np.array(output["data"], dtype=np.object_).reshape(shape)
        else:
            values = np.array(output["data"], dtype=NUMPY_DTYPES[datatype]).reshape(shape)
        outputs[output["name"]] = (datatype, shape, values)
    return {
        "model_name": body["model_name"],
        "model_version": body["model_version"],
        "id": body.get("id"),
        "outputs": outputs,
    }


def assert_same_json_infer(responses: dict[str, requests.Response]) -> dict[str, Any]:
    """Both answered 200 with the same outputs; returns Triton's decoded answer for further checks."""
    for name, response in responses.items():
        assert response.status_code == 200, f"{name}: {response.status_code} {response.text[:500]}"
    expected = decode_json_outputs(json_body(responses["triton"]))
    actual = decode_json_outputs(json_body(responses["transerve"]))
    assert_same_decoded(actual, expected)
    return expected


def assert_same_decoded(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert {k: v for k, v in actual.items() if k != "outputs"} == {k: v for k, v in expected.items() if k != "outputs"}
    assert sorted(actual["outputs"]) == sorted(expected["outputs"])
    for name, (datatype, shape, values) in expected["outputs"].items():
        got_datatype, got_shape, got_values = actual["outputs"][name]
        assert (got_datatype, got_shape) == (datatype, shape), name
        assert got_values.dtype == values.dtype, name
        np.testing.assert_array_equal(got_values, values, err_msg=name)


def result_summary(result: httpclient.InferResult) -> dict[str, Any]:
    """A tritonclient result as comparable data: the JSON header without inline data, and each output as numpy."""
    response = result.get_response()
    outputs = {}
    for output in response["outputs"]:
        header = {k: v for k, v in output.items() if k != "data"}
        outputs[output["name"]] = (header, result.as_numpy(output["name"]))
    return {"model_name": response["model_name"], "model_version": response["model_version"],
            "id": response.get("id"), "outputs": outputs}


def assert_same_result(actual: httpclient.InferResult, expected: httpclient.InferResult) -> None:
    """Same outputs, and the same binary_data_size parameters, which clients use to slice the body."""
    got, want = result_summary(actual), result_summary(expected)
    assert {k: v for k, v in got.items() if k != "outputs"} == {k: v for k, v in want.items() if k != "outputs"}
    assert sorted(got["outputs"]) == sorted(want["outputs"])
    for name, (header, values) in want["outputs"].items():
        got_header, got_values = got["outputs"][name]
        assert got_header == header, name
        assert got_values.dtype == values.dtype, name
        assert got_values.shape == values.shape, name
        np.testing.assert_array_equal(got_values, values, err_msg=name)


def parse_infer_response(response: requests.Response) -> httpclient.InferResult:
    """Parse a JSON or binary-extension infer response the way tritonclient does."""
    header_length = response.headers.get("Inference-Header-Content-Length")
    return httpclient.InferResult.from_response_body(
        response.content, header_length=int(header_length) if header_length is not None else None
    )


def make_input(name: str, values: np.ndarray, datatype: str, binary: bool) -> httpclient.InferInput:
    tensor = httpclient.InferInput(name, list(values.shape), datatype)
    tensor.set_data_from_numpy(values, binary_data=binary)
    return tensor


def infer_both(servers: dict[str, ServerProcess], call: Callable[[httpclient.InferenceServerClient], Any]) -> dict:
    """Run `call(client)` with a sync tritonclient against each server."""
    results = {}
    for name, server in servers.items():
        with httpclient.InferenceServerClient(
            server.http_url, connection_timeout=TIMEOUT_S, network_timeout=TIMEOUT_S
        ) as client:
            results[name] = call(client)
    return results


def binary_request(header: dict[str, Any], *chunks: bytes, header_length: int | None = None) -> dict[str, Any]:
    """requests kwargs for a binary-extension body: JSON header, then raw tensor bytes."""
    encoded = json.dumps(header).encode()
    return {
        "data": encoded + b"".join(chunks),
        "headers": {
            "Inference-Header-Content-Length": str(len(encoded) if header_length is None else header_length),
            "Content-Type": "application/octet-stream",
        },
    }


def fp32_input(name: str, shape: list[int], data: list[Any]) -> dict[str, Any]:
    return {"name": name, "shape": shape, "datatype": "FP32", "data": data}


ADD_SUB_INPUTS = [fp32_input("INPUT0", [1, 4], [1, 2, 3, 4]), fp32_input("INPUT1", [1, 4], [1, 1, 1, 1])]


# ------------------------------------------------------------------------------------- tritonclient infer


@pytest.mark.parametrize("binary_in", [False, True], ids=["json_in", "binary_in"])
@pytest.mark.parametrize("binary_out", [False, True], ids=["json_out", "binary_out"])
def test_add_sub_tritonclient_sync(servers: dict[str, ServerProcess], binary_in: bool, binary_out: bool) -> None:
    in0 = np.arange(8, dtype=np.float32).reshape(2, 4) / 3
    in1 = np.full((2, 4), 0.25, dtype=np.float32)

    def call(client: httpclient.InferenceServerClient) -> httpclient.InferResult:
        return client.infer(
            "add_sub",
            [make_input("INPUT0", in0, "FP32", binary_in), make_input("INPUT1", in1, "FP32", binary_in)],
            outputs=[httpclient.InferRequestedOutput(n, binary_data=binary_out) for n in ("OUTPUT0", "OUTPUT1")],
            request_id="sync-1",
        )

    results = infer_both(servers, call)
    assert_same_result(results["transerve"], results["triton"])
    np.testing.assert_array_equal(results["transerve"].as_numpy("OUTPUT0"), in0 + in1)
    np.testing.assert_array_equal(results["transerve"].as_numpy("OUTPUT1"), in0 - in1)
    assert results["transerve"].get_response()["id"] == "sync-1"


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_add_sub_tritonclient_aio(servers: dict[str, ServerProcess], binary: bool) -> None:
    """Sixteen concurrent requests on one aio client: each answer must belong to its own request."""
    requests_data = [
        (np.full((1, 4), i, dtype=np.float32), np.arange(4, dtype=np.float32).reshape(1, 4) * i) for i in range(16)
    ]

    async def run(server: ServerProcess) -> list[httpclient.InferResult]:
        async with aioclient.InferenceServerClient(server.http_url, conn_timeout=TIMEOUT_S) as client:
            calls = [
                client.infer(
                    "add_sub",
                    [make_input("INPUT0", a, "FP32", binary), make_input("INPUT1", b, "FP32", binary)],
                    outputs=[aioclient.InferRequestedOutput(n, binary_data=binary) for n in ("OUTPUT0", "OUTPUT1")],
                    request_id=f"aio-{i}",
                )
                for i, (a, b) in enumerate(requests_data)
            ]
            return await asyncio.wait_for(asyncio.gather(*calls), TIMEOUT_S)

    triton_results = asyncio.run(run(servers["triton"]))
    transerve_results = asyncio.run(run(servers["transerve"]))
    for i, (got, want) in enumerate(zip(transerve_results, triton_results, strict=True)):
        assert_same_result(got, want)
        a, b = requests_data[i]
        assert got.get_response()["id"] == f"aio-{i}"
        np.testing.assert_array_equal(got.as_numpy("OUTPUT0"), a + b)


@pytest.mark.parametrize("datatype", sorted(BINARY_VALUES))
def test_identity_binary_every_datatype(servers: dict[str, ServerProcess], datatype: str) -> None:
    values = BINARY_VALUES[datatype].reshape(1, -1)

    def call(client: httpclient.InferenceServerClient) -> httpclient.InferResult:
        return client.infer(
            "identity",
            [make_input(f"INPUT_{datatype_suffix(datatype)}", values, datatype, binary=True)],
            outputs=[httpclient.InferRequestedOutput(f"OUTPUT_{datatype_suffix(datatype)}", binary_data=True)],
        )

    results = infer_both(servers, call)
    assert_same_result(results["transerve"], results["triton"])
    np.testing.assert_array_equal(results["transerve"].as_numpy(f"OUTPUT_{datatype_suffix(datatype)}"), values)


def test_identity_binary_all_datatypes_in_one_request(servers: dict[str, ServerProcess]) -> None:
    """Thirteen binary inputs back to back in one body: offsets must be computed from each binary_data_size."""
    arrays = {dt: np.resize(values, (2, 3)) for dt, values in BINARY_VALUES.items()}

    def call(client: httpclient.InferenceServerClient) -> httpclient.InferResult:
        return client.infer(
            "identity",
            [make_input(f"INPUT_{datatype_suffix(dt)}", v, dt, binary=True) for dt, v in arrays.items()],
            outputs=[httpclient.InferRequestedOutput(f"OUTPUT_{datatype_suffix(dt)}", binary_data=True)
                     for dt in arrays],
        )

    results = infer_both(servers, call)
    assert_same_result(results["transerve"], results["triton"])


def datatype_suffix(datatype: str) -> str:
    """identity names its BYTES tensors INPUT_STRING/OUTPUT_STRING (after TYPE_STRING), the others by datatype."""
    return "STRING" if datatype == "BYTES" else datatype


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_strings_unicode(servers: dict[str, ServerProcess], binary: bool) -> None:
    texts = ["안녕하세요 세계", "😀👍🏽 emoji", "", "ß straße", "plain ascii"]
    values = np.array([t.encode() for t in texts], dtype=np.object_)

    def call(client: httpclient.InferenceServerClient) -> httpclient.InferResult:
        return client.infer(
            "strings",
            [make_input("TEXT", values, "BYTES", binary)],
            outputs=[httpclient.InferRequestedOutput(n, binary_data=binary) for n in ("UPPER", "LENGTH")],
        )

    results = infer_both(servers, call)
    assert_same_result(results["transerve"], results["triton"])
    # tritonclient gives str for JSON BYTES outputs and bytes for binary ones.
    upper = [u.decode() if isinstance(u, bytes) else u for u in results["transerve"].as_numpy("UPPER")]
    assert upper == [t.upper() for t in texts]
    assert results["transerve"].as_numpy("LENGTH").tolist() == [len(t) for t in texts]


def test_params_tritonclient(servers: dict[str, ServerProcess]) -> None:
    parameters = {"scale": 3, "label": "héllo 안녕 😀", "flag": True, "off": False, "negative": -7, "empty": ""}

    def call(client: httpclient.InferenceServerClient) -> httpclient.InferResult:
        return client.infer(
            "params", [make_input("INPUT0", np.array([1.0, 2.0], np.float32), "FP32", True)], parameters=parameters
        )

    results = infer_both(servers, call)
    assert_same_result(results["transerve"], results["triton"])
    echoes = {name: json.loads(result.as_numpy("PARAMETERS")[0]) for name, result in results.items()}
    assert echoes["transerve"] == echoes["triton"]
    assert echoes["transerve"]["request"] == parameters
    np.testing.assert_array_equal(results["transerve"].as_numpy("OUTPUT0"), [3.0, 6.0])


# ------------------------------------------------------------------------------------------- raw JSON infer


@pytest.mark.parametrize("datatype", sorted(JSON_VALUES))
@pytest.mark.parametrize("shape_kind", ["row", "batch", "empty"])
def test_identity_json_every_datatype(servers: dict[str, ServerProcess], datatype: str, shape_kind: str) -> None:
    """Every datatype Triton accepts in JSON (all but FP16), as one row, as a batch of two, and empty ([1, 0])."""
    values = JSON_VALUES[datatype]
    if shape_kind == "row":
        shape, data = [1, len(values)], values
    elif shape_kind == "batch":
        shape, data = [2, len(values)], values + values[::-1]
    else:
        shape, data = [1, 0], []
    suffix = datatype_suffix(datatype)
    body = {"inputs": [{"name": f"INPUT_{suffix}", "shape": shape, "datatype": datatype, "data": data}]}
    decoded = assert_same_json_infer(both(servers, "POST", "/v2/models/identity/infer", json=body))
    assert decoded["outputs"][f"OUTPUT_{suffix}"][1] == shape


def test_identity_json_all_datatypes_in_one_request(servers: dict[str, ServerProcess]) -> None:
    body = {"inputs": [
        {"name": f"INPUT_{datatype_suffix(dt)}", "shape": [1, len(v)], "datatype": dt, "data": v}
        for dt, v in JSON_VALUES.items()
    ]}
    assert_same_json_infer(both(servers, "POST", "/v2/models/identity/infer", json=body))


def test_identity_json_nested_data(servers: dict[str, ServerProcess]) -> None:
    """KServe allows `data` as nested lists in row-major order; Triton flattens them."""
    body = {"inputs": [{"name": "INPUT_INT32", "shape": [2, 2], "datatype": "INT32", "data": [[1, 2], [3, 4]]}]}
    assert_same_json_infer(both(servers, "POST", "/v2/models/identity/infer", json=body))


def test_strings_json_raw(servers: dict[str, ServerProcess]) -> None:
    body = {"inputs": [{"name": "TEXT", "shape": [4], "datatype": "BYTES", "data": ["héllo", "안녕", "😀 emoji", ""]}]}
    decoded = assert_same_json_infer(both(servers, "POST", "/v2/models/strings/infer", json=body))
    assert decoded["outputs"]["LENGTH"][2].tolist() == [5, 2, 7, 0]


@pytest.mark.parametrize(
    "parameters",
    [
        {},
        {"scale": 3},
        {"scale": "0.5", "label": "héllo 안녕 😀"},
        {"flag": True, "off": False, "negative": -7, "big": 2**62, "empty": ""},
    ],
    ids=["none", "int", "str", "mixed"],
)
def test_params_json_echo(servers: dict[str, ServerProcess], parameters: dict[str, Any]) -> None:
    """Request parameters reach the model with their JSON types; the model echoes them back as a JSON string."""
    body: dict[str, Any] = {"inputs": [fp32_input("INPUT0", [2], [1, 2])]}
    if parameters:
        body["parameters"] = parameters
    responses = both(servers, "POST", "/v2/models/params/infer", json=body)
    decoded = assert_same_json_infer(responses)
    echoes = {
        name: json.loads(decode_json_outputs(json_body(r))["outputs"]["PARAMETERS"][2][0])
        for name, r in responses.items()
    }
    assert echoes["transerve"] == echoes["triton"]
    assert echoes["transerve"] == {"config": {"greeting": "hello", "scale": "2.0"}, "request": parameters}
    assert decoded["outputs"]["OUTPUT0"][2].tolist() == [float(parameters.get("scale", 2.0)) * x for x in (1, 2)]


@pytest.mark.parametrize(
    "outputs",
    [
        [{"name": "OUTPUT1"}],
        [{"name": "OUTPUT0"}],
        [{"name": "OUTPUT1"}, {"name": "OUTPUT0"}],
    ],
    ids=["only_output1", "only_output0", "both_reversed"],
)
def test_requested_output_subset_json(servers: dict[str, ServerProcess], outputs: list[dict[str, Any]]) -> None:
    body = {"inputs": ADD_SUB_INPUTS, "outputs": outputs}
    decoded = assert_same_json_infer(both(servers, "POST", "/v2/models/add_sub/infer", json=body))
    assert sorted(decoded["outputs"]) == sorted(o["name"] for o in outputs)


@pytest.mark.parametrize("names", [["OUTPUT1", "OUTPUT0"], ["OUTPUT0", "OUTPUT0"], ["OUTPUT1", "OUTPUT0", "OUTPUT1"]],
                         ids=["reversed", "twice", "reversed_and_twice"])
def test_requested_outputs_come_in_the_models_order_once_each(servers: dict[str, ServerProcess],
                                                               names: list[str]) -> None:
    body = {"inputs": ADD_SUB_INPUTS, "outputs": [{"name": name} for name in names]}
    answers = both(servers, "POST", "/v2/models/add_sub/infer", json=body)
    order = {name: [output["name"] for output in json_body(answer)["outputs"]] for name, answer in answers.items()}
    assert order["transerve"] == order["triton"] == [name for name in ("OUTPUT0", "OUTPUT1") if name in names]


@pytest.mark.parametrize(
    ("request_parameters", "outputs"),
    [
        ({}, [{"name": "OUTPUT0", "parameters": {"binary_data": True}}]),
        ({}, [{"name": "OUTPUT0", "parameters": {"binary_data": True}}, {"name": "OUTPUT1"}]),
        ({"binary_data_output": True}, None),
        ({"binary_data_output": True}, [{"name": "OUTPUT1"}]),
    ],
    ids=["one_binary", "mixed", "all_binary_by_default", "default_binary_with_listed_outputs"],
)
def test_requested_outputs_binary(
    servers: dict[str, ServerProcess], request_parameters: dict[str, Any], outputs: list[dict[str, Any]] | None
) -> None:
    """JSON inputs, binary (or mixed) outputs chosen per output or by the request's binary_data_output.

    Triton 2.51 applies binary_data_output only when the request lists no outputs: with a listed output that has
    no binary_data parameter, the answer is plain JSON, and transerve must agree.
    """
    body: dict[str, Any] = {"inputs": ADD_SUB_INPUTS}
    if request_parameters:
        body["parameters"] = request_parameters
    if outputs is not None:
        body["outputs"] = outputs
    responses = both(servers, "POST", "/v2/models/add_sub/infer", json=body)
    for name, response in responses.items():
        assert response.status_code == 200, f"{name}: {response.text[:500]}"
    has_binary = {name: "Inference-Header-Content-Length" in r.headers for name, r in responses.items()}
    assert has_binary["transerve"] == has_binary["triton"]
    assert_same_result(parse_infer_response(responses["transerve"]), parse_infer_response(responses["triton"]))


def test_binary_inputs_raw(servers: dict[str, ServerProcess]) -> None:
    """Binary inputs built by hand (not by tritonclient), answered in JSON because no binary output is asked."""
    a = np.array([[1, 2, 3, 4]], np.float32)
    b = np.array([[0.5, 0.5, 0.5, 0.5]], np.float32)
    header = {"inputs": [
        {"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "parameters": {"binary_data_size": 16}},
        {"name": "INPUT1", "shape": [1, 4], "datatype": "FP32", "parameters": {"binary_data_size": 16}},
    ]}
    responses = both(servers, "POST", "/v2/models/add_sub/infer", **binary_request(header, a.tobytes(), b.tobytes()))
    decoded = assert_same_json_infer(responses)
    np.testing.assert_array_equal(decoded["outputs"]["OUTPUT0"][2], a + b)


@pytest.mark.parametrize(
    "request_id", [None, "", "abc-123", "ünïcode 안녕"], ids=["absent", "empty", "ascii", "unicode"]
)
def test_id_echo(servers: dict[str, ServerProcess], request_id: str | None) -> None:
    body: dict[str, Any] = {"inputs": ADD_SUB_INPUTS}
    if request_id is not None:
        body["id"] = request_id
    responses = both(servers, "POST", "/v2/models/add_sub/infer", json=body)
    assert_same_json_infer(responses)
    assert ("id" in json_body(responses["transerve"])) == ("id" in json_body(responses["triton"]))


def test_versioned_infer_path(servers: dict[str, ServerProcess]) -> None:
    body = {"inputs": ADD_SUB_INPUTS}
    assert_same_json_infer(both(servers, "POST", "/v2/models/add_sub/versions/1/infer", json=body))


# -------------------------------------------------------------------------------- metadata and health


@pytest.mark.parametrize(
    "path",
    ["/v2/models/add_sub", "/v2/models/add_sub/versions/1", "/v2/models/identity", "/v2/models/strings",
     "/v2/models/params"],
)
def test_model_metadata(servers: dict[str, ServerProcess], path: str) -> None:
    """Model metadata is small and fully specified by KServe v2 plus Triton's choices (platform "python",
    shapes with -1 for the batch dimension), so it must match exactly."""
    responses = both(servers, "GET", path)
    assert responses["transerve"].status_code == responses["triton"].status_code == 200
    assert json_body(responses["transerve"]) == json_body(responses["triton"])


def config_key_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The parts of a model config that describe the model, leaving out auto-filled defaults (optimization,
    instance_group naming, pinned memory...) that are Triton implementation details."""

    def tensors(entries: list[dict[str, Any]]) -> list[tuple[str, str, list[int]]]:
        return [(t["name"], t["data_type"], [int(d) for d in t["dims"]]) for t in entries]

    return {
        "name": config["name"],
        "backend": config["backend"],
        "max_batch_size": config.get("max_batch_size", 0),
        "input": tensors(config["input"]),
        "output": tensors(config["output"]),
        "parameters": config.get("parameters", {}),
    }


@pytest.mark.parametrize("model", ["add_sub", "identity", "strings", "params"])
def test_model_config(servers: dict[str, ServerProcess], model: str) -> None:
    responses = both(servers, "GET", f"/v2/models/{model}/config")
    assert responses["transerve"].status_code == responses["triton"].status_code == 200
    assert config_key_fields(json_body(responses["transerve"])) == config_key_fields(json_body(responses["triton"]))


@pytest.mark.parametrize("body", [None, {}, {"ready": True}], ids=["no_body", "empty", "ready_only"])
def test_repository_index(servers: dict[str, ServerProcess], body: dict[str, Any] | None) -> None:
    responses = both(servers, "POST", "/v2/repository/index", json=body)
    assert responses["transerve"].status_code == responses["triton"].status_code == 200

    def by_name(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return sorted(entries, key=lambda e: (e["name"], e.get("version", "")))

    assert by_name(json_body(responses["transerve"])) == by_name(json_body(responses["triton"]))


EXERCISED_EXTENSIONS = {"binary_tensor_data", "parameters", "model_configuration", "model_repository",
                        "classification", "system_shared_memory"}
"""The extensions the differential tests use (classification and shared memory in their own files); a server must
advertise what it implements."""


def test_server_metadata(servers: dict[str, ServerProcess]) -> None:
    """Both are named "triton" (Triton's clients and tests check it); `version` is each implementation's, and Triton
    lists an extension transerve does not claim (cuda_shared_memory). Both advertise the extensions that the
    differential tests exercise."""
    responses = both(servers, "GET", "/v2")
    assert json_body(responses["transerve"])["name"] == json_body(responses["triton"])["name"] == "triton"
    for name, response in responses.items():
        assert response.status_code == 200, name
        metadata = json_body(response)
        assert set(metadata) == {"name", "version", "extensions"}, name
        assert metadata["name"] == "triton", name
        assert isinstance(metadata["version"], str) and metadata["version"], name
        assert all(isinstance(e, str) for e in metadata["extensions"]), name
        assert set(metadata["extensions"]) >= EXERCISED_EXTENSIONS, name


@pytest.mark.parametrize(
    "path",
    [
        "/v2/health/live",
        "/v2/health/ready",
        "/v2/models/add_sub/ready",
        "/v2/models/add_sub/versions/1/ready",
        "/v2/models/add_sub/versions/2/ready",
        "/v2/models/no_such_model/ready",
    ],
)
def test_readiness(servers: dict[str, ServerProcess], path: str) -> None:
    """Readiness is a status code; Triton 2.51 answers 400 (not 404) for an unknown model or version."""
    responses = both(servers, "GET", path)
    assert responses["transerve"].status_code == responses["triton"].status_code, (
        f"transerve {responses['transerve'].status_code} {responses['transerve'].text[:300]!r}, "
        f"triton {responses['triton'].status_code} {responses['triton'].text[:300]!r}"
    )


# ---------------------------------------------------------------------------------------- bad input


@dataclass(frozen=True)
class BadRequest:
    """One malformed request, Triton 2.51's status for it, and words of Triton's message that must appear."""

    id: str
    path: str
    status: int
    substrings: tuple[str, ...] = ()
    json: Any = None
    raw: dict[str, Any] = field(default_factory=dict)

    def kwargs(self) -> dict[str, Any]:
        return {"json": self.json} if self.json is not None else self.raw


_BIN16 = np.arange(4, dtype=np.float32).tobytes()


def _bin_input(name: str, size: int, shape: tuple[int, ...] = (1, 4)) -> dict[str, Any]:
    return {"name": name, "shape": list(shape), "datatype": "FP32", "parameters": {"binary_data_size": size}}


BAD_REQUESTS = [
    BadRequest("unknown_model", "/v2/models/no_such_model/infer", 404, ("unknown model", "'no_such_model'"),
               json={"inputs": ADD_SUB_INPUTS}),
    BadRequest("unknown_version", "/v2/models/add_sub/versions/2/infer", 404, ("unknown model", "version 2"),
               json={"inputs": ADD_SUB_INPUTS}),
    BadRequest("missing_input", "/v2/models/add_sub/infer", 400, ("expected 2 inputs but got 1 inputs", "INPUT1"),
               json={"inputs": ADD_SUB_INPUTS[:1]}),
    BadRequest("unexpected_extra_input", "/v2/models/add_sub/infer", 400, ("expected 2 inputs but got 3 inputs",),
               json={"inputs": [*ADD_SUB_INPUTS, fp32_input("INPUT9", [1, 4], [1, 2, 3, 4])]}),
    BadRequest("duplicate_input", "/v2/models/add_sub/infer", 400, ("input 'INPUT0' already exists",),
               json={"inputs": [ADD_SUB_INPUTS[0], *ADD_SUB_INPUTS]}),
    BadRequest("wrong_datatype", "/v2/models/add_sub/infer", 400, ("data-type is 'INT32'", "expects 'FP32'"),
               json={"inputs": [{**ADD_SUB_INPUTS[0], "datatype": "INT32"}, ADD_SUB_INPUTS[1]]}),
    BadRequest("shape_mismatch", "/v2/models/add_sub/infer", 400,
               ("unexpected shape for input 'INPUT0'", "expected [-1,4], got [1,5]"),
               json={"inputs": [fp32_input("INPUT0", [1, 5], [1, 2, 3, 4, 5]), ADD_SUB_INPUTS[1]]}),
    BadRequest("batch_over_max_batch_size", "/v2/models/add_sub/infer", 400, ("batch-size must be <= 8",),
               json={"inputs": [fp32_input(n, [9, 4], [1.0] * 36) for n in ("INPUT0", "INPUT1")]}),
    BadRequest("unknown_requested_output", "/v2/models/add_sub/infer", 400, ("unexpected inference output 'OUTPUT9'",),
               json={"inputs": ADD_SUB_INPUTS, "outputs": [{"name": "OUTPUT9"}]}),
    BadRequest("invalid_datatype_string", "/v2/models/add_sub/infer", 400, ("invalid datatype for input INPUT0",),
               json={"inputs": [{**ADD_SUB_INPUTS[0], "datatype": "FLOAT"}, ADD_SUB_INPUTS[1]]}),
    BadRequest("parameter_of_invalid_type", "/v2/models/params/infer", 400, ("parameter 'obj' has invalid type",),
               json={"parameters": {"obj": {"a": 1}}, "inputs": [fp32_input("INPUT0", [2], [1, 2])]}),
    # Binary extension. The declared sizes add up to the body, so only the per-input check can catch it.
    BadRequest("binary_byte_size_mismatch", "/v2/models/add_sub/infer", 400,
               ("input byte size mismatch for input 'INPUT0'", "expected 16, got 12"),
               raw=binary_request({"inputs": [_bin_input("INPUT0", 12), _bin_input("INPUT1", 16)]},
                                  _BIN16[:12], _BIN16)),
    BadRequest("binary_data_size_beyond_body", "/v2/models/add_sub/infer", 400, ("unexpected size for input 'INPUT1'",),
               raw=binary_request({"inputs": [_bin_input("INPUT0", 16), _bin_input("INPUT1", 1000)]},
                                  _BIN16, _BIN16)),
    BadRequest("binary_trailing_bytes", "/v2/models/add_sub/infer", 400, ("unexpected additional input data",),
               raw=binary_request({"inputs": [_bin_input("INPUT0", 16), _bin_input("INPUT1", 16)]},
                                  _BIN16, _BIN16, b"xxxx")),
    BadRequest("header_length_beyond_body", "/v2/models/add_sub/infer", 400,
               ("inference header size should be in range",),
               raw=binary_request({"inputs": [_bin_input("INPUT0", 16), _bin_input("INPUT1", 16)]},
                                  _BIN16, _BIN16, header_length=100000)),
    BadRequest("header_length_negative", "/v2/models/add_sub/infer", 400,
               ("inference header size should be in range",),
               raw=binary_request({"inputs": [_bin_input("INPUT0", 16), _bin_input("INPUT1", 16)]},
                                  _BIN16, _BIN16, header_length=-5)),
]


def assert_both_alive(servers: dict[str, ServerProcess]) -> None:
    for name, server in servers.items():
        assert server.alive(), f"{name} did not survive the request\n--- log tail ---\n{server.log_tail()}"


def error_message(response: requests.Response) -> str:
    body = json_body(response)
    assert isinstance(body, dict) and isinstance(body.get("error"), str), body
    return body["error"]


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=lambda c: c.id)
def test_bad_input_same_answer(servers: dict[str, ServerProcess], case: BadRequest) -> None:
    responses = both(servers, "POST", case.path, **case.kwargs())
    assert responses["triton"].status_code == case.status, f"the reference changed: {responses['triton'].text}"
    assert responses["transerve"].status_code == case.status, responses["transerve"].text[:500]
    for name, response in responses.items():
        message = error_message(response).lower()
        for substring in case.substrings:
            assert substring.lower() in message, f"{name}: {substring!r} not in {message!r}"
    assert_both_alive(servers)


# Known, deliberate divergences: Triton 2.51 answers each of these with 500 because its JSON parsing errors
# surface as INTERNAL; transerve answers 400, because the mistake is the client's and only a bug may produce a
# 500 there. `status` is transerve's answer; Triton's 500 is asserted too, so a Triton upgrade that fixes it shows.
DELIBERATE_DIVERGENCES = [
    BadRequest("malformed_json", "/v2/models/add_sub/infer", 400, raw={"data": b'{"inputs": ['}),
    BadRequest("missing_inputs_key", "/v2/models/add_sub/infer", 400, json={"id": "x"}),
    BadRequest("missing_name_key", "/v2/models/add_sub/infer", 400,
               json={"inputs": [{k: v for k, v in ADD_SUB_INPUTS[0].items() if k != "name"}, ADD_SUB_INPUTS[1]]}),
    BadRequest("missing_shape_key", "/v2/models/add_sub/infer", 400,
               json={"inputs": [{k: v for k, v in ADD_SUB_INPUTS[0].items() if k != "shape"}, ADD_SUB_INPUTS[1]]}),
    BadRequest("missing_datatype_key", "/v2/models/add_sub/infer", 400,
               json={"inputs": [{k: v for k, v in ADD_SUB_INPUTS[0].items() if k != "datatype"}, ADD_SUB_INPUTS[1]]}),
    BadRequest("data_shorter_than_shape", "/v2/models/add_sub/infer", 400,
               json={"inputs": [fp32_input("INPUT0", [1, 4], [1, 2, 3]), ADD_SUB_INPUTS[1]]}),
    BadRequest("data_longer_than_shape", "/v2/models/add_sub/infer", 400,
               json={"inputs": [fp32_input("INPUT0", [1, 4], [1, 2, 3, 4, 5]), ADD_SUB_INPUTS[1]]}),
    BadRequest("non_numeric_data", "/v2/models/add_sub/infer", 400,
               json={"inputs": [fp32_input("INPUT0", [1, 4], [1, "x", 3, 4]), ADD_SUB_INPUTS[1]]}),
    BadRequest("negative_shape", "/v2/models/add_sub/infer", 400,
               json={"inputs": [fp32_input("INPUT0", [-1, 4], [1, 2, 3, 4]), ADD_SUB_INPUTS[1]]}),
]


@pytest.mark.parametrize("case", DELIBERATE_DIVERGENCES, ids=lambda c: c.id)
def test_bad_input_deliberate_divergence(servers: dict[str, ServerProcess], case: BadRequest) -> None:
    """Known, deliberate divergence: Triton 2.51 answers these malformed requests with 500 (its JSON parser's
    errors surface as INTERNAL), transerve with 400, because a client's mistake is not a server failure and in
    transerve only a bug may produce a 500. Both must answer with a JSON error and stay alive."""
    responses = both(servers, "POST", case.path, **case.kwargs())
    assert responses["triton"].status_code == 500, f"the reference changed: {responses['triton'].text}"
    assert responses["transerve"].status_code == case.status, responses["transerve"].text[:500]
    for response in responses.values():
        error_message(response)
    assert_both_alive(servers)


def test_fp16_in_json_is_accepted_where_triton_refuses(servers: dict[str, ServerProcess]) -> None:
    """Deliberate divergence: Triton 2.51 refuses FP16 values in JSON (400, "use the binary data format");
    transerve accepts them, since JSON numbers convert to FP16 without ambiguity. Binary FP16 is compared
    against Triton in the datatype tests above."""
    body = {"inputs": [{"name": "INPUT_FP16", "shape": [1, 2], "datatype": "FP16", "data": [1.5, 2]}]}
    responses = both(servers, "POST", "/v2/models/identity/infer", json=body)
    assert responses["triton"].status_code == 400, f"the reference changed: {responses['triton'].text}"
    assert "receiving FP16 data via JSON is not supported" in error_message(responses["triton"])
    answer = responses["transerve"]
    assert answer.status_code == 200, answer.text[:500]
    expected = {"name": "OUTPUT_FP16", "datatype": "FP16", "shape": [1, 2], "data": [1.5, 2.0]}
    assert answer.json()["outputs"] == [expected]
    assert_both_alive(servers)


def test_bytes_that_are_not_utf8_asked_for_as_json(servers: dict[str, ServerProcess]) -> None:
    """Triton 2.51 writes them into the JSON as they are, which tritonclient then fails to decode (L0_string_io
    counts on an error there); transerve refuses with a 400 that says what to do instead."""
    raw = np.array([b"ok", b"\xfa\x03 not utf-8"], dtype=np.object_).reshape(1, 2)
    errors = {}
    for name, server in servers.items():
        client = httpclient.InferenceServerClient(server.http_url, network_timeout=TIMEOUT_S)
        with pytest.raises(InferenceServerException) as refused:
            client.infer("identity", [make_input("INPUT_STRING", raw, "BYTES", binary=True)],
                         outputs=[httpclient.InferRequestedOutput("OUTPUT_STRING", binary_data=False)])
        errors[name] = refused.value.message()
        assert name != "transerve" or refused.value.status() == "400"
    assert "Failed to encode using UTF-8" in errors["triton"]
    assert errors["transerve"] == ("output 'OUTPUT_STRING' holds bytes that are not valid UTF-8, which JSON cannot "
                                   "carry: request it with binary_data")
    for name, server in servers.items():  # asked for in binary, the bytes come back as they went
        client = httpclient.InferenceServerClient(server.http_url, network_timeout=TIMEOUT_S)
        result = client.infer("identity", [make_input("INPUT_STRING", raw, "BYTES", binary=True)],
                              outputs=[httpclient.InferRequestedOutput("OUTPUT_STRING", binary_data=True)])
        np.testing.assert_array_equal(result.as_numpy("OUTPUT_STRING"), raw, err_msg=name)
