"""The python backend as Triton 24.10's (the release behind Triton 2.51): response senders of non-decoupled models,
request rescheduling, cancellation, model control from model code and pb_utils' argument checks, and the statistics
of rescheduled and cancelled requests, against the real Triton.

The models live in `python_parity_models/`; every test that can runs the same requests against transerve and
Triton and expects the same answers. Where Triton has no answer (a request it drops, a model it never answers),
transerve answers with an error instead, tested on transerve alone.
"""

from __future__ import annotations

import json
import queue
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from support import ServerProcess, require_triton, start_transerve, start_triton

MODELS = Path(__file__).resolve().parent / "python_parity_models"
TIMEOUT_S = 30.0
SERVERS = ["transerve", "triton"]


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("python_parity") / "models"
    shutil.copytree(MODELS, repo, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(repo / "sender", repo / "sender_async")
    config = (repo / "sender_async" / "config.pbtxt").read_text()
    config = config.replace('name: "sender"', 'name: "sender_async"').replace('string_value: "0"', 'string_value: "1"')
    (repo / "sender_async" / "config.pbtxt").write_text(config)
    shutil.copytree(repo / "cancel_probe", repo / "cancel_probe_batched")
    config = (repo / "cancel_probe_batched" / "config.pbtxt").read_text()
    config = config.replace('name: "cancel_probe"', 'name: "cancel_probe_batched"')
    config = config.replace("max_batch_size: 0", "max_batch_size: 1\ndynamic_batching { }")
    (repo / "cancel_probe_batched" / "config.pbtxt").write_text(config)
    return repo


@pytest.fixture(scope="module")
def servers(repository: Path) -> Iterator[dict[str, ServerProcess]]:
    install = require_triton()
    flags = ("--model-control-mode=explicit", "--load-model=*")
    with start_transerve(repository, *flags) as ours, start_triton(repository, *flags, install=install) as theirs:
        yield {"transerve": ours, "triton": theirs}


def infer(server: ServerProcess, model: str, inputs: dict[str, tuple[str, list]]) -> requests.Response:
    body = {"inputs": [{"name": name, "shape": list(np.shape(values)), "datatype": datatype, "data": values}
                       for name, (datatype, values) in inputs.items()]}
    return requests.post(f"{server.base_url}/v2/models/{model}/infer", json=body, timeout=TIMEOUT_S)


def outputs(answer: requests.Response) -> dict[str, list]:
    assert answer.status_code == 200, answer.text
    return {output["name"]: output["data"] for output in answer.json()["outputs"]}


def stream(server: ServerProcess, model: str, inputs: list[grpcclient.InferInput], count: int) -> list:
    """The first `count` answers to one request on a gRPC stream (results, or errors)."""
    answers: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(lambda result, error: answers.put(error or result))
        client.async_stream_infer(model, inputs)
        received = [answers.get(timeout=TIMEOUT_S) for _ in range(count)]
        client.stop_stream()
    return received


def wait_for(condition, what: str):
    """Poll `condition()` until it gives something true (statistics settle after the answer); that value."""
    deadline = time.monotonic() + TIMEOUT_S
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def model_stats(server: ServerProcess, model: str) -> dict:
    answer = requests.get(f"{server.base_url}/v2/models/{model}/stats", timeout=TIMEOUT_S)
    assert answer.status_code == 200, answer.text
    return answer.json()["model_stats"][0]


def failure_metric(server: ServerProcess, model: str, reason: str) -> float:
    text = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=TIMEOUT_S).text
    sample = f'nv_inference_request_failure{{model="{model}",reason="{reason}",version="1"}} '
    return float(next(line for line in text.splitlines() if line.startswith(sample)).split()[-1])


def counts(stats: dict) -> dict[str, int]:
    """The counters of a model's statistics (durations differ between runs and servers)."""
    inference = stats["inference_stats"]
    found = {"inference_count": stats["inference_count"], "execution_count": stats["execution_count"]}
    found.update({name: inference[name]["count"] for name in ("success", "fail", "queue", "compute_infer")})
    found.update({f"batch_{batch['batch_size']}": batch["compute_infer"]["count"] for batch in stats["batch_stats"]})
    return found


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {name: value - before.get(name, 0) for name, value in after.items() if value != before.get(name, 0)}


