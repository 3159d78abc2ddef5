"""A start that fails, against the real Triton 2.51 (Triton's L0_lifecycle test_parse_error_noexit): a model
repository that does not exist, with `--exit-on-error=false`, leaves the server serving, neither live nor ready
(whatever `--strict-readiness` says), its metadata answering over HTTP and gRPC. transerve without the flag, and
with `--exit-on-error=true`, exits instead (Triton's default is true)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests
import tritonclient.grpc as grpcclient
from support import REPO_ROOT, ServerProcess, free_ports
from support.servers import transerve_argv
from support.triton_reference import require_triton, triton_argv

STARTED_S = 60.0


@contextmanager
def launched(kind: str, repository: Path, *flags: str, tmp: Path) -> Iterator[ServerProcess]:
    """The server, started on free ports and not waited for; stopped afterwards."""
    http, grpc, metrics = free_ports(3)
    if kind == "triton":
        install = require_triton()
        argv, env = triton_argv(install, repository, http, grpc, metrics, *flags), install.env()
    else:
        argv = transerve_argv(repository, http, grpc, metrics, *flags)
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT / "src"), PYTHONUNBUFFERED="1")
    server = ServerProcess(kind, argv, http_port=http, grpc_port=grpc, metrics_port=metrics,
                           log_path=tmp / f"{kind}.log", env=env, cwd=tmp)
    try:
        yield server
    finally:
        server.stop()


def answering(server: ServerProcess) -> bool:
    """Whether the server metadata answers (the server is up), waiting for it while the process runs."""
    deadline = time.monotonic() + STARTED_S
    while time.monotonic() < deadline and server.running():
        try:
            if requests.get(f"http://127.0.0.1:{server.http_port}/v2", timeout=2).status_code == 200:
                return True
        except requests.ConnectionError:
            pass
        time.sleep(0.2)
    return False


@pytest.mark.parametrize("kind", ["triton", "transerve"])
@pytest.mark.parametrize("strict", ["true", "false"])
def test_a_missing_repository_without_exit_on_error_serves_not_live_not_ready(
    kind: str, strict: str, tmp_path: Path
) -> None:
    missing = tmp_path / "no_such_repository"
    with launched(kind, missing, f"--strict-readiness={strict}", "--exit-on-error=false", tmp=tmp_path) as server:
        assert answering(server), server.log_tail()
        base = f"http://127.0.0.1:{server.http_port}/v2"
        assert requests.get(f"{base}/health/live", timeout=5).status_code != 200
        assert requests.get(f"{base}/health/ready", timeout=5).status_code != 200
        metadata = requests.get(base, timeout=5).json()
        assert metadata["name"] == "triton" and metadata["version"] == "2.51.0"
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        deadline = time.monotonic() + STARTED_S
        while True:  # gRPC may open a moment after HTTP
            try:
                assert not client.is_server_live()
                break
            except grpcclient.InferenceServerException:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert not client.is_server_ready()
        assert client.get_server_metadata().version == "2.51.0"


@pytest.mark.parametrize("flags", [(), ("--exit-on-error=true",)])
def test_a_missing_repository_otherwise_ends_transerve(flags: tuple[str, ...], tmp_path: Path) -> None:
    http, grpc, metrics = free_ports(3)
    argv = transerve_argv(tmp_path / "no_such_repository", http, grpc, metrics, *flags)
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT / "src"))
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1
    assert "no_such_repository' is not a folder" in done.stderr


FLAKY_MODEL = '''
import os

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        marker = os.path.join(os.environ["TRANSERVE_TEST_MARKER_DIR"], "tried")
        if not os.path.exists(marker):
            open(marker, "w").close()
            raise pb_utils.TritonModelException("the first initialize fails")

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(
            r, "IN").as_numpy())]) for r in requests]
'''


@pytest.mark.parametrize("kind", ["triton", "transerve"])
@pytest.mark.parametrize("retries", [0, 1])
def test_model_load_retry_count_tries_a_failed_load_again(
    kind: str, retries: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model whose first `initialize` fails: READY at start with `--model-load-retry-count=1`, UNAVAILABLE (and
    the server not ready) without."""
    monkeypatch.setenv("TRANSERVE_TEST_MARKER_DIR", str(tmp_path))
    repository = tmp_path / "models"
    (repository / "flaky" / "1").mkdir(parents=True)
    (repository / "flaky" / "1" / "model.py").write_text(FLAKY_MODEL)
    (repository / "flaky" / "config.pbtxt").write_text(
        'name: "flaky" backend: "python" max_batch_size: 0\n'
        'input [{ name: "IN" data_type: TYPE_INT32 dims: [ 1 ] }]\n'
        'output [{ name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] }]\n')
    flags = ["--exit-on-error=false", f"--model-load-retry-count={retries}"]
    with launched(kind, repository, *flags, tmp=tmp_path) as server:
        assert answering(server), server.log_tail()
        base = f"http://127.0.0.1:{server.http_port}/v2"
        deadline = time.monotonic() + STARTED_S
        while requests.get(f"{base}/health/live", timeout=5).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        ready = requests.get(f"{base}/models/flaky/ready", timeout=5).status_code == 200
        assert ready is (retries == 1)
        assert (requests.get(f"{base}/health/ready", timeout=5).status_code == 200) is (retries == 1)
