"""Restricted API groups and header forwarding, end to end and differential against the real Triton 2.51.

`--http-restricted-api` / `--grpc-restricted-protocol`: every endpoint of a restricted group answers only requests
carrying its header (HTTP 403, gRPC UNAVAILABLE, Triton's messages), whatever else is wrong with the request;
the flags tritonserver refuses are refused with its messages. `--http-header-forward-pattern` /
`--grpc-header-forward-pattern`: matching headers reach the model (and an ensemble's steps) as string parameters,
named as sent. The model that shows them has no config.pbtxt: both servers find its backend from `model.py`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from support import ServerProcess, free_ports, require_triton, start_transerve, start_triton
from support.servers import REPO_ROOT, transerve_argv
from support.triton_reference import triton_argv
from tritonclient.grpc import service_pb2, service_pb2_grpc

from transerve.frontends.access import GROUPS

MODELS = Path(__file__).resolve().parent / "access_models"
TIMEOUT_S = 30.0
SECRET = "secret"


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("access") / "models"
    shutil.copytree(MODELS, repo, ignore=shutil.ignore_patterns("__pycache__"))
    return repo


@pytest.fixture(scope="module")
def servers_with(repository: Path) -> Iterator[Callable[..., tuple[ServerProcess, ServerProcess]]]:
    """`servers_with(*flags)`: Triton and transerve started with the same flags, kept while the next tests ask for
    the same flags (one pair runs at a time)."""
    current: dict[tuple[str, ...], tuple[ServerProcess, ServerProcess]] = {}
    with contextlib.ExitStack() as outer:
        pair_stack = outer.enter_context(contextlib.ExitStack())

        def pair(*flags: str) -> tuple[ServerProcess, ServerProcess]:
            nonlocal pair_stack
            if flags not in current:
                install = require_triton()
                pair_stack.close()
                current.clear()
                pair_stack = outer.enter_context(contextlib.ExitStack())
                current[flags] = (pair_stack.enter_context(start_triton(repository, *flags, install=install)),
                                  pair_stack.enter_context(start_transerve(repository, *flags)))
            return current[flags]

        yield pair


def group_header(group: str) -> str:
    return f"{group}-key"


# ---- HTTP restrictions --------------------------------------------------------------------------------------

#: Health stays open: both servers' readiness is polled over /v2/health/ready.
HTTP_RESTRICTED = tuple(group for group in GROUPS if group != "health")
HTTP_FLAGS = tuple(f"--http-restricted-api={group}:{group_header(group)}={SECRET}" for group in HTTP_RESTRICTED)
INFER_BODY = {"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "FP32", "data": [1.0]}]}

#: (group, method, path, JSON body): one or more endpoints of each group, a wrong method among them.
HTTP_ENDPOINTS = [
    ("metadata", "GET", "/v2", None),
    ("metadata", "GET", "/v2/models/echo_parameters", None),
    ("metadata", "GET", "/v2/models/echo_parameters/versions/1", None),
    ("inference", "POST", "/v2/models/echo_parameters/infer", INFER_BODY),
    ("inference", "POST", "/v2/models/echo_parameters/versions/1/infer", INFER_BODY),
    ("inference", "GET", "/v2/models/echo_parameters/infer", None),
    ("inference", "POST", "/v2/models/echo_parameters/generate", {"INPUT0": [1.0]}),
    ("inference", "POST", "/v2/models/echo_parameters/generate_stream", {"INPUT0": [1.0]}),
    ("model-config", "GET", "/v2/models/echo_parameters/config", None),
    ("statistics", "GET", "/v2/models/echo_parameters/stats", None),
    ("statistics", "GET", "/v2/models/stats", None),
    ("trace", "GET", "/v2/trace/setting", None),
    ("trace", "GET", "/v2/models/echo_parameters/trace/setting", None),
    ("logging", "GET", "/v2/logging", None),
    ("shared-memory", "GET", "/v2/systemsharedmemory/status", None),
    ("shared-memory", "POST", "/v2/systemsharedmemory/region/nothing/unregister", None),
    ("shared-memory", "GET", "/v2/cudasharedmemory/status", None),
    ("model-repository", "POST", "/v2/repository/index", {}),
    ("model-repository", "POST", "/v2/repository/models/echo_parameters/unload", {}),
]


def http_call(server: ServerProcess, method: str, path: str, body: Any, headers: dict[str, str]) -> tuple[int, str]:
    answer = requests.request(method, f"{server.base_url}{path}", json=body, headers=headers, timeout=TIMEOUT_S)
    return answer.status_code, answer.text


def test_http_restricted_groups_answer_403_as_triton(servers_with: Any) -> None:
    triton, transerve = servers_with(*HTTP_FLAGS)
    for group, method, path, body in HTTP_ENDPOINTS:
        refused = [http_call(server, method, path, body, {}) for server in (triton, transerve)]
        assert refused[1] == refused[0], (method, path)
        assert refused[1] == (403, json.dumps({"error": f"This API is restricted, expecting header "
                                                        f"'{group_header(group)}'"}, separators=(",", ":")))
        wrong = {group_header(group): "wrong", group_header("health"): SECRET}
        assert http_call(transerve, method, path, body, wrong)[0] == 403
        header = {group_header(group): SECRET}
        assert http_call(transerve, method, path, body, header)[0] != 403, (method, path)
        assert http_call(triton, method, path, body, header)[0] != 403, (method, path)


def test_http_open_groups_and_unknown_paths_are_not_restricted(servers_with: Any) -> None:
    triton, transerve = servers_with(*HTTP_FLAGS)
    for method, path in (("GET", "/v2/health/live"), ("GET", "/v2/models/echo_parameters/ready"),
                         ("GET", "/v2/elsewhere"), ("GET", "/metrics/v2")):
        assert http_call(transerve, method, path, None, {})[0] == http_call(triton, method, path, None, {})[0]
    # The header names are HTTP's: any case will do.
    answer = requests.get(f"{transerve.base_url}/v2", headers={"METADATA-KEY": SECRET}, timeout=TIMEOUT_S)
    assert answer.status_code == 200


def test_tritonclient_sees_the_restriction(servers_with: Any) -> None:
    _, transerve = servers_with(*HTTP_FLAGS)
    client = httpclient.InferenceServerClient(transerve.http_url)
    with pytest.raises(Exception, match="This API is restricted, expecting header 'model-repository-key'"):
        client.unload_model("echo_parameters")
    with pytest.raises(Exception, match="explicit model load / unload is not allowed"):
        client.unload_model("echo_parameters", headers={"model-repository-key": SECRET})


# ---- gRPC restrictions --------------------------------------------------------------------------------------

GRPC_FLAGS = tuple(f"--grpc-restricted-protocol={group}:{group_header(group)}={SECRET}" for group in GROUPS)
GRPC_PREFIX = "triton-grpc-protocol-"


def infer_request() -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="echo_parameters")
    tensor = request.inputs.add(name="INPUT0", datatype="FP32", shape=[1])
    tensor.contents.fp32_contents.append(1.0)
    return request


#: (group, method, request) for every RPC of the service and grpc.health.v1's Check.
GRPC_CALLS = [
    ("health", "ServerLive", service_pb2.ServerLiveRequest()),
    ("health", "ServerReady", service_pb2.ServerReadyRequest()),
    ("health", "ModelReady", service_pb2.ModelReadyRequest(name="echo_parameters")),
    ("health", "grpc.health.v1.Health/Check", None),
    ("metadata", "ServerMetadata", service_pb2.ServerMetadataRequest()),
    ("metadata", "ModelMetadata", service_pb2.ModelMetadataRequest(name="echo_parameters")),
    ("inference", "ModelInfer", infer_request()),
    ("inference", "ModelStreamInfer", infer_request()),
    ("model-config", "ModelConfig", service_pb2.ModelConfigRequest(name="echo_parameters")),
    ("statistics", "ModelStatistics", service_pb2.ModelStatisticsRequest(name="echo_parameters")),
    ("model-repository", "RepositoryIndex", service_pb2.RepositoryIndexRequest()),
    ("model-repository", "RepositoryModelLoad", service_pb2.RepositoryModelLoadRequest(model_name="echo_parameters")),
    ("model-repository", "RepositoryModelUnload",
     service_pb2.RepositoryModelUnloadRequest(model_name="echo_parameters")),
    ("shared-memory", "SystemSharedMemoryStatus", service_pb2.SystemSharedMemoryStatusRequest()),
    ("shared-memory", "SystemSharedMemoryRegister", service_pb2.SystemSharedMemoryRegisterRequest(name="r")),
    ("shared-memory", "SystemSharedMemoryUnregister", service_pb2.SystemSharedMemoryUnregisterRequest()),
    ("shared-memory", "CudaSharedMemoryStatus", service_pb2.CudaSharedMemoryStatusRequest()),
    ("shared-memory", "CudaSharedMemoryRegister", service_pb2.CudaSharedMemoryRegisterRequest(name="r")),
    ("shared-memory", "CudaSharedMemoryUnregister", service_pb2.CudaSharedMemoryUnregisterRequest()),
    ("trace", "TraceSetting", service_pb2.TraceSettingRequest()),
    ("logging", "LogSettings", service_pb2.LogSettingsRequest()),
]


def grpc_call(server: ServerProcess, method: str, request: Any, metadata: list[tuple[str, str]]) -> tuple[Any, str]:
    """(status code, details) of one call; (OK, "") when it succeeds."""
    with grpc.insecure_channel(server.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            if method == "grpc.health.v1.Health/Check":
                check = channel.unary_unary(f"/{method}", request_serializer=lambda _: b"",
                                            response_deserializer=bytes)
                check(None, metadata=metadata, timeout=TIMEOUT_S)
            elif method == "ModelStreamInfer":
                list(stub.ModelStreamInfer(iter([request]), metadata=metadata, timeout=TIMEOUT_S))
            else:
                getattr(stub, method)(request, metadata=metadata, timeout=TIMEOUT_S)
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


@pytest.mark.parametrize("transport", ["native", "grpcio"])
def test_grpc_restricted_groups_answer_unavailable_as_triton(servers_with: Any, repository: Path,
                                                             transport: str) -> None:
    triton, native = servers_with(*GRPC_FLAGS)
    with contextlib.ExitStack() as stack:
        transerve = native if transport == "native" else stack.enter_context(
            start_transerve(repository, *GRPC_FLAGS, "--grpc-transport=grpcio"))
        for group, method, request in GRPC_CALLS:
            expected = (grpc.StatusCode.UNAVAILABLE,
                        f"This protocol is restricted, expecting header '{GRPC_PREFIX}{group_header(group)}'")
            assert grpc_call(triton, method, request, []) == expected, method
            assert grpc_call(transerve, method, request, []) == expected, method
            wrong = [(GRPC_PREFIX + group_header(group), "wrong")]
            assert grpc_call(transerve, method, request, wrong) == expected, method
            header = [(GRPC_PREFIX + group_header(group), SECRET)]
            for server in (triton, transerve):
                code, details = grpc_call(server, method, request, header)
                assert "restricted" not in details, (server.name, method, code, details)


def test_tritonclient_stream_sees_the_restriction(servers_with: Any) -> None:
    _, transerve = servers_with(*GRPC_FLAGS)
    client = grpcclient.InferenceServerClient(transerve.grpc_url)
    results: list[Any] = []
    client.start_stream(lambda result, error: results.append(error or result))
    inputs = [grpcclient.InferInput("INPUT0", [1], "FP32")]
    inputs[0].set_data_from_numpy(np.ones(1, np.float32))
    with pytest.raises(Exception, match="The stream is no longer in valid state"):
        for _ in range(100):  # the refusal ends the stream as soon as it is read
            client.async_stream_infer("echo_parameters", inputs)
            time.sleep(0.05)
    client.stop_stream()
    assert "This protocol is restricted, expecting header 'triton-grpc-protocol-inference-key'" in str(results[0])
    client.start_stream(lambda result, error: results.append(error or result),
                        headers={GRPC_PREFIX + "inference-key": SECRET})
    client.async_stream_infer("echo_parameters", inputs)
    client.stop_stream()
    assert isinstance(results[-1], grpcclient.InferResult)
    client.close()


# ---- flags tritonserver refuses -----------------------------------------------------------------------------

REFUSED = [
    (["--http-restricted-api=model-repository,health:k1=v1", "--http-restricted-api=metadata,health:k2=v2"],
     "restricted api 'health' can not be specified in multiple config groups"),
    (["--http-restricted-api=model-reposit,health:k1=v1"], "unknown restricted api 'model-reposit'"),
    (["--http-restricted-api=health:k1"],
     "--http-restricted-api option format is '<config name>:<setting>=<value>'. Got health:k1"),
    (["--grpc-restricted-protocol=model-repository,health:k1=v1", "--grpc-restricted-protocol=metadata,health:k2=v2"],
     "restricted protocol 'health' can not be specified in multiple config groups"),
    (["--grpc-restricted-protocol=bogus:k=v"], "unknown restricted protocol 'bogus'"),
]


def run_transerve(repository: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """`transerve serve` with flags it refuses: it must exit at once."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT / "src"))
    return subprocess.run(transerve_argv(repository, *free_ports(3), *flags), capture_output=True, text=True,
                          timeout=TIMEOUT_S, env=env)