def mode_input(mode: str) -> list[grpcclient.InferInput]:
    tensor = grpcclient.InferInput("MODE", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([mode.encode()], np.object_))
    return [tensor]


# ---- the response sender of a non-decoupled model -------------------------------------------------------------

#: MODE -> OUT: 1 the response sent before `execute` returned, 2 the one returned, 3 the one sent after it returned.
#: A second response, or a returned one after a sent one, is refused in the model; the first one stands.
SENDER_ANSWERS = {"on": 2, "pre": 1, "pre_then_final": 1, "post": 3, "pre_and_on": 1, "on_and_post": 2}


@pytest.mark.parametrize("server", SERVERS)
@pytest.mark.parametrize("model", ["sender", "sender_async"])
@pytest.mark.parametrize("mode", sorted(SENDER_ANSWERS))
def test_a_non_decoupled_model_answers_with_its_response_sender(servers, server, model, mode):
    answer = infer(servers[server], model, {"MODE": ("BYTES", [mode])})
    assert outputs(answer) == {"OUT": [SENDER_ANSWERS[mode]]}


@pytest.mark.parametrize("server", SERVERS)
@pytest.mark.parametrize("model", ["sender", "sender_async"])
def test_the_first_of_two_sent_responses_reaches_a_stream(servers, server, model):
    (result,) = stream(servers[server], model, mode_input("two_pre"), 1)
    assert not isinstance(result, Exception), result
    assert result.as_numpy("OUT").tolist() == [1]


@pytest.mark.parametrize("server", SERVERS)
@pytest.mark.parametrize("model", ["sender", "sender_async"])
def test_a_final_flag_before_any_response_fails_the_request(servers, server, model):
    answer = infer(servers[server], model, {"MODE": ("BYTES", ["zero_pre"])})
    assert answer.status_code == 500
    assert "Non-decoupled model cannot send complete final before sending a response" in answer.json()["error"]


@pytest.mark.parametrize("server", SERVERS)
def test_an_error_response_sent_after_returning_keeps_its_code(servers, server):
    answer = infer(servers[server], "sender", {"MODE": ("BYTES", ["error_post"])})
    assert answer.status_code == 400 and answer.json()["error"] == "failed after returning"


def test_a_request_left_without_response_or_sender_fails_at_once(servers):
    # Triton never answers such a request; transerve says why instead of hanging.
    answer = infer(servers["transerve"], "sender", {"MODE": ("BYTES", ["none"])})
    assert answer.status_code == 500
    assert answer.json()["error"] == "model 'sender' returned no response for the request"


# ---- request rescheduling (sequence_batching { iterative_sequence: true }) -------------------------------------

@pytest.mark.parametrize("server", SERVERS)
def test_a_rescheduled_decoupled_request_runs_again_with_flags_cleared(servers, server):
    value = grpcclient.InferInput("IN", [1], "INT32")
    value.set_data_from_numpy(np.array([3], np.int32))
    answers = stream(servers[server], "iterative", [value], 3)
    seen = [(a.as_numpy("LEFT")[0], a.as_numpy("FLAGS")[0], a.as_numpy("START_SEEN")[0]) for a in answers]
    # One run per response; only the first has the START flag and START control input.
    assert seen == [(2, 1, 1), (1, 0, 0), (0, 0, 0)]


@pytest.mark.parametrize("server", SERVERS)
def test_a_rescheduled_request_is_answered_by_its_next_run(servers, server):
    assert outputs(infer(servers[server], "iterative_addsub", {"IN": ("INT32", [21])})) == {"OUT": [42], "RUNS": [2]}
    with grpcclient.InferenceServerClient(servers[server].grpc_url) as client:
        value = grpcclient.InferInput("IN", [1], "INT32")
        value.set_data_from_numpy(np.array([5], np.int32))
        assert client.infer("iterative_addsub", [value]).as_numpy("OUT").tolist() == [10]


@pytest.mark.parametrize("server", SERVERS)
def test_returning_a_response_for_a_rescheduled_request_fails_it(servers, server):
    answer = infer(servers[server], "wrong_return", {"IN": ("INT32", [1])})
    assert answer.status_code == 500
    assert "Expected a None object in the execute function return list for reschduled request" in (
        answer.json()["error"])


