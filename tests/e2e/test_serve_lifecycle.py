"""`transerve serve` as an operator meets it: flags, broken models, model control, limits, shutdown."""

from __future__ import annotations

import gzip
import json
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import requests
import tritonclient.http as httpclient
from support import EXAMPLE_REPOSITORY, start_transerve
from support.repositories import copy_example, write_model
from support.servers import free_ports, http_status, transerve_argv

ADD_SUB_BODY = {
    "inputs": [
        {"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]},
        {"name": "INPUT1", "shape": [1, 4], "datatype": "FP32", "data": [1, 1, 1, 1]},
    ]
}

SLOW_MODEL = '''
import time, numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.marker = args["model_repository"] + "/finalized"

    def execute(self, requests):
        time.sleep(1.0)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([7], np.int32))]) for _ in requests]

    def finalize(self):
        open(self.marker, "w").write("yes")
'''

SLOW_CONFIG = '''
name: "slow" backend: "python"
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
'''


def test_unknown_flag_exits_2_with_a_clear_error():
    result = subprocess.run(
        [sys.executable, "-m", "transerve", "serve", "--model-repository", str(EXAMPLE_REPOSITORY), "--bogus-flag=1"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert "unrecognized arguments: --bogus-flag=1" in result.stderr


def test_missing_repository_flag_exits_2():
    result = subprocess.run([sys.executable, "-m", "transerve", "serve"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--model-repository" in result.stderr


def test_both_flag_forms_and_backend_config(tmp_path):
    repo = copy_example(tmp_path, "add_sub")
    with start_transerve(repo, "--strict-readiness=true", "--exit-timeout-secs", "5", "--log-verbose=1",
                         "--backend-config=python,shm-default-byte-size=1048576",
                         "--repository-poll-secs=2", "--model-control-mode", "none") as server:
        answer = requests.post(f"{server.base_url}/v2/models/add_sub/infer", json=ADD_SUB_BODY, timeout=10)
        assert answer.status_code == 200
        assert answer.json()["outputs"][0]["data"] == [2.0, 3.0, 4.0, 5.0]


def test_log_flags_write_the_servers_log_where_and_as_asked(tmp_path):
    repo = copy_example(tmp_path, "add_sub")
    log_file = tmp_path / "server.log"
    with start_transerve(repo, f"--log-file={log_file}", "--log-format=ISO8601", "--log-warning=false",
                         "--cache-config=local,size=1024", "--cache-directory=/opt/tritonserver/caches") as server:
        settings = requests.get(f"{server.base_url}/v2/logging", timeout=10).json()
        assert settings == {"log_file": str(log_file), "log_info": True, "log_warning": False, "log_error": True,
                            "log_verbose_level": 0, "log_format": "ISO8601"}
        assert "model 'add_sub' is READY" not in server.log_path.read_text()  # not on stderr
    ready = [line for line in log_file.read_text().splitlines() if "model 'add_sub' is READY" in line]
    assert ready and ready[0].split(" ", 1)[0].endswith("Z")  # ISO 8601 in UTC


def test_a_cache_config_other_than_local_size_is_refused():
    result = subprocess.run(
        [sys.executable, "-m", "transerve", "serve", "--model-repository", str(EXAMPLE_REPOSITORY),
         "--cache-config=redis,host=localhost"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode != 0
    assert "only the 'local' cache is available (local,size=BYTES)" in result.stderr


def test_sigterm_finishes_in_flight_requests_then_finalizes_and_exits_0(tmp_path):
    repo = tmp_path / "repo"
    model_dir = write_model(repo, "slow", SLOW_CONFIG, SLOW_MODEL)
    with start_transerve(repo) as server:
        result: dict = {}

        def call() -> None:
            body = {"inputs": [{"name": "IN", "shape": [1], "datatype": "INT32", "data": [1]}]}
            result["answer"] = requests.post(f"{server.base_url}/v2/models/slow/infer", json=body, timeout=30)

        caller = threading.Thread(target=call)
        caller.start()
        time.sleep(0.3)  # the request is inside execute() now
        server.process.send_signal(signal.SIGTERM)
        caller.join(timeout=30)
        assert server.process.wait(timeout=30) == 0
        assert result["answer"].status_code == 200
        assert result["answer"].json()["outputs"][0]["data"] == [7]
    assert (model_dir / "finalized").read_text() == "yes"


def test_broken_models_are_unavailable_with_reasons_and_the_rest_serve(tmp_path):
    repo = copy_example(tmp_path, "add_sub")
    write_model(repo, "bad_config", 'name: "bad_config" backend: "python" max_batch_size: "x"', "")
    write_model(repo, "bad_import", SLOW_CONFIG.replace('"slow"', '"bad_import"'), "import no_such_module_here\n")
    write_model(repo, "wrong_name", SLOW_CONFIG, SLOW_MODEL)  # config says "slow"
    (repo / "no_versions").mkdir()
    (repo / "no_versions" / "config.pbtxt").write_text(SLOW_CONFIG.replace('"slow"', '"no_versions"'))
    with start_transerve(repo, "--strict-readiness=false") as server:
        index = {e["name"]: e for e in requests.post(f"{server.base_url}/v2/repository/index", timeout=10).json()}
        assert index["add_sub"]["state"] == "READY"
        for name, fragment in [("bad_config", "failed to parse"), ("bad_import", "no_such_module_here"),
                               ("wrong_name", "must match the folder name"), ("no_versions", "no version")]:
            assert index[name]["state"] == "UNAVAILABLE", index[name]
            assert fragment in index[name]["reason"], index[name]
            assert f"model '{name}'" in server.log  # one log line says why
        ready = requests.post(f"{server.base_url}/v2/repository/index", json={"ready": True}, timeout=10).json()
        assert [e["name"] for e in ready] == ["add_sub"]
        assert requests.post(f"{server.base_url}/v2/models/add_sub/infer", json=ADD_SUB_BODY, timeout=10).ok
        failed = requests.post(f"{server.base_url}/v2/models/bad_import/infer", json=ADD_SUB_BODY, timeout=10)
        assert failed.status_code == 503 and "no_such_module_here" in failed.json()["error"]
        assert requests.get(f"{server.base_url}/v2/health/ready", timeout=10).status_code == 200


def test_strict_readiness_reports_not_ready_while_a_model_is_broken(tmp_path):
    repo = copy_example(tmp_path, "add_sub")
    write_model(repo, "bad_import", SLOW_CONFIG.replace('"slow"', '"bad_import"'), "import no_such_module\n")
    http, grpc, metrics = free_ports(3)
    log = (tmp_path / "log").open("wb")
    process = subprocess.Popen(transerve_argv(repo, http, grpc, metrics), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while http_status(http, "/v2/health/live") != 200:
            assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "log").read_text()
            time.sleep(0.05)
        assert http_status(http, "/v2/health/ready") == 400
        assert http_status(http, "/v2/models/add_sub/ready") == 200
    finally:
        process.terminate()
        assert process.wait(timeout=30) == 0
        log.close()


def test_explicit_model_control(tmp_path):
    repo = copy_example(tmp_path, "add_sub", "identity", "params")
    with start_transerve(repo, "--model-control-mode=explicit", "--load-model", "add_sub") as server:
        base = server.base_url
        names = {e["name"]: e.get("state") for e in requests.post(f"{base}/v2/repository/index", timeout=10).json()}
        assert names == {"add_sub": "READY", "identity": None, "params": None}
        assert requests.post(f"{base}/v2/repository/models/identity/load", timeout=60).status_code == 200
        client = httpclient.InferenceServerClient(server.http_url)
        assert client.is_model_ready("identity")
        client.unload_model("add_sub")
        assert not client.is_model_ready("add_sub")
        assert requests.post(f"{base}/v2/models/add_sub/infer", json=ADD_SUB_BODY, timeout=10).status_code == 404
        client.load_model("add_sub")
        assert client.is_model_ready("add_sub")
        for bad in ("%2E%2E", "..%2F..%2Fetc", "%2Fetc"):
            answer = requests.post(f"{base}/v2/repository/models/{bad}/load", timeout=10)
            assert answer.status_code == 400, (bad, answer.text)
        missing = requests.post(f"{base}/v2/repository/models/nope/load", timeout=10)
        assert missing.status_code == 400 and "nope" in missing.json()["error"]
        override = json.dumps({"backend": "python", "max_batch_size": 2,
                               "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
                               "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [-1]},
                                          {"name": "PARAMETERS", "data_type": "TYPE_STRING", "dims": [1]}],
                               "parameters": {"scale": {"string_value": "5"}}})
        client.load_model("params", config=override)
        assert client.get_model_config("params")["max_batch_size"] == 2
        data = httpclient.InferInput("INPUT0", [1, 2], "FP32")
        data.set_data_from_numpy(np.array([[1, 2]], np.float32))
        result = client.infer("params", [data])
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), [[5, 10]])


def test_body_over_the_input_limit_is_refused_before_it_is_read(tmp_path):
    repo = copy_example(tmp_path, "add_sub")
    with start_transerve(repo, "--http-max-input-size=1024") as server:
        answer = requests.post(f"{server.base_url}/v2/models/add_sub/infer", data=b"x" * 4096, timeout=10)
        assert answer.status_code == 413 and "1024" in answer.json()["error"]
        with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as raw:
            raw.sendall(b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999\r\n\r\n")
            assert raw.recv(4096).startswith(b"HTTP/1.1 413")
        bomb = gzip.compress(b"{" + b" " * 100_000 + b"}")
        answer = requests.post(f"{server.base_url}/v2/models/add_sub/infer", data=bomb,
                               headers={"Content-Encoding": "gzip"}, timeout=10)
        assert answer.status_code == 400 and "exceeds the limit" in answer.json()["error"]
        assert server.alive()


def test_gzip_and_deflate_bodies_and_compressed_responses(transerve_server):
    client = httpclient.InferenceServerClient(transerve_server.http_url)
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        tensor = httpclient.InferInput(name, [2, 4], "FP32")
        tensor.set_data_from_numpy(np.arange(8, dtype=np.float32).reshape(2, 4))
        inputs.append(tensor)
    for algorithm in ("gzip", "deflate"):
        result = client.infer("add_sub", inputs, request_compression_algorithm=algorithm,
                              response_compression_algorithm=algorithm)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.arange(8).reshape(2, 4) * 2)


def test_pipelined_requests_on_one_connection_are_answered_in_order(transerve_server):
    bodies = []
    for value in range(5):
        body = json.dumps({"id": str(value), "inputs": [
            {"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [value] * 4},
            {"name": "INPUT1", "shape": [1, 4], "datatype": "FP32", "data": [0] * 4}]}).encode()
        bodies.append(b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                      % (len(body), body))
    with socket.create_connection(("127.0.0.1", transerve_server.http_port), timeout=10) as raw:
        raw.sendall(b"".join(bodies))
        received = b""
        deadline = time.monotonic() + 10
        while received.count(b'"id"') < 5 and time.monotonic() < deadline:
            received += raw.recv(65536)
    ids = [chunk.split(b'"', 1)[0] for chunk in received.split(b'"id":"')[1:]]
    assert ids == [b"0", b"1", b"2", b"3", b"4"]


def test_a_body_framed_both_by_chunks_and_by_length_is_read_by_chunks_then_the_connection_closes(transerve_server):
    """RFC 9112, 6.3: Transfer-Encoding wins over Content-Length, and the connection must not be reused, so that
    bytes a proxy would read differently can never become a second request."""
    body = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1] * 4},
                                  {"name": "INPUT1", "shape": [1, 4], "datatype": "FP32", "data": [2] * 4}]}).encode()
    framed = b"%X\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    smuggled = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection(("127.0.0.1", transerve_server.http_port), timeout=10) as raw:
        raw.sendall(b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                    b"Content-Length: 5\r\n\r\n" + framed + smuggled)
        received = b""
        while chunk := raw.recv(65536):
            received += chunk
    assert received.startswith(b"HTTP/1.1 200 OK") and b"Connection: close" in received
    assert received.count(b"HTTP/1.1") == 1 and b'"data":[3.0,3.0,3.0,3.0]' in received


