"""`transerve client` and `transerve perf`, run as the user runs them, against a hostile HTTP server on loopback:
one that answers without end, one that accepts and never answers, one that answers malformed JSON. Each tool ends
in bounded time with one line on stderr (no traceback), and grows by far less than the answer offered."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

#: Longer than any bounded run here; the tools are given small timeouts.
RUN_LIMIT_S = 60


def _huge(connection: socket.socket) -> None:
    """200 with a 4 GiB Content-Length (and, for a tool that ignores it, zeros without end)."""
    connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 4294967296\r\n\r\n")
    block = b"0" * (1 << 16)
    while True:
        connection.sendall(block)


def _huge_chunked(connection: socket.socket) -> None:
    """200 with chunks without end (no Content-Length to refuse it by)."""
    connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunk = b"10000\r\n" + b"0" * 0x10000 + b"\r\n"
    while True:
        connection.sendall(chunk)


def _hang(connection: socket.socket) -> None:
    time.sleep(RUN_LIMIT_S)


def _junk(connection: socket.socket) -> None:
    body = b'{"name": "m", "inputs": [tru'
    connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                       % (len(body), body))
    time.sleep(1)


@pytest.fixture
def hostile() -> Iterator[Callable[[Callable[[socket.socket], None]], str]]:
    """Start a server whose every connection gets `behaviour` (after its request is read); yields its address."""
    listeners: list[socket.socket] = []

    def start(behaviour: Callable[[socket.socket], None]) -> str:
        listener = socket.create_server(("127.0.0.1", 0))
        listeners.append(listener)

        def serve(connection: socket.socket) -> None:
            with connection:
                try:
                    connection.recv(65536)
                    behaviour(connection)
                except OSError:  # the tool hung up
                    pass

        def accept() -> None:
            while True:
                try:
                    connection, _ = listener.accept()
                except OSError:
                    return
                threading.Thread(target=serve, args=(connection,), daemon=True).start()

        threading.Thread(target=accept, daemon=True).start()
        return f"127.0.0.1:{listener.getsockname()[1]}"

    yield start
    for listener in listeners:
        listener.close()


def run_tool(*argv: str) -> tuple[int, str, float]:
    """Run `transerve ARGV`; its exit code, stderr and how long it took."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "transerve", *argv], capture_output=True, text=True,
                          timeout=RUN_LIMIT_S)
    return done.returncode, done.stderr, time.monotonic() - started


def client(address: str, tmp_path: Path, *extra: str) -> tuple[int, str, float]:
    lines = tmp_path / "in.txt"
    lines.write_text("hello\n")
    return run_tool("client", "-m", "m", "-u", address, "--input-file", str(lines),
                    "--output-file", str(tmp_path / "out.txt"), *extra)


def perf(address: str, *extra: str) -> tuple[int, str, float]:
    return run_tool("perf", "-m", "m", "-u", address, *extra)


def one_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.mark.parametrize("behaviour", [_huge, _huge_chunked], ids=["length", "chunked"])
def test_a_huge_answer_stops_each_tool_at_its_bound(hostile, tmp_path: Path, behaviour) -> None:
    address = hostile(behaviour)
    code, stderr, _ = client(address, tmp_path, "--max-answer-bytes", "1000000")
    assert code != 0 and "more than --max-answer-bytes 1000000" in one_line(stderr)
    code, stderr, _ = perf(address, "--max-answer-bytes", "1000000")
    assert code != 0 and "more than --max-answer-bytes 1000000" in one_line(stderr)


def test_a_server_that_never_answers_times_each_tool_out(hostile, tmp_path: Path) -> None:
    address = hostile(_hang)
    code, stderr, took = client(address, tmp_path, "--timeout", "1")
    assert code != 0 and "within --timeout 1 s" in one_line(stderr) and took < 20
    code, stderr, took = perf(address, "--request-timeout", "1")  # metadata: the lesser of 1 s and 10 s
    assert code != 0 and "no answer within the timeout" in one_line(stderr) and took < 20


def test_malformed_json_is_one_line(hostile, tmp_path: Path) -> None:
    address = hostile(_junk)
    code, stderr, _ = client(address, tmp_path)
    assert code != 0 and "is not JSON" in one_line(stderr)
    code, stderr, _ = perf(address)
    assert code != 0 and "is not JSON" in one_line(stderr)