def test_rescheduling_without_iterative_sequence_is_refused(servers):
    # Triton releases such a request without an answer; transerve names what is missing.
    answer = infer(servers["transerve"], "reschedule_plain", {"IN": ("INT32", [1])})
    assert answer.status_code == 500
    assert answer.json()["error"] == (
        "model 'reschedule_plain' rescheduled a request, which needs "
        "'sequence_batching { iterative_sequence: true }' in its configuration")


@pytest.mark.parametrize("server", SERVERS)
def test_each_run_of_a_rescheduled_request_counts_as_an_execution(servers, server):
    target = servers[server]
    before = counts(model_stats(target, "iterative_addsub"))
    for value in (1, 2, 3):
        assert outputs(infer(target, "iterative_addsub", {"IN": ("INT32", [value])})) == {"OUT": [2 * value],
                                                                                         "RUNS": [2]}
    after = wait_for(lambda: (found := counts(model_stats(target, "iterative_addsub")))["execution_count"]
                     - before["execution_count"] >= 6 and found, "six executions")
    changed = delta(after, before)
    # Triton 2.51 also counts one CANCELED failure per rescheduled request as it is released (the cancelled null
    # request it sends to free the sequence), with no meaningful duration: transerve does not copy that.
    expected_fail = {"triton": 3, "transerve": 0}[server]
    if expected_fail:
        after = wait_for(lambda: (found := counts(model_stats(target, "iterative_addsub")))["fail"]
                         - before.get("fail", 0) >= expected_fail and found, "the release failures")
        changed = delta(after, before)
    assert changed.pop("fail", 0) == expected_fail
    # Two runs per request, each an execution, an inference, a queued request and a success.
    assert changed == {"inference_count": 6, "execution_count": 6, "success": 6, "queue": 6, "compute_infer": 6,
                       "batch_1": 6}


@pytest.mark.parametrize("server", SERVERS)
def test_each_run_of_a_rescheduled_decoupled_request_counts_as_an_execution(servers, server):
    target = servers[server]
    before = counts(model_stats(target, "iterative"))
    value = grpcclient.InferInput("IN", [1], "INT32")
    value.set_data_from_numpy(np.array([3], np.int32))
    assert len(stream(target, "iterative", [value], 3)) == 3
    after = wait_for(lambda: (found := counts(model_stats(target, "iterative")))["success"]
                     - before.get("success", 0) >= 3 and found, "three successes")
    changed = delta(after, before)
    assert changed.pop("fail", 0) in {"triton": (0, 1), "transerve": (0,)}[server]  # Triton's release failure
    assert changed == {"inference_count": 3, "execution_count": 3, "success": 3, "queue": 3, "compute_infer": 3,
                       "batch_1": 3}


# ---- cancellation of non-decoupled requests ---------------------------------------------------------------------

def probe_inputs(delay_ms: int, marker: Path | str, batched: bool) -> list[grpcclient.InferInput]:
    shape = [1, 1] if batched else [1]
    delay = grpcclient.InferInput("DELAY_MS", shape, "INT32")
    delay.set_data_from_numpy(np.full(shape, delay_ms, np.int32))
    path = grpcclient.InferInput("MARKER", shape, "BYTES")
    path.set_data_from_numpy(np.full(shape, str(marker).encode(), np.object_))
    return [delay, path]


PROBES = ["cancel_probe", "cancel_probe_batched"]


@pytest.mark.parametrize("server", SERVERS)
@pytest.mark.parametrize("model", PROBES)
@pytest.mark.parametrize("how", ["cancel", "client_timeout"])
def test_a_running_request_hears_that_its_grpc_client_went_away(servers, server, model, how, tmp_path):
    target = servers[server]
    marker = tmp_path / "seen.json"
    before = counts(model_stats(target, model))
    with grpcclient.InferenceServerClient(target.grpc_url) as client:
        answers: queue.Queue = queue.Queue()
        inputs = probe_inputs(20_000, marker, model.endswith("batched"))
        if how == "cancel":
            call = client.async_infer(model, inputs, lambda result, error: answers.put(error or result))
            time.sleep(1.0)  # it is running
            call.cancel()
        else:
            client.async_infer(model, inputs, lambda result, error: answers.put(error or result), client_timeout=1.0)
        answer = answers.get(timeout=TIMEOUT_S)
        assert answer.status() in ("StatusCode.CANCELLED", "StatusCode.DEADLINE_EXCEEDED")
        wait_for(marker.exists, "the model's report")
    assert json.loads(wait_for(marker.read_text, "the report's text")) == {"request": True, "sender": True}
    # The model answered normally, so the request counts as a success, as Triton counts what its backend reports.
    after = wait_for(lambda: (found := counts(model_stats(target, model)))["success"] > before.get("success", 0)
                     and found, "the success")
    assert delta(after, before) == {"inference_count": 1, "execution_count": 1, "success": 1, "queue": 1,
                                    "compute_infer": 1, "batch_1": 1}


