"""EXECUTION_ENV_PATH: a python model runs in a Python environment of its own, here one with NumPy 1.26 while the
server has whatever NumPy it has, against the real Triton too.

The environment is built here as conda-pack lays one out (bin/python, bin/activate that finds its own folder,
lib/python3.X/site-packages, conda-meta/), packed into a .tar.gz: conda-pack itself packs only conda environments,
and there is no conda on the machines this runs on. It is a `--copies` virtual environment, so its interpreter
still finds its standard library where the base Python is installed; everything else it imports is its own.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from support import ServerProcess, in_ci, require_triton, start_transerve, start_triton
from support.repositories import write_model

NUMPY_1 = "1.26.4"
TIMEOUT_S = 60.0

ACTIVATE = """\
# As conda-pack's: the environment is wherever this script lies.
_ENV_PREFIX="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export CONDA_PREFIX="$_ENV_PREFIX"
export PATH="$_ENV_PREFIX/bin:$PATH"
"""

MODEL = '''\
import json
import sys

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        x = pb_utils.get_input_tensor_by_name(requests[0], "X").as_numpy()
        report = {"numpy": np.__version__, "ninf": float(np.NINF), "prefix": sys.prefix}
        out = pb_utils.Tensor("REPORT", np.array([json.dumps(report).encode()], np.object_))
        return [pb_utils.InferenceResponse([out, pb_utils.Tensor("Y", x * 2)]) for _ in requests]
'''

CONFIG = """\
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 2 ] }} ]
output [ {{ name: "REPORT" data_type: TYPE_STRING dims: [ 1 ] }}, {{ name: "Y" data_type: TYPE_FP32 dims: [ 2 ] }} ]
parameters {{ key: "EXECUTION_ENV_PATH" value: {{ string_value: "{path}" }} }}
"""


@pytest.fixture(scope="module")
def environment(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A packed NumPy 1.26 environment (the folder it was made in is gone once packed, as on a real server)."""
    work = tmp_path_factory.mktemp("np1env")
    env = work / "env"
    subprocess.run([sys.executable, "-m", "venv", "--copies", "--without-pip", str(env)], check=True)
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(env / "bin" / "python"), "install", "-q", f"numpy=={NUMPY_1}"],
        capture_output=True, text=True,
    )
    if installed.returncode != 0:
        reason = f"cannot install numpy {NUMPY_1} into a test environment: {installed.stderr[-500:]}"
        if in_ci():
            pytest.fail(reason)
        pytest.skip(reason)
    (env / "bin" / "activate").write_text(ACTIVATE)
    (env / "conda-meta").mkdir()
    (env / "conda-meta" / "history").write_text("")
    archive = work / "numpy1.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(env, arcname=".")
    shutil.rmtree(env)
    return archive


@pytest.fixture(scope="module")
def repository(environment: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("execution_env") / "models"
    models = {
        "packed": "$$TRITON_MODEL_DIRECTORY/numpy1.tar.gz",  # the archive beside config.pbtxt
        "unpacked": "$$TRITON_MODEL_DIRECTORY/numpy1",  # the same, extracted there
        "shared": "$$TRITON_MODEL_DIRECTORY/../packed/numpy1.tar.gz",  # another model's, still in the repository
    }
    for name, path in models.items():
        write_model(repo, name, CONFIG.format(name=name, path=path), MODEL)
    shutil.copy(environment, repo / "packed" / "numpy1.tar.gz")
    with tarfile.open(environment) as tar:
        tar.extractall(repo / "unpacked" / "numpy1", filter="data")
    return repo


@pytest.fixture(scope="module")
def transerve(repository: Path) -> Iterator[ServerProcess]:
    with start_transerve(repository, ready_timeout=180) as server:
        yield server


def report(server: ServerProcess, model: str) -> tuple[dict, list]:
    body = {"inputs": [{"name": "X", "shape": [2], "datatype": "FP32", "data": [1.5, -2.0]}]}
    answer = requests.post(f"{server.base_url}/v2/models/{model}/infer", json=body, timeout=TIMEOUT_S)
    assert answer.status_code == 200, answer.text
    outputs = {output["name"]: output["data"] for output in answer.json()["outputs"]}
    return json.loads(outputs["REPORT"][0]), outputs["Y"]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["packed", "unpacked", "shared"])
def test_a_model_runs_on_its_environments_numpy(transerve, model):
    seen, doubled = report(transerve, model)
    assert seen["numpy"] == NUMPY_1 and seen["ninf"] == float("-inf")
    assert doubled == [3.0, -4.0]
    if model == "unpacked":
        assert Path(seen["prefix"]).name == "numpy1"


def test_triton_runs_the_same_environment(repository):
    install = require_triton()
    with start_triton(repository, install=install, ready_timeout=180) as triton:
        seen, doubled = report(triton, "packed")
    assert seen["numpy"] == NUMPY_1 and doubled == [3.0, -4.0]


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/usr", "is outside the model repository"),
        ("$$TRITON_MODEL_DIRECTORY/../../outside", "is outside the model repository"),
        ("$$TRITON_MODEL_DIRECTORY/missing.tar.gz", "Failed to get the canonical path for"),
        ("$$TRITON_MODEL_DIRECTORY/1", "does not exist. The Python environment should contain an 'activate' script."),
        ("$$TRITON_MODEL_DIRECTORY/1/model.py", "cannot extract the execution environment"),
    ],
)
def test_unusable_environments_fail_the_load(tmp_path, path, message):
    repo = tmp_path / "models"
    write_model(repo, "bad", CONFIG.format(name="bad", path=path), MODEL)
    (tmp_path / "outside" / "bin").mkdir(parents=True)
    (tmp_path / "outside" / "bin" / "activate").write_text("")
    with start_transerve(repo, "--model-control-mode=explicit") as server:
        answer = requests.post(f"{server.base_url}/v2/repository/models/bad/load", timeout=TIMEOUT_S)
    assert answer.status_code == 400 and message in answer.json()["error"], answer.text


def test_an_archive_that_escapes_its_folder_is_refused(tmp_path):
    repo = tmp_path / "models"
    write_model(repo, "bad", CONFIG.format(name="bad", path="$$TRITON_MODEL_DIRECTORY/evil.tgz"), MODEL)
    with tarfile.open(repo / "bad" / "evil.tgz", "w:gz") as tar:
        escaping = tarfile.TarInfo("../../escaped")
        tar.addfile(escaping)
    with start_transerve(repo, "--model-control-mode=explicit") as server:
        answer = requests.post(f"{server.base_url}/v2/repository/models/bad/load", timeout=TIMEOUT_S)
    assert answer.status_code == 400 and "cannot extract the execution environment" in answer.json()["error"]
    assert not (tmp_path / "escaped").exists()
