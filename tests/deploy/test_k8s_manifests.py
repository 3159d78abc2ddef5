"""The Kubernetes manifests in deploy/ (KServe runtime, Helm chart): they parse, agree with each other, and the exact
command line each gives its container starts a real server whose probes and metrics answer.

There is no helm binary or cluster here. The chart's templates only substitute values, so `render` below (which
refuses any other template action) produces what helm would; see docs/kubernetes.md.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from support.doc_blocks import code_blocks, commands
from support.servers import EXAMPLE_REPOSITORY, REPO_ROOT, http_status, start_server

DEPLOY = REPO_ROOT / "deploy"
CHART = DEPLOY / "helm" / "transerve"
KSERVE = DEPLOY / "kserve"
RELEASE = "demo"
_ACTION = re.compile(r"\{\{-?\s*(.*?)\s*-?\}\}")
_SUBSTITUTION = re.compile(r"\.(Values(?:\.\w+)+|Release\.Name)")
_QUEUE_METRIC = "nv_inference_queue_duration_us"


def render(text: str, values: dict[str, Any], release: str = RELEASE) -> str:
    """Replace `{{ .Values.a.b }}` and `{{ .Release.Name }}`; any other template action is an error."""
    def substitute(match: re.Match[str]) -> str:
        action = _SUBSTITUTION.fullmatch(match.group(1))
        if action is None:
            raise ValueError(f"template action the renderer does not support: {match.group(0)}")
        if action.group(1) == "Release.Name":
            return release
        value: Any = values
        for key in action.group(1).split(".")[1:]:
            value = value[key]
        return str(value)
    return _ACTION.sub(substitute, text)


def _chart() -> dict[str, dict[str, Any]]:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    rendered = {}
    for template in sorted((CHART / "templates").glob("*.yaml")):
        documents = [d for d in yaml.safe_load_all(render(template.read_text(), values)) if d]
        assert len(documents) == 1, template
        rendered[documents[0]["kind"]] = documents[0]
    return rendered


def _kserve() -> dict[str, dict[str, Any]]:
    documents = {}
    for path in sorted(KSERVE.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            documents[document["kind"]] = document
    return documents


def test_renderer_refuses_logic_it_does_not_implement() -> None:
    assert render("a: {{ .Values.x.y }} {{ .Release.Name }}", {"x": {"y": 3}}) == f"a: 3 {RELEASE}"
    with pytest.raises(ValueError, match="does not support"):
        render("{{- if .Values.x }}", {"x": 1})


def test_chart_kinds_ports_and_probes_agree() -> None:
    chart = _chart()
    assert yaml.safe_load((CHART / "Chart.yaml").read_text())["apiVersion"] == "v2"
    assert {k: d["apiVersion"] for k, d in chart.items()} == {
        "Deployment": "apps/v1", "Service": "v1", "HorizontalPodAutoscaler": "autoscaling/v2", "ConfigMap": "v1"}
    container = chart["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8000, "grpc": 8001, "metrics": 8002}
    args = container["args"]
    assert {"--http-port=8000", "--grpc-port=8001", "--metrics-port=8002"} <= set(args)
    assert container["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    annotations = chart["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == ports["metrics"]
    service = chart["Service"]["spec"]
    assert service["selector"] == chart["Deployment"]["spec"]["selector"]["matchLabels"]
    assert {p["targetPort"]: p["port"] for p in service["ports"]} == ports
    hpa = chart["HorizontalPodAutoscaler"]["spec"]
    assert hpa["scaleTargetRef"]["name"] == chart["Deployment"]["metadata"]["name"] == RELEASE
    rule = yaml.safe_load(chart["ConfigMap"]["data"]["config.yaml"])["rules"][0]
    assert rule["name"]["as"] == hpa["metrics"][0]["pods"]["metric"]["name"]
    assert rule["name"]["matches"] == _QUEUE_METRIC and _QUEUE_METRIC in rule["seriesQuery"]


def test_kserve_runtime_and_inference_service_agree() -> None:
    documents = _kserve()
    runtime, service = documents["ServingRuntime"], documents["InferenceService"]
    assert runtime["apiVersion"] == "serving.kserve.io/v1alpha1"
    assert service["apiVersion"] == "serving.kserve.io/v1beta1"
    spec = runtime["spec"]
    assert set(spec["protocolVersions"]) == {"v2", "grpc-v2"}
    assert {"triton", "onnx", "pytorch"} <= {f["name"] for f in spec["supportedModelFormats"]}
    container = spec["containers"][0]
    assert {"--model-repository=/mnt/models", "--http-port=8080", "--grpc-port=9000",
            "--metrics-port=8002"} <= set(container["args"])
    assert container["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": 8080}
    assert container["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": 8080}
    assert spec["annotations"]["prometheus.kserve.io/port"] == "8002"
    assert spec["annotations"]["prometheus.kserve.io/path"] == "/metrics"
    model = service["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"]["name"] in {f["name"] for f in spec["supportedModelFormats"]}


def _local_argv(container: dict[str, Any], repository: Path, http: int, grpc: int, metrics: int,
                cluster_ports: tuple[int, int], repository_arg: str) -> list[str]:
    """The container's command line, run here: the same flags with local ports, the local repository, loopback."""
    assert container["command"] == ["transerve"]
    cluster_http, cluster_grpc = cluster_ports
    local = {f"--http-port={cluster_http}": f"--http-port={http}", f"--grpc-port={cluster_grpc}": f"--grpc-port={grpc}",
             "--metrics-port=8002": f"--metrics-port={metrics}", repository_arg: f"--model-repository={repository}"}
    args = [local.get(arg, arg) for arg in container["args"]]
    assert set(local.values()) <= set(args), args
    loopback = ["--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1"]
    return [sys.executable, "-m", "transerve", *args, *loopback]