def test_several_repositories_and_version_policies(tmp_path):
    first = copy_example(tmp_path, "add_sub")
    second = tmp_path / "second"
    versioned = SLOW_CONFIG.replace('"slow"', '"versioned"') + "version_policy: { all: {} }\n"
    fast = SLOW_MODEL.replace("time.sleep(1.0)", "pass").replace("[7]", "[int(self.version)]").replace(
        'self.marker = args["model_repository"] + "/finalized"', 'self.marker = "/dev/null"; '
        'self.version = args["model_version"]')
    for version in ("1", "2", "3"):
        write_model(second, "versioned", versioned, fast, version)
    with start_transerve(first, "--model-repository", str(second)) as server:
        client = httpclient.InferenceServerClient(server.http_url)
        assert client.get_model_metadata("versioned")["versions"] == ["1", "2", "3"]
        assert client.get_model_metadata("versioned", "2")["versions"] == ["2"]  # as Triton: that version alone
        tensor = httpclient.InferInput("IN", [1], "INT32")
        tensor.set_data_from_numpy(np.array([0], np.int32))
        for version in ("1", "2", "3"):
            assert client.infer("versioned", [tensor], model_version=version).as_numpy("OUT")[0] == int(version)
        assert client.infer("versioned", [tensor]).as_numpy("OUT")[0] == 3  # no version: the latest
        assert client.is_model_ready("add_sub")