@pytest.mark.parametrize(("flags", "message"), REFUSED)
def test_refused_flags_name_the_mistake_as_triton(repository: Path, tmp_path: Path, flags: list[str],
                                                  message: str) -> None:
    ours = run_transerve(repository, *flags)
    assert ours.returncode == 1
    assert message in ours.stderr
    install = require_triton()
    theirs = subprocess.run(triton_argv(install, repository, *free_ports(3), *flags), capture_output=True,
                            text=True, timeout=60, env=install.env(), cwd=tmp_path)
    assert theirs.returncode != 0
    assert message in theirs.stdout + theirs.stderr


def test_a_pattern_that_is_no_regular_expression_is_refused(repository: Path) -> None:
    ours = run_transerve(repository, "--grpc-header-forward-pattern=(")
    assert ours.returncode == 1
    assert "--grpc-header-forward-pattern: '(' is not a regular expression" in ours.stderr


# ---- header forwarding ---------------------------------------------------------------------------------------

def model_parameters(result: Any) -> dict[str, Any]:
    return json.loads(result.as_numpy("PARAMETERS")[0])


def http_parameters(server: ServerProcess, model: str, headers: dict[str, str]) -> dict[str, Any]:
    client = httpclient.InferenceServerClient(server.http_url)
    inputs = [httpclient.InferInput("INPUT0", [1], "FP32")]
    inputs[0].set_data_from_numpy(np.ones(1, np.float32))
    parameters = model_parameters(client.infer(model, inputs, headers=headers, parameters={"p": 1}))
    client.close()
    return parameters