@pytest.mark.parametrize("model", PROBES)
def test_a_running_request_hears_that_its_http_client_closed_the_connection(servers, model, tmp_path):
    # Triton 2.51 does not cancel a request whose HTTP client went away (its model never sees is_cancelled()).
    marker = tmp_path / "seen.json"
    shape = [1, 1] if model.endswith("batched") else [1]
    body = {"inputs": [{"name": "DELAY_MS", "shape": shape, "datatype": "INT32", "data": [20_000]},
                       {"name": "MARKER", "shape": shape, "datatype": "BYTES", "data": [str(marker)]}]}
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(f"{servers['transerve'].base_url}/v2/models/{model}/infer", json=body, timeout=1.0)
    wait_for(marker.exists, "the model's report")
    assert json.loads(wait_for(marker.read_text, "the report's text")) == {"request": True, "sender": True}


def send_seven(server: ServerProcess, model: str, tmp_path: Path) -> tuple[dict[str, int], dict[str, float]]:
    """A (1.5 s), then B to G (at once), G's client going away while A runs; the statistics and the CANCELED
    failure metric before, once everything is answered."""
    batched = model.endswith("batched")
    before = counts(model_stats(server, model))
    canceled = failure_metric(server, model, "CANCELED")
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        answers: queue.Queue = queue.Queue()
        calls = {}
        for name in "ABCDEFG":
            calls[name] = client.async_infer(
                model, probe_inputs(1500 if name == "A" else 0, tmp_path / name, batched),
                lambda result, error: answers.put(error or result))
            time.sleep(0.05)
        calls["F"].cancel()
        received = [answers.get(timeout=TIMEOUT_S) for _ in range(7)]
    assert sum(isinstance(answer, Exception) for answer in received) == 1  # F, cancelled
    return before, {"CANCELED": canceled}


@pytest.mark.parametrize("server", SERVERS)
def test_a_request_cancelled_in_the_dynamic_batchers_queue_is_a_canceled_failure(servers, server, tmp_path):
    # Triton's batcher holds what it cannot hand on (two batches wait per busy instance there, none here): F is
    # still in its queue when its client goes away, and both drop it and count it as CANCELED when they reach it.
    target, model = servers[server], "cancel_probe_batched"
    before, metric = send_seven(target, model, tmp_path)
    after = wait_for(lambda: (found := counts(model_stats(target, model)))["fail"] > before.get("fail", 0)
                     and found["success"] - before.get("success", 0) >= 6 and found, "six successes and a failure")
    assert delta(after, before) == {"inference_count": 6, "execution_count": 6, "success": 6, "fail": 1,
                                    "queue": 6, "compute_infer": 6, "batch_1": 6}
    assert failure_metric(target, model, "CANCELED") == metric["CANCELED"] + 1
    assert not (tmp_path / "F").exists()  # never computed


@pytest.mark.parametrize("server", SERVERS)
def test_a_request_cancelled_in_the_direct_queue_is_dropped_as_canceled(servers, server, tmp_path):
    # Without dynamic batching Triton hands every request to its instance at once, so F runs there (its model sees
    # is_cancelled()) and counts as a success. transerve's instance has four requests in hand (max-inflight), so F
    # still waits in the scheduler's queue: it is dropped and counted as CANCELED, as Triton's batcher does.
    target, model = servers[server], "cancel_probe"
    before, metric = send_seven(target, model, tmp_path)
    if server == "triton":
        expected = {"inference_count": 7, "execution_count": 7, "success": 7, "queue": 7, "compute_infer": 7,
                    "batch_1": 7}
    else:
        expected = {"inference_count": 6, "execution_count": 6, "success": 6, "fail": 1, "queue": 6,
                    "compute_infer": 6, "batch_1": 6}
    after = wait_for(lambda: (found := counts(model_stats(target, model)))["execution_count"]
                     - before["execution_count"] >= expected["execution_count"]
                     and found["fail"] - before.get("fail", 0) >= expected.get("fail", 0) and found, "the counts")
    assert delta(after, before) == expected
    assert failure_metric(target, model, "CANCELED") == metric["CANCELED"] + expected.get("fail", 0)
    assert (tmp_path / "F").exists() == (server == "triton")


