"""The fuzz properties against a real server process on loopback, with real models behind the codecs: hostile
HTTP requests (raw bytes on a socket, and inference bodies) and hostile ModelInferRequests over gRPC are answered
without a 500 or gRPC INTERNAL, and the server keeps serving. Few examples: the in-process tests in tests/fuzz are
where the volume is."""

from __future__ import annotations

import socket
from typing import Any

import grpc
import orjson
import pytest
import requests
from fuzz.test_fuzz_codecs import hostile_input, hostile_message
from fuzz.test_fuzz_http1 import mutated, request_like
from hypothesis import given, settings
from hypothesis import strategies as st
from support import ServerProcess
from tritonclient.grpc import service_pb2

TIMEOUT_S = 30.0
MODELS = ["add_sub", "identity", "params"]
_FEW = settings(max_examples=25)


def _answers(port: int, data: bytes) -> list[int]:
    """The statuses of what the server answers to `data` before it closes (or stays silent for a moment)."""
    statuses = []
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(2.0)
        received = b""
        try:
            while chunk := sock.recv(1 << 16):
                received += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    for line in received.split(b"\r\n"):
        if line.startswith(b"HTTP/1.1 "):
            statuses.append(int(line[9:12]))
    return statuses


@_FEW
@given(data=st.one_of(request_like(), mutated()))
def test_hostile_bytes_get_no_500(transerve_server: ServerProcess, data: bytes) -> None:
    statuses = _answers(transerve_server.http_port, data)
    assert all(status < 500 for status in statuses), statuses
    assert transerve_server.alive()


@_FEW
@given(model=st.sampled_from(MODELS), inputs=st.lists(hostile_input(), max_size=3), binary=st.binary(max_size=32))
def test_hostile_inference_bodies_get_no_500(transerve_server: ServerProcess, model: str,
                                             inputs: list[dict[str, Any]], binary: bytes) -> None:
    header = orjson.dumps({"inputs": inputs})
    response = requests.post(f"{transerve_server.base_url}/v2/models/{model}/infer", data=header + binary,
                             headers={"Inference-Header-Content-Length": str(len(header))}, timeout=TIMEOUT_S)
    assert response.status_code < 500, response.text


@pytest.fixture(scope="module")
def channel(transerve_server: ServerProcess) -> grpc.Channel:
    with grpc.insecure_channel(transerve_server.grpc_url) as channel:
        yield channel


@_FEW
@given(model=st.sampled_from(MODELS), message=hostile_message())
def test_hostile_grpc_requests_get_no_internal(channel: grpc.Channel, model: str,
                                               message: service_pb2.ModelInferRequest) -> None:
    message.model_name = model
    call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
    try:
        call(message.SerializeToString(), timeout=TIMEOUT_S)
    except grpc.RpcError as exc:
        assert exc.code() not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), exc.details()