def grpc_parameters(server: ServerProcess, model: str, metadata: dict[str, str], stream: bool) -> dict[str, Any]:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    inputs = [grpcclient.InferInput("INPUT0", [1], "FP32")]
    inputs[0].set_data_from_numpy(np.ones(1, np.float32))
    if not stream:
        result = client.infer(model, inputs, headers=metadata, parameters={"p": "q"})
    else:
        results: list[Any] = []
        client.start_stream(lambda result, error: results.append(error or result), headers=metadata)
        client.async_stream_infer(model, inputs, parameters={"p": "q"})
        client.stop_stream()
        result = results[0]
    client.close()
    return model_parameters(result)


HEADERS = {"My_Header_1": "one", "my_header_2": 'a "quoted" value\\', "other": "not forwarded"}
METADATA = {"my_header_1": "one", "other": "two"}


@pytest.mark.parametrize(("http_pattern", "grpc_pattern"), [
    ("MY_HEADER.*", "MY_HEADER.*"),
    (".*", "(?-i)MY_HEADER.*|^oth"),
])
def test_forwarded_headers_reach_models_as_in_triton(servers_with: Any, http_pattern: str, grpc_pattern: str) -> None:
    triton, transerve = servers_with(f"--http-header-forward-pattern={http_pattern}",
                                     f"--grpc-header-forward-pattern={grpc_pattern}")
    port = {triton.name: str(triton.http_port), transerve.name: str(transerve.http_port)}
    answers: dict[str, list[dict[str, Any]]] = {}
    for server in (triton, transerve):
        answers[server.name] = []
        for model in ("echo_parameters", "echo_ensemble"):
            http = http_parameters(server, model, HEADERS)
            if "Host" in http:  # the one header that differs: each server's own port
                http["Host"] = http["Host"].replace(port[server.name], "PORT")
            answers[server.name].append(http)
            answers[server.name].append(grpc_parameters(server, model, METADATA, stream=False))
            answers[server.name].append(grpc_parameters(server, model, METADATA, stream=True))
    assert answers["transerve"] == answers["tritonserver"]
    http, grpc_unary, grpc_stream = answers["transerve"][:3]
    assert http["My_Header_1"] == "one" and http["p"] == 1
    if http_pattern == ".*":
        assert http["other"] == "not forwarded" and "User-Agent" in http
        assert grpc_unary == grpc_stream == {"p": "q", "other": "two"}
    else:
        assert "other" not in http
        assert grpc_unary == grpc_stream == {"p": "q", "my_header_1": "one"}