# ---- model control from model code, argv and argument checks ----------------------------------------------------

def loader(server: ServerProcess, action: str, name: str = "probe") -> str:
    answer = infer(server, "loader", {"ACTION": ("BYTES", [action]), "NAME": ("BYTES", [name])})
    return outputs(answer)["RESULT"][0]


def model_ready(server: ServerProcess, name: str) -> bool:
    return requests.get(f"{server.base_url}/v2/models/{name}/ready", timeout=TIMEOUT_S).status_code == 200


def with_model_control_models(repository: Path, tmp_path: Path, server: str, check: Callable[[ServerProcess], None],
                              *flags: str) -> None:
    """Run `check` on a server of its own serving the loader and probe models. Triton 2.51 aborts now and then when
    a model calls its model control (boost::interprocess::lock_exception in its python backend, about one start in
    three on the 2-core machine); its answers are what transerve's are compared with, so it is started again then.
    transerve gets no second chance."""
    repo = tmp_path / "models"
    for name in ("loader", "probe"):
        shutil.copytree(repository / name, repo / name)
    for attempt in range(3):
        start = (start_transerve(repo, *flags) if server == "transerve"
                 else start_triton(repo, *flags, install=require_triton()))
        with start as target:
            try:
                check(target)
            except requests.ConnectionError:
                if server == "triton" and attempt < 2 and "lock_exception" in target.log_path.read_text():
                    continue
                raise
            return


def loads_and_unloads_other_models(target: ServerProcess) -> None:
    assert loader(target, "ready") == "True"
    assert loader(target, "unload") == "None"
    deadline = time.monotonic() + TIMEOUT_S
    while model_ready(target, "probe"):  # unloading returns once it has begun, as in Triton
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert loader(target, "ready") == "False"
    assert loader(target, "load") == "None"
    assert model_ready(target, "probe") and loader(target, "ready") == "True"
    assert loader(target, "load", "no_such_model").startswith(
        "TritonModelException: Failed to load model: Failed to process the request for model 'loader_0', message: ")


@pytest.mark.parametrize("server", SERVERS)
def test_a_model_loads_and_unloads_other_models(repository, tmp_path, server):
    with_model_control_models(repository, tmp_path, server, loads_and_unloads_other_models,
                              "--model-control-mode=explicit", "--load-model=*")


def test_a_bad_version_string_fails_in_the_model(servers):
    # Triton 2.51's server process dies of this one.
    assert loader(servers["transerve"], "bad_version") == (
        "TritonModelException: Failed to check model readiness: failed to get model version from specified "
        "version string 'one', version should be an integral value > 0")


def refuses_model_control(target: ServerProcess) -> None:
    assert loader(target, "unload") == (
        "TritonModelException: Failed to unload model: Failed to process the request for model 'loader_0', "
        "message: explicit model load / unload is not allowed if polling is enabled")
    assert loader(target, "ready") == "True"


@pytest.mark.parametrize("server", SERVERS)
def test_model_control_from_model_code_needs_explicit_mode(repository, tmp_path, server):
    with_model_control_models(repository, tmp_path, server, refuses_model_control)


def test_models_see_the_interpreter_and_argument_checks_of_triton(servers):
    reports = {name: json.loads(outputs(infer(server, "probe", {"IN": ("INT32", [1])}))["OUT"][0])
               for name, server in servers.items()}
    assert reports["transerve"]["argv"] == reports["triton"]["argv"] == [""]
    assert reports["transerve"]["cases"] == reports["triton"]["cases"]
    assert set(reports["transerve"]["cases"].values()) == {"TypeError", "TritonModelException", "ok"}


