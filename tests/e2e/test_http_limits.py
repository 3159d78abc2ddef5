"""HTTP/1.1 limits end to end: raw sockets against a real transerve with short timeouts (docs/security.md).

Each test sends what a hostile or broken client sends and checks what the server answers, and that it closes the
connection in time; none measures speed or memory (benchmarks/http_hostile.py does). Every wait is bounded.
"""

from __future__ import annotations

import gzip
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from support import ServerProcess, start_transerve
from support.repositories import copy_example

TIMEOUT_S = 1.0
"""The server's header, body, keep-alive and send timeouts in these tests."""

ADD_SUB = json.dumps({"inputs": [
    {"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]},
    {"name": "INPUT1", "shape": [1, 4], "datatype": "FP32", "data": [1, 1, 1, 1]},
]}).encode()
INFER = b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n" % len(ADD_SUB)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    repo = copy_example(tmp_path_factory.mktemp("limits"), "add_sub")
    timeouts = [f"--http-{kind}-timeout-secs={TIMEOUT_S}" for kind in ("header", "body", "keepalive", "send")]
    with start_transerve(repo, *timeouts, "--http-max-url-size=1024", "--http-max-header-size=2048",
                         "--http-max-headers=20") as process:
        yield process


class Answer:
    """What the server sent on one connection, and whether and when (after the first byte sent) it closed it."""

    def __init__(self, data: bytes, closed_after: float | None) -> None:
        self.data = data
        self.closed_after = closed_after

    @property
    def statuses(self) -> list[int]:
        return [int(line[9:12]) for line in self.data.split(b"\r\n") if line.startswith(b"HTTP/1.1 ")]

    @property
    def closed(self) -> bool:
        return self.closed_after is not None


def exchange(port: int, data: bytes, wait: float = 10.0, keep_sending: bytes = b"") -> Answer:
    """Send `data` (from a thread, as the server may stop reading it), then read until the server closes the
    connection or `wait` passes. `keep_sending` follows `data` slowly, one byte every 0.2 s, until the server closes
    the connection (a trickling client)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=wait)
    start = time.monotonic()

    def send() -> None:
        try:
            sock.sendall(data)
            for index in range(len(keep_sending)):
                time.sleep(0.2)
                sock.sendall(keep_sending[index:index + 1])
        except OSError:
            pass

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    received, closed_after = b"", None
    deadline = start + wait
    with sock:
        while time.monotonic() < deadline:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            except OSError:
                chunk = b""
            if not chunk:
                closed_after = time.monotonic() - start
                break
            received += chunk
    sender.join(timeout=5)
    return Answer(received, closed_after)


def error_of(answer: Answer) -> str:
    return json.loads(answer.data.split(b"\r\n\r\n", 1)[1].split(b"\r\n")[0])["error"]


def still_serving(server: ServerProcess) -> None:
    response = requests.post(f"{server.base_url}/v2/models/add_sub/infer", data=ADD_SUB, timeout=10)
    assert response.status_code == 200 and response.json()["outputs"][0]["data"] == [2.0, 3.0, 4.0, 5.0]


# ------------------------------------------------------------------------------------------------ sizes


def test_a_request_target_past_the_limit_is_answered_414(server: ServerProcess) -> None:
    answer = exchange(server.http_port, b"GET /v2/" + b"a" * 70_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    assert answer.statuses == [414] and answer.closed and "--http-max-url-size" in error_of(answer)
    assert exchange(server.http_port, b"GET /v2/health/live?" + b"a" * 900 + b" HTTP/1.1\r\nConnection: close\r\n"
                    b"\r\n").statuses == [200]


def test_a_header_line_of_16_mib_is_answered_431_without_reading_it(server: ServerProcess) -> None:
    line = b"X-Long: " + b"a" * (16 << 20) + b"\r\n"
    answer = exchange(server.http_port, b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n" + line + b"\r\n")
    assert answer.statuses == [431] and answer.closed and "--http-max-header-size" in error_of(answer)
    still_serving(server)


def test_header_count_and_size_limits(server: ServerProcess) -> None:
    def request(headers: list[bytes]) -> Answer:
        return exchange(server.http_port, b"GET /v2/health/live HTTP/1.1\r\nConnection: close\r\n"
                        + b"".join(headers) + b"\r\n")

    assert request([b"X-%d: v\r\n" % index for index in range(19)]).statuses == [200]  # 20 with Connection
    too_many = request([b"X-%d: v\r\n" % index for index in range(100_000)])
    assert too_many.statuses == [431] and "--http-max-headers" in error_of(too_many)
    too_large = request([b"X-%d: %s\r\n" % (index, b"v" * 300) for index in range(10)])
    assert too_large.statuses == [431] and "--http-max-header-size" in error_of(too_large)


def test_trailers_without_end_are_refused(server: ServerProcess) -> None:
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as sock:
        sock.sendall(b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"1\r\na\r\n0\r\nX-Trailer: ")
        time.sleep(0.2)  # a read of its own, with no body in it
        sock.sendall(b"b" * 100_000)
        assert sock.recv(65536).startswith(b"HTTP/1.1 431 ")


# ------------------------------------------------------------------------------------------------ request forms


def test_connect_and_upgrades_are_refused_with_400_before_any_route_runs(server: ServerProcess) -> None:
    connect = exchange(server.http_port, b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n")
    assert connect.statuses == [400] and connect.closed and "CONNECT" in error_of(connect)
    upgrade = exchange(server.http_port, b"POST /v2/repository/index HTTP/1.1\r\nConnection: upgrade\r\n"
                       b"Upgrade: h2c\r\nContent-Length: 2\r\n\r\n{}")
    assert upgrade.statuses == [400] and upgrade.closed and "upgrade" in error_of(upgrade)


@pytest.mark.parametrize(("target", "status"), [
    (b"http://example.com/v2/health/live", 200),  # absolute form: RFC 9112 says a server must take it
    (b"http://example.com", 404),
    (b"*", 404),
    (b"example.com:80", 400),  # authority form, for CONNECT only
])
def test_request_target_forms(server: ServerProcess, target: bytes, status: int) -> None:
    answer = exchange(server.http_port, b"GET " + target + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert answer.statuses == [status]


# ------------------------------------------------------------------------------------------------ timeouts


def test_a_head_that_trickles_is_answered_408_at_the_header_timeout(server: ServerProcess) -> None:
    answer = exchange(server.http_port, b"GET /v2/health/live HTTP/1.1\r\n", keep_sending=b"X-Slow: 1\r\n" * 20)
    assert answer.statuses == [408] and "--http-header-timeout-secs" in error_of(answer)
    assert answer.closed_after is not None and TIMEOUT_S * 0.9 < answer.closed_after < TIMEOUT_S + 2


def test_a_body_shorter_than_its_length_is_answered_408(server: ServerProcess) -> None:
    answer = exchange(server.http_port, INFER + b"\r\n" + ADD_SUB[:-10])
    assert answer.statuses == [408] and "--http-body-timeout-secs" in error_of(answer)
    assert answer.closed_after is not None and answer.closed_after < TIMEOUT_S + 2


def test_idle_connections_are_closed(server: ServerProcess) -> None:
    silent = exchange(server.http_port, b"")
    assert silent.data == b"" and silent.closed_after is not None and silent.closed_after < TIMEOUT_S + 2
    idle = exchange(server.http_port, b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
    assert idle.statuses == [200] and idle.closed_after is not None and idle.closed_after > TIMEOUT_S * 0.9


def test_a_client_that_pipelines_without_reading_is_stopped_then_cut(server: ServerProcess) -> None:
    """The server stops reading once its answers are not read (the client's sends then block) and cuts the
    connection after the send timeout; others are served meanwhile."""
    request = (INFER + b"\r\n" + ADD_SUB) * 512
    sock = socket.create_connection(("127.0.0.1", server.http_port))
    sock.setblocking(False)
    sent, stalled, cut = 0, False, False
    deadline = time.monotonic() + 60
    with sock:
        while time.monotonic() < deadline and not cut:
            try:
                sent += sock.send(request)
            except BlockingIOError:
                if not stalled:  # the server no longer reads this connection: others are still served
                    stalled = True
                    still_serving(server)
                time.sleep(0.05)
            except OSError:
                cut = True
            cut = cut or sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] != 1  # not ESTABLISHED
    assert stalled and cut, f"stalled: {stalled}, cut: {cut} ({sent} bytes sent)"
    still_serving(server)


# ------------------------------------------------------------------------------------------------ 100-continue


def test_expect_100_continue_is_answered_before_the_body(server: ServerProcess) -> None:
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as sock:
        sock.sendall(INFER + b"Expect: 100-continue\r\n\r\n")
        assert sock.recv(65536) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(ADD_SUB)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 OK")


def test_expect_100_continue_is_refused_at_once_when_the_body_is_too_large(server: ServerProcess) -> None:
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as sock:
        sock.sendall(b"POST /v2/models/add_sub/infer HTTP/1.1\r\nContent-Length: 100000000000\r\n"
                     b"Expect: 100-continue\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 413 ")


def test_a_pipelined_100_continue_waits_for_the_answers_before_it(server: ServerProcess) -> None:
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as sock:
        sock.sendall(INFER + b"\r\n" + ADD_SUB + INFER + b"Expect: 100-continue\r\n\r\n")
        received = b""
        while b"100 Continue" not in received:
            received += sock.recv(65536)
        assert received.index(b"HTTP/1.1 200 OK") < received.index(b"HTTP/1.1 100 Continue")
        sock.sendall(ADD_SUB)
        while received.count(b"HTTP/1.1 200 OK") < 2:
            received += sock.recv(65536)


# ------------------------------------------------------------------------------------------------ bodies


def test_every_gzip_member_is_inflated(server: ServerProcess) -> None:
    half = len(ADD_SUB) // 2
    body = gzip.compress(ADD_SUB[:half]) + gzip.compress(ADD_SUB[half:]) + b"\0\0"
    response = requests.post(f"{server.base_url}/v2/models/add_sub/infer", data=body,
                             headers={"Content-Encoding": "gzip"}, timeout=10)
    assert response.status_code == 200, response.text
    response = requests.post(f"{server.base_url}/v2/models/add_sub/infer", data=body + b"junk",
                             headers={"Content-Encoding": "gzip"}, timeout=10)
    assert response.status_code == 400 and "after its last member" in response.json()["error"]


# ------------------------------------------------------------------------------------------------ connections


def test_connections_past_the_cap_are_answered_503(tmp_path: Path) -> None:
    with start_transerve(copy_example(tmp_path, "add_sub"), "--http-max-connections=3") as server:
        held: list[socket.socket] = []
        deadline = time.monotonic() + 10
        while len(held) < 3 and time.monotonic() < deadline:  # readiness polling's connections may linger a moment
            sock = socket.create_connection(("127.0.0.1", server.http_port), timeout=10)
            sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            if sock.recv(65536).startswith(b"HTTP/1.1 200 OK"):
                held.append(sock)
            else:
                sock.close()
        try:
            refused = exchange(server.http_port, b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            assert refused.statuses == [503] and refused.closed and "--http-max-connections" in error_of(refused)
            held[0].sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")  # admitted ones are still served
            assert held[0].recv(65536).startswith(b"HTTP/1.1 200 OK")
            held.pop().close()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                answer = exchange(server.http_port, b"GET /v2/health/live HTTP/1.1\r\nConnection: close\r\n\r\n")
                if answer.statuses == [200]:
                    break
                time.sleep(0.1)
            assert answer.statuses == [200]
        finally:
            for sock in held:
                sock.close()
