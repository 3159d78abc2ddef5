"""Faults a model can cause, met end to end: a hung `execute` at SIGTERM and at unload, a request timeout while the
worker computes, a server killed with SIGKILL, a worker past its memory ceiling (docs/security.md, "Faults")."""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from support import start_transerve
from support.repositories import write_model
from support.servers import ServerProcess, start_server, transerve_argv
from tritonclient.utils import InferenceServerException

#: Sleeps IN[0] seconds (forever when negative, ignoring SIGTERM), allocates IN[1] MiB (kept), answers IN[0]; writes
#: its pid next to its config so tests can watch it.
SLEEPY_MODEL = '''
import os, signal, time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self.hoard = []
        folder = os.path.join(args["model_repository"], "pids")
        os.makedirs(folder, exist_ok=True)
        open(os.path.join(folder, str(os.getpid())), "w").close()

    def execute(self, requests):
        responses = []
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            seconds, mebibytes = float(values[0]), int(values[1])
            if mebibytes:
                self.hoard.append(bytearray(b"\\x01") * (mebibytes << 20))
            if seconds < 0:
                while True:
                    time.sleep(0.05)
            time.sleep(seconds)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", values[:1].copy())]))
        return responses
'''

SLEEPY_CONFIG = '''
name: "{name}" backend: "python"
input [ {{ name: "IN" data_type: TYPE_FP32 dims: [ 2 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
{extra}
'''

EXIT_TIMEOUT_S = 2.0
#: Startup of the next worker, scheduling noise on a loaded CI box.
MARGIN_S = 3.0


def sleepy_repository(root: Path, *names: str, extra: str = "") -> Path:
    repo = root / "repo"
    for name in names:
        write_model(repo, name, SLEEPY_CONFIG.format(name=name, extra=extra), SLEEPY_MODEL)
    return repo


def worker_pids(repo: Path, name: str) -> set[int]:
    folder = repo / name / "pids"
    return {int(entry.name) for entry in folder.iterdir()} if folder.is_dir() else set()


