"""The gRPC frontend end to end: a real transerve process, driven by tritonclient.grpc (sync, callbacks, aio and
streams) and by raw stubs where a client library would hide what is on the wire.

Comparisons against the real Triton live in test_differential_grpc.py; this file checks transerve's own promises:
every RPC answers, every datatype round-trips, errors carry Triton's status codes, the same bad input gets the
same error category over gRPC as over HTTP, and the server's lifecycle (explicit control, shutdown) holds.
"""

from __future__ import annotations

import asyncio
import json
import queue
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import ml_dtypes
import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from google.protobuf import json_format
from support import ServerProcess, start_transerve
from support.grpc_tensors import TYPED_FIELDS, suffix
from support.repositories import copy_example, write_model
from support.servers import free_ports, transerve_argv
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

TIMEOUT_S = 30.0
"""Per request; generous for a loaded 2-core CI machine, yet a hung server fails the test instead of the job."""

# Values at each type's edges; BYTES with non-ASCII, empty and non-UTF-8 elements. Floats include NaN and
# infinities, which only a binary protocol can carry.
VALUES: dict[str, np.ndarray] = {
    "BOOL": np.array([True, False, True]),
    "UINT8": np.array([0, 1, 255], np.uint8),
    "UINT16": np.array([0, 1, 65535], np.uint16),
    "UINT32": np.array([0, 1, 2**32 - 1], np.uint32),
    "UINT64": np.array([0, 1, 2**64 - 1], np.uint64),
    "INT8": np.array([-128, 0, 127], np.int8),
    "INT16": np.array([-(2**15), 0, 2**15 - 1], np.int16),
    "INT32": np.array([-(2**31), 0, 2**31 - 1], np.int32),
    "INT64": np.array([-(2**63), 0, 2**63 - 1], np.int64),
    "FP16": np.array([0.0, -0.0, 1.5, 65504.0, -6e-8, np.inf, np.nan], np.float16),
    "FP32": np.array([0.0, -0.0, 1.1, -3.4e38, 1e-45, np.inf, np.nan], np.float32),
    "FP64": np.array([0.0, -0.1, 1e300, 5e-324, -np.inf, np.nan], np.float64),
    "BYTES": np.array([b"", "héllo wörld".encode(), "안녕하세요".encode(), "😀".encode(), b"\x00\xff raw", b""],
                      dtype=np.object_),
}

ADD_SUB_A = np.array([[1, 2, 3, 4]], np.float32)
ADD_SUB_B = np.array([[0.5, 0.5, 0.5, 0.5]], np.float32)


def make_input(name: str, values: np.ndarray, datatype: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(values.shape), datatype)
    tensor.set_data_from_numpy(values)
    return tensor


def add_sub_inputs(a: np.ndarray = ADD_SUB_A, b: np.ndarray = ADD_SUB_B) -> list[grpcclient.InferInput]:
    return [make_input("INPUT0", a, "FP32"), make_input("INPUT1", b, "FP32")]


def raw_add_sub(model: str = "add_sub", request_id: str = "", **fields: Any) -> service_pb2.ModelInferRequest:
    """An add_sub request built by hand, raw contents in input order."""
    tensor = service_pb2.ModelInferRequest.InferInputTensor
    message = service_pb2.ModelInferRequest(
        model_name=model, id=request_id,
        inputs=[tensor(name="INPUT0", datatype="FP32", shape=[1, 4]),
                tensor(name="INPUT1", datatype="FP32", shape=[1, 4])],
        **fields,
    )
    message.raw_input_contents.extend([ADD_SUB_A.tobytes(), ADD_SUB_B.tobytes()])
    return message


def status_of(exc: InferenceServerException) -> str:
    """tritonclient reports the gRPC status as 'StatusCode.NAME'; the name alone reads better in assertions."""
    return str(exc.status()).removeprefix("StatusCode.")


@pytest.fixture(scope="module")
def client(transerve_server: ServerProcess) -> Iterator[grpcclient.InferenceServerClient]:
    with grpcclient.InferenceServerClient(transerve_server.grpc_url) as grpc_client:
        yield grpc_client


@pytest.fixture(scope="module")
def stub(transerve_server: ServerProcess) -> Iterator[service_pb2_grpc.GRPCInferenceServiceStub]:
    with grpc.insecure_channel(transerve_server.grpc_url) as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


