"""Ensembles as Triton 2.51 runs them, against the real Triton on one repository: steps pruned to the outputs a
request asks for, an optional tensor connecting two steps, batching and non-batching layouts mixed, an ensemble
inside an ensemble, and how a failed ensemble request is counted; and the refusal of a request that leaves out a
required input of a model with optional ones (L0_input_validation's wording)."""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from support import EXAMPLE_REPOSITORY, ServerProcess, require_triton, start_transerve, start_triton
from support.repositories import write_model
from tritonclient.utils import InferenceServerException

TIMEOUT_S = 30.0

IDENTITY = '''
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())]) for r in requests]
'''

# Answers only the outputs whose inputs came: an optional input left out upstream leaves its output out too.
PRESENT_ONLY = '''
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            tensors = []
            for index in ("0", "1"):
                given = pb_utils.get_input_tensor_by_name(request, "INPUT" + index)
                if given is not None:
                    tensors.append(pb_utils.Tensor("OUTPUT" + index, given.as_numpy()))
            responses.append(pb_utils.InferenceResponse(tensors))
        return responses
'''

FAILING = '''
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([], error=pb_utils.TritonError("refused")) for _ in requests]
'''


def identity_config(name: str, max_batch_size: int, dims: str) -> str:
    return (f'name: "{name}" backend: "python" max_batch_size: {max_batch_size} '
            f'input [{{ name: "IN" data_type: TYPE_FP32 dims: {dims} }}] '
            f'output [{{ name: "OUT" data_type: TYPE_FP32 dims: {dims} }}]')


