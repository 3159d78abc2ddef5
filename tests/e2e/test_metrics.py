"""Prometheus metrics on the metrics port: Triton's families (names, types, help texts, labels), counters that move
with the traffic, and `--metrics-config` / `--metrics-interval-ms` as in Triton 2.51."""

from __future__ import annotations

import math
import os
import re
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families
from support import EXAMPLE_REPOSITORY, REPO_ROOT, free_ports, require_triton, start_transerve, start_triton
from support.repositories import copy_model, int32_in_out, write_model
from support.servers import transerve_argv
from support.triton_reference import triton_argv

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
    write_model(repo, "failing", int32_in_out("failing"), FAILING_MODEL)
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


# ---- family declarations and --metrics-config, against the real Triton ------------------------------------------

#: Triton's pinned memory pool gauges: transerve has no pinned memory pool (no CUDA), so it declares none.
NOT_IN_TRANSERVE = {"nv_pinned_memory_pool_total_bytes", "nv_pinned_memory_pool_used_bytes"}
#: transerve's own family (Triton adds it in later releases).
NOT_IN_TRITON = {"nv_model_load_duration_secs"}


def families(port: int) -> dict[str, Any]:
    """/metrics through prometheus_client's parser, which types a sample only under its family's declaration."""
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {family.name: family for family in text_string_to_metric_families(text)}


def declarations(port: int) -> dict[str, tuple[str, str]]:
    return {name: (family.type, family.documentation) for name, family in families(port).items()}


def test_families_are_declared_as_triton_declares_them(transerve_server, triton_server):
    """Every family typed, under the name its samples carry, with Triton's type and help text: strict parsers and
    Triton's Grafana dashboards read them so."""
    for server in (transerve_server, triton_server):
        client = httpclient.InferenceServerClient(server.http_url)
        client.infer("add_sub", add_sub_inputs(batch=1))
    ours, theirs = families(transerve_server.metrics_port), families(triton_server.metrics_port)
    for name, family in ours.items():
        assert family.type != "unknown" and family.samples, name
    shared = set(theirs) - NOT_IN_TRANSERVE
    assert set(ours) - NOT_IN_TRITON == shared
    for name in shared:
        assert (ours[name].type, ours[name].documentation) == (theirs[name].type, theirs[name].documentation), name
        assert {sample.name for sample in ours[name].samples} == {sample.name for sample in theirs[name].samples}


def summary_samples(family: Any, model: str) -> dict[str, Any]:
    """A summary family's samples of one model: `count`, `sum` and {quantile: value}."""
    found: dict[str, Any] = {"quantiles": {}}
    for sample in family.samples:
        if sample.labels.get("model") != model:
            continue
        if sample.name.endswith("_count"):
            found["count"] = sample.value
        elif sample.name.endswith("_sum"):
            found["sum"] = sample.value
        else:
            found["quantiles"][sample.labels["quantile"]] = sample.value
    return found


def scrape_when(port: int, done: Any) -> dict[str, Any]:
    """Triton counts a request just after answering it: scrape until `done(families)` holds (or 10 s)."""
    deadline = time.monotonic() + 10
    while True:
        found = families(port)
        if done(found) or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


SUMMARY_FLAGS = ("--metrics-config=summary_latencies=true", "--metrics-config=counter_latencies=false",
                 "--metrics-config=summary_quantiles=0.5:0.05,0.75:0.01")