@pytest.mark.parametrize("path", ["/v2/models/add_sub/versions/abc", "/v2/models/add_sub/versions/9/ready"])
def test_unknown_versions(transerve_server, path):
    answer = requests.get(transerve_server.base_url + path, timeout=10)
    assert answer.status_code in (400, 404)


CRASHY_MODEL = '''
import os, numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            if value[0] < 0:
                os._exit(3)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", value)]))
        return responses
'''


def test_a_crashing_model_gets_500_naming_it_and_the_server_recovers(tmp_path):
    repo = copy_example(tmp_path, "add_sub")
    write_model(repo, "crashy", SLOW_CONFIG.replace('"slow"', '"crashy"'), CRASHY_MODEL)
    with start_transerve(repo) as server:
        url = f"{server.base_url}/v2/models/crashy/infer"

        def call(value: int) -> requests.Response:
            body = {"inputs": [{"name": "IN", "shape": [1], "datatype": "INT32", "data": [value]}]}
            return requests.post(url, json=body, timeout=60)

        assert call(1).json()["outputs"][0]["data"] == [1]
        crashed = call(-1)
        assert crashed.status_code == 500
        assert "crashy" in crashed.json()["error"] and "exited unexpectedly" in crashed.json()["error"]
        deadline = time.monotonic() + 60
        while (answer := call(2)).status_code != 200:  # the instance restarts in the background
            assert answer.status_code in (500, 503) and time.monotonic() < deadline, answer.text
            time.sleep(0.1)
        assert answer.json()["outputs"][0]["data"] == [2]
        assert requests.post(f"{server.base_url}/v2/models/add_sub/infer", json=ADD_SUB_BODY, timeout=10).ok
