"""Triton's logging extension end to end: the settings over HTTP and gRPC against the real Triton 2.51, and their
effect on a running python-backend model's `pb_utils.Logger` and on the server's own log.

Deliberate divergences, tested against transerve alone: a setting of the wrong type or an unknown `log_format` is
a 400 (Triton: 500, and 503 for the format).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import tritonclient.grpc as grpcclient
from support import ServerProcess, require_triton, start_transerve, start_triton

MODELS = Path(__file__).resolve().parent / "logging_models"
TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("logging") / "models"
    shutil.copytree(MODELS, repo, ignore=shutil.ignore_patterns("__pycache__"))
    return repo


def settings_sequence(server: ServerProcess) -> list[tuple[int, Any]]:
    """The same reads and changes, ending where they started."""
    url = f"http://127.0.0.1:{server.http_port}/v2/logging"
    answers = [requests.get(url, timeout=TIMEOUT_S)]
    for change in ({"log_verbose_level": 2}, {"log_info": False, "log_warning": False}, {"log_format": "ISO8601"},
                   {"unknown_setting": 1}, {"log_file": "/tmp/elsewhere.log"},
                   {"log_verbose_level": 0, "log_info": True, "log_warning": True, "log_format": "default"}):
        answers.append(requests.post(url, json=change, timeout=TIMEOUT_S))
    results = [(answer.status_code, answer.json()) for answer in answers]
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    try:
        results.append((200, client.update_log_settings({"log_error": False}, as_json=True)))
        results.append((200, client.get_log_settings(as_json=True)))
        client.update_log_settings({"log_error": True})
    finally:
        client.close()
    return results


def test_settings_match_triton(repository: Path) -> None:
    install = require_triton()
    answers = {}
    for name, start in (("triton", start_triton), ("transerve", start_transerve)):
        with start(repository, **({"install": install} if name == "triton" else {})) as server:
            answers[name] = settings_sequence(server)
    assert answers["transerve"] == answers["triton"]
    assert answers["transerve"][2][1]["log_info"] is False
    assert answers["transerve"][5] == (501, {"error": "log file location can not be updated through network protocol"})


@pytest.fixture(scope="module")
def transerve(repository: Path) -> Iterator[ServerProcess]:
    with start_transerve(repository) as server:
        yield server


def infer_and_read_log(server: ServerProcess, seen: int) -> tuple[int, str]:
    """Run the model once; its execution number and the log written since `seen` characters."""
    body = {"inputs": [{"name": "IN", "shape": [1], "datatype": "INT32", "data": [0]}]}
    answer = requests.post(f"http://127.0.0.1:{server.http_port}/v2/models/chatty/infer", json=body,
                           timeout=TIMEOUT_S)
    execution = answer.json()["outputs"][0]["data"][0]
    deadline = time.monotonic() + 10
    while True:  # the worker writes to the shared log file on its own; wait for its last line
        log = server.log_path.read_text(errors="replace")
        if f"chatty-error-{execution}" in log or time.monotonic() > deadline:
            return execution, log[seen:]
        time.sleep(0.05)


def test_a_running_model_follows_the_settings(transerve: ServerProcess) -> None:
    url = f"http://127.0.0.1:{transerve.http_port}/v2/logging"
    seen = len(transerve.log_path.read_text(errors="replace"))
    first, log = infer_and_read_log(transerve, seen)
    assert all(f"chatty-{level}-{first}" in log for level in ("info", "warning", "error"))
    assert f"chatty-verbose-{first}" not in log
    try:
        requests.post(url, json={"log_verbose_level": 1, "log_warning": False}, timeout=TIMEOUT_S)
        seen = len(transerve.log_path.read_text(errors="replace"))
        second, log = infer_and_read_log(transerve, seen)
        assert all(f"chatty-{level}-{second}" in log for level in ("info", "error", "verbose"))
        assert f"chatty-warning-{second}" not in log
    finally:
        requests.post(url, json={"log_verbose_level": 0, "log_warning": True}, timeout=TIMEOUT_S)


@pytest.mark.parametrize(("change", "message"), [
    ({"log_info": "yes"}, "log setting 'log_info' must be true or false"),
    ({"log_verbose_level": -1}, "log setting 'log_verbose_level' must be a non-negative integer"),
    ({"log_format": "xml"}, "invalid argument for --log_format, got: xml"),
    ({"log_format": "ISO8601", "log_error": 1}, "log setting 'log_error' must be true or false"),
])
def test_mistakes_are_400s_and_change_nothing(transerve: ServerProcess, change: dict, message: str) -> None:
    url = f"http://127.0.0.1:{transerve.http_port}/v2/logging"
    before = requests.get(url, timeout=TIMEOUT_S).json()
    answer = requests.post(url, json=change, timeout=TIMEOUT_S)
    assert (answer.status_code, answer.json()) == (400, {"error": message})
    assert requests.get(url, timeout=TIMEOUT_S).json() == before