@pytest.mark.slow
def test_metrics_config_summaries_as_in_triton():
    """Summaries replace the latency counters, with the configured quantiles. One deliberate difference: with
    counter_latencies=false Triton 2.51 also stops counting successes, inferences and executions (its reporter
    skips every counter); transerve keeps counting them."""
    install = require_triton()
    requests_sent = 5
    found = {}
    for name, start in (("triton", start_triton), ("transerve", start_transerve)):
        with start(EXAMPLE_REPOSITORY, *SUMMARY_FLAGS, **({"install": install} if name == "triton" else {})) as server:
            client = httpclient.InferenceServerClient(server.http_url)
            for _ in range(requests_sent):
                client.infer("add_sub", add_sub_inputs(batch=1))
            found[name] = scrape_when(server.metrics_port, lambda families: summary_samples(
                families["nv_inference_request_summary_us"], "add_sub").get("count") == requests_sent)
    ours, theirs = found["transerve"], found["triton"]
    assert {name: (f.type, f.documentation) for name, f in ours.items() if name not in NOT_IN_TRITON} == \
        {name: (f.type, f.documentation) for name, f in theirs.items() if name not in NOT_IN_TRANSERVE}
    assert not any(name.endswith("_duration_us") for name in ours)
    for name in ("request", "queue", "compute_input", "compute_infer", "compute_output"):
        family = f"nv_inference_{name}_summary_us"
        for server in (ours, theirs):
            summary = summary_samples(server[family], "add_sub")
            assert summary["count"] == requests_sent
            assert set(summary["quantiles"]) == {"0.5", "0.75"}
            assert summary["quantiles"]["0.5"] <= summary["quantiles"]["0.75"] <= summary["sum"]
        idle = summary_samples(ours[family], "identity")
        assert idle["count"] == 0 and all(math.isnan(value) for value in idle["quantiles"].values())
    success = {s.labels["model"]: s.value for s in ours["nv_inference_request_success"].samples}
    assert success["add_sub"] == requests_sent


def test_summaries_of_a_caching_model_as_in_triton(tmp_path: Path):
    """With the response cache, Triton 2.51 summarises cache hits and misses instead of the request duration."""
    repo = tmp_path / "models"
    models = Path(__file__).resolve().parent / "response_cache_models"
    copy_model(models / "counter_cached", repo / "cached", models / "counter.py")
    install = require_triton()
    flags = ("--cache-config=local,size=1048576", "--metrics-config=summary_latencies=true")
    body = {"inputs": [{"name": "IN", "shape": [2], "datatype": "FP32", "data": [1.0, 2.0]}]}
    names = {}
    for name, start in (("triton", start_triton), ("transerve", start_transerve)):
        extra = (f"--cache-directory={install.server_dir / 'caches'}",) if name == "triton" else ()
        with start(repo, *flags, *extra, **({"install": install} if name == "triton" else {})) as server:
            for _ in range(3):
                requests.post(f"{server.base_url}/v2/models/cached/infer", json=body, timeout=10)
            found = scrape_when(server.metrics_port, lambda families: summary_samples(
                families["nv_cache_hit_summary_per_model"], "cached").get("count") == 2)
            names[name] = {family for family in found if family.endswith(("_summary_us", "_summary_per_model"))}
            assert summary_samples(found["nv_cache_miss_summary_per_model"], "cached")["count"] == 1
    assert names["transerve"] == names["triton"]
    assert "nv_inference_request_summary_us" not in names["transerve"]


@pytest.mark.parametrize(("flag", "message"), [
    ("--metrics-config=foo", "--metrics-config option format is <setting>=<value>. Got foo"),
    ("--metrics-config=a,b=c", "--metrics-config option format is <setting>=<value>. Got a,b=c"),
])
def test_malformed_metrics_config_is_refused_as_by_triton(tmp_path: Path, flag: str, message: str):
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT / "src"))
    ours = subprocess.run(transerve_argv(EXAMPLE_REPOSITORY, *free_ports(3), flag), capture_output=True, text=True,
                          timeout=30, env=env)
    assert ours.returncode == 1 and message in ours.stderr
    install = require_triton()
    theirs = subprocess.run(triton_argv(install, EXAMPLE_REPOSITORY, *free_ports(3), flag), capture_output=True,
                            text=True, timeout=60, env=install.env(), cwd=tmp_path)
    assert theirs.returncode != 0 and message in theirs.stdout + theirs.stderr


def test_cpu_metrics_are_read_once_per_interval():
    with start_transerve(EXAMPLE_REPOSITORY, "--metrics-interval-ms=600000") as server:
        first = scrape(server.metrics_port)
        ballast = bytearray(64 << 20)  # used memory moves; the gauges hold their reading for the interval
        time.sleep(0.2)
        second = scrape(server.metrics_port)
        del ballast
    for name in ("nv_cpu_utilization", "nv_cpu_memory_used_bytes"):
        assert first[(name, frozenset())] == second[(name, frozenset())]
