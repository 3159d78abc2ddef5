"""Paths a model config names stay inside the model's folder, over the load API of both protocols.

The reproduction of issue 19: a load request whose `config` parameter sets `default_model_filename` to a file
outside the model's folder (absolute, `../..`, or a symbolic link leading out) made the python backend run that
file. Here the file writes a marker when imported, so the tests see that it never ran.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from support import EXAMPLE_REPOSITORY, start_transerve
from tritonclient.utils import InferenceServerException

EVIL = '''
from pathlib import Path

Path({marker!r}).write_text("ran")


class TritonPythonModel:
    def execute(self, requests):
        return []
'''


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A repository holding add_sub (not loaded), with `x.py` beside it (inside the repository, outside the model's
    folder) and outside it; both would write `marker` if they ever ran."""
    root = tmp_path_factory.mktemp("paths")
    repo = root / "repo"
    shutil.copytree(EXAMPLE_REPOSITORY / "add_sub", repo / "add_sub")
    marker = root / "marker"
    for place in (root, repo):
        (place / "x.py").write_text(EVIL.format(marker=str(marker)))
    (repo / "add_sub" / "1" / "escape.py").symlink_to(root / "x.py")
    with start_transerve(repo, "--model-control-mode=explicit") as server:
        yield server, root, marker
        assert not marker.exists(), "a file outside the model's folder ran as a model"


def _config(filename: str) -> str:
    return json.dumps({"backend": "python", "default_model_filename": filename})


#: Outside the model's folder: absolute, climbing out (to the repository, above it), and through a link.
OUTSIDE = ["{root}/x.py", "../../x.py", "../../../x.py", "1/../../../x.py", "escape.py"]


@pytest.mark.parametrize("filename", OUTSIDE)
def test_http_load_refuses_a_model_file_outside_the_model_folder(setup, filename):
    server, root, marker = setup
    answer = requests.post(f"{server.base_url}/v2/repository/models/add_sub/load",
                           json={"parameters": {"config": _config(filename.format(root=root))}}, timeout=60)
    assert answer.status_code == 400, answer.text
    assert "default_model_filename" in answer.json()["error"]
    assert not marker.exists()
    assert not httpclient.InferenceServerClient(server.http_url).is_model_ready("add_sub")


@pytest.mark.parametrize("filename", OUTSIDE)
def test_grpc_load_refuses_a_model_file_outside_the_model_folder(setup, filename):
    server, root, marker = setup
    client = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException) as raised:
        client.load_model("add_sub", config=_config(filename.format(root=root)))
    assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "default_model_filename" in raised.value.message()
    assert not marker.exists()
    assert not client.is_model_ready("add_sub")


def test_load_with_files_refuses_a_model_file_outside_them(setup):
    server, root, marker = setup
    config = json.dumps({"backend": "python", "default_model_filename": str(root / "x.py")})
    client = httpclient.InferenceServerClient(server.http_url)
    with pytest.raises(InferenceServerException) as raised:
        client.load_model("uploaded", config=config, files={"file:1/model.py": b"raise SystemExit(3)\n"})
    assert "default_model_filename" in raised.value.message()
    assert not marker.exists()
    assert not client.is_model_ready("uploaded")


def test_the_model_still_loads_from_its_own_file_afterwards(setup):
    server, _, marker = setup
    client = httpclient.InferenceServerClient(server.http_url)
    client.load_model("add_sub")
    assert add(server, "add_sub") == [3.0, 3.0, 3.0, 3.0]
    client.unload_model("add_sub")
    assert not marker.exists()


def add(server, name: str) -> list[float]:
    body = {"inputs": [{"name": f"INPUT{i}", "shape": [1, 4], "datatype": "FP32", "data": [float(i + 1)] * 4}
                       for i in range(2)]}
    answer = requests.post(f"{server.base_url}/v2/models/{name}/infer", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()["outputs"][0]["data"]


def test_linked_model_and_version_folders_load(tmp_path):
    """Deployments link a model folder into the repository, or a version folder to a model store: both are the
    operator's links, so what they lead to is the model's folder."""
    store = tmp_path / "store"
    shutil.copytree(EXAMPLE_REPOSITORY / "add_sub", store / "add_sub")
    shutil.copytree(EXAMPLE_REPOSITORY / "add_sub" / "1", store / "versions" / "7")
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "add_sub").symlink_to(store / "add_sub", target_is_directory=True)
    (repo / "versioned").mkdir()
    (repo / "versioned" / "config.pbtxt").write_text(
        (EXAMPLE_REPOSITORY / "add_sub" / "config.pbtxt").read_text().replace('"add_sub"', '"versioned"'))
    (repo / "versioned" / "7").symlink_to(store / "versions" / "7", target_is_directory=True)
    with start_transerve(repo) as server:
        for name in ("add_sub", "versioned"):
            assert np.allclose(add(server, name), [3.0] * 4)