# --------------------------------------------------------------------------------------- health and metadata


def test_liveness_and_readiness(client: grpcclient.InferenceServerClient) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("add_sub")
    assert client.is_model_ready("add_sub", "1")
    assert not client.is_model_ready("add_sub", "2")
    assert not client.is_model_ready("no_such_model")


def test_model_ready_with_a_version_that_is_not_a_number(client: grpcclient.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException) as caught:
        client.is_model_ready("add_sub", "latest")
    assert status_of(caught.value) == "INVALID_ARGUMENT"


@pytest.mark.parametrize("service", [b"", b"inference.GRPCInferenceService", b"anything"])
def test_grpc_health_check(transerve_server: ServerProcess, service: bytes) -> None:
    """grpc.health.v1.Health/Check, encoded by hand: field 1 (service, a string) in, field 1 (status) out."""
    request = bytes([0x0A, len(service)]) + service if service else b""
    with grpc.insecure_channel(transerve_server.grpc_url) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        assert check(request, timeout=TIMEOUT_S) == b"\x08\x01"  # SERVING


def test_server_metadata(client: grpcclient.InferenceServerClient) -> None:
    metadata = client.get_server_metadata()
    assert metadata.name == "triton" and metadata.version  # the name Triton's clients and tests expect
    assert {"binary_tensor_data", "statistics", "model_repository", "model_configuration"} <= set(metadata.extensions)


@pytest.mark.parametrize("model", ["add_sub", "identity", "strings", "params"])
def test_model_metadata_and_config_match_http(
    transerve_server: ServerProcess, client: grpcclient.InferenceServerClient, model: str
) -> None:
    """The two frontends describe a model identically: the HTTP JSON parses into the very gRPC message."""
    http_metadata = requests.get(f"{transerve_server.base_url}/v2/models/{model}", timeout=TIMEOUT_S).json()
    assert client.get_model_metadata(model) == json_format.ParseDict(http_metadata,
                                                                       service_pb2.ModelMetadataResponse())
    assert client.get_model_metadata(model, "1") == client.get_model_metadata(model)
    http_config = requests.get(f"{transerve_server.base_url}/v2/models/{model}/config", timeout=TIMEOUT_S).json()
    assert client.get_model_config(model).config == json_format.ParseDict(http_config, model_config_pb2.ModelConfig())


@pytest.mark.parametrize(
    ("call", "status"),
    [
        (lambda c: c.get_model_metadata("no_such_model"), "NOT_FOUND"),
        (lambda c: c.get_model_metadata("add_sub", "2"), "NOT_FOUND"),
        (lambda c: c.get_model_config("no_such_model"), "NOT_FOUND"),
        (lambda c: c.get_model_config("add_sub", "x1"), "INVALID_ARGUMENT"),
        (lambda c: c.get_inference_statistics("add_sub", "x1"), "INVALID_ARGUMENT"),
        (lambda c: c.load_model("add_sub"), "UNAVAILABLE"),  # this server polls nothing but is not explicit
        (lambda c: c.unload_model("add_sub"), "UNAVAILABLE"),
    ],
    ids=["metadata_unknown_model", "metadata_unknown_version", "config_unknown_model", "config_bad_version",
         "statistics_bad_version", "load_without_explicit_control", "unload_without_explicit_control"],
)
def test_metadata_and_control_errors(client: grpcclient.InferenceServerClient, call: Any, status: str) -> None:
    with pytest.raises(InferenceServerException) as caught:
        call(client)
    assert status_of(caught.value) == status, caught.value.message()


def test_statistics(transerve_server: ServerProcess, client: grpcclient.InferenceServerClient) -> None:
    client.infer("add_sub", add_sub_inputs())
    stats = client.get_inference_statistics("add_sub").model_stats
    assert [(s.name, s.version) for s in stats] == [("add_sub", "1")]
    assert stats[0].inference_count >= 1 and stats[0].inference_stats.success.count >= 1
    assert stats[0].inference_stats.success.ns > 0 and stats[0].last_inference > 0
    assert {s.name for s in client.get_inference_statistics().model_stats} >= {"add_sub", "identity", "strings"}
    # Same numbers as HTTP: nothing else runs between the two calls.
    http_stats = requests.get(f"{transerve_server.base_url}/v2/models/add_sub/stats", timeout=TIMEOUT_S).json()
    assert client.get_inference_statistics("add_sub") == json_format.ParseDict(
        http_stats, service_pb2.ModelStatisticsResponse())