def gone(pid: int) -> bool:
    """The process has exited (a zombie awaiting its reaper counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True
    return state in ("Z", "X")


def wait_gone(pids: set[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(gone(pid) for pid in pids):
            return True
        time.sleep(0.05)
    return False


def http_infer(url: str, model: str, seconds: float, mebibytes: int = 0, **kwargs) -> requests.Response:
    body = {"inputs": [{"name": "IN", "shape": [2], "datatype": "FP32", "data": [seconds, mebibytes]}], **kwargs}
    return requests.post(f"{url}/v2/models/{model}/infer", json=body, timeout=60)


def grpc_infer(url: str, model: str, seconds: float, **kwargs) -> np.ndarray:
    with grpcclient.InferenceServerClient(url) as client:
        tensor = grpcclient.InferInput("IN", [2], "FP32")
        tensor.set_data_from_numpy(np.array([seconds, 0], np.float32))
        return client.infer(model, [tensor], **kwargs).as_numpy("OUT")


class InBackground:
    """A call on a thread, its result or exception kept."""

    def __init__(self, function, *args, **kwargs) -> None:
        self.result = self.error = None
        self.thread = threading.Thread(target=self._run, args=(function, args, kwargs), daemon=True)
        self.thread.start()

    def _run(self, function, args, kwargs) -> None:
        try:
            self.result = function(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - kept for the test to judge
            self.error = exc

    def join(self, timeout: float = 30.0):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the call was never answered"
        return self


def metric(server: ServerProcess, name: str, **labels: str) -> float:
    text = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text
    wanted = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(name + "{") and wanted in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_sigterm_kills_a_hung_worker_at_the_exit_timeout_and_answers_its_requests_unavailable(tmp_path):
    repo = sleepy_repository(tmp_path, "hang")
    with start_transerve(repo, "--exit-timeout-secs", str(EXIT_TIMEOUT_S)) as server:
        (pid,) = worker_pids(repo, "hang")
        over_http = InBackground(http_infer, server.base_url, "hang", -1)
        over_grpc = InBackground(grpc_infer, server.grpc_url, "hang", -1)
        time.sleep(0.5)  # both in flight: one runs, one waits in the worker's socket
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(EXIT_TIMEOUT_S + MARGIN_S)
        took = time.monotonic() - started
        answer = over_http.join().result
        over_grpc.join()
        log = server.log
    assert EXIT_TIMEOUT_S - 0.2 < took < EXIT_TIMEOUT_S + MARGIN_S, log
    assert answer is not None and answer.status_code == 503, (answer and answer.text, log)
    assert "was stopped: the server is shutting down" in answer.json()["error"]
    assert isinstance(over_grpc.error, InferenceServerException)
    assert over_grpc.error.status() == "StatusCode.UNAVAILABLE", over_grpc.error
    assert wait_gone({pid}, 2.0)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_unload_of_a_hung_model_finishes_after_the_exit_timeout_and_others_keep_serving(tmp_path, protocol):
    repo = sleepy_repository(tmp_path, "hang", "other")
    with start_transerve(repo, "--model-control-mode=explicit", "--load-model=*",
                         "--exit-timeout-secs", str(EXIT_TIMEOUT_S)) as server:
        (pid,) = worker_pids(repo, "hang")
        hung = InBackground(http_infer, server.base_url, "hang", -1)
        time.sleep(0.5)
        started = time.monotonic()
        if protocol == "http":
            reply = requests.post(f"{server.base_url}/v2/repository/models/hang/unload", timeout=30)
            assert reply.status_code == 200, reply.text
        else:
            with grpcclient.InferenceServerClient(server.grpc_url) as client:
                client.unload_model("hang")
        took = time.monotonic() - started
        answer = hung.join().result
        assert EXIT_TIMEOUT_S - 0.2 < took < EXIT_TIMEOUT_S + MARGIN_S, server.log
        assert answer.status_code == 503, answer.text
        assert "was stopped: it was unloaded" in answer.json()["error"]
        assert wait_gone({pid}, 2.0)
        assert http_infer(server.base_url, "other", 0).json()["outputs"][0]["data"] == [0.0]
        assert requests.get(f"{server.base_url}/v2/models/hang/ready", timeout=10).status_code != 200
        # loadable again, and serving
        assert requests.post(f"{server.base_url}/v2/repository/models/hang/load", timeout=30).status_code == 200
        assert http_infer(server.base_url, "hang", 0).json()["outputs"][0]["data"] == [0.0]


def test_a_request_timeout_answers_while_the_worker_computes_and_a_hung_worker_is_restarted(tmp_path):
    repo = sleepy_repository(tmp_path, "sleepy")
    grace = 3.0
    with start_transerve(repo, f"--backend-config=python,hung-execute-grace-secs={grace:g}") as server:
        (first,) = worker_pids(repo, "sleepy")
        # Slow but finishing: the client is answered at its timeout, the late result is dropped, the next request
        # on the same worker gets its own answer.
        started = time.monotonic()
        answer = http_infer(server.base_url, "sleepy", 1.5, parameters={"timeout": 300_000})
        assert answer.status_code == 503 and answer.json()["error"] == "Request timeout expired", answer.text
        assert time.monotonic() - started < 1.2
        assert http_infer(server.base_url, "sleepy", 0.25).json()["outputs"][0]["data"] == [0.25]
        with pytest.raises(InferenceServerException) as raised:
            grpc_infer(server.grpc_url, "sleepy", 1.0, timeout=200_000)
        assert raised.value.status() == "StatusCode.UNAVAILABLE" and "Request timeout expired" in str(raised.value)
        assert grpc_infer(server.grpc_url, "sleepy", 0.5)[0] == 0.5
        assert worker_pids(repo, "sleepy") == {first}
        # Hung: answered at the timeout, and the worker restarted `grace` later; the next request is served.
        started = time.monotonic()
        answer = http_infer(server.base_url, "sleepy", -1, parameters={"timeout": 300_000})
        assert answer.status_code == 503 and time.monotonic() - started < 1.2
        assert http_infer(server.base_url, "sleepy", 0.125).json()["outputs"][0]["data"] == [0.125]
        assert time.monotonic() - started < 0.3 + grace + MARGIN_S
        assert wait_gone({first}, 2.0)
        assert len(worker_pids(repo, "sleepy")) == 2
        assert metric(server, "transerve_model_instance_restarts", model="sleepy", reason="hung") == 1
        assert "past its request's timeout" in server.log


def test_workers_die_with_a_killed_server(tmp_path):
    repo = sleepy_repository(tmp_path, "one", "two")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with tempfile.TemporaryDirectory() as logs:
        server: ServerProcess = start_server(
            "transerve", lambda http, grpc, metrics: transerve_argv(repo, http, grpc, metrics), log_dir=Path(logs),
            env=env,
        )
        try:
            pids = worker_pids(repo, "one") | worker_pids(repo, "two")
            assert len(pids) == 2
            busy = InBackground(http_infer, server.base_url, "one", -1)
            time.sleep(0.3)
            server.process.send_signal(signal.SIGKILL)
            server.process.wait(10)
            assert wait_gone(pids, 2.0), [pid for pid in pids if not gone(pid)]
            busy.join()
        finally:
            server.stop()


def test_a_worker_past_its_memory_ceiling_is_restarted(tmp_path):
    repo = sleepy_repository(tmp_path, "hoarder", extra='parameters { key: "max_worker_rss_bytes" '
                                                         'value { string_value: "300000000" } }')
    with start_transerve(repo) as server:
        (first,) = worker_pids(repo, "hoarder")
        assert http_infer(server.base_url, "hoarder", 0, 16).status_code == 200  # under the ceiling
        answer = http_infer(server.base_url, "hoarder", 3.0, 400)
        assert answer.status_code == 503, answer.text
        assert "max_worker_rss_bytes" in answer.json()["error"]
        assert wait_gone({first}, 2.0)
        assert http_infer(server.base_url, "hoarder", 0).json()["outputs"][0]["data"] == [0.0]
        assert metric(server, "transerve_model_instance_restarts", model="hoarder", reason="memory") == 1
        assert "passed max_worker_rss_bytes" in server.log


def test_a_bad_memory_ceiling_fails_the_load(tmp_path):
    repo = sleepy_repository(tmp_path, "bad", extra='parameters { key: "max_worker_rss_bytes" '
                                                    'value { string_value: "lots" } }')
    with start_transerve(repo, "--strict-readiness=false") as server:
        index = requests.post(f"{server.base_url}/v2/repository/index", timeout=10).json()
    assert index[0]["state"] == "UNAVAILABLE" and "max_worker_rss_bytes" in index[0]["reason"]