def test_a_model_folder_with_only_model_py_is_a_python_model(servers):
    configs = {name: requests.get(f"{server.base_url}/v2/models/no_config/config", timeout=TIMEOUT_S).json()
               for name, server in servers.items()}
    assert configs["transerve"] == configs["triton"]
    assert configs["transerve"]["backend"] == "python" and configs["transerve"]["max_batch_size"] == 4
    for server in servers.values():
        assert outputs(infer(server, "no_config", {"IN": ("FP32", [[1.0, 2.5]])})) == {"OUT": [2.0, 5.0]}


# ---- gRPC streams with the triton_grpc_error header --------------------------------------------------------------

@pytest.fixture(scope="module")
def grpcio_transerve(repository: Path) -> Iterator[ServerProcess]:
    with start_transerve(repository, "--grpc-transport=grpcio") as server:
        yield server


def stream_modes(server: ServerProcess, modes: list[tuple[str, str]], headers: dict[str, str] | None) -> list:
    """Send (model, MODE) requests on one stream, each after the previous answer; what came back, in order. A stream
    that ended shows as the error that ended it, once."""
    answers: queue.Queue = queue.Queue()
    received: list = []
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(lambda result, error: answers.put(error or result), headers=headers)
        for model, mode in modes:
            try:
                client.async_stream_infer(model, mode_input(mode))
            except Exception as exc:  # the stream has ended
                received.append(("refused", type(exc).__name__))
                continue
            answer = answers.get(timeout=TIMEOUT_S)
            if isinstance(answer, Exception):
                received.append(("error", str(answer.status()), answer.message()))
            else:
                received.append(("result", answer.as_numpy("OUT").tolist()))
        client.stop_stream()
    return received


GRPC_ERROR_MODES = [("sender", "on"), ("no_such_model", "on"), ("sender", "on"), ("sender", "zero_pre"),
                    ("sender", "on")]
ZERO_PRE = "Non-decoupled model cannot send complete final before sending a response"


@pytest.mark.parametrize("server", [*SERVERS, "transerve_grpcio"])
def test_triton_grpc_error_ends_a_stream_at_the_first_model_error(servers, grpcio_transerve, server):
    target = grpcio_transerve if server == "transerve_grpcio" else servers[server]
    received = stream_modes(target, GRPC_ERROR_MODES, {"triton_grpc_error": "true"})
    # A request refused before it runs is answered on the stream, which goes on; a model's error ends it.
    assert received[0] == received[2] == ("result", [2])
    assert received[1][:2] == ("error", "None") and "no_such_model" in received[1][2]
    assert received[3][:2] == ("error", "StatusCode.INTERNAL") and ZERO_PRE in received[3][2]
    assert received[4][0] == "refused"


@pytest.mark.parametrize("server", [*SERVERS, "transerve_grpcio"])
def test_without_triton_grpc_error_errors_are_answers_on_the_stream(servers, grpcio_transerve, server):
    target = grpcio_transerve if server == "transerve_grpcio" else servers[server]
    received = stream_modes(target, GRPC_ERROR_MODES, None)
    assert [answer[0] for answer in received] == ["result", "error", "result", "error", "result"]
    assert ZERO_PRE in received[3][2]


# ---- custom metrics (pb_utils.MetricFamily) ----------------------------------------------------------------------
# Triton 2.51 here aborts (boost::interprocess::lock_exception) as soon as a model updates a metric, so these run on
# transerve alone, with the expectations of python_backend's custom_metrics test.

def metrics_call(server: ServerProcess, action: str, value: float = 0.0) -> dict:
    answer = infer(server, "metrics", {"ACTION": ("BYTES", [action]), "VALUE": ("FP32", [value])})
    return json.loads(outputs(answer)["OUT"][0])