def test_repository_index(transerve_server: ServerProcess, client: grpcclient.InferenceServerClient) -> None:
    index = client.get_model_repository_index()
    assert {(m.name, m.version, m.state) for m in index.models} >= {("add_sub", "1", "READY"),
                                                                    ("identity", "1", "READY")}
    http_index = requests.post(f"{transerve_server.base_url}/v2/repository/index", timeout=TIMEOUT_S).json()
    assert index == json_format.ParseDict({"models": http_index}, service_pb2.RepositoryIndexResponse())


def test_repository_name_is_not_supported(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        stub.RepositoryIndex(service_pb2.RepositoryIndexRequest(repository_name="other"), timeout=TIMEOUT_S)
    assert caught.value.code() is grpc.StatusCode.UNIMPLEMENTED


# ------------------------------------------------------------------------------------------------ inference


def test_infer_sync(client: grpcclient.InferenceServerClient) -> None:
    result = client.infer("add_sub", add_sub_inputs(), request_id="sync-1")
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), ADD_SUB_A + ADD_SUB_B)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), ADD_SUB_A - ADD_SUB_B)
    response = result.get_response()
    assert (response.id, response.model_name, response.model_version) == ("sync-1", "add_sub", "1")
    assert [(o.name, o.datatype, list(o.shape)) for o in response.outputs] == [
        ("OUTPUT0", "FP32", [1, 4]), ("OUTPUT1", "FP32", [1, 4])]
    assert len(response.raw_output_contents) == 2  # outputs always travel raw, as in Triton


def test_infer_versioned_and_requested_outputs(client: grpcclient.InferenceServerClient) -> None:
    result = client.infer("add_sub", add_sub_inputs(), model_version="1",
                          outputs=[grpcclient.InferRequestedOutput("OUTPUT1")])
    assert [o.name for o in result.get_response().outputs] == ["OUTPUT1"]
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), ADD_SUB_A - ADD_SUB_B)


def test_async_infer_with_callbacks(client: grpcclient.InferenceServerClient) -> None:
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    for i in range(8):
        client.async_infer("add_sub", add_sub_inputs(np.full((1, 4), i, np.float32)),
                           callback=lambda result, error: answers.put((result, error)), request_id=f"cb-{i}")
    seen = {}
    for _ in range(8):
        result, error = answers.get(timeout=TIMEOUT_S)
        assert error is None, error
        seen[result.get_response().id] = result.as_numpy("OUTPUT0")
    for i in range(8):
        np.testing.assert_array_equal(seen[f"cb-{i}"], np.full((1, 4), i, np.float32) + ADD_SUB_B)


def test_aio_client_concurrent(transerve_server: ServerProcess) -> None:
    """Sixty-four concurrent requests on one aio client: each answer must belong to its own request."""

    async def run() -> list[Any]:
        async with grpcaio.InferenceServerClient(transerve_server.grpc_url) as aio_client:
            assert await aio_client.is_server_ready()
            calls = [aio_client.infer("add_sub", add_sub_inputs(np.full((1, 4), i, np.float32)), request_id=str(i))
                     for i in range(64)]
            return await asyncio.wait_for(asyncio.gather(*calls), TIMEOUT_S)

    for i, result in enumerate(asyncio.run(run())):
        assert result.get_response().id == str(i)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), np.full((1, 4), i, np.float32) - ADD_SUB_B)


def test_a_burst_of_calls_on_one_connection_is_served_not_cancelled(transerve_server: ServerProcess) -> None:
    """Thousands of calls arriving at once on one channel all get answers, as from Triton. (With gRPC core's
    default pending-call limits, a grpc.aio server cancels whatever exceeds about a thousand.)"""

    async def run() -> list[Any]:
        async with grpc.aio.insecure_channel(transerve_server.grpc_url) as channel:
            call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
            message = raw_add_sub().SerializeToString()
            return await asyncio.wait_for(
                asyncio.gather(*(call(message) for _ in range(4000)), return_exceptions=True), 120)

    outcomes = asyncio.run(run())
    failures = [o for o in outcomes if isinstance(o, Exception)]
    assert not failures, f"{len(failures)} of {len(outcomes)} failed, e.g. {failures[0]!r}"


