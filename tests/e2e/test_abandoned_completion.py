"""Work that outlives its client: an OpenAI completion asking for 128 long choices, streamed to a client that
never reads and then goes away, ends all 128 sequences promptly, and a bystander's short completion is answered
soon after (issue 35, part 4)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import pytest
import requests
from support import start_transerve
from support.openai_models import N_POSITIONS, build_repository
from support.servers import ServerProcess

pytest.importorskip("ctranslate2")
pytest.importorskip("transformers")

CHOICES = 128
#: How long after the client left its sequences may still run: one decoding step of 128 rows, plus the
#: cancellations travelling, on a loaded 2-core box. All 128 choices run to their length would take minutes.
ENDED_WITHIN_S = 10.0


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    repository, _ = build_repository(tmp_path_factory.mktemp("abandoned"))
    with start_transerve(repository) as running:
        yield running


def ended_requests(server: ServerProcess, model: str) -> int:
    stats = requests.get(f"{server.base_url}/v2/models/{model}/stats", timeout=10).json()
    inference = stats["model_stats"][0]["inference_stats"]
    return inference["success"]["count"] + inference["fail"]["count"]


def complete(server: ServerProcess, max_tokens: int) -> requests.Response:
    return requests.post(f"{server.base_url}/v1/completions", timeout=60,
                         json={"model": "gpt", "prompt": "hello", "max_tokens": max_tokens, "temperature": 0})


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_choices_end_soon_after_a_client_that_never_read_leaves(server: ServerProcess, stream: bool) -> None:
    assert complete(server, 8).status_code == 200
    before = ended_requests(server, "gpt")
    long = N_POSITIONS - 48
    body = json.dumps({"model": "gpt", "prompt": "hello there", "max_tokens": long, "min_tokens": long,
                       "n": CHOICES, "stream": stream, "temperature": 1.0}).encode()
    with socket.create_connection(("127.0.0.1", server.http_port)) as client:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # and it never reads
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        time.sleep(1.5)  # its choices are decoding
        assert ended_requests(server, "gpt") == before
    left = time.monotonic()
    while ended_requests(server, "gpt") < before + CHOICES:
        assert time.monotonic() - left < ENDED_WITHIN_S, "the abandoned choices still run"
        time.sleep(0.05)
    started = time.monotonic()
    assert complete(server, 8).status_code == 200
    assert time.monotonic() - started < 5.0
    assert server.alive()


def test_the_module_runs_the_torch_engine(server: ServerProcess) -> None:
    """The stats above are the torch engine's (`gpt`): the one slow enough for 128 long choices to outlast the
    test unless they are cancelled."""
    config = requests.get(f"{server.base_url}/v2/models/gpt/config", timeout=10).json()
    assert config["parameters"]["engine"]["string_value"] == "torch"
