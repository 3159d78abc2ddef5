"""Triton's classification extension (`classification: k` on a requested output, `class_count` in tritonclient)
end to end, against the real Triton 2.51: the same requests over HTTP and gRPC, the same answers.

The models live in `classification_models/`: python models that echo their input as outputs of several datatypes
and shapes, with and without batching and labels, a decoupled one and an ensemble whose output has labels of its
own. Deliberate divergences from Triton 2.51, each tested against transerve alone:
* a `classification` value that is not a non-negative integer in HTTP JSON is a 400 (Triton answers 500);
* classifying a BYTES output is a 400 (Triton 2.51 crashes);
* over gRPC, `classification` 0 is refused as Triton refuses it, but the message says "expected > 0" where
  Triton's says "expected >= 0".
"""

from __future__ import annotations

import queue
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from support import ServerProcess, require_triton, start_transerve, start_triton
from support.repositories import copy_model
from tritonclient.grpc import service_pb2, service_pb2_grpc

MODELS = Path(__file__).resolve().parent / "classification_models"
SHARED_CODE = {"cls_batched": MODELS / "echo_scores.py", "cls_plain": MODELS / "echo_scores.py"}
"""The models that differ only in their configs and labels, and their one model.py."""
TIMEOUT_S = 30.0

SCORES = [[0.1, 0.7, 0.2], [0.5, 0.25, 0.25]]
WIDE = [[1e30, -1e-30, 3.14159265]]


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("classification") / "models"
    for model in MODELS.iterdir():
        if model.is_dir():
            copy_model(model, repo / model.name, SHARED_CODE.get(model.name))
    return repo


@pytest.fixture(scope="module")
def transerve(repository: Path) -> Iterator[ServerProcess]:
    with start_transerve(repository) as server:
        yield server


@pytest.fixture(scope="module")
def servers(repository: Path, transerve: ServerProcess) -> Iterator[dict[str, ServerProcess]]:
    """transerve and the real Triton on the same models (skipped, failed under CI, without Triton)."""
    with start_triton(repository, install=require_triton()) as triton:
        yield {"triton": triton, "transerve": transerve}


def infer_body(model: str, data: list[list[float]], *outputs: dict[str, Any], input_name: str = "IN") -> dict:
    return {
        "inputs": [{"name": input_name, "shape": [len(data), len(data[0])], "datatype": "FP32", "data": data}],
        "outputs": list(outputs),
    }


def ranked(name: str, k: Any, **parameters: Any) -> dict[str, Any]:
    return {"name": name, "parameters": {"classification": k, **parameters}}


HTTP_CASES: dict[str, tuple[str, dict]] = {
    **{
        f"batched_{output}_k{k}": ("cls_batched", infer_body("cls_batched", SCORES, ranked(output, k)))
        for output in ("SCORES", "IDS", "NOLABEL")
        for k in (1, 2, 3, 5, 0)
    },
    "batched_binary": ("cls_batched", infer_body("cls_batched", SCORES, ranked("SCORES", 2, binary_data=True))),
    "batched_wide_values": ("cls_batched", infer_body("cls_batched", WIDE, ranked("SCORES", 3), ranked("NOLABEL", 3))),
    "plain_k2": ("cls_plain", infer_body("cls_plain", SCORES, ranked("SCORES", 2))),
    "plain_k4_sparse_labels": ("cls_plain", infer_body("cls_plain", SCORES, ranked("SCORES", 4))),
    "plain_ids_all": ("cls_plain", infer_body("cls_plain", SCORES, ranked("IDS", 6))),
    **{
        f"types_{output}": ("cls_types", infer_body("cls_types", SCORES, ranked(output, 2)))
        for output in ("I64", "U8", "I8", "D3", "F16", "B")
    },
    "ensemble_labels": ("cls_ensemble", infer_body("cls_ensemble", [[0.2, 0.5, 0.3]], ranked("RANKED", 2),
                                                   input_name="SCORES_IN")),
}