@pytest.mark.parametrize("datatype", sorted(VALUES))
def test_identity_every_datatype_raw(client: grpcclient.InferenceServerClient, datatype: str) -> None:
    values = VALUES[datatype].reshape(1, -1)
    result = client.infer("identity", [make_input(f"INPUT_{suffix(datatype)}", values, datatype)])
    output = result.get_response().outputs[0]
    assert (output.name, output.datatype, list(output.shape)) == (f"OUTPUT_{suffix(datatype)}", datatype,
                                                                   list(values.shape))
    got = result.as_numpy(f"OUTPUT_{suffix(datatype)}")
    assert got.dtype == values.dtype
    np.testing.assert_array_equal(got, values)


def test_identity_all_datatypes_in_one_request_and_empty_tensors(client: grpcclient.InferenceServerClient) -> None:
    arrays = {dt: np.resize(values, (2, 3)) for dt, values in VALUES.items()}
    arrays["INT32"] = np.zeros((2, 0), np.int32)
    result = client.infer("identity", [make_input(f"INPUT_{suffix(dt)}", v, dt) for dt, v in arrays.items()])
    for datatype, values in arrays.items():
        np.testing.assert_array_equal(result.as_numpy(f"OUTPUT_{suffix(datatype)}"), values, err_msg=datatype)


@pytest.mark.parametrize("datatype", sorted(TYPED_FIELDS))
def test_identity_typed_contents(stub: service_pb2_grpc.GRPCInferenceServiceStub, datatype: str) -> None:
    """Typed `contents` in, raw out: the answer's bytes are the values in the datatype's own encoding."""
    values = VALUES[datatype]
    if datatype.startswith("FP"):
        values = values[np.isfinite(values)]
    message = service_pb2.ModelInferRequest(model_name="identity")
    tensor = message.inputs.add(name=f"INPUT_{suffix(datatype)}", datatype=datatype, shape=[1, len(values)])
    getattr(tensor.contents, TYPED_FIELDS[datatype]).extend(values.tolist())
    response = stub.ModelInfer(message, timeout=TIMEOUT_S)
    assert response.outputs[0].datatype == datatype and list(response.outputs[0].shape) == [1, len(values)]
    expected = (b"".join(len(v).to_bytes(4, "little") + v for v in values) if datatype == "BYTES"
                else values.tobytes())
    assert response.raw_output_contents[0] == expected


@pytest.mark.parametrize(
    "parameters",
    [{}, {"scale": 3}, {"scale": 0.5, "label": "héllo 안녕 😀"},
     {"flag": True, "off": False, "negative": -7, "empty": ""}],
    ids=["none", "int", "double_and_string", "mixed"],
)
def test_request_parameters_reach_the_model(client: grpcclient.InferenceServerClient, parameters: dict) -> None:
    result = client.infer("params", [make_input("INPUT0", np.array([1, 2], np.float32), "FP32")],
                          parameters=parameters)
    echo = json.loads(result.as_numpy("PARAMETERS")[0])
    assert echo == {"config": {"greeting": "hello", "scale": "2.0"}, "request": parameters}
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), [float(parameters.get("scale", 2.0)) * x for x in (1, 2)])


