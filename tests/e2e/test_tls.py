"""TLS end to end: gRPC with tritonserver's flags on both transports, differential against the real Triton 2.51 with
the same flags, and HTTPS with transerve's own `--http-use-ssl*` flags, through tritonclient's SSL options and curl.

Certificates are made per module (`support/certs.py`): a CA that signed the server's and a client's certificate,
and another CA that signed a stranger's. Every server here is checked with the same clients: one that trusts the
CA (and, for mutual TLS, shows the client certificate) is served; a plaintext client, one that trusts another CA,
and, for mutual TLS, one without a certificate or with the stranger's are refused.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import ssl
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from support import EXAMPLE_REPOSITORY, ServerProcess, require_triton, start_transerve, start_triton
from support.certs import Certificates, make_certificates
from support.servers import http_status

TIMEOUT_S = 30.0
INPUT0 = np.arange(4, dtype=np.float32).reshape(1, 4)
INPUT1 = np.ones((1, 4), dtype=np.float32)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return make_certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """add_sub and identity only: every server here starts in a second or two."""
    repo = tmp_path_factory.mktemp("tls") / "models"
    for model in ("add_sub", "identity"):
        shutil.copytree(EXAMPLE_REPOSITORY / model, repo / model, ignore=shutil.ignore_patterns("__pycache__"))
    return repo


def grpc_flags(certs: Certificates, mutual: bool) -> list[str]:
    """tritonserver's flags, as an operator writes them."""
    flags = [f"--grpc-server-cert={certs.server_cert}", f"--grpc-server-key={certs.server_key}"]
    if mutual:
        return ["--grpc-use-ssl-mutual=true", f"--grpc-root-cert={certs.ca}", *flags]
    return ["--grpc-use-ssl=true", *flags]


def http_flags(certs: Certificates, mutual: bool) -> list[str]:
    flags = [f"--http-server-cert={certs.server_cert}", f"--http-server-key={certs.server_key}"]
    if mutual:
        return ["--http-use-ssl-mutual=true", f"--http-root-cert={certs.ca}", *flags]
    return ["--http-use-ssl=true", *flags]


def client_context(certs: Certificates, with_cert: bool) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs.ca))
    if with_cert:
        context.load_cert_chain(certs.client_cert, certs.client_key)
    return context


#: The servers under test: (server, mutual). "native" and "grpcio" are transerve's gRPC transports (HTTP plain).
KINDS = [("native", False), ("native", True), ("grpcio", False), ("grpcio", True), ("triton", False),
         ("triton", True)]


@pytest.fixture(scope="module", params=KINDS, ids=[f"{kind}-{'mutual' if mutual else 'tls'}" for kind, mutual in KINDS])
def grpc_server(request: pytest.FixtureRequest, repository: Path,
                certs: Certificates) -> Iterator[tuple[ServerProcess, bool]]:
    """A server with gRPC over TLS (mutual or not), and whether it is mutual; tests run grouped by server."""
    kind, mutual = request.param
    flags = grpc_flags(certs, mutual)
    if kind == "triton":
        context = start_triton(repository, *flags, install=require_triton())
    else:
        context = start_transerve(repository, f"--grpc-transport={kind}", *flags)
    with context as server:
        yield server, mutual


@pytest.fixture(scope="module", params=[False, True], ids=["https", "https-mutual"])
def https_server(request: pytest.FixtureRequest, repository: Path,
                 certs: Certificates) -> Iterator[tuple[ServerProcess, bool]]:
    mutual = request.param
    with start_transerve(repository, *http_flags(certs, mutual), https=client_context(certs, mutual)) as server:
        yield server, mutual


def grpc_client(server: ServerProcess, certs: Certificates, *, ca: Path | None, with_cert: bool = False,
                stranger: bool = False) -> grpcclient.InferenceServerClient:
    """tritonclient's own SSL options; `ca=None` is a plaintext client. The URL names localhost, as the
    certificate does."""
    url = f"localhost:{server.grpc_port}"
    if ca is None:
        return grpcclient.InferenceServerClient(url)
    cert, key = (certs.stranger_cert, certs.stranger_key) if stranger else (certs.client_cert, certs.client_key)
    return grpcclient.InferenceServerClient(
        url, ssl=True, root_certificates=str(ca),
        private_key=str(key) if with_cert else None, certificate_chain=str(cert) if with_cert else None)


def add_sub_inputs(module: Any) -> list[Any]:
    inputs = [module.InferInput("INPUT0", [1, 4], "FP32"), module.InferInput("INPUT1", [1, 4], "FP32")]
    inputs[0].set_data_from_numpy(INPUT0)
    inputs[1].set_data_from_numpy(INPUT1)
    return inputs