@pytest.mark.parametrize("source", ["helm", "kserve"])
def test_container_command_line_serves_probes_and_queue_metric(source: str, tmp_path: Path) -> None:
    if source == "helm":
        container = _chart()["Deployment"]["spec"]["template"]["spec"]["containers"][0]
        cluster_ports, repository_arg = (8000, 8001), "--model-repository=/models"
    else:
        container = _kserve()["ServingRuntime"]["spec"]["containers"][0]
        cluster_ports, repository_arg = (8080, 9000), "--model-repository=/mnt/models"
    repository = tmp_path / "models"
    shutil.copytree(EXAMPLE_REPOSITORY, repository)
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT / "src"), os.environ.get("PYTHONPATH")])))
    with tempfile.TemporaryDirectory(prefix="transerve-k8s-") as logs:
        server = start_server(source, lambda h, g, m: _local_argv(container, repository, h, g, m, cluster_ports,
                                                                repository_arg),
                              log_dir=Path(logs), env=env, cwd=tmp_path)
        try:
            for probe in ("livenessProbe", "readinessProbe"):
                assert http_status(server.http_port, container[probe]["httpGet"]["path"]) == 200
            metrics = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10)
            assert metrics.status_code == 200
            assert re.search(rf'^{_QUEUE_METRIC}\{{model="add_sub",version="1"\}} ', metrics.text, re.M), metrics.text
        finally:
            assert server.stop() == 0, server.log_tail()


def test_kubernetes_page_commands_name_files_that_exist() -> None:
    """docs/kubernetes.md's commands need docker, kubectl or helm and a cluster, none of which is here: they are not
    run (the page says so). What they name must exist, and the chart they install is the one tested above."""
    lines = [line for block in code_blocks(REPO_ROOT / "docs" / "kubernetes.md", "bash") for line in commands(block)]
    assert [line.split()[0] for line in lines] == ["docker", "kubectl", "kubectl", "helm"]
    named = [word for line in lines for word in line.split() if word.startswith("deploy/")]
    assert named and all((REPO_ROOT / path).exists() for path in named), named