def test_uint64_parameter_and_protocol_parameters(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    """uint64_param reaches the model as an exact integer; sequence/priority/timeout are the protocol's, not the
    model's, so they do not show up among its parameters."""
    message = service_pb2.ModelInferRequest(model_name="params")
    message.inputs.add(name="INPUT0", datatype="FP32", shape=[1])
    message.raw_input_contents.append(np.float32(1).tobytes())
    message.parameters["big"].uint64_param = 2**64 - 1
    message.parameters["priority"].uint64_param = 1
    message.parameters["timeout"].int64_param = 10_000_000
    message.parameters["sequence_id"].int64_param = 9
    response = stub.ModelInfer(message, timeout=TIMEOUT_S)
    echo = json.loads(response.raw_output_contents[1][4:])
    assert echo["request"] == {"big": 2**64 - 1}


def test_message_larger_than_grpc_default_limit(client: grpcclient.InferenceServerClient) -> None:
    """gRPC's default limit is 4 MiB per message; Triton (and transerve) accept up to INT32_MAX."""
    values = np.arange(3 * 1024 * 1024, dtype=np.float32).reshape(1, -1)  # 12 MiB each way
    result = client.infer("identity", [make_input("INPUT_FP32", values, "FP32")], client_timeout=120)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT_FP32"), values)


# ---------------------------------------------------------------------------------------------------- streams


def test_stream_answers_in_order_and_survives_errors(client: grpcclient.InferenceServerClient) -> None:
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for i in range(6):
            model = "no_such_model" if i == 2 else "add_sub"
            inputs = add_sub_inputs(np.full((1, 4), i, np.float32))
            if i == 4:  # wrong datatype: the core's validation, answered on the stream
                inputs = [make_input("INPUT0", np.full((1, 4), i, np.int32), "INT32"), inputs[1]]
            client.async_stream_infer(model, inputs, request_id=f"s-{i}")
        received = [answers.get(timeout=TIMEOUT_S) for _ in range(6)]
    finally:
        client.stop_stream()
    for i, (result, error) in enumerate(received):
        if i == 2:
            assert result is None and "Request for unknown model: 'no_such_model' is not found" in error.message()
        elif i == 4:
            assert result is None and "data-type is 'INT32', but model 'add_sub' expects 'FP32'" in error.message()
        else:
            assert error is None, error
            assert result.get_response().id == f"s-{i}"
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.full((1, 4), i, np.float32) + ADD_SUB_B)


def test_stream_many_requests_in_flight_stay_in_order(transerve_server: ServerProcess) -> None:
    """Two hundred requests written without waiting, with a bad one every tenth: answers come back one per
    request, in request order, and the stream stays open after each error."""

    async def run() -> list[service_pb2.ModelStreamInferResponse]:
        async with grpc.aio.insecure_channel(transerve_server.grpc_url) as channel:
            call = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(timeout=TIMEOUT_S)
            for i in range(200):
                await call.write(raw_add_sub("no_such_model" if i % 10 == 9 else "add_sub", request_id=str(i)))
            await call.done_writing()
            return [answer async for answer in call]

    answers = asyncio.run(run())
    assert len(answers) == 200
    for i, answer in enumerate(answers):
        if i % 10 == 9:
            assert "unknown model" in answer.error_message and not answer.infer_response.outputs
        else:
            assert answer.error_message == "" and answer.infer_response.id == str(i)


def test_aio_client_stream_infer(transerve_server: ServerProcess) -> None:
    async def run() -> list[tuple[Any, Any]]:
        async with grpcaio.InferenceServerClient(transerve_server.grpc_url) as aio_client:

            async def requests_iterator() -> Any:
                for i in range(5):
                    yield {"model_name": "add_sub", "inputs": add_sub_inputs(np.full((1, 4), i, np.float32)),
                           "request_id": f"aio-{i}"}

            return [item async for item in aio_client.stream_infer(requests_iterator(), stream_timeout=TIMEOUT_S)]

    received = asyncio.run(run())
    assert [result.get_response().id for result, error in received] == [f"aio-{i}" for i in range(5)]
    assert all(error is None for _, error in received)


# ------------------------------------------------------------------------------------------------ bad input


def grpc_code(stub: service_pb2_grpc.GRPCInferenceServiceStub, message: service_pb2.ModelInferRequest) -> str:
    with pytest.raises(grpc.RpcError) as caught:
        stub.ModelInfer(message, timeout=TIMEOUT_S)
    return caught.value.code().name


def _with(message: service_pb2.ModelInferRequest, edit: Any) -> service_pb2.ModelInferRequest:
    edit(message)
    return message


def _fp32_json(name: str, shape: list[int], data: list[float]) -> dict[str, Any]:
    return {"name": name, "shape": shape, "datatype": "FP32", "data": data}


_JSON_INPUTS = [_fp32_json("INPUT0", [1, 4], [1, 2, 3, 4]), _fp32_json("INPUT1", [1, 4], [0.5] * 4)]