def scrape(server: ServerProcess) -> dict[str, tuple[str, str, list]]:
    """The custom families on /metrics: name -> (type, help, [(sample name, labels, value)]), whether the text
    declares a counter as `x` (as Triton does) or as `x_total`."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=TIMEOUT_S).text
    found: dict[str, tuple[str, str, list]] = {}
    for family in text_string_to_metric_families(text):
        name = family.name.removesuffix("_total")
        if not name.startswith("pyback_"):
            continue
        kind, documentation, samples = found.get(name, ("unknown", "", []))
        if family.type != "unknown":
            kind, documentation = family.type, family.documentation
        found[name] = (kind, documentation, samples + [(s.name, s.labels, s.value) for s in family.samples])
    return found


def test_custom_metrics_of_every_kind_reach_the_metrics_port(servers):
    server = servers["transerve"]
    assert metrics_call(server, "update", 0.75) == {"requests": 1.0, "level": 0.25}
    assert metrics_call(server, "update", 4.0) == {"requests": 2.0, "level": 3.5}
    families = scrape(server)
    assert families["pyback_requests"][:2] == ("counter", "Requests counted by the model")
    assert [sample[1:] for sample in families["pyback_requests"][2]] == [({"model": "metrics"}, 2.0)]
    assert families["pyback_level"][0] == "gauge" and families["pyback_level"][2][0][2] == 3.5
    kind, _, samples = families["pyback_values"]
    assert kind == "histogram"
    by_name = {(name, labels.get("le")): value for name, labels, value in samples}
    # Bounds as prometheus-cpp writes them (Triton's test looks for le="1", le="10").
    assert by_name == {("pyback_values_count", None): 2.0, ("pyback_values_sum", None): 4.75,
                       ("pyback_values_bucket", "0.5"): 0.0, ("pyback_values_bucket", "1"): 1.0,
                       ("pyback_values_bucket", "10"): 2.0, ("pyback_values_bucket", "+Inf"): 2.0}
    assert all(labels["kind"] == "value" for _, labels, _ in samples)


def test_custom_metric_misuse_raises_tritons_errors(servers):
    errors = metrics_call(servers["transerve"], "errors")
    core = "Failed to process the request for model 'metrics_0', message: "
    assert errors == {
        "counter_decrement": f"TritonModelException: Failed to increment metric value: {core}"
                             "TRITONSERVER_METRIC_KIND_COUNTER can only be incremented monotonically by non-negative "
                             "values.",
        "counter_set": f"TritonModelException: Failed to set metric value: {core}"
                       "TRITONSERVER_METRIC_KIND_COUNTER does not support Set",
        "counter_observe": f"TritonModelException: Failed to observe metric value: {core}"
                           "TRITONSERVER_METRIC_KIND_COUNTER does not support Observe",
        "histogram_value": f"TritonModelException: Failed to get metric value: {core}"
                           "TRITONSERVER_METRIC_KIND_HISTOGRAM does not support Value",
        "other_kind": f"TritonModelException: Error when creating MetricFamily: {core}"
                      "Family name already exists with different type",
        "bad_name": f"TritonModelException: Error when creating MetricFamily: {core}Invalid metric name",
        "bad_label": f"TritonModelException: Error when creating Metric: {core}Invalid label name",
        "label_value": f"TritonModelException: Error when creating Metric: {core}"
                       "metric labels must map strings to strings",
        "labels_type": "TritonModelException: Failed to create metric. Labels must be a dictionary.",
        "unsorted_buckets": f"TritonModelException: Error when creating Metric: {core}"
                            "Bucket Boundaries must be strictly sorted",
        "no_buckets": "TritonModelException: Failed to create metric. Missing required buckets.",
        "counter_buckets": "TritonModelException: Failed to create metric. Unexpected buckets found.",
        "after_family_deleted": "TritonModelException: Failed to set metric value: Invalid metric operation as the "
                                "corresponding 'MetricFamily' has been deleted. The 'MetricFamily' object should be "
                                "deleted AFTER its corresponding 'Metric' objects have been deleted.",
        "kind_type": "TypeError: MetricFamily(): kind must be a pb_utils.MetricKind, not int",
    }


def test_custom_metrics_go_with_their_last_holder(servers):
    server = servers["transerve"]
    metrics_call(server, "drop")
    metrics_call(server, "update", 1.0)  # the deletion travels with the worker's next message
    assert "pyback_dropped" not in scrape(server)
    assert requests.post(f"{server.base_url}/v2/repository/models/metrics/unload", timeout=TIMEOUT_S).ok
    deadline = time.monotonic() + TIMEOUT_S
    while "pyback_requests" in scrape(server):  # the unloaded model's worker takes its metrics with it
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert requests.post(f"{server.base_url}/v2/repository/models/metrics/load", timeout=TIMEOUT_S).ok
    assert metrics_call(server, "update", 1.0)["requests"] == 1.0
