"""Hostile load API requests against a real transerve in explicit model control (issue 35, parts 3 and 5): too many
`file:` entries, a config override or a `config.pbtxt` past the bound, a NUL byte in a file path, a 300-character
model name, a chain of ensembles 1000 deep. Each is a 400 naming the problem (never a 500), answered without
stalling the event loop: a bystander's health checks on another connection keep answering meanwhile."""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import tritonclient.grpc as grpcclient
from support import ServerProcess, start_transerve
from support.repositories import add_sub_ensemble, copy_example
from tritonclient.utils import InferenceServerException

TIMEOUT_S = 60.0
#: The longest a bystander's health check may take while a probe runs (the loaded 2-core CI machine included).
STALL_BOUND_S = 1.0
CHAIN = 1000




def write_chain(repo: Path, prefix: str, length: int) -> None:
    """`prefix`0 -> `prefix`1 -> ... -> add_sub: `length` ensembles, each the step of the one before."""
    for index in range(length):
        step = f"{prefix}{index + 1}" if index + 1 < length else "add_sub"
        folder = repo / f"{prefix}{index}"
        (folder / "1").mkdir(parents=True)
        (folder / "config.pbtxt").write_text(add_sub_ensemble(f"{prefix}{index}", step))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    repo = copy_example(tmp_path_factory.mktemp("hostile_load"), "add_sub")
    write_chain(repo, "deep", CHAIN)
    write_chain(repo, "short", 3)
    huge = repo / "huge_config"
    (huge / "1").mkdir(parents=True)
    dims = ", ".join(["1"] * 1_000_000)  # a million dims: 3 MB of text, seconds for protobuf's parser
    (huge / "config.pbtxt").write_text(f'name: "huge_config"\nbackend: "python"\ninput [{{ name: "X" data_type: '
                                       f'TYPE_FP32 dims: [ {dims} ] }}]\n')
    with start_transerve(repo, "--model-control-mode=explicit", "--load-model=add_sub") as process:
        yield process


class Bystander:
    """Health checks on a connection of their own every 20 ms while the block runs: the slowest one's time."""

    def __init__(self, server: ServerProcess) -> None:
        self._url = f"{server.base_url}/v2/health/live"
        self._stop = threading.Event()
        self.slowest = 0.0
        self.failures = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Bystander:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=TIMEOUT_S)

    def _run(self) -> None:
        session = requests.Session()
        while not self._stop.wait(0.02):
            started = time.monotonic()
            try:
                ok = session.get(self._url, timeout=TIMEOUT_S).status_code == 200
            except requests.RequestException:
                ok = False
            self.slowest = max(self.slowest, time.monotonic() - started)
            self.failures += not ok


def load(server: ServerProcess, name: str, parameters: dict | None = None) -> requests.Response:
    body = {"parameters": parameters} if parameters is not None else {}
    return requests.post(f"{server.base_url}/v2/repository/models/{name}/load", json=body, timeout=TIMEOUT_S)


def refused(answer: requests.Response, *fragments: str) -> None:
    assert answer.status_code == 400, (answer.status_code, answer.text[:500])
    message = answer.json()["error"]
    for fragment in fragments:
        assert fragment in message, message[:500]


CONFIG = json.dumps({"name": "uploaded", "backend": "python", "max_batch_size": 0,
                     "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [1]}],
                     "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [1]}]})


@pytest.mark.parametrize(("probe", "fragments"), [
    ("50,000 file: entries", ("50000 'file:' parameters, more than the 1024 allowed", "--model-load-max-files")),
    ("6 MB config override", ("more than the 1048576 allowed", "--model-config-max-bytes")),
    ("NUL in a file path", ("holds a NUL byte",)),
    ("overlong file name", ("is too long (at most 255 bytes a name",)),
    ("300-character model name", ("invalid model name", "at most 255 bytes")),
    ("config.pbtxt of a million dims", ("huge_config", "--model-config-max-bytes")),
    ("ensemble chain 1000 deep", ("nests ensembles more than 32 deep",)),
])
def test_hostile_loads_are_400s_and_never_stall_the_loop(server: ServerProcess, probe: str,
                                                         fragments: tuple[str, ...]) -> None:
    content = base64.b64encode(b"x").decode()
    with Bystander(server) as bystander:
        if probe == "50,000 file: entries":
            answer = load(server, "uploaded", {"config": CONFIG,
                                               **{f"file:1/f{index}": content for index in range(50_000)}})
        elif probe == "6 MB config override":
            answer = load(server, "uploaded", {"config": CONFIG + " " * (6 << 20)})
        elif probe == "NUL in a file path":
            answer = load(server, "uploaded", {"config": CONFIG, "file:1/model\u0000.py": content})
        elif probe == "overlong file name":
            answer = load(server, "uploaded", {"config": CONFIG, f"file:1/{'m' * 300}.py": content})
        elif probe == "300-character model name":
            answer = load(server, "m" * 300)
        elif probe == "config.pbtxt of a million dims":
            answer = load(server, "huge_config")
        else:
            answer = load(server, "deep0")
        refused(answer, *fragments)
    assert bystander.failures == 0
    assert bystander.slowest < STALL_BOUND_S, f"a health check waited {bystander.slowest:.2f} s during '{probe}'"
    assert server.alive()


def test_unloading_a_300_character_name_is_a_400(server: ServerProcess) -> None:
    answer = requests.post(f"{server.base_url}/v2/repository/models/{'m' * 300}/unload", timeout=TIMEOUT_S)
    refused(answer, "invalid model name")


def test_a_chain_within_the_bound_loads_leaves_first(server: ServerProcess) -> None:
    """Explicit control loads the composing models first, walked without recursion: short0 -> short1 -> short2 ->
    add_sub loads all three and serves."""
    assert load(server, "short0").status_code == 200
    index = requests.post(f"{server.base_url}/v2/repository/index", json={"ready": True}, timeout=TIMEOUT_S).json()
    assert {"short0", "short1", "short2", "add_sub"} <= {entry["name"] for entry in index}
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]},
                       {"name": "INPUT1", "shape": [1, 4], "datatype": "FP32", "data": [1, 1, 1, 1]}]}
    answer = requests.post(f"{server.base_url}/v2/models/short0/infer", json=body, timeout=TIMEOUT_S)
    assert answer.status_code == 200, answer.text
    assert answer.json()["outputs"][0]["data"] == [2, 3, 4, 5]


def test_the_same_refusals_over_grpc(server: ServerProcess) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        cases = [
            ("uploaded", {f"file:1/f{index}": b"x" for index in range(1025)}, "more than the 1024 allowed"),
            ("uploaded", {"file:1/model\u0000.py": b"x"}, "holds a NUL byte"),
            ("m" * 300, {"file:1/model.py": b"x"}, "invalid model name"),
        ]
        for name, files, fragment in cases:
            with pytest.raises(InferenceServerException) as raised:
                client.load_model(name, config=CONFIG, files=files)
            assert raised.value.status() == "StatusCode.INVALID_ARGUMENT", raised.value.message()
            assert fragment in raised.value.message()
        with pytest.raises(InferenceServerException) as deep:
            client.load_model("deep0")
        assert deep.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "nests ensembles more than 32 deep" in deep.value.message()
    finally:
        client.close()
    assert server.alive()