# The same mistake sent over both protocols: (id, HTTP path, HTTP JSON body, gRPC request).
SAME_MISTAKES = [
    ("unknown_model", "/v2/models/no_such_model/infer", {"inputs": _JSON_INPUTS}, raw_add_sub("no_such_model")),
    ("unknown_version", "/v2/models/add_sub/versions/2/infer", {"inputs": _JSON_INPUTS},
     raw_add_sub(model_version="2")),
    ("missing_input", "/v2/models/add_sub/infer", {"inputs": _JSON_INPUTS[:1]},
     _with(raw_add_sub(), lambda m: (m.inputs.pop(), m.raw_input_contents.pop()))),
    ("wrong_datatype", "/v2/models/add_sub/infer",
     {"inputs": [{**_JSON_INPUTS[0], "datatype": "INT32"}, _JSON_INPUTS[1]]},
     _with(raw_add_sub(), lambda m: setattr(m.inputs[0], "datatype", "INT32"))),
    ("invalid_datatype", "/v2/models/add_sub/infer",
     {"inputs": [{**_JSON_INPUTS[0], "datatype": "FLOAT"}, _JSON_INPUTS[1]]},
     _with(raw_add_sub(), lambda m: setattr(m.inputs[0], "datatype", "FLOAT"))),
    ("shape_mismatch", "/v2/models/add_sub/infer",
     {"inputs": [_fp32_json("INPUT0", [1, 2], [1, 2]), _fp32_json("INPUT1", [1, 2], [1, 2])]},
     _with(raw_add_sub(), lambda m: [(t.ClearField("shape"), t.shape.extend([2, 2])) for t in m.inputs])),
    ("batch_over_max", "/v2/models/add_sub/infer",
     {"inputs": [_fp32_json(n, [9, 4], [1.0] * 36) for n in ("INPUT0", "INPUT1")]},
     _with(raw_add_sub(), lambda m: ([(t.ClearField("shape"), t.shape.extend([9, 4])) for t in m.inputs],
                                     m.ClearField("raw_input_contents"),
                                     m.raw_input_contents.extend([b"\0" * 144] * 2)))),
    ("unknown_output", "/v2/models/add_sub/infer", {"inputs": _JSON_INPUTS, "outputs": [{"name": "OUTPUT9"}]},
     _with(raw_add_sub(), lambda m: m.outputs.add(name="OUTPUT9"))),
    ("duplicate_input", "/v2/models/add_sub/infer", {"inputs": [_JSON_INPUTS[0], *_JSON_INPUTS]},
     _with(raw_add_sub(), lambda m: (m.inputs.insert(0, m.inputs[0]),
                                     m.raw_input_contents.insert(0, m.raw_input_contents[0])))),
    ("data_count", "/v2/models/add_sub/infer", {"inputs": [_fp32_json("INPUT0", [1, 4], [1, 2, 3]), _JSON_INPUTS[1]]},
     _with(raw_add_sub(), lambda m: m.raw_input_contents.__setitem__(0, b"\0" * 12))),
    ("65_dimensions", "/v2/models/add_sub/infer", {"inputs": [_fp32_json("INPUT0", [1] * 65, [1]), _JSON_INPUTS[1]]},
     _with(raw_add_sub(), lambda m: m.inputs[0].shape.extend([1] * 63))),
    ("classification_negative", "/v2/models/add_sub/infer",
     {"inputs": _JSON_INPUTS, "outputs": [{"name": "OUTPUT0", "parameters": {"classification": -2}}]},
     _with(raw_add_sub(), lambda m: m.outputs.add(name="OUTPUT0").parameters["classification"].CopyFrom(
         service_pb2.InferParameter(int64_param=-2)))),
]

#: Triton's correspondence between HTTP statuses and gRPC codes (both derive from one TRITONSERVER error code).
HTTP_TO_GRPC = {400: "INVALID_ARGUMENT", 404: "NOT_FOUND", 500: "INTERNAL", 501: "UNIMPLEMENTED", 503: "UNAVAILABLE"}


@pytest.mark.parametrize(("path", "body", "message"), [case[1:] for case in SAME_MISTAKES],
                         ids=[case[0] for case in SAME_MISTAKES])
def test_same_error_category_over_http_and_grpc(
    transerve_server: ServerProcess, stub: service_pb2_grpc.GRPCInferenceServiceStub, path: str,
    body: dict[str, Any], message: service_pb2.ModelInferRequest,
) -> None:
    http = requests.post(transerve_server.base_url + path, json=body, timeout=TIMEOUT_S)
    assert http.status_code != 200
    assert grpc_code(stub, message) == HTTP_TO_GRPC[http.status_code], http.text