def test_without_a_pattern_no_header_is_forwarded(servers_with: Any) -> None:
    triton, transerve = servers_with()
    for server in (triton, transerve):
        assert http_parameters(server, "echo_ensemble", HEADERS) == {"p": 1}
        assert grpc_parameters(server, "echo_parameters", METADATA, stream=False) == {"p": "q"}


def test_a_model_folder_without_config_is_served_as_triton_serves_it(servers_with: Any) -> None:
    triton, transerve = servers_with()
    configs = [requests.get(f"{server.base_url}/v2/models/echo_parameters/config", timeout=TIMEOUT_S).json()
               for server in (triton, transerve)]
    assert configs[1] == configs[0]
    assert configs[1]["backend"] == "python"


@pytest.mark.parametrize("key", ["triton_", "triton_x", "triton_enable_empty_final_response"])
def test_reserved_parameter_prefix_is_refused_as_in_triton(servers_with: Any, key: str) -> None:
    triton, transerve = servers_with()
    answers = []
    for server in (triton, transerve):
        body = {**INFER_BODY, "parameters": {key: True}}
        http = requests.post(f"{server.base_url}/v2/models/echo_parameters/infer", json=body, timeout=TIMEOUT_S)
        request = infer_request()
        request.parameters[key].bool_param = True
        answers.append(((http.status_code, http.json()), grpc_call(server, "ModelInfer", request, [])))
    assert answers[1] == answers[0]
    assert answers[1][0][0] == 400