def add_sub(client: Any, module: Any) -> np.ndarray:
    kwargs = {"client_timeout": TIMEOUT_S} if module is grpcclient else {}
    return client.infer("add_sub", add_sub_inputs(module), **kwargs).as_numpy("OUTPUT0")


def refused(call: Callable[[], object]) -> str:
    """The status of the InferenceServerException `call` raises."""
    with pytest.raises(Exception) as caught:
        call()
    assert isinstance(caught.value, grpcclient.InferenceServerException), caught.value
    return caught.value.status()


# ---- gRPC: the same clients against every server -----------------------------------------------------------------


def test_grpc_serves_a_client_that_trusts_the_ca(grpc_server: tuple[ServerProcess, bool],
                                                 certs: Certificates) -> None:
    server, mutual = grpc_server
    with grpc_client(server, certs, ca=certs.ca, with_cert=mutual) as client:
        assert client.is_server_live(client_timeout=TIMEOUT_S)
        np.testing.assert_array_equal(add_sub(client, grpcclient), INPUT0 + INPUT1)
    assert http_status(server.http_port, "/v2/health/ready") == 200  # gRPC's flags leave HTTP plain


def test_grpc_refuses_plaintext_and_a_client_of_another_ca(grpc_server: tuple[ServerProcess, bool],
                                                           certs: Certificates) -> None:
    server, mutual = grpc_server
    with grpc_client(server, certs, ca=None) as client:
        assert refused(lambda: client.is_server_live(client_timeout=5)) == "StatusCode.UNAVAILABLE"
    # This client trusts another CA, so it refuses the server's certificate.
    with grpc_client(server, certs, ca=certs.other_ca, with_cert=mutual) as client:
        assert refused(lambda: client.is_server_live(client_timeout=5)) == "StatusCode.UNAVAILABLE"


def test_client_certificates_count_with_mutual_tls_only(grpc_server: tuple[ServerProcess, bool],
                                                        certs: Certificates) -> None:
    """Mutual TLS refuses a client without a certificate, or with one of another CA; otherwise none is asked for."""
    server, mutual = grpc_server
    for options in ({}, {"with_cert": True, "stranger": True}):
        with grpc_client(server, certs, ca=certs.ca, **options) as client:
            if mutual:
                assert refused(lambda: client.is_server_live(client_timeout=5)) == "StatusCode.UNAVAILABLE"
            else:
                assert client.is_server_live(client_timeout=TIMEOUT_S)
    with grpc_client(server, certs, ca=certs.ca, with_cert=True) as client:  # and the server still serves
        assert client.is_server_live(client_timeout=TIMEOUT_S)


def test_grpc_streams_and_large_messages_over_tls(grpc_server: tuple[ServerProcess, bool],
                                                  certs: Certificates) -> None:
    """16 MiB each way (many TLS records, the write buffer past its high-water mark) and ModelStreamInfer."""
    server, mutual = grpc_server
    big = np.random.default_rng(0).integers(0, 255, size=(1, 16 << 20), dtype=np.uint8)
    answers: list[object] = []
    with grpc_client(server, certs, ca=certs.ca, with_cert=mutual) as client:
        tensor = grpcclient.InferInput("INPUT_UINT8", list(big.shape), "UINT8")
        tensor.set_data_from_numpy(big)
        result = client.infer("identity", [tensor], outputs=[grpcclient.InferRequestedOutput("OUTPUT_UINT8")],
                              client_timeout=TIMEOUT_S)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT_UINT8"), big)
        client.start_stream(callback=lambda result, error: answers.append(error or result))
        try:
            for _ in range(3):
                client.async_stream_infer("add_sub", add_sub_inputs(grpcclient))
        finally:
            client.stop_stream()
    assert len(answers) == 3
    for answer in answers:
        assert isinstance(answer, grpcclient.InferResult), answer
        np.testing.assert_array_equal(answer.as_numpy("OUTPUT0"), INPUT0 + INPUT1)


def test_alpn_selects_h2(grpc_server: tuple[ServerProcess, bool], certs: Certificates) -> None:
    server, mutual = grpc_server
    assert negotiated(server.grpc_port, client_context(certs, mutual), ["h2", "http/1.1"]) == "h2"


def negotiated(port: int, context: ssl.SSLContext, offer: list[str]) -> str | None:
    """The ALPN protocol the server picks from `offer`."""
    context.set_alpn_protocols(offer)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
            context.wrap_socket(raw, server_hostname="localhost") as tls:
        return tls.selected_alpn_protocol()


