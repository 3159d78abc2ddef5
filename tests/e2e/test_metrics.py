"""Prometheus metrics on the metrics port: Triton's names and labels, counters that move with the traffic."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.http as httpclient
from support import EXAMPLE_REPOSITORY, start_transerve

SAMPLE = re.compile(r'^(?P<name>[a-z_]+)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$')

FAILING_MODEL = '''
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            if value[0] < 0:
                responses.append(pb_utils.InferenceResponse([], error=pb_utils.TritonError("negative input")))
            else:
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", value)]))
        return responses
'''


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    samples = {}
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        match = SAMPLE.match(line)
        assert match, line
        labels = frozenset(re.findall(r'(\w+)="([^"]*)"', match["labels"] or ""))
        samples[(match["name"], labels)] = float(match["value"])
    return samples


def model_labels(model: str, **extra: str) -> frozenset:
    return frozenset({"model": model, "version": "1", **extra}.items())


def add_sub_inputs(batch: int) -> list[httpclient.InferInput]:
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        tensor = httpclient.InferInput(name, [batch, 4], "FP32")
        tensor.set_data_from_numpy(np.ones((batch, 4), np.float32))
        inputs.append(tensor)
    return inputs


def test_counters_move_with_n_requests(transerve_server):
    before = scrape(transerve_server.metrics_port)
    client = httpclient.InferenceServerClient(transerve_server.http_url)
    n = 7
    for _ in range(n):
        client.infer("add_sub", add_sub_inputs(batch=2))
    with pytest.raises(Exception, match="expected 2 inputs"):  # validation failures are not counted, as in Triton
        client.infer("add_sub", add_sub_inputs(batch=2)[:1])
    after = scrape(transerve_server.metrics_port)
    labels = model_labels("add_sub")

    def moved(name: str, key: frozenset = labels) -> float:
        return after[(name, key)] - before.get((name, key), 0.0)

    assert moved("nv_inference_request_success") == n
    assert moved("nv_inference_count") == 2 * n  # samples, not requests
    assert moved("nv_inference_exec_count") == n
    for reason in ("REJECTED", "CANCELED", "BACKEND", "OTHER"):
        assert moved("nv_inference_request_failure", model_labels("add_sub", reason=reason)) == 0
    for name in ("request", "queue", "compute_input", "compute_infer", "compute_output"):
        assert moved(f"nv_inference_{name}_duration_us") >= 0
    assert moved("nv_inference_request_duration_us") > 0
    assert moved("nv_inference_compute_infer_duration_us") > 0
    assert after[("nv_inference_pending_request_count", labels)] == 0
    assert after[("nv_model_load_duration_secs", labels)] > 0
    assert 0.0 <= after[("nv_cpu_utilization", frozenset())] <= 1.0
    total = after[("nv_cpu_memory_total_bytes", frozenset())]
    assert 0 < after[("nv_cpu_memory_used_bytes", frozenset())] < total


def test_model_errors_count_as_backend_failures(tmp_path: Path):
    repo = tmp_path / "repo"
    (repo / "failing" / "1").mkdir(parents=True)
    (repo / "failing" / "config.pbtxt").write_text(
        'name: "failing" backend: "python" input [{name: "IN" data_type: TYPE_INT32 dims: [1]}] '
        'output [{name: "OUT" data_type: TYPE_INT32 dims: [1]}]')
    (repo / "failing" / "1" / "model.py").write_text(FAILING_MODEL)
    with start_transerve(repo) as server:
        for value in (1, -1, -2):
            body = {"inputs": [{"name": "IN", "shape": [1], "datatype": "INT32", "data": [value]}]}
            requests.post(f"{server.base_url}/v2/models/failing/infer", json=body, timeout=10)
        samples = scrape(server.metrics_port)
        assert samples[("nv_inference_request_success", model_labels("failing"))] == 1
        assert samples[("nv_inference_request_failure", model_labels("failing", reason="BACKEND"))] == 2
        stats = requests.get(f"{server.base_url}/v2/models/failing/stats", timeout=10).json()
        assert stats["model_stats"][0]["inference_stats"]["fail"]["count"] == 2


def test_metric_names_and_labels_match_triton(transerve_server, triton_server):
    """Dashboards written for Triton query these names and labels; transerve must expose each of them."""
    wanted = {name for name, labels in scrape(triton_server.metrics_port) if name.startswith("nv_inference")}
    wanted |= {"nv_cpu_utilization", "nv_cpu_memory_total_bytes", "nv_cpu_memory_used_bytes"}
    ours = scrape(transerve_server.metrics_port)
    assert wanted <= {name for name, _ in ours}
    triton_keys = {labels for name, labels in scrape(triton_server.metrics_port)
                   if name == "nv_inference_request_failure" and ("model", "add_sub") in labels}
    our_keys = {labels for name, labels in ours
                if name == "nv_inference_request_failure" and ("model", "add_sub") in labels}
    assert our_keys == triton_keys


def test_metrics_can_be_turned_off(tmp_path: Path):
    with start_transerve(EXAMPLE_REPOSITORY, "--allow-metrics=false") as server:
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", server.metrics_port), timeout=2).close()
        assert server.alive()


def test_metrics_endpoint_paths(transerve_server):
    base = f"http://127.0.0.1:{transerve_server.metrics_port}"
    assert requests.get(f"{base}/nope", timeout=10).status_code == 404
    assert requests.post(f"{base}/metrics", timeout=10).status_code == 405
    answer = requests.get(f"{base}/metrics", timeout=10)
    assert answer.headers["Content-Type"].startswith("text/plain")
    assert "# TYPE nv_inference_pending_request_count gauge" in answer.text
