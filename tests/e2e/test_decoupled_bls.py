"""Decoupled python models and BLS end to end, on real servers, and against the real Triton 2.51.

The models live in `decoupled_bls_models/` (served with four of the examples). A BLS model
(`bls_probe`) calls other models as each MODE says and answers with a JSON description of what it
got back, so one HTTP request compares a whole BLS interaction between transerve and Triton.
Decoupled streaming over the network goes through HTTP generate_stream (server-sent events).

Deliberate divergences from Triton 2.51, each a Triton bug that transerve does not copy:
* an error from the model a BLS call ran keeps its code (Triton 2.51 makes it INTERNAL, fixed in
  later Tritons: triton-inference-server/server#7804);
* an error response a decoupled model sends mid-stream reaches a BLS caller (Triton 2.51's BLS
  iterator drops it, while its gRPC and SSE streams deliver it; the calling instance then never
  unloads, so shutting Triton down hangs: that case is not sent to Triton here);
* a decoupled `execute` that raises after sending a response ends a BLS caller's iterator with the
  error (Triton 2.51's iterator waits forever; its streams deliver the error).
"""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson
import pytest
import requests
from support import EXAMPLE_REPOSITORY, ServerProcess, require_triton, start_transerve, start_triton

MODELS = Path(__file__).resolve().parent / "decoupled_bls_models"
EXAMPLES_USED = ("add_sub", "byte_tokenizer", "token_stats", "text_pipeline")
TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("decoupled_bls") / "models"
    shutil.copytree(MODELS, repo, ignore=shutil.ignore_patterns("__pycache__"))
    for name in EXAMPLES_USED:
        shutil.copytree(EXAMPLE_REPOSITORY / name, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
    return repo


@pytest.fixture(scope="module")
def transerve(repository: Path) -> Iterator[ServerProcess]:
    with start_transerve(repository) as server:
        yield server


@pytest.fixture(scope="module")
def triton(repository: Path) -> Iterator[ServerProcess]:
    install = require_triton()
    with start_triton(repository, install=install) as server:
        yield server


def probe(server: ServerProcess, mode: str) -> object:
    """What `bls_probe` saw when it ran MODE's BLS calls."""
    body = {"inputs": [{"name": "MODE", "shape": [1], "datatype": "BYTES", "data": [mode]}]}
    answer = requests.post(f"{server.base_url}/v2/models/bls_probe/infer", json=body, timeout=TIMEOUT_S)
    assert answer.status_code == 200, answer.text
    return json.loads(answer.json()["outputs"][0]["data"][0])


def infer(server: ServerProcess, model: str, inputs: dict[str, tuple[str, list]]) -> requests.Response:
    body = {"inputs": [{"name": name, "shape": list(np.shape(values)), "datatype": datatype, "data": values}
                       for name, (datatype, values) in inputs.items()]}
    return requests.post(f"{server.base_url}/v2/models/{model}/infer", json=body, timeout=TIMEOUT_S)


def events(body: bytes) -> list[dict]:
    return [orjson.loads(line[len(b"data: "):]) for line in body.split(b"\n") if line.startswith(b"data: ")]


INTERNAL, INVALID_ARG, CANCELLED = 1, 3, 7
ADD_SUB_SUMS = {"OUTPUT0": [[11.0, 22.0, 33.0, 44.0]], "OUTPUT1": [[-9.0, -18.0, -27.0, -36.0]]}
REPEAT = [{"outputs": {"OUT": [4], "IDX": [0]}}, {"outputs": {"OUT": [5], "IDX": [1]}},
          {"outputs": {"OUT": [6], "IDX": [2]}}, {"outputs": {}}]

#: Modes whose answers are identical on both servers.
SAME_AS_TRITON = [
    "add_sub", "add_sub_one_output", "add_sub_all_outputs", "unknown_model", "unknown_version", "bad_dtype",
    "bad_shape", "missing_input", "unknown_output", "decoupled_without_flag", "single_as_decoupled", "repeat",
    "repeat_empty", "repeat_twice", "ensemble", "ensemble_bad", "dec:error_final", "dec:final_with_response",
    "dec:send_after_final", "dec:bad_flag", "dec:zero", "dec:thread", "dec:cancel_state", "dec:undeclared_output",
]


@pytest.mark.parametrize("mode", SAME_AS_TRITON)
def test_bls_answers_match_triton(transerve, triton, mode):
    assert probe(transerve, mode) == probe(triton, mode)


def test_bls_results_and_error_wording(transerve):
    assert probe(transerve, "add_sub") == {"outputs": ADD_SUB_SUMS}
    assert probe(transerve, "repeat") == REPEAT
    assert probe(transerve, "unknown_model") == {"error": [INTERNAL, (
        "Model no_such_model - Error when running inference: Failed for execute the inference request. "
        "Model 'no_such_model' is not ready.")]}
    code, message = probe(transerve, "bad_dtype")["error"]
    assert code == INTERNAL and message == (
        "Model add_sub - Error when running inference: [request id: rid7] inference input 'INPUT0' data-type is "
        "'INT32', but model 'add_sub' expects 'FP32'")
    code, message = probe(transerve, "decoupled_without_flag")["error"]
    assert code == INTERNAL and "Please use 'decoupled=True' argument to the 'exec'" in message
    assert probe(transerve, "ensemble") == {"outputs": {"token_count": [[6]], "mean_id": [[133.5]]}}
    report = probe(transerve, "dec:send_after_final")["report"][0]["outputs"]["MSG"][0]
    assert "Unable to send response. Response sender has been closed." in report


def test_bls_divergences_from_triton_are_the_documented_ones(transerve, triton):
    # The called model's own error code survives (2.51: always INTERNAL).
    assert probe(transerve, "model_error") == {"error": [INVALID_ARG, "bad"]}
    assert probe(triton, "model_error") == {"error": [INTERNAL, "bad"]}
    # A mid-stream error response reaches the BLS caller (2.51's iterator drops it: see the docstring).
    assert probe(transerve, "dec:error_midstream")["responses"] == [
        {"outputs": {"OUT": [1]}}, {"error": [INVALID_ARG, "mid"]}, {"outputs": {"OUT": [2]}}, {"outputs": {}}]
    # Returning responses from a decoupled execute: both fail the request with the same explanation.
    for server in (transerve, triton):
        (error,) = probe(server, "dec:return_list")["responses"]
        assert error["error"][0] == INTERNAL
        assert error["error"][1].endswith("is using the decoupled mode and the execute function must return None.")


def test_a_decoupled_execute_that_raises_ends_the_bls_stream_with_its_error(transerve):
    responses = probe(transerve, "dec:raise")["responses"]
    assert responses[0] == {"outputs": {"OUT": [1]}}
    code, message = responses[1]["error"]
    assert code == INTERNAL and message.endswith("message: ValueError: probe boom") and len(responses) == 2


def test_async_bls_calls_run_concurrently_and_match_triton(transerve, triton):
    answers = {}
    for name, server in (("transerve", transerve), ("triton", triton)):
        started = time.monotonic()
        answer = infer(server, "bls_async", {"N": ("INT32", [3])})
        assert answer.status_code == 200, answer.text
        answers[name] = {output["name"]: output["data"] for output in answer.json()["outputs"]}
        answers[name]["wall"] = time.monotonic() - started
    ours, theirs = answers["transerve"], answers["triton"]
    assert ours["SUMS"] == theirs["SUMS"] == [4.0, 8.0, 12.0]
    assert ours["STREAMED"] == theirs["STREAMED"] == [7, 8, 9]
    # Three 0.3 s calls on three instances: together they take about one call's time, not three.
    assert ours["ELAPSED"][0] < 0.75, ours


def test_bls_from_an_ensemble_step_and_under_concurrency(transerve):
    results: dict[int, list] = {}

    def call(index: int) -> None:
        a = [[float(index)] * 4]
        answer = infer(transerve, "bls_ensemble", {"A": ("FP32", a), "B": ("FP32", [[1.0, 2.0, 3.0, 4.0]])})
        assert answer.status_code == 200, answer.text
        results[index] = answer.json()["outputs"][0]["data"]

    # More calls than the BLS model's pipeline is deep: its worker receives executes while `exec()` waits.
    threads = [threading.Thread(target=call, args=(index,)) for index in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S)
    assert results == {index: [index + 1.0, index + 2.0, index + 3.0, index + 4.0] for index in range(12)}


def test_decoupled_stream_over_generate_stream_matches_triton(transerve, triton):
    bodies = {}
    for name, server in (("transerve", transerve), ("triton", triton)):
        answer = requests.post(f"{server.base_url}/v2/models/repeat_int32/generate_stream", json={"IN": [4, 5, 6]},
                               timeout=TIMEOUT_S)
        assert answer.status_code == 200
        bodies[name] = events(answer.content)
    assert bodies["transerve"] == bodies["triton"]
    assert [event["OUT"] for event in bodies["transerve"]] == [4, 5, 6]


def test_a_decoupled_model_on_plain_infer_answers_as_triton(transerve, triton):
    for server in (transerve, triton):
        answer = infer(server, "repeat_int32", {"IN": ("INT32", [1, 2])})
        assert answer.status_code == 501
        assert answer.json() == {"error": "HTTP end point doesn't support models with decoupled transaction policy"}


@pytest.mark.parametrize("style", ["thread", "inline"])
def test_a_client_that_goes_away_stops_the_decoupled_model(transerve, tmp_path: Path, style: str):
    """The model polls `is_cancelled()` (its sender's from a thread, the request's inside execute)."""
    log = tmp_path / f"{style}.log"
    body = orjson.dumps({"N": 500, "style": style, "log": str(log)})
    raw = (b"POST /v2/models/counter/generate_stream HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    client = socket.create_connection(("127.0.0.1", transerve.http_port), timeout=TIMEOUT_S)
    client.sendall(raw)
    received = b""
    while received.count(b"data: ") < 3:
        chunk = client.recv(65536)
        assert chunk, received
        received += chunk
    client.close()  # 500 responses would take 10 s
    assert_counter_cancelled_early(log, transerve)


def assert_counter_cancelled_early(log: Path, server: ServerProcess) -> None:
    """The `counter` model wrote that it saw the cancellation after a few of its 500 responses; the server lives."""
    deadline = time.monotonic() + 5.0
    while not (log.exists() and log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    outcome = log.read_text().strip()
    assert outcome.startswith("cancelled after "), outcome
    assert 3 <= int(outcome.rsplit(" ", 1)[1]) < 250, outcome
    assert server.alive()


def grpc_stream_answers(
    server: ServerProcess, requests_: list, expected: int | None, timeout: float = TIMEOUT_S
) -> list:
    """Send requests on one tritonclient gRPC stream and collect `expected` answers (None: up to the first one
    flagged final): (id, outputs, final)."""
    import queue

    import tritonclient.grpc as grpcclient

    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for request_id, model, inputs, extra in requests_:
            client.async_stream_infer(model, inputs, request_id=request_id, **extra)
        collected: list = []
        while len(collected) < expected if expected is not None else not (collected and collected[-1][2]):
            result, error = answers.get(timeout=timeout)
            if error is not None:
                collected.append(("error", str(error), True))
                continue
            response = result.get_response()
            final = response.parameters["triton_final_response"].bool_param
            outputs = {o.name: result.as_numpy(o.name).tolist() for o in response.outputs}
            collected.append((response.id, outputs, final))
        assert answers.empty()
        return collected
    finally:
        client.stop_stream()
        client.close()


def repeat_inputs(values: list[int], name: str = "IN"):
    import tritonclient.grpc as grpcclient

    tensor = grpcclient.InferInput(name, [len(values)], "INT32")
    tensor.set_data_from_numpy(np.array(values, np.int32))
    return [tensor]


@pytest.mark.parametrize("how", ["cancel", "drop"])
def test_a_bls_caller_that_cancels_or_drops_its_iterator_stops_the_decoupled_model(transerve, tmp_path, how):
    """`cancel()` on the response iterator (the API of later Tritons; 2.51 has none), or dropping the iterator
    before its final response: the called model sees `is_cancelled()` and stops."""
    log = tmp_path / f"{how}.log"
    answers = probe(transerve, f"{how}:{log}")
    assert answers[:3] == [{"outputs": {"OUT": [index]}} for index in range(3)]
    if how == "cancel":
        assert answers[-1] == {"error": [CANCELLED, "the BLS request to model counter was cancelled"]}
        assert len(answers) < 250
    assert_counter_cancelled_early(log, transerve)


def test_decoupled_responses_stream_over_grpc_as_triton_sends_them(transerve, triton):
    """N responses then the final flag alone, which Triton sends as an empty final response only on request."""
    enable_empty = {"enable_empty_final_response": True}
    requests_ = [("a", "repeat_int32", repeat_inputs([5, 6, 7]), enable_empty)]
    ours, theirs = grpc_stream_answers(transerve, requests_, 4), grpc_stream_answers(triton, requests_, 4)
    assert ours == theirs
    assert [outputs for _, outputs, _ in ours[:3]] == [{"OUT": [v], "IDX": [i]} for i, v in enumerate([5, 6, 7])]
    assert [final for *_, final in ours] == [False, False, False, True]


def test_decoupled_and_ordinary_requests_share_one_grpc_stream(transerve):
    import tritonclient.grpc as grpcclient

    add = [grpcclient.InferInput(name, [1, 4], "FP32") for name in ("INPUT0", "INPUT1")]
    for tensor in add:
        tensor.set_data_from_numpy(np.ones((1, 4), np.float32))
    answers = grpc_stream_answers(transerve, [("r1", "repeat_int32", repeat_inputs([1, 2]), {}),
                                              ("s1", "add_sub", add, {})], expected=3)
    by_id: dict[str, list] = {}
    for request_id, outputs, final in answers:
        by_id.setdefault(request_id, []).append((outputs, final))
    assert [final for _, final in by_id["r1"]] == [False, False]  # no empty final response unless asked
    assert by_id["s1"] == [({"OUTPUT0": [[2.0] * 4], "OUTPUT1": [[0.0] * 4]}, True)]


def test_cancelling_a_grpc_stream_stops_the_decoupled_model(transerve, tmp_path: Path):
    import queue

    import tritonclient.grpc as grpcclient

    log = tmp_path / "grpc.log"
    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(transerve.grpc_url)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    count = grpcclient.InferInput("N", [1], "INT32")
    count.set_data_from_numpy(np.array([500], np.int32))
    client.async_stream_infer("counter", [count], parameters={"style": "thread", "log": str(log)})
    for _ in range(3):
        result, error = answers.get(timeout=TIMEOUT_S)
        assert error is None, error
    client.stop_stream(cancel_requests=True)  # 500 responses would take 10 s
    client.close()
    assert_counter_cancelled_early(log, transerve)


def test_an_error_response_midstream_is_an_event_and_the_stream_goes_on(transerve, triton):
    """Both servers send the error as a `data:` event and keep streaming to the model's final flag."""
    body = {"MODE": "error_midstream"}
    ours = requests.post(f"{transerve.base_url}/v2/models/dec_probe/generate_stream", json=body, timeout=TIMEOUT_S)
    theirs = requests.post(f"{triton.base_url}/v2/models/dec_probe/generate_stream", json=body, timeout=TIMEOUT_S)
    assert ours.status_code == theirs.status_code == 200
    ours_events, theirs_events = events(ours.content), events(theirs.content)
    assert ["error" in event for event in ours_events] == ["error" in event for event in theirs_events]
    assert any("error" in event for event in ours_events) and "error" not in ours_events[-1]


def test_grpc_model_infer_on_a_decoupled_model_answers_as_triton(transerve, triton):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    messages = []
    for server in (transerve, triton):
        client = grpcclient.InferenceServerClient(server.grpc_url)
        with pytest.raises(InferenceServerException) as info:
            client.infer("repeat_int32", repeat_inputs([1]))
        messages.append((info.value.status(), info.value.message()))
    assert messages[0] == messages[1]


def test_a_decoupled_step_streams_through_its_ensemble_as_in_triton(transerve, triton):
    """Each response of repeat_int32 runs the next step once and is one response of the ensemble."""
    bodies = {}
    for name, server in (("transerve", transerve), ("triton", triton)):
        answer = requests.post(f"{server.base_url}/v2/models/stream_scaled/generate_stream",
                               json={"VALUES": [4, 5, 6]}, timeout=TIMEOUT_S)
        assert answer.status_code == 200, answer.text
        bodies[name] = events(answer.content)
    assert bodies["transerve"] == bodies["triton"]
    assert [(event["SCALED"], event["INDEX"]) for event in bodies["transerve"]] == [(8, 0), (10, 1), (12, 2)]
    requests_ = [("s", "stream_scaled", repeat_inputs([1, 2], "VALUES"), {"enable_empty_final_response": True})]
    ours, theirs = grpc_stream_answers(transerve, requests_, None), grpc_stream_answers(triton, requests_, None)
    # Data responses equal; the final flag rides on the last one when the step had ended by the time that response
    # was through the next step (the usual case on both servers), else it comes alone, which is timing, not a rule.
    data = [(answer_id, outputs) for answer_id, outputs, _ in ours if outputs]
    assert data == [(answer_id, outputs) for answer_id, outputs, _ in theirs if outputs]
    assert data == [("s", {"SCALED": [2], "INDEX": [0]}), ("s", {"SCALED": [4], "INDEX": [1]})]
    assert [final for *_, final in ours].count(True) == 1


def test_an_ensemble_with_a_decoupled_step_is_decoupled_as_in_triton(transerve, triton):
    for server in (transerve, triton):
        config = requests.get(f"{server.base_url}/v2/models/stream_scaled/config", timeout=TIMEOUT_S).json()
        assert config["model_transaction_policy"] == {"decoupled": True}
        answer = infer(server, "stream_scaled", {"VALUES": ("INT32", [1])})
        assert answer.status_code == 501
        assert answer.json() == {"error": "HTTP end point doesn't support models with decoupled transaction policy"}


@pytest.mark.parametrize("inputs", [{"X": ("INT32", [5])}, {"X": ("INT32", [5]), "FACTOR": ("INT32", [3])}])
def test_an_absent_optional_ensemble_input_is_absent_for_its_step_as_in_triton(transerve, triton, inputs):
    ours, theirs = infer(transerve, "scaled_chain", inputs), infer(triton, "scaled_chain", inputs)
    assert ours.status_code == theirs.status_code == 200, (ours.text, theirs.text)
    assert ours.json()["outputs"] == theirs.json()["outputs"]
    assert ours.json()["outputs"][0]["data"] == [15 if "FACTOR" in inputs else 10]