@pytest.mark.parametrize("case", sorted(HTTP_CASES))
def test_http_matches_triton(servers: dict[str, ServerProcess], case: str) -> None:
    model, body = HTTP_CASES[case]
    answers = {
        name: requests.post(f"http://127.0.0.1:{server.http_port}/v2/models/{model}/infer", json=body,
                            timeout=TIMEOUT_S)
        for name, server in servers.items()
    }
    assert answers["transerve"].status_code == answers["triton"].status_code, case
    if "binary_data" in str(body):  # a JSON header, then the tensors' bytes: compare the whole body
        assert answers["transerve"].content == answers["triton"].content
        return
    assert comparable(answers["transerve"].json()) == comparable(answers["triton"].json())
    if answers["triton"].status_code == 200 and not case.endswith("_k0"):
        assert all(output["datatype"] == "BYTES" for output in answers["triton"].json()["outputs"])


def comparable(answer: dict[str, Any]) -> dict[str, Any]:
    """An HTTP answer with FP32 data cast to float32: Triton writes an FP32 as its double widening's repr."""
    for output in answer.get("outputs", []):
        if output["datatype"] == "FP32":
            output["data"] = np.array(output["data"], np.float32).tolist()
    return answer


def grpc_request(model: str, data: list[list[float]], output: str, parameter: service_pb2.InferParameter
                 ) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=model)
    request.inputs.add(name="IN", datatype="FP32", shape=[len(data), len(data[0])])
    request.raw_input_contents.append(np.array(data, np.float32).tobytes())
    request.outputs.add(name=output).parameters["classification"].CopyFrom(parameter)
    return request


GRPC_CASES: dict[str, tuple[str, str, service_pb2.InferParameter]] = {
    "batched_scores": ("cls_batched", "SCORES", service_pb2.InferParameter(int64_param=2)),
    "batched_ids": ("cls_batched", "IDS", service_pb2.InferParameter(int64_param=3)),
    "zero": ("cls_batched", "SCORES", service_pb2.InferParameter(int64_param=0)),
    "plain": ("cls_plain", "SCORES", service_pb2.InferParameter(int64_param=4)),
    "uint64_param": ("cls_batched", "SCORES", service_pb2.InferParameter(uint64_param=1)),
    "string_param": ("cls_batched", "SCORES", service_pb2.InferParameter(string_param="1")),
    "negative": ("cls_batched", "SCORES", service_pb2.InferParameter(int64_param=-1)),
    "fp16": ("cls_types", "F16", service_pb2.InferParameter(int64_param=1)),
}


@pytest.mark.parametrize("case", sorted(GRPC_CASES))
def test_grpc_matches_triton(servers: dict[str, ServerProcess], case: str) -> None:
    model, output, parameter = GRPC_CASES[case]
    answers = {}
    for name, server in servers.items():
        with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            try:
                response = stub.ModelInfer(grpc_request(model, SCORES, output, parameter), timeout=TIMEOUT_S)
                answers[name] = ("OK", list(response.outputs), list(response.raw_output_contents))
            except grpc.RpcError as error:
                answers[name] = (error.code().name, error.details().split(", expected")[0])
    assert answers["transerve"] == answers["triton"]


def test_tritonclient_class_count(servers: dict[str, ServerProcess]) -> None:
    """`class_count` as tritonclient sends it, HTTP (binary and JSON) and gRPC: the top classes with labels."""
    scores = np.array(SCORES, np.float32)
    expected = np.array([[b"0.700000:1:pos", b"0.200000:2:neutral"], [b"0.500000:0:neg", b"0.250000:1:pos"]],
                        dtype=np.object_)
    for name, server in servers.items():
        http = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}", network_timeout=TIMEOUT_S)
        given = httpclient.InferInput("IN", [2, 3], "FP32")
        given.set_data_from_numpy(scores)
        for binary in (True, False):
            wanted = httpclient.InferRequestedOutput("SCORES", binary_data=binary, class_count=2)
            result = http.infer("cls_batched", [given], outputs=[wanted]).as_numpy("SCORES")
            np.testing.assert_array_equal(result.astype(bytes), expected.astype(bytes), err_msg=name)
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        given = grpcclient.InferInput("IN", [2, 3], "FP32")
        given.set_data_from_numpy(scores)
        wanted = grpcclient.InferRequestedOutput("SCORES", class_count=2)
        result = client.infer("cls_batched", [given], outputs=[wanted], client_timeout=TIMEOUT_S).as_numpy("SCORES")
        np.testing.assert_array_equal(result, expected, err_msg=name)
        client.close()


