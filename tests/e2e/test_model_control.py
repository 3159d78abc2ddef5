"""Model control while serving: explicit loads with config and file overrides, polling, reload under traffic."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from support import EXAMPLE_REPOSITORY, start_transerve
from tritonclient.utils import InferenceServerException

SCALER = '''
import triton_python_backend_utils as pb_utils

FACTOR = {factor}

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() * FACTOR)]) for r in requests]
'''

SCALER_CONFIG = {
    "backend": "python",
    "input": [{"name": "IN", "data_type": "TYPE_INT32", "dims": [1]}],
    "output": [{"name": "OUT", "data_type": "TYPE_INT32", "dims": [1]}],
}


def scaler_pbtxt(name: str) -> str:
    return (f'name: "{name}" backend: "python" input [{{name: "IN" data_type: TYPE_INT32 dims: [1]}}] '
            'output [{name: "OUT" data_type: TYPE_INT32 dims: [1]}]')


def write_scaler(repo: Path, name: str, factor: int, version: str = "1") -> None:
    (repo / name / version).mkdir(parents=True, exist_ok=True)
    (repo / name / "config.pbtxt").write_text(scaler_pbtxt(name))
    (repo / name / version / "model.py").write_text(SCALER.format(factor=factor))


def scale(server, name: str, value: int = 1) -> int:
    body = {"inputs": [{"name": "IN", "shape": [1], "datatype": "INT32", "data": [value]}]}
    answer = requests.post(f"{server.base_url}/v2/models/{name}/infer", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()["outputs"][0]["data"][0]


def wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


@pytest.fixture()
def explicit_server(tmp_path: Path):
    repo = tmp_path / "repo"
    shutil.copytree(EXAMPLE_REPOSITORY / "add_sub", repo / "add_sub")
    with start_transerve(repo, "--model-control-mode=explicit", "--load-model=*") as server:
        yield server, repo


def test_load_with_files_over_http_writes_nothing_into_the_repository(explicit_server):
    server, repo = explicit_server
    client = httpclient.InferenceServerClient(server.http_url)
    client.load_model("from_files", config=json.dumps(SCALER_CONFIG),
                      files={"file:1/model.py": SCALER.format(factor=3).encode()})
    assert scale(server, "from_files", 5) == 15
    assert not (repo / "from_files").exists()
    client.unload_model("from_files")
    assert not client.is_model_ready("from_files")


def test_load_with_files_over_grpc(explicit_server):
    server, _ = explicit_server
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.load_model("grpc_files", config=json.dumps(SCALER_CONFIG),
                      files={"file:1/model.py": SCALER.format(factor=4).encode()})
    assert scale(server, "grpc_files", 2) == 8


@pytest.mark.parametrize("path", ["../../escape.py", "/etc/escape.py", "1/../../escape.py", ""])
def test_file_paths_outside_the_model_folder_are_refused(explicit_server, path, tmp_path):
    server, _ = explicit_server
    parameters = {"config": json.dumps(SCALER_CONFIG), f"file:{path}": "cHJpbnQoKQ=="}
    answer = requests.post(f"{server.base_url}/v2/repository/models/evil/load",
                           json={"parameters": parameters}, timeout=30)
    assert answer.status_code == 400, answer.text
    assert not (tmp_path / "escape.py").exists()
    assert server.alive()


def test_files_without_config_and_bad_base64_are_refused(explicit_server):
    server, _ = explicit_server
    url = f"{server.base_url}/v2/repository/models/x/load"
    answer = requests.post(url, json={"parameters": {"file:1/model.py": "cHJpbnQoKQ=="}}, timeout=30)
    assert answer.status_code == 400 and "config" in answer.json()["error"]
    answer = requests.post(url, json={"parameters": {"config": "{}", "file:1/model.py": "not base64!"}}, timeout=30)
    assert answer.status_code == 400 and "base64" in answer.json()["error"]


def test_unload_dependents_is_accepted(explicit_server):
    server, _ = explicit_server
    client = httpclient.InferenceServerClient(server.http_url)
    client.unload_model("add_sub", unload_dependents=True)
    assert not client.is_model_ready("add_sub")


def test_poll_mode_picks_up_added_changed_and_removed_models(tmp_path: Path):
    repo = tmp_path / "repo"
    write_scaler(repo, "scaler", 2)
    with start_transerve(repo, "--model-control-mode=poll", "--repository-poll-secs=0.5") as server:
        client = httpclient.InferenceServerClient(server.http_url)
        assert scale(server, "scaler") == 2
        write_scaler(repo, "added", 7)
        wait_for(lambda: client.is_model_ready("added"))
        assert scale(server, "added") == 7
        (repo / "scaler" / "1" / "model.py").write_text(SCALER.format(factor=3))
        wait_for(lambda: scale(server, "scaler") == 3)
        (repo / "scaler" / "1" / "model.py").write_text("this is not python")  # a failed reload ...
        time.sleep(2.0)
        assert scale(server, "scaler") == 3  # ... keeps the old version serving
        write_scaler(repo, "scaler", 5, version="2")  # a new version replaces the old
        wait_for(lambda: client.get_model_metadata("scaler")["versions"] == ["2"])
        assert scale(server, "scaler") == 5
        shutil.rmtree(repo / "added")
        wait_for(lambda: not client.is_model_ready("added"))
        with pytest.raises(InferenceServerException):
            client.load_model("scaler")  # poll mode refuses explicit control, as Triton


def test_reload_under_traffic_drops_no_request(tmp_path: Path):
    repo = tmp_path / "repo"
    write_scaler(repo, "scaler", 1)
    with start_transerve(repo, "--model-control-mode=explicit", "--load-model=scaler") as server:
        client = httpclient.InferenceServerClient(server.http_url)
        stop = threading.Event()
        results: list[int] = []
        failures: list[str] = []

        def traffic() -> None:
            session = requests.Session()
            body = {"inputs": [{"name": "IN", "shape": [1], "datatype": "INT32", "data": [1]}]}
            while not stop.is_set():
                answer = session.post(f"{server.base_url}/v2/models/scaler/infer", json=body, timeout=30)
                if answer.status_code == 200:
                    results.append(answer.json()["outputs"][0]["data"][0])
                else:
                    failures.append(answer.text)

        threads = [threading.Thread(target=traffic) for _ in range(4)]
        for thread in threads:
            thread.start()
        try:
            for factor in (2, 3, 4):
                time.sleep(0.5)
                (repo / "scaler" / "1" / "model.py").write_text(SCALER.format(factor=factor))
                client.load_model("scaler")
            time.sleep(0.5)
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=30)
        assert failures == []
        assert len(results) > 50
        assert set(results) <= {1, 2, 3, 4} and results[-1] == 4
