"""A python model that misbehaves in its worker, met end to end with a bystander model served beside it: a flood
of output reaches the log within its budget, the processes a model starts end with its worker, and a worker that
dies right after each start is restarted with a growing delay and then given up, its model UNAVAILABLE with the
reason (docs/security.md, "Faults")."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import requests
from support import start_transerve
from support.repositories import int32_in_out, write_model

TIMEOUT_S = 10

ECHO_MODEL = '''
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN")
                .as_numpy())]) for r in requests]
'''

#: Prints as fast as it can, forever, from a thread started in `initialize`.
FLOOD_MODEL = ECHO_MODEL.replace("class TritonPythonModel:", '''import sys, threading

def flood():
    line = "flood " + "x" * 200 + "\\n"
    while True:
        sys.stdout.write(line * 50)

class TritonPythonModel:
    def initialize(self, args):
        threading.Thread(target=flood, daemon=True).start()
''')

#: Starts a child process in `initialize` and writes its pid beside the config.
FORKING_MODEL = ECHO_MODEL.replace("class TritonPythonModel:", '''import os, subprocess

class TritonPythonModel:
    def initialize(self, args):
        child = subprocess.Popen(["sleep", "1000"])
        with open(os.path.join(args["model_repository"], "child.pid"), "w") as out:
            out.write(str(child.pid))
''')

#: Exits 0.1 s after each start; each start leaves a file named by its pid.
EXITING_MODEL = ECHO_MODEL.replace("class TritonPythonModel:", '''import os, threading

class TritonPythonModel:
    def initialize(self, args):
        folder = os.path.join(args["model_repository"], "starts")
        os.makedirs(folder, exist_ok=True)
        open(os.path.join(folder, str(os.getpid())), "w").close()
        threading.Timer(0.1, os._exit, (3,)).start()
''')


def infer(url: str, model: str, value: int = 7) -> requests.Response:
    body = {"inputs": [{"name": "IN", "shape": [1], "datatype": "INT32", "data": [value]}]}
    return requests.post(f"{url}/v2/models/{model}/infer", json=body, timeout=TIMEOUT_S)


def bystander_latencies(url: str, seconds: float) -> list[float]:
    """Infer on the bystander for `seconds`; each answer must be right."""
    latencies = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        started = time.monotonic()
        answer = infer(url, "echo", len(latencies))
        latencies.append(time.monotonic() - started)
        assert answer.status_code == 200 and answer.json()["outputs"][0]["data"] == [len(latencies) - 1]
    return latencies


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def test_a_flood_of_output_reaches_the_log_within_its_budget(tmp_path: Path):
    repo = tmp_path / "repo"
    write_model(repo, "echo", int32_in_out("echo"), ECHO_MODEL)
    write_model(repo, "flood", int32_in_out("flood"), FLOOD_MODEL)
    with start_transerve(repo) as server:
        before = server.log_path.stat().st_size
        latencies = bystander_latencies(server.base_url, 3.0)
        assert infer(server.base_url, "flood").status_code == 200
        grown = server.log_path.stat().st_size - before
        log = server.log
    # The budget: a 1 MiB burst, then 64 KiB a second (the flood writes hundreds of MB a second unchecked).
    assert grown < 2 << 20, grown
    assert "model instance 'flood_0': flood xxx" in log
    assert "model instance 'flood_0': suppressed" in log
    latencies.sort()
    assert latencies[int(len(latencies) * 0.99)] < 1.0, latencies[-5:]


def test_processes_a_model_starts_end_with_its_worker(tmp_path: Path):
    repo = tmp_path / "repo"
    write_model(repo, "echo", int32_in_out("echo"), ECHO_MODEL)
    write_model(repo, "forking", int32_in_out("forking"), FORKING_MODEL)
    with start_transerve(repo, "--model-control-mode=explicit", "--load-model=*") as server:
        child = int((repo / "forking" / "child.pid").read_text())
        assert alive(child)
        answer = requests.post(f"{server.base_url}/v2/repository/models/forking/unload", timeout=TIMEOUT_S)
        assert answer.status_code == 200
        deadline = time.monotonic() + TIMEOUT_S
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(child)
        assert infer(server.base_url, "echo").status_code == 200


def test_a_worker_that_dies_after_each_start_is_given_up(tmp_path: Path):
    repo = tmp_path / "repo"
    write_model(repo, "echo", int32_in_out("echo"), ECHO_MODEL)
    write_model(repo, "exiting", int32_in_out("exiting"), EXITING_MODEL)
    with start_transerve(repo) as server:
        url = server.base_url
        ready = f"{url}/v2/models/exiting/ready"
        deadline = time.monotonic() + 40  # 5 restarts after delays of 0, 0.5, 1, 2 and 4 s, plus the starts
        while requests.get(ready, timeout=TIMEOUT_S).status_code == 200 and time.monotonic() < deadline:
            assert infer(url, "echo").status_code == 200
            time.sleep(0.1)
        assert requests.get(ready, timeout=TIMEOUT_S).status_code == 400
        starts = os.listdir(repo / "exiting" / "starts")
        assert len(starts) == 6  # the first start and 5 restarts
        time.sleep(1.0)  # and no more
        assert len(os.listdir(repo / "exiting" / "starts")) == 6
        index = requests.post(f"{url}/v2/repository/index", json={}, timeout=TIMEOUT_S).json()
        entry = next(entry for entry in index if entry["name"] == "exiting")
        assert entry["state"] == "UNAVAILABLE" and "restarted 5 times within 60s" in entry["reason"]
        failed = infer(url, "exiting")
        assert failed.status_code == 400 or failed.status_code == 503
        assert "restarted 5 times" in failed.json()["error"]
        assert "model 'exiting' instance 'exiting_0' is UNAVAILABLE" in server.log
        assert infer(url, "echo").status_code == 200


#: Answers IN[0] bytes of zeros.
BIG_MODEL = '''
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.ones(
            int(pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()[0]), np.uint8))]) for r in requests]
'''

BIG_CONFIG = ('name: "big" backend: "python" input [{name: "IN" data_type: TYPE_INT32 dims: [1]}] '
              'output [{name: "OUT" data_type: TYPE_UINT8 dims: [-1]}]')


def rss_bytes(pid: int) -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_response_past_the_size_bound_fails_without_being_copied(tmp_path: Path):
    repo = tmp_path / "repo"
    write_model(repo, "echo", int32_in_out("echo"), ECHO_MODEL)
    write_model(repo, "big", BIG_CONFIG, BIG_MODEL)
    with start_transerve(repo, f"--max-response-bytes={32 << 20}") as server:
        url = server.base_url
        small = infer(url, "big", 1000)
        assert small.status_code == 200 and len(small.json()["outputs"][0]["data"]) == 1000
        before = rss_bytes(server.process.pid)
        for _ in range(3):
            refused = infer(url, "big", 128 << 20)
            assert refused.status_code == 400
            assert refused.json()["error"] == (f"the response of model 'big' holds {128 << 20} bytes of outputs, "
                                               f"more than the {32 << 20} allowed (--max-response-bytes)")
            assert infer(url, "echo").status_code == 200
        assert rss_bytes(server.process.pid) - before < 64 << 20  # the 128 MiB outputs were never read
        assert infer(url, "big", 1000).status_code == 200


#: Decoupled: answers 10 bytes of ones, then IN[0], then 10 again, then the final flag.
BIG_STREAM_MODEL = '''
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            size = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            for count in (10, size, 10):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.ones(count, np.uint8))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''


def test_a_streamed_response_past_the_bound_is_an_error_event_and_the_stream_goes_on(tmp_path: Path):
    repo = tmp_path / "repo"
    config = BIG_CONFIG.replace('"big"', '"big_stream"') + " model_transaction_policy { decoupled: true }"
    write_model(repo, "big_stream", config, BIG_STREAM_MODEL)
    with start_transerve(repo, f"--max-response-bytes={1 << 20}") as server:
        answer = requests.post(f"{server.base_url}/v2/models/big_stream/generate_stream", json={"IN": [8 << 20]},
                               timeout=TIMEOUT_S)
        assert answer.status_code == 200
        events = [json.loads(line[len("data: "):]) for line in answer.text.splitlines() if line.startswith("data: ")]
        assert len(events) == 3 and events[0]["OUT"] == events[2]["OUT"] == [1] * 10
        assert events[1] == {"error": f"the response of model 'big_stream' holds {8 << 20} bytes of outputs, more "
                                      f"than the {1 << 20} allowed (--max-response-bytes)"}
