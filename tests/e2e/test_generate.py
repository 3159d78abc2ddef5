"""The generate extension (/generate, /generate_stream) and dropping the work of clients that went away."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import numpy as np
import orjson
import pytest
import requests
from support import start_transerve
from support.repositories import int32_in_out, write_model

CASES = [
    ("strings", {"TEXT": "héllo 😀", "parameters": {"x": 1}}),
    ("strings", {"TEXT": ["a", "bb"]}),
    ("add_sub", {"INPUT0": [1, 2, 3, 4], "INPUT1": [1, 1, 1, 1]}),
    ("text_pipeline", {"input_text": "안녕"}),
]



def assert_same_document(ours: dict, theirs: dict) -> None:
    """Same keys; numbers equal to float32 precision (Triton prints FP32 widened to double), the rest exactly."""
    assert ours.keys() == theirs.keys()
    for key, value in ours.items():
        if value != theirs[key]:  # only numbers may differ, and only in float32's last digits
            np.testing.assert_allclose(value, theirs[key], rtol=1e-6, err_msg=key)


def events(body: bytes) -> list[dict]:
    return [orjson.loads(line[len(b"data: "):]) for line in body.split(b"\n") if line.startswith(b"data: ")]


@pytest.mark.parametrize(("model", "body"), CASES, ids=[f"{m}-{i}" for i, (m, _) in enumerate(CASES)])
def test_generate_matches_triton(transerve_server, triton_server, model, body):
    answers = {name: requests.post(f"{server.base_url}/v2/models/{model}/generate", json=body, timeout=30)
               for name, server in (("transerve", transerve_server), ("triton", triton_server))}
    assert answers["transerve"].status_code == answers["triton"].status_code == 200
    assert answers["transerve"].headers["Content-Type"].startswith("application/json")
    assert_same_document(answers["transerve"].json(), answers["triton"].json())


@pytest.mark.parametrize(("model", "body"), CASES, ids=[f"{m}-{i}" for i, (m, _) in enumerate(CASES)])
def test_generate_stream_matches_triton(transerve_server, triton_server, model, body):
    answers = {name: requests.post(f"{server.base_url}/v2/models/{model}/generate_stream", json=body, timeout=30)
               for name, server in (("transerve", transerve_server), ("triton", triton_server))}
    assert answers["transerve"].status_code == answers["triton"].status_code == 200
    assert answers["transerve"].headers["Content-Type"] == "text/event-stream; charset=utf-8"
    ours, theirs = events(answers["transerve"].content), events(answers["triton"].content)
    assert len(ours) == len(theirs) == 1
    assert_same_document(ours[0], theirs[0])


@pytest.mark.parametrize(
    ("model", "body", "status"),
    [
        ("nope", {}, 404),
        ("add_sub", {"INPUT0": [1, 2, 3, 4]}, 400),  # missing input
        ("add_sub", {"INPUT0": [1, 2, 3], "INPUT1": [1, 1, 1, 1]}, 400),  # wrong element count
    ],
)
@pytest.mark.parametrize("endpoint", ["generate", "generate_stream"])
def test_errors_before_inference_are_plain_json_with_tritons_status(
    transerve_server, triton_server, model, body, status, endpoint
):
    for server in (transerve_server, triton_server):
        answer = requests.post(f"{server.base_url}/v2/models/{model}/{endpoint}", json=body, timeout=30)
        assert answer.status_code == status, answer.text
        assert "error" in answer.json()


def test_malformed_generate_bodies_are_400(transerve_server):
    url = f"{transerve_server.base_url}/v2/models/strings/generate"
    for body in (b"{", b"[]", b'{"TEXT": "a", "parameters": []}', b'{"TEXT": "a", "p": {"nested": 1}}'):
        answer = requests.post(url, data=body, timeout=10)
        assert answer.status_code == 400, (body, answer.text)
    assert requests.get(url, timeout=10).status_code == 405


SLOW = '''
import time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        time.sleep(0.3)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([1], np.int32))]) for _ in requests]
'''


def test_queued_requests_of_a_client_that_disconnected_are_dropped(tmp_path: Path):
    repo = tmp_path / "repo"
    write_model(repo, "slow", int32_in_out("slow"), SLOW)
    with start_transerve(repo) as server:
        body = orjson.dumps({"inputs": [{"name": "IN", "shape": [1], "datatype": "INT32", "data": [1]}]})
        raw = (b"POST /v2/models/slow/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        clients = [socket.create_connection(("127.0.0.1", server.http_port), timeout=10) for _ in range(12)]
        for client in clients:
            client.sendall(raw)
        time.sleep(0.2)
        for client in clients:  # every client gives up while most requests still wait in the queue
            client.close()
        time.sleep(12 * 0.3 + 1.0)
        stats = requests.get(f"{server.base_url}/v2/models/slow/stats", timeout=10).json()["model_stats"][0]
        assert stats["execution_count"] < 12, stats  # the queued ones never ran
        assert server.alive()