# ---- HTTPS --------------------------------------------------------------------------------------------------------


def test_https_serves_tritonclient_and_curl(https_server: tuple[ServerProcess, bool], certs: Certificates) -> None:
    server, mutual = https_server
    options = {"ca_certs": str(certs.ca)}
    if mutual:
        options |= {"certfile": str(certs.client_cert), "keyfile": str(certs.client_key)}
    with httpclient.InferenceServerClient(f"localhost:{server.http_port}", ssl=True, ssl_options=options) as client:
        assert client.is_server_ready()
        np.testing.assert_array_equal(add_sub(client, httpclient), INPUT0 + INPUT1)
    cert = ["--cert", str(certs.client_cert), "--key", str(certs.client_key)] if mutual else []
    assert curl(server, "--cacert", str(certs.ca), *cert) == (0, "200")
    # Metrics stay plain HTTP, as in Triton.
    assert http_status(server.metrics_port, "/metrics") == 200


def test_https_refuses_plaintext_and_a_client_of_another_ca(https_server: tuple[ServerProcess, bool],
                                                            certs: Certificates) -> None:
    server, mutual = https_server
    assert http_status(server.http_port, "/v2/health/ready") is None  # plain HTTP gets no answer
    cert = ["--cert", str(certs.client_cert), "--key", str(certs.client_key)] if mutual else []
    code, _ = curl(server, "--cacert", str(certs.other_ca), *cert)
    assert code == 60  # curl: the peer's certificate cannot be verified
    assert server.alive()


def test_https_client_certificates_count_with_mutual_tls_only(https_server: tuple[ServerProcess, bool],
                                                              certs: Certificates) -> None:
    server, mutual = https_server
    stranger = ssl.create_default_context(cafile=str(certs.ca))
    stranger.load_cert_chain(certs.stranger_cert, certs.stranger_key)
    for context in (client_context(certs, False), stranger):
        assert http_status(server.http_port, "/v2/health/ready", https=context) == (None if mutual else 200)
    code, status = curl(server, "--cacert", str(certs.ca))
    assert (code != 0) if mutual else (code, status) == (0, "200")
    assert server.alive()


def test_https_with_tritonclient_aio(https_server: tuple[ServerProcess, bool], certs: Certificates) -> None:
    import asyncio

    import tritonclient.http.aio as aioclient

    server, mutual = https_server

    async def ready() -> bool:
        client = aioclient.InferenceServerClient(f"localhost:{server.http_port}", ssl=True,
                                                 ssl_context=client_context(certs, mutual))
        try:
            return await client.is_server_ready()
        finally:
            await client.close()

    assert asyncio.run(ready())


def curl(server: ServerProcess, *options: str) -> tuple[int, str]:
    """curl's exit code and the status it printed, for GET /v2/health/ready over HTTPS."""
    result = subprocess.run(["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "10", *options,
                             f"https://localhost:{server.http_port}/v2/health/ready"],
                            capture_output=True, text=True, timeout=30, check=False)
    return result.returncode, result.stdout.strip()


def test_https_speaks_http_1_1_and_tls_1_2(https_server: tuple[ServerProcess, bool], certs: Certificates) -> None:
    server, mutual = https_server
    assert negotiated(server.http_port, client_context(certs, mutual), ["h2", "http/1.1"]) == "http/1.1"
    tls12 = client_context(certs, mutual)
    tls12.maximum_version = ssl.TLSVersion.TLSv1_2
    assert http_status(server.http_port, "/v2/health/ready", https=tls12) == 200


def test_https_holds_the_http_limits(https_server: tuple[ServerProcess, bool], certs: Certificates) -> None:
    """The HTTP/1.1 limits sit above TLS: a long URL, a 1 MiB header line and CONNECT are refused as over plain
    HTTP, and the refusal reaches the client before the connection closes (no lingering half-close over TLS)."""
    server, mutual = https_server
    probes = [(b"GET /v2/" + b"a" * 70_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", b"414"),
              (b"GET /v2/health/live HTTP/1.1\r\nX-Long: " + b"a" * (1 << 20) + b"\r\n\r\n", b"431"),
              (b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n", b"400")]
    for request, status in probes:
        with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as raw, \
                client_context(certs, mutual).wrap_socket(raw, server_hostname="localhost") as tls:
            with contextlib.suppress(ssl.SSLError, OSError):  # refused before all of it was sent
                tls.sendall(request)
            answer = b""
            while chunk := tls.recv(65536):
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 " + status), answer[:200]
    assert http_status(server.http_port, "/v2/health/ready", https=client_context(certs, mutual)) == 200