def stream_answers(server: ServerProcess) -> list[Any]:
    """What a gRPC stream to the decoupled model returns for one request with `class_count` 2."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        given = grpcclient.InferInput("IN", [1, 3], "FP32")
        given.set_data_from_numpy(np.array([[0.2, 0.5, 0.3]], np.float32))
        client.async_stream_infer("cls_stream", [given], outputs=[grpcclient.InferRequestedOutput(
            "SCORES", class_count=2)], enable_empty_final_response=True)
        answers = []
        while True:
            result, error = results.get(timeout=TIMEOUT_S)
            assert error is None, error
            response = result.get_response()
            if not response.outputs:
                assert response.parameters["triton_final_response"].bool_param
                return answers
            answers.append(result.as_numpy("SCORES").tolist())
    finally:
        client.stop_stream()
        client.close()


def test_decoupled_stream_matches_triton(servers: dict[str, ServerProcess]) -> None:
    answers = {name: stream_answers(server) for name, server in servers.items()}
    assert answers["transerve"] == answers["triton"] == [
        [[b"0.500000:1:pos", b"0.300000:2:neutral"]], [[b"1.000000:1:pos", b"0.600000:2:neutral"]],
    ]


@pytest.mark.slow
def test_missing_label_file_fails_the_load_as_in_triton(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    copy_model(MODELS / "cls_batched", repo / "unlabelled", SHARED_CODE["cls_batched"])
    (repo / "unlabelled" / "labels.txt").unlink()
    install = require_triton()
    reasons = {}
    for name, start in (("triton", start_triton), ("transerve", start_transerve)):
        extra = ("--strict-readiness=false", "--exit-on-error=false") if name == "triton" else (
            "--strict-readiness=false",)
        kwargs = {"install": install} if name == "triton" else {}
        with start(repo, *extra, **kwargs) as server:
            index = requests.post(f"http://127.0.0.1:{server.http_port}/v2/repository/index", timeout=TIMEOUT_S)
            (entry,) = index.json()
            assert entry["state"] == "UNAVAILABLE"
            reasons[name] = entry["reason"]
    for reason in reasons.values():
        assert "failed to open text file for read" in reason
        assert reason.endswith("unlabelled/labels.txt: No such file or directory")


# ---- transerve alone: deliberate divergences -------------------------------------------------------------


@pytest.mark.parametrize("value", ["2", -1, True, 2.0, None, [2]])
def test_http_bad_class_count_is_a_400(transerve: ServerProcess, value: Any) -> None:
    body = infer_body("cls_batched", SCORES, ranked("SCORES", value))
    answer = requests.post(f"http://127.0.0.1:{transerve.http_port}/v2/models/cls_batched/infer", json=body,
                           timeout=TIMEOUT_S)
    if value is None:  # a null parameter is no parameter: the tensor itself
        assert answer.status_code == 200 and answer.json()["outputs"][0]["datatype"] == "FP32"
        return
    assert answer.status_code == 400
    assert "Unable to set 'classification' of output 'SCORES': it must be a non-negative integer" in (
        answer.json()["error"])


def test_bytes_output_is_refused_and_the_server_keeps_serving(transerve: ServerProcess) -> None:
    url = f"http://127.0.0.1:{transerve.http_port}/v2/models"
    answer = requests.post(f"{url}/cls_types/infer", json=infer_body("cls_types", SCORES, ranked("S", 1)),
                           timeout=TIMEOUT_S)
    assert answer.status_code == 400
    assert answer.json()["error"] == "class result not available for output due to unsupported type 'BYTES'"
    ok = requests.post(f"{url}/cls_batched/infer", json=infer_body("cls_batched", SCORES, ranked("SCORES", 1)),
                       timeout=TIMEOUT_S)
    assert ok.status_code == 200 and ok.json()["outputs"][0]["data"] == ["0.700000:1:pos", "0.500000:0:neg"]
