"""Ensembles end to end: the tokenizer → model pipeline, load-time checks, step errors, batching and concurrency."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.http as httpclient
from support import EXAMPLE_REPOSITORY, start_transerve
from support.repositories import int32_in_out, write_model

SEED_BODY = {"inputs": [{"name": "input_text", "shape": [2, 1], "datatype": "BYTES",
                         "data": [["안녕하세요 😀"], ["hello"]]}]}


def by_name(answer: dict) -> dict[str, dict]:
    return {output["name"]: output for output in answer["outputs"]}


def test_seed_pipeline_over_curl_json_matches_triton(transerve_server, triton_server):
    ours = requests.post(f"{transerve_server.base_url}/v2/models/text_pipeline/infer", json=SEED_BODY, timeout=30)
    theirs = requests.post(f"{triton_server.base_url}/v2/models/text_pipeline/infer", json=SEED_BODY, timeout=30)
    assert ours.status_code == theirs.status_code == 200
    mine, reference = by_name(ours.json()), by_name(theirs.json())
    assert mine.keys() == reference.keys() == {"token_count", "mean_id"}
    for name in mine:
        assert (mine[name]["datatype"], mine[name]["shape"]) == (reference[name]["datatype"], reference[name]["shape"])
        np.testing.assert_allclose(mine[name]["data"], reference[name]["data"], rtol=1e-6)
    assert mine["token_count"]["data"] == [len("안녕하세요 😀".encode()), 5]
    for path in ("", "/config"):
        meta = requests.get(f"{transerve_server.base_url}/v2/models/text_pipeline{path}", timeout=10).json()
        ref = requests.get(f"{triton_server.base_url}/v2/models/text_pipeline{path}", timeout=10).json()
        for key in ("name", "platform", "inputs", "outputs", "max_batch_size"):
            assert meta.get(key) == ref.get(key), key
    ours_steps = requests.get(f"{transerve_server.base_url}/v2/models/text_pipeline/config", timeout=10).json()
    triton_steps = requests.get(f"{triton_server.base_url}/v2/models/text_pipeline/config", timeout=10).json()
    # tritonclient's newer schema adds ensemble_scheduling.max_inflight_requests, which Triton 2.51 lacks.
    assert ours_steps["ensemble_scheduling"]["step"] == triton_steps["ensemble_scheduling"]["step"]


def test_seed_pipeline_with_tritonclient_binary_bytes(transerve_server):
    client = httpclient.InferenceServerClient(transerve_server.http_url)
    text = httpclient.InferInput("input_text", [3, 1], "BYTES")
    text.set_data_from_numpy(np.array([["é"], ["🙂🙂"], [""]], dtype=object), binary_data=True)
    result = client.infer("text_pipeline", [text], outputs=[httpclient.InferRequestedOutput("token_count")])
    np.testing.assert_array_equal(result.as_numpy("token_count"), [[2], [8], [0]])
    assert result.as_numpy("mean_id") is None  # only what was asked for


ENSEMBLE = '''
name: "{name}" platform: "ensemble" max_batch_size: 16
input [ {{ name: "input_text" data_type: TYPE_STRING dims: [ 1 ] }} ]
output [ {{ name: "token_count" data_type: {count_type} dims: [ 1 ] }} ]
ensemble_scheduling {{ step [
  {{ model_name: "{tokenizer}" model_version: -1 input_map {{ key: "TEXT" value: "input_text" }}
     output_map {{ key: "input_ids" value: "ids" }} output_map {{ key: "attention_mask" value: "{mask}" }} }},
  {{ model_name: "token_stats" model_version: -1 input_map {{ key: "input_ids" value: "ids" }}
     input_map {{ key: "attention_mask" value: "mask" }} output_map {{ key: "token_count" value: "token_count" }} }}
] }}
'''

CYCLE = '''
name: "cycle" platform: "ensemble" max_batch_size: 16
input [ { name: "input_text" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "token_count" data_type: TYPE_INT64 dims: [ 1 ] } ]
ensemble_scheduling { step [
  { model_name: "byte_tokenizer" model_version: -1 input_map { key: "TEXT" value: "input_text" }
    output_map { key: "input_ids" value: "ids" } output_map { key: "attention_mask" value: "mask" } },
  { model_name: "token_stats" model_version: -1 input_map { key: "input_ids" value: "ids" }
    input_map { key: "attention_mask" value: "loop" } output_map { key: "token_count" value: "token_count" }
    output_map { key: "mean_id" value: "mean" } },
  { model_name: "token_stats" model_version: -1 input_map { key: "input_ids" value: "ids" }
    input_map { key: "attention_mask" value: "token_count" } output_map { key: "token_count" value: "loop" } }
] }
'''


def pipeline_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    for name in ("byte_tokenizer", "token_stats", "text_pipeline"):
        shutil.copytree(EXAMPLE_REPOSITORY / name, repo / name)
    return repo


def add_ensemble(repo: Path, name: str, text: str) -> None:
    write_model(repo, name, text)


def test_broken_ensembles_are_unavailable_with_reasons(tmp_path: Path):
    repo = pipeline_repo(tmp_path)
    good = {"count_type": "TYPE_INT64", "tokenizer": "byte_tokenizer", "mask": "mask"}
    add_ensemble(repo, "unknown_step", ENSEMBLE.format(name="unknown_step", **{**good, "tokenizer": "nope"}))
    add_ensemble(repo, "wrong_type", ENSEMBLE.format(name="wrong_type", **{**good, "count_type": "TYPE_FP32"}))
    add_ensemble(repo, "unmapped", ENSEMBLE.format(name="unmapped", **{**good, "mask": "other_mask"}))
    add_ensemble(repo, "cycle", CYCLE)
    with start_transerve(repo, "--strict-readiness=false") as server:
        index = {e["name"]: e for e in requests.post(f"{server.base_url}/v2/repository/index", timeout=10).json()}
        assert index["text_pipeline"]["state"] == "READY"
        expectations = {
            "unknown_step": "names a model that is not loaded",
            "wrong_type": "is INT64 from step 1 (model 'token_stats') but the ensemble declares FP32",
            "unmapped": "reads 'mask', which is neither an ensemble input nor any step's output",
            "cycle": "has a cycle",
        }
        for name, fragment in expectations.items():
            assert index[name]["state"] == "UNAVAILABLE", index[name]
            assert fragment in index[name]["reason"], index[name]["reason"]


FAILING_STATS = '''
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([], error=pb_utils.TritonError("stats exploded")) for _ in requests]
'''


def test_a_failing_step_is_named_in_the_error(tmp_path: Path):
    repo = pipeline_repo(tmp_path)
    (repo / "token_stats" / "1" / "model.py").write_text(FAILING_STATS)
    with start_transerve(repo) as server:
        answer = requests.post(f"{server.base_url}/v2/models/text_pipeline/infer", json=SEED_BODY, timeout=30)
        assert answer.status_code == 500
        error = answer.json()["error"]
        assert "step 1 (model 'token_stats')" in error and "stats exploded" in error


SLOW_STEP = '''
import time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        time.sleep(0.5)
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())]) for r in requests]
'''

PARALLEL = '''
name: "parallel" platform: "ensemble"
input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "A" data_type: TYPE_INT32 dims: [ 1 ] }, { name: "B" data_type: TYPE_INT32 dims: [ 1 ] } ]
ensemble_scheduling { step [
  { model_name: "slow_a" model_version: -1 input_map { key: "IN" value: "X" } output_map { key: "OUT" value: "A" } },
  { model_name: "slow_b" model_version: -1 input_map { key: "IN" value: "X" } output_map { key: "OUT" value: "B" } }
] }
'''


def test_independent_steps_run_concurrently_and_explicit_load_brings_dependencies(tmp_path: Path):
    repo = tmp_path / "repo"
    for name in ("slow_a", "slow_b"):
        write_model(repo, name, int32_in_out(name), SLOW_STEP)
    add_ensemble(repo, "parallel", PARALLEL)
    with start_transerve(repo, "--model-control-mode=explicit", "--load-model=parallel") as server:
        client = httpclient.InferenceServerClient(server.http_url)
        assert client.is_model_ready("slow_a") and client.is_model_ready("slow_b")
        body = {"inputs": [{"name": "X", "shape": [1], "datatype": "INT32", "data": [9]}]}
        started = time.monotonic()
        answer = requests.post(f"{server.base_url}/v2/models/parallel/infer", json=body, timeout=30)
        elapsed = time.monotonic() - started
        assert answer.status_code == 200 and {o["name"]: o["data"] for o in answer.json()["outputs"]} == {
            "A": [9], "B": [9]}
        assert elapsed < 0.95, f"the two 0.5 s steps ran one after the other ({elapsed:.2f} s)"
        client.unload_model("parallel", unload_dependents=True)
        assert not client.is_model_ready("slow_a") and not client.is_model_ready("slow_b")


def test_a_batching_step_batches_across_ensemble_requests(tmp_path: Path):
    repo = pipeline_repo(tmp_path)
    config = repo / "token_stats" / "config.pbtxt"
    config.write_text(config.read_text() + "\ndynamic_batching { max_queue_delay_microseconds: 200000 }\n")
    with start_transerve(repo) as server:
        results: dict[str, float] = {}

        def call(text: str) -> None:
            body = {"inputs": [{"name": "input_text", "shape": [1, 1], "datatype": "BYTES", "data": [[text]]}]}
            answer = requests.post(f"{server.base_url}/v2/models/text_pipeline/infer", json=body, timeout=30)
            results[text] = by_name(answer.json())["mean_id"]["data"][0]

        # Same length (Triton batches only equal shapes), different content: each answer is its own.
        texts = [f"{n:04d}" for n in range(8)]
        threads = [threading.Thread(target=call, args=(text,)) for text in texts]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        for text in texts:
            assert results[text] == pytest.approx(np.mean(np.frombuffer(text.encode(), np.uint8) + 1.0))
        stats = requests.get(f"{server.base_url}/v2/models/token_stats/stats", timeout=10).json()["model_stats"][0]
        assert stats["inference_count"] == 8
        assert stats["execution_count"] < 8, stats  # requests from different ensemble calls shared executions
        ensemble = requests.get(f"{server.base_url}/v2/models/text_pipeline/stats", timeout=10).json()
        assert ensemble["model_stats"][0]["inference_stats"]["success"]["count"] == 8


@pytest.mark.parametrize("field", ["name", "platform"])
def test_ensemble_appears_in_the_index(transerve_server, field):
    index = requests.post(f"{transerve_server.base_url}/v2/repository/index", timeout=10).json()
    assert any(entry["name"] == "text_pipeline" and entry["state"] == "READY" for entry in index), field