def step(model: str, inputs: dict[str, str], outputs: dict[str, str]) -> str:
    maps = [f'input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items()]
    maps += [f'output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items()]
    return f'{{ model_name: "{model}" model_version: -1 {" ".join(maps)} }}'


def ensemble(name: str, max_batch_size: int, inputs: str, outputs: str, *steps: str) -> str:
    return (f'name: "{name}" platform: "ensemble" max_batch_size: {max_batch_size} input [{inputs}] '
            f'output [{outputs}] ensemble_scheduling {{ step [ {", ".join(steps)} ] }}')


def fp32(name: str, dims: str = "[ 1 ]", optional: bool = False) -> str:
    return f'{{ name: "{name}" data_type: TYPE_FP32 dims: {dims}{" optional: true" if optional else ""} }}'


ENSEMBLES = {
    # A fork: asking for OUT_A alone runs 'left' twice and 'right' not at all.
    "fork": ensemble(
        "fork", 4, fp32("INPUT0"), f"{fp32('OUT_A')}, {fp32('OUT_B')}",
        step("left", {"IN": "INPUT0"}, {"OUT": "a"}), step("right", {"IN": "a"}, {"OUT": "OUT_B"}),
        step("left", {"IN": "a"}, {"OUT": "OUT_A"})),
    # Named to load before 'fork' if ensembles were not ordered by what they contain.
    "a_nested": ensemble(
        "a_nested", 4, fp32("INPUT0"), f"{fp32('OUT_A')}, {fp32('OUT_B')}",
        step("fork", {"INPUT0": "INPUT0"}, {"OUT_A": "OUT_A", "OUT_B": "OUT_B"})),
    # Two independent chains: an input that only feeds steps left out. Triton 2.51's pruning then also drops the
    # first step (it looks for the step producing an ensemble input) and answers "unexpected deadlock".
    "branches": ensemble(
        "branches", 4, f"{fp32('INPUT0')}, {fp32('INPUT1')}", f"{fp32('OUT_A')}, {fp32('OUT_B')}",
        step("left", {"IN": "INPUT0"}, {"OUT": "a"}), step("right", {"IN": "INPUT1"}, {"OUT": "b"}),
        step("left", {"IN": "a"}, {"OUT": "OUT_A"}), step("right", {"IN": "b"}, {"OUT": "OUT_B"})),
    # L0_optional_input's connecting tensor: step 1 reads both of step 0's outputs, which sends one when given one.
    "connecting": ensemble(
        "connecting", 4, f"{fp32('INPUT0', optional=True)}, {fp32('INPUT1', optional=True)}",
        f"{fp32('OUTPUT0')}, {fp32('OUTPUT1')}",
        step("present_only", {"INPUT0": "INPUT0", "INPUT1": "INPUT1"}, {"OUTPUT0": "t0", "OUTPUT1": "t1"}),
        step("present_only", {"INPUT0": "t0", "INPUT1": "t1"}, {"OUTPUT0": "OUTPUT0", "OUTPUT1": "OUTPUT1"})),
    # The seed tutorials' layout: no batching in the ensemble, its dims [-1, 1] in front of batching [1] steps.
    "seed_layout": (
        'name: "seed_layout" platform: "ensemble" max_batch_size: 0 '
        'input [ { name: "input_text" data_type: TYPE_STRING dims: [ -1, 1 ] } ] '
        'output [ { name: "token_count" data_type: TYPE_INT64 dims: [ -1, 1 ] }, '
        '{ name: "mean_id" data_type: TYPE_FP32 dims: [ -1, 1 ] } ] ensemble_scheduling { step [ '
        + step("byte_tokenizer", {"TEXT": "input_text"}, {"input_ids": "ids", "attention_mask": "mask"}) + ", "
        + step("token_stats", {"input_ids": "ids", "attention_mask": "mask"},
               {"token_count": "token_count", "mean_id": "mean_id"}) + " ] }"),
    # And the other way round: a batching ensemble with a step that does not batch and declares [-1, 1].
    "whole_step": ensemble("whole_step", 4, fp32("X"), fp32("Y"), step("whole", {"IN": "X"}, {"OUT": "Y"})),
    "failing_ensemble": ensemble("failing_ensemble", 4, fp32("X"), fp32("Y"), step("failing", {"IN": "X"},
                                                                                      {"OUT": "Y"})),
}


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("ensembles") / "models"
    for name in ("byte_tokenizer", "token_stats"):
        shutil.copytree(EXAMPLE_REPOSITORY / name, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
    models = {
        "left": (IDENTITY, identity_config("left", 4, "[ 1 ]")),
        "right": (IDENTITY, identity_config("right", 4, "[ 1 ]")),
        "whole": (IDENTITY, identity_config("whole", 0, "[ -1, 1 ]")),
        "failing": (FAILING, identity_config("failing", 4, "[ 1 ]")),
        "present_only": (PRESENT_ONLY, 'name: "present_only" backend: "python" max_batch_size: 4 '
                         f'input [{fp32("INPUT0", optional=True)}, {fp32("INPUT1", optional=True)}] '
                         f'output [{fp32("OUTPUT0")}, {fp32("OUTPUT1")}]'),
        "one_required": (PRESENT_ONLY, 'name: "one_required" backend: "python" max_batch_size: 4 '
                         f'input [{fp32("INPUT0")}, {fp32("INPUT1", optional=True)}] '
                         f'output [{fp32("OUTPUT0")}, {fp32("OUTPUT1")}]'),
    }
    for name, (code, config) in models.items():
        write_model(repo, name, config, code)
    for name, config in ENSEMBLES.items():
        write_model(repo, name, config)
    return repo


@pytest.fixture(scope="module")
def servers(repository: Path) -> Iterator[dict[str, ServerProcess]]:
    install = require_triton()
    with start_triton(repository, install=install) as triton, start_transerve(repository) as transerve:
        yield {"triton": triton, "transerve": transerve}


def settled(read: Callable[[], object], expected: object) -> object:
    """What `read` gives once it gives `expected`, or after 5 s: Triton counts a request just after answering it."""
    deadline = time.monotonic() + 5
    value = read()
    while value != expected and time.monotonic() < deadline:
        time.sleep(0.05)
        value = read()
    return value


def successes(server: ServerProcess, model: str) -> int:
    stats = requests.get(f"{server.base_url}/v2/models/{model}/stats", timeout=TIMEOUT_S).json()
    return stats["model_stats"][0]["inference_stats"]["success"]["count"]


def column(value: float) -> np.ndarray:
    return np.array([[value]], np.float32)


def test_every_model_loads_in_both(servers: dict[str, ServerProcess]) -> None:
    for name, server in servers.items():
        index = requests.post(f"{server.base_url}/v2/repository/index", timeout=TIMEOUT_S).json()
        assert {entry["name"]: entry.get("state") for entry in index} == dict.fromkeys(
            ["a_nested", "branches", "byte_tokenizer", "connecting", "failing", "failing_ensemble", "fork", "left",
             "one_required", "present_only", "right", "seed_layout", "token_stats", "whole", "whole_step"],
            "READY"), name


def step_requests(server: ServerProcess, model: str, values: dict[str, float], right: int) -> dict[str, int]:
    """Send two requests, the first asking for OUT_A only; how many requests 'left' and 'right' ran for them."""
    client = httpclient.InferenceServerClient(server.http_url)
    before = {m: successes(server, m) for m in ("left", "right")}
    inputs = []
    for tensor, value in values.items():
        inputs.append(httpclient.InferInput(tensor, [1, 1], "FP32"))
        inputs[-1].set_data_from_numpy(column(value))
    result = client.infer(model, inputs, outputs=[httpclient.InferRequestedOutput("OUT_A")])
    assert result.as_numpy("OUT_A").tolist() == [[values["INPUT0"]]] and result.as_numpy("OUT_B") is None
    assert client.infer(model, inputs).as_numpy("OUT_B").tolist() == [[values.get("INPUT1", values["INPUT0"])]]
    return settled(lambda: {m: successes(server, m) - before[m] for m in before}, {"left": 4, "right": right})


# Inside 'a_nested', 'fork' is asked for both its outputs (a step asks for every output it maps), so it prunes none.
@pytest.mark.parametrize("model, right", [("fork", 1), ("a_nested", 2)])
def test_steps_that_only_feed_outputs_not_asked_for_do_not_run(
    servers: dict[str, ServerProcess], model: str, right: int
) -> None:
    counted = {name: step_requests(server, model, {"INPUT0": 1.5}, right) for name, server in servers.items()}
    assert counted["transerve"] == counted["triton"] == {"left": 4, "right": right}


def test_an_input_that_only_feeds_steps_left_out(servers: dict[str, ServerProcess]) -> None:
    """Where Triton 2.51 answers "unexpected deadlock" (see 'branches'), transerve answers."""
    counted = step_requests(servers["transerve"], "branches", {"INPUT0": 1.5, "INPUT1": 2.5}, 2)
    assert counted == {"left": 4, "right": 2}


@pytest.mark.parametrize("given", [("INPUT0",), ("INPUT1",), ("INPUT0", "INPUT1")])
def test_an_optional_tensor_connecting_steps(servers: dict[str, ServerProcess], given: tuple[str, ...]) -> None:
    answers = {}
    for name, server in servers.items():
        client = grpcclient.InferenceServerClient(server.grpc_url)
        inputs = []
        for tensor in given:
            inputs.append(grpcclient.InferInput(tensor, [1, 1], "FP32"))
            inputs[-1].set_data_from_numpy(column(float(tensor[-1]) + 0.5))
        outputs = [grpcclient.InferRequestedOutput(tensor.replace("IN", "OUT")) for tensor in given]
        result = client.infer("connecting", inputs, outputs=outputs)
        answers[name] = {o.name: result.as_numpy(o.name).tolist() for o in result.get_response().outputs}
    assert answers["transerve"] == answers["triton"] == {
        tensor.replace("IN", "OUT"): [[float(tensor[-1]) + 0.5]] for tensor in given}


def test_an_output_left_out_upstream_without_asking_for_fewer_outputs(servers: dict[str, ServerProcess]) -> None:
    """All outputs asked for, one input given: the other output is simply missing from the answer, in both."""
    for name, server in servers.items():
        body = {"inputs": [{"name": "INPUT1", "shape": [1, 1], "datatype": "FP32", "data": [7.0]}]}
        answer = requests.post(f"{server.base_url}/v2/models/connecting/infer", json=body, timeout=TIMEOUT_S)
        assert answer.status_code == 200, (name, answer.text)
        assert [(o["name"], o["data"]) for o in answer.json()["outputs"]] == [("OUTPUT1", [7.0])], name


def test_a_non_batching_ensemble_in_front_of_batching_steps(servers: dict[str, ServerProcess]) -> None:
    body = {"inputs": [{"name": "input_text", "shape": [2, 1], "datatype": "BYTES", "data": ["hé", "hello"]}]}
    answers = {}
    for name, server in servers.items():
        answer = requests.post(f"{server.base_url}/v2/models/seed_layout/infer", json=body, timeout=TIMEOUT_S)
        assert answer.status_code == 200, (name, answer.text)
        answers[name] = {o["name"]: (o["shape"], o["data"]) for o in answer.json()["outputs"]}
    assert answers["transerve"]["token_count"] == answers["triton"]["token_count"] == ([2, 1], [3, 5])
    assert answers["transerve"]["mean_id"][0] == answers["triton"]["mean_id"][0] == [2, 1]
    np.testing.assert_allclose(answers["transerve"]["mean_id"][1], answers["triton"]["mean_id"][1], rtol=1e-6)


def test_a_batching_ensemble_with_a_step_that_does_not_batch(servers: dict[str, ServerProcess]) -> None:
    body = {"inputs": [{"name": "X", "shape": [3, 1], "datatype": "FP32", "data": [1.0, 2.0, 3.0]}]}
    for name, server in servers.items():
        answer = requests.post(f"{server.base_url}/v2/models/whole_step/infer", json=body, timeout=TIMEOUT_S)
        assert answer.status_code == 200, (name, answer.text)
        assert [(o["shape"], o["data"]) for o in answer.json()["outputs"]] == [([3, 1], [1.0, 2.0, 3.0])], name


Failures = tuple[int, dict[str, int]]


def failures(server: ServerProcess, model: str, since: Failures = (0, {})) -> Failures:
    """The model's failure count in its statistics, and its failure metric by reason (less those of `since`)."""
    stats = requests.get(f"{server.base_url}/v2/models/{model}/stats", timeout=TIMEOUT_S).json()
    text = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=TIMEOUT_S).text
    pattern = rf'nv_inference_request_failure\{{model="{model}",reason="(\w+)",version="1"\}} ([\d.]+)'
    by_reason = {reason: int(float(count)) - since[1].get(reason, 0) for reason, count in re.findall(pattern, text)}
    return stats["model_stats"][0]["inference_stats"]["fail"]["count"] - since[0], by_reason


def test_a_failed_ensemble_request_is_counted_as_triton_counts_it(servers: dict[str, ServerProcess]) -> None:
    """Triton 2.51 counts it twice, as reason OTHER (Triton's L0_model_queue checks this for queue rejections)."""
    for name, server in servers.items():
        client = grpcclient.InferenceServerClient(server.grpc_url)
        before = failures(server, "failing_ensemble")
        x = grpcclient.InferInput("X", [1, 1], "FP32")
        x.set_data_from_numpy(column(1.0))
        for _ in range(3):
            with pytest.raises(InferenceServerException, match="refused"):
                client.infer("failing_ensemble", [x])
        expected = (6, {"REJECTED": 0, "CANCELED": 0, "BACKEND": 0, "OTHER": 6})
        assert settled(lambda: failures(server, "failing_ensemble", since=before), expected) == expected, name  # noqa: B023


def refusal(server: ServerProcess, given: tuple[str, ...]) -> tuple[str, str] | None:
    inputs = []
    for tensor in given:
        inputs.append(grpcclient.InferInput(tensor, [1, 1], "FP32"))
        inputs[-1].set_data_from_numpy(column(1.0))
    try:
        grpcclient.InferenceServerClient(server.grpc_url).infer("one_required", inputs)
    except InferenceServerException as refused:
        return str(refused.status()), refused.message()
    return None


def test_a_required_input_left_out_beside_optional_ones(servers: dict[str, ServerProcess]) -> None:
    answers = {name: refusal(server, ()) for name, server in servers.items()}
    assert answers["transerve"] == answers["triton"] == (
        "StatusCode.INVALID_ARGUMENT", "[request id: <id_unknown>] expected number of inputs between 1 and 2 but got "
        "0 inputs for model 'one_required'. Got input(s) [], but missing required input(s) ['INPUT0']. Please provide "
        "all required input(s).")
    # Triton 2.51 only counts the inputs, and runs the model without INPUT0; transerve refuses, in the same words.
    assert refusal(servers["triton"], ("INPUT1",)) is None
    assert refusal(servers["transerve"], ("INPUT1",)) == (
        "StatusCode.INVALID_ARGUMENT", "[request id: <id_unknown>] expected number of inputs between 1 and 2 but got "
        "1 inputs for model 'one_required'. Got input(s) ['INPUT1'], but missing required input(s) ['INPUT0']. "
        "Please provide all required input(s).")