# ---- explicit model control on a public address ---------------------------------------------------------------

OPEN_CONTROL_WARNING = "explicit model control is served over"


@pytest.mark.parametrize(
    ("flags", "warned"),
    [
        (["--model-control-mode=explicit", "--http-address=0.0.0.0", "--grpc-address=::"], ["HTTP", "GRPC"]),
        (["--model-control-mode=explicit", "--http-address=10.1.2.3", "--grpc-address=example.org"], ["HTTP", "GRPC"]),
        (["--model-control-mode=explicit", "--http-address=127.0.0.1", "--grpc-address=[::1]"], []),
        (["--model-control-mode=explicit", "--http-address=localhost", "--grpc-address=127.1.2.3"], []),
        (["--model-control-mode=poll", "--http-address=0.0.0.0", "--grpc-address=0.0.0.0"], []),
        (["--model-control-mode=explicit", "--allow-http=false", "--allow-grpc=false"], []),
        (["--model-control-mode=explicit", f"--http-restricted-api=model-repository,inference:k={SECRET}",
          f"--grpc-restricted-protocol=model-repository:k={SECRET}"], []),
        (["--model-control-mode=explicit", f"--http-restricted-api=inference:k={SECRET}"], ["HTTP", "GRPC"]),
    ],
)
def test_open_model_control_is_warned_of_per_protocol(flags, warned, caplog):
    from transerve.cli import access_from_args, build_parser, warn_open_model_control

    args = build_parser().parse_args(["serve", "--model-repository", str(MODELS), *flags])
    with caplog.at_level("WARNING", logger="transerve"):
        warn_open_model_control(args, access_from_args(args))
    said = [record.getMessage() for record in caplog.records if OPEN_CONTROL_WARNING in record.getMessage()]
    assert [message.split()[6] for message in said] == warned, said


def test_the_server_log_warns_of_model_control_open_to_the_network(tmp_path):
    """HTTP on every interface, gRPC on loopback: one warning, for HTTP, naming the flag that restricts it."""
    tmp_path.joinpath("repo").mkdir()
    with start_transerve(tmp_path / "repo", "--model-control-mode=explicit", "--http-address=0.0.0.0") as server:
        assert server.alive()
    warnings = [line for line in server.log.splitlines() if OPEN_CONTROL_WARNING in line]
    assert len(warnings) == 1, server.log
    assert " W " in warnings[0] and "over HTTP on 0.0.0.0" in warnings[0]
    assert "--http-restricted-api=model-repository:KEY=VALUE" in warnings[0]