@pytest.mark.parametrize(
    ("message", "code"),
    [
        (service_pb2.ModelInferRequest(model_name="add_sub"), "INVALID_ARGUMENT"),
        (_with(raw_add_sub(), lambda m: m.raw_input_contents.pop()), "INVALID_ARGUMENT"),
        (_with(raw_add_sub(), lambda m: m.inputs[0].contents.fp32_contents.extend([1, 2, 3, 4])), "INVALID_ARGUMENT"),
        (_with(raw_add_sub(), lambda m: m.parameters["triton_x"].CopyFrom(service_pb2.InferParameter(bool_param=1))),
         "INVALID_ARGUMENT"),
        (_with(raw_add_sub(), lambda m: m.inputs[0].parameters["shared_memory_region"].CopyFrom(
            service_pb2.InferParameter(string_param="never_registered"))), "NOT_FOUND"),
    ],
    ids=["no_inputs", "raw_missing_for_one_input", "raw_and_typed", "reserved_parameter", "unknown_region"],
)
def test_grpc_only_mistakes(stub: service_pb2_grpc.GRPCInferenceServiceStub, message: Any, code: str) -> None:
    assert grpc_code(stub, message) == code
    assert stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=TIMEOUT_S).live


# --------------------------------------------------------------------------------------- server lifecycle


def test_explicit_model_control_over_grpc(tmp_path: Path) -> None:
    repo = copy_example(tmp_path, "add_sub", "params")
    with start_transerve(repo, "--model-control-mode=explicit") as server, \
            grpcclient.InferenceServerClient(server.grpc_url) as control, \
            grpc.insecure_channel(server.grpc_url) as channel:
        raw_stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        assert {m.name: m.state for m in control.get_model_repository_index().models} == {"add_sub": "",
                                                                                          "params": ""}
        assert not control.is_model_ready("add_sub")
        control.load_model("add_sub")
        assert control.is_model_ready("add_sub")
        np.testing.assert_array_equal(control.infer("add_sub", add_sub_inputs()).as_numpy("OUTPUT0"),
                                      ADD_SUB_A + ADD_SUB_B)
        ready = raw_stub.RepositoryIndex(service_pb2.RepositoryIndexRequest(ready=True), timeout=TIMEOUT_S)
        assert [(m.name, m.state) for m in ready.models] == [("add_sub", "READY")]
        # A reload shows at once in the (cached) config and metadata answers.
        assert control.get_model_config("add_sub").config.max_batch_size == 8
        assert list(control.get_model_metadata("add_sub").inputs[0].shape) == [-1, 4]
        unbatched = {"backend": "python", "max_batch_size": 0, "instance_group": [{"count": 1, "kind": "KIND_CPU"}],
                     "input": [{"name": n, "data_type": "TYPE_FP32", "dims": [4]} for n in ("INPUT0", "INPUT1")],
                     "output": [{"name": n, "data_type": "TYPE_FP32", "dims": [4]} for n in ("OUTPUT0", "OUTPUT1")]}
        control.load_model("add_sub", config=json.dumps(unbatched))
        assert control.get_model_config("add_sub").config.max_batch_size == 0
        assert list(control.get_model_metadata("add_sub").inputs[0].shape) == [4]
        control.unload_model("add_sub")
        assert not control.is_model_ready("add_sub")
        with pytest.raises(InferenceServerException) as caught:
            control.infer("add_sub", add_sub_inputs())
        assert status_of(caught.value) == "NOT_FOUND"
        with pytest.raises(InferenceServerException) as caught:
            control.load_model("no_such_model")
        assert status_of(caught.value) == "INVALID_ARGUMENT" and "no_such_model" in caught.value.message()

        override = json.dumps({"backend": "python", "max_batch_size": 2,
                               "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
                               "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [-1]},
                                          {"name": "PARAMETERS", "data_type": "TYPE_STRING", "dims": [1]}],
                               "parameters": {"scale": {"string_value": "5"}}})
        control.load_model("params", config=override)
        assert control.get_model_config("params").config.max_batch_size == 2
        result = control.infer("params", [make_input("INPUT0", np.array([[1, 2]], np.float32), "FP32")])
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), [[5, 10]])

        message = service_pb2.RepositoryModelLoadRequest(model_name="params")
        message.parameters["config"].int64_param = 1
        with pytest.raises(grpc.RpcError) as raw_caught:
            raw_stub.RepositoryModelLoad(message, timeout=TIMEOUT_S)
        assert raw_caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT


def test_allow_grpc_false_leaves_the_port_closed(tmp_path: Path) -> None:
    repo = copy_example(tmp_path, "add_sub")
    with start_transerve(repo, "--allow-grpc=false") as server:
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", server.grpc_port), timeout=5).close()
        assert server.alive()


def test_a_busy_grpc_port_is_a_clear_startup_error(tmp_path: Path) -> None:
    repo = copy_example(tmp_path, "add_sub")
    http, grpc_port, metrics = free_ports(3)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", grpc_port))
        taken.listen()
        result = subprocess.run(transerve_argv(repo, http, grpc_port, metrics), capture_output=True, text=True,
                                timeout=120)
    assert result.returncode == 1
    assert "cannot listen for grpc" in result.stderr.lower()


BF16_ECHO_CONFIG = '''
name: "bf16_echo" backend: "python" max_batch_size: 0
input [ { name: "INPUT_BF16" data_type: TYPE_BF16 dims: [ -1 ] } ]
output [ { name: "OUTPUT_BF16" data_type: TYPE_BF16 dims: [ -1 ] } ]
'''

BF16_ECHO_MODEL = '''
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT_BF16", r.inputs()[0].as_numpy())])
                for r in requests]
'''


def test_bf16_raw_only(tmp_path: Path) -> None:
    """BF16 travels as raw bytes both ways; typed contents have no field for it, as in Triton. (Built by hand:
    tritonclient's BF16 numpy conventions changed across its versions.)"""
    write_model(tmp_path / "repo", "bf16_echo", BF16_ECHO_CONFIG, BF16_ECHO_MODEL)
    values = np.array([0.0, 1.0, -2.5, 0.0078125, 3.0e38, np.inf], ml_dtypes.bfloat16)
    with start_transerve(tmp_path / "repo") as server, grpc.insecure_channel(server.grpc_url) as channel:
        bf16 = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        message = service_pb2.ModelInferRequest(model_name="bf16_echo")
        message.inputs.add(name="INPUT_BF16", datatype="BF16", shape=[len(values)])
        message.raw_input_contents.append(values.tobytes())
        response = bf16.ModelInfer(message, timeout=TIMEOUT_S)
        assert [(o.name, o.datatype, list(o.shape)) for o in response.outputs] == [
            ("OUTPUT_BF16", "BF16", [len(values)])]
        assert response.raw_output_contents[0] == values.tobytes()
        message.ClearField("raw_input_contents")
        message.inputs[0].contents.fp32_contents.extend(values.astype(np.float32).tolist())
        with pytest.raises(grpc.RpcError) as caught:
            bf16.ModelInfer(message, timeout=TIMEOUT_S)
        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "of type 'FP32', expected datatype 'BF16'" in caught.value.details()


SLOW_MODEL = '''
import time, numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        time.sleep(1.0)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([7], np.int32))]) for _ in requests]
'''

SLOW_CONFIG = '''
name: "slow" backend: "python"
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
'''


def test_sigterm_answers_in_flight_grpc_requests_and_does_not_wait_for_idle_streams(tmp_path: Path) -> None:
    """An unary request inside the model when SIGTERM arrives still gets its answer; a stream the client keeps
    open without sending anything does not hold the exit for the whole exit timeout."""
    write_model(tmp_path / "repo", "slow", SLOW_CONFIG, SLOW_MODEL)
    with start_transerve(tmp_path / "repo", "--exit-timeout-secs=60") as server, \
            grpcclient.InferenceServerClient(server.grpc_url) as slow_client:
        slow_client.start_stream(callback=lambda result, error: None)  # idle: never sends a request
        answers: queue.Queue[Any] = queue.Queue()
        slow_client.async_infer("slow", [make_input("IN", np.array([1], np.int32), "INT32")],
                                callback=lambda result, error: answers.put(error or result))
        time.sleep(0.3)  # the request is inside execute() now
        stopped_at = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        answer = answers.get(timeout=TIMEOUT_S)
        assert not isinstance(answer, Exception), answer
        assert answer.as_numpy("OUT").tolist() == [7]
        assert server.process.wait(timeout=TIMEOUT_S) == 0
        assert time.monotonic() - stopped_at < 10
