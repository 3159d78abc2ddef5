"""Hostile HTTP/2 clients against the gRPC listener, driven by the `h2` library (raw frames where h2 will not send
them): each flood is cut with GOAWAY ENHANCE_YOUR_CALM once past its budget, streams past MAX_CONCURRENT_STREAMS are
refused before the client acknowledges SETTINGS, idle, handshake and stalled-answer timeouts close what they should,
the per-message limit holds on both transports, and after each a bystander connection is still answered.
Floods are bounded in count and time; speed and memory bounds are benchmarks/grpc_hostile.py's."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.events import (
    ConnectionTerminated,
    DataReceived,
    Event,
    RemoteSettingsChanged,
    StreamEnded,
    StreamReset,
    TrailersReceived,
)
from h2.exceptions import ProtocolError
from h2.settings import SettingCodes
from hpack import Encoder
from support import EXAMPLE_REPOSITORY, ServerProcess, start_transerve
from support.h2client import (
    CONTINUATION,
    DATA,
    GOAWAY,
    HEADERS,
    HEALTH,
    INFER,
    PING,
    PREFACE,
    RST_STREAM,
    frame,
    grpc_message,
    request_headers,
    settings,
)
from tritonclient.utils import InferenceServerException

from transerve.frontends.grpc.limits import MAX_CONCURRENT_STREAMS, MAX_CONTINUATIONS, RESETS, STREAM_WINDOW

STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"
MAX_INPUT = 2 << 20
FLAGS = ("--grpc-max-input-size", str(MAX_INPUT), "--grpc-idle-timeout-secs", "2", "--grpc-stall-timeout-secs", "1",
         "--grpc-handshake-timeout-secs", "1")


@pytest.fixture(scope="module")
def native() -> Iterator[ServerProcess]:
    with start_transerve(EXAMPLE_REPOSITORY, "--grpc-transport=native", *FLAGS) as server:
        yield server


@pytest.fixture(scope="module")
def grpcio() -> Iterator[ServerProcess]:
    with start_transerve(EXAMPLE_REPOSITORY, "--grpc-transport=grpcio", *FLAGS) as server:
        yield server


def identity_request(size: int) -> bytes:
    from tritonclient.grpc import service_pb2

    message = service_pb2.ModelInferRequest(model_name="identity")
    message.inputs.add(name="INPUT_UINT8", datatype="UINT8", shape=[1, size])
    message.raw_input_contents.append(bytes(size))
    return message.SerializeToString()


class Probe:
    """One client connection through the `h2` library; `send` flushes what h2 wrote, `events` reads until told."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.h2 = H2Connection(H2Configuration(client_side=True, header_encoding="utf-8"))
        self.h2.initiate_connection()
        self.send()

    def __enter__(self) -> Probe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def send(self) -> bool:
        """False once the server has closed the connection."""
        try:
            self.sock.sendall(self.h2.data_to_send())
        except OSError:
            return False
        return True

    def events(self, until: Callable[[Event], bool], timeout: float = 10.0) -> list[Event]:
        """Events up to the first for which `until` is true, or to the end of the connection."""
        seen: list[Event] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                data = self.sock.recv(1 << 20)
            except (ConnectionResetError, TimeoutError):
                return seen
            if not data:
                return seen
            try:
                received = self.h2.receive_data(data)
            except ProtocolError:
                continue  # h2 objecting to the server's frames on streams it reset: irrelevant here
            seen += received
            if any(until(event) for event in received):
                return seen
        raise AssertionError(f"nothing ended the wait in {timeout} s; saw {seen[-5:]}")

    def terminated(self, timeout: float = 10.0) -> ConnectionTerminated:
        events = self.events(lambda event: isinstance(event, ConnectionTerminated), timeout)
        ends = [event for event in events if isinstance(event, ConnectionTerminated)]
        assert ends, f"the connection ended without GOAWAY; saw {events[-5:]}"
        return ends[0]

    def handshake(self) -> None:
        self.events(lambda event: type(event).__name__ == "SettingsAcknowledged")
        self.send()

    def health(self) -> bool:
        """One Health/Check call; True when it is answered SERVING."""
        stream = self.h2.get_next_available_stream_id()
        self.h2.send_headers(stream, request_headers())
        self.h2.send_data(stream, grpc_message(b""), end_stream=True)
        self.send()
        events = self.events(lambda event: isinstance(event, StreamEnded) and event.stream_id == stream)
        data = b"".join(event.data for event in events if isinstance(event, DataReceived))
        trailers = [dict(event.headers) for event in events if isinstance(event, TrailersReceived)]
        return [end.get("grpc-status") for end in trailers] == ["0"] and data == grpc_message(b"\x08\x01")


def assert_bystander_answered(server: ServerProcess) -> None:
    with grpc.insecure_channel(server.grpc_url) as channel:
        assert channel.unary_unary(HEALTH)(b"", timeout=30) == b"\x08\x01"
    client = grpcclient.InferenceServerClient(server.grpc_url)
    inputs = [grpcclient.InferInput(name, [1, 4], "FP32") for name in ("INPUT0", "INPUT1")]
    for tensor in inputs:
        tensor.set_data_from_numpy(np.ones((1, 4), np.float32))
    assert client.infer("add_sub", inputs).as_numpy("OUTPUT0").tolist() == [[2.0] * 4]
    client.close()


def assert_calmed(end: ConnectionTerminated, debug: bytes | None = None) -> None:
    assert end.error_code == ErrorCodes.ENHANCE_YOUR_CALM, (end.error_code, end.additional_data)
    if debug is not None:
        assert end.additional_data == debug


# ---- floods: each cut past its budget, with ENHANCE_YOUR_CALM -----------------------------------------------------


def test_rapid_reset_is_cut(native: ServerProcess) -> None:
    with Probe(native.grpc_port) as probe:
        for count in range(RESETS[0] * 2):
            stream = probe.h2.get_next_available_stream_id()
            probe.h2.send_headers(stream, request_headers())
            probe.h2.send_data(stream, grpc_message(b""), end_stream=True)
            probe.h2.reset_stream(stream)
            if count % 100 == 99 and not probe.send():
                break
        probe.send()
        assert_calmed(probe.terminated())
    assert_bystander_answered(native)


@pytest.mark.parametrize("transport", ["native", "grpcio"])
def test_a_ping_flood_is_cut_as_grpc_core_does(transport: str, request: pytest.FixtureRequest) -> None:
    server: ServerProcess = request.getfixturevalue(transport)
    with Probe(server.grpc_port) as probe:
        probe.handshake()
        for count in range(10):
            probe.h2.ping(count.to_bytes(8, "big"))
        probe.send()
        assert_calmed(probe.terminated(), b"too_many_pings")
    assert_bystander_answered(server)


def test_pings_between_answered_calls_are_welcome(native: ServerProcess) -> None:
    with Probe(native.grpc_port) as probe:
        probe.handshake()
        for count in range(6):
            probe.h2.ping(count.to_bytes(8, "big"))
            assert probe.health()


def test_a_settings_flood_is_cut(native: ServerProcess) -> None:
    with Probe(native.grpc_port) as probe:
        for count in range(1000):
            probe.h2.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: 65535 + count})
        probe.send()
        assert_calmed(probe.terminated())
    assert_bystander_answered(native)


def test_an_empty_data_flood_is_cut(native: ServerProcess) -> None:
    with Probe(native.grpc_port) as probe:
        probe.h2.send_headers(1, request_headers())
        for _ in range(1000):
            probe.h2.send_data(1, b"")
        probe.send()
        assert_calmed(probe.terminated())
    assert_bystander_answered(native)


def _raw(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(PREFACE + settings({}))
    return sock


def _goaway_code(sock: socket.socket, timeout: float = 10.0) -> tuple[int | None, list[int]]:
    """The GOAWAY's error code (None if the connection ended without one) and the codes of RST_STREAMs before it."""
    buffer, resets = b"", []
    sock.settimeout(timeout)
    while True:
        while len(buffer) >= 9 and len(buffer) >= 9 + int.from_bytes(buffer[:3], "big"):
            end = 9 + int.from_bytes(buffer[:3], "big")
            kind, payload, buffer = buffer[3], buffer[9:end], buffer[end:]
            if kind == GOAWAY:
                return int.from_bytes(payload[4:8], "big"), resets
            if kind == RST_STREAM:
                resets.append(int.from_bytes(payload[:4], "big"))
        try:
            chunk = sock.recv(1 << 20)
        except ConnectionResetError:
            return None, resets
        if not chunk:
            return None, resets
        buffer += chunk


@pytest.mark.parametrize("transport", ["native", "grpcio"])
def test_zero_length_continuations_are_cut(transport: str, request: pytest.FixtureRequest) -> None:
    """h2 will not send a header block in pieces: the frames are spelled out (CVE-2024-27316's flood)."""
    server: ServerProcess = request.getfixturevalue(transport)
    sock = _raw(server.grpc_port)
    block = Encoder().encode(request_headers())
    flood = frame(HEADERS, 0, 1, block[:3]) + frame(CONTINUATION, 0, 1, b"") * 100_000
    with contextlib.suppress(OSError):  # cut while still sending
        sock.sendall(flood)
    code, _ = _goaway_code(sock)
    sock.close()
    if transport == "native":  # grpc-core closes the connection without a GOAWAY: that it ends is the point
        assert code == ErrorCodes.ENHANCE_YOUR_CALM
    assert_bystander_answered(server)


def test_a_header_block_of_too_many_continuations_is_cut(native: ServerProcess) -> None:
    sock = _raw(native.grpc_port)
    block = Encoder().encode(request_headers())
    pieces = [block[i:i + 1] for i in range(len(block))]
    assert len(pieces) > MAX_CONTINUATIONS + 1
    sock.sendall(frame(HEADERS, 0, 1, pieces[0]) + b"".join(frame(CONTINUATION, 0, 1, p) for p in pieces[1:]))
    code, _ = _goaway_code(sock)
    sock.close()
    assert code == ErrorCodes.ENHANCE_YOUR_CALM


def test_streams_past_the_limit_are_refused_before_settings_are_acknowledged(native: ServerProcess) -> None:
    """The client never acknowledges the server's SETTINGS: MAX_CONCURRENT_STREAMS holds all the same, and a client
    that goes on opening refused streams is cut."""
    sock = _raw(native.grpc_port)
    encoder = Encoder()
    opened = MAX_CONCURRENT_STREAMS + RESETS[0] + 100
    frames = b"".join(frame(HEADERS, 0x4, 2 * index + 1, encoder.encode(request_headers()))
                      for index in range(opened))
    with contextlib.suppress(OSError):
        sock.sendall(frames)
    code, resets = _goaway_code(sock)
    sock.close()
    assert code == ErrorCodes.ENHANCE_YOUR_CALM
    assert resets and set(resets) == {ErrorCodes.REFUSED_STREAM}
    assert len(resets) <= RESETS[0] + 1
    assert_bystander_answered(native)


# ---- timeouts -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["native", "grpcio"])
def test_an_idle_connection_gets_goaway(transport: str, request: pytest.FixtureRequest) -> None:
    server: ServerProcess = request.getfixturevalue(transport)
    with Probe(server.grpc_port) as probe:
        probe.handshake()
        assert probe.health()
        started = time.monotonic()
        end = probe.terminated(timeout=15)
        assert 1.5 < time.monotonic() - started < 10
        # grpc-core says INTERNAL_ERROR "connection idle" where the native transport says NO_ERROR
        assert (end.error_code, end.additional_data) in ((ErrorCodes.NO_ERROR, None), (ErrorCodes.NO_ERROR, b""),
                                                         (ErrorCodes.INTERNAL_ERROR, b"connection idle"))


def test_the_idle_timeout_starts_when_the_last_call_ends(native: ServerProcess) -> None:
    """A call open across the first timeout check (the handshake's, at 1 s) does not leave the connection without
    an idle timeout once it ends."""
    with Probe(native.grpc_port) as probe:
        probe.handshake()
        stream = probe.h2.get_next_available_stream_id()
        probe.h2.send_headers(stream, request_headers())
        probe.send()
        time.sleep(1.5)
        probe.h2.send_data(stream, grpc_message(b""), end_stream=True)
        probe.send()
        probe.events(lambda event: isinstance(event, StreamEnded) and event.stream_id == stream)
        started = time.monotonic()
        end = probe.terminated(timeout=15)
        assert end.error_code == ErrorCodes.NO_ERROR and 1.5 < time.monotonic() - started < 5


def test_a_silent_connection_is_closed_after_the_handshake_timeout() -> None:
    with start_transerve(EXAMPLE_REPOSITORY, *FLAGS) as server:  # a server of its own: no other connection is idle
        silent = socket.create_connection(("127.0.0.1", server.grpc_port), timeout=10)
        unacknowledged = _raw(server.grpc_port)
        started = time.monotonic()
        assert _goaway_code(silent)[0] in (None, ErrorCodes.SETTINGS_TIMEOUT)
        assert _goaway_code(unacknowledged)[0] == ErrorCodes.SETTINGS_TIMEOUT
        assert time.monotonic() - started < 8
        silent.close()
        unacknowledged.close()


def test_grpc_core_closes_a_silent_connection_after_the_handshake_timeout(grpcio: ServerProcess) -> None:
    silent = socket.create_connection(("127.0.0.1", grpcio.grpc_port), timeout=10)
    started = time.monotonic()
    _goaway_code(silent)  # grpc-core's GOAWAY says INTERNAL_ERROR; what matters is that the connection ends
    assert time.monotonic() - started < 8
    silent.close()


@pytest.mark.parametrize("transport", ["native", "grpcio"])
def test_both_transports_announce_the_stream_limit(transport: str, request: pytest.FixtureRequest) -> None:
    server: ServerProcess = request.getfixturevalue(transport)
    with Probe(server.grpc_port) as probe:
        events = probe.events(lambda event: isinstance(event, RemoteSettingsChanged))
        changed = next(event for event in events if isinstance(event, RemoteSettingsChanged)).changed_settings
        assert changed[SettingCodes.MAX_CONCURRENT_STREAMS].new_value == MAX_CONCURRENT_STREAMS


def _call_with_1_mib_answer(probe: Probe) -> None:
    probe.h2.send_headers(1, request_headers(INFER))
    body = grpc_message(identity_request(1 << 20))
    for start in range(0, len(body), 1 << 19):
        probe.h2.send_data(1, body[start:start + (1 << 19)], end_stream=start + (1 << 19) >= len(body))
    probe.send()


def test_a_stream_whose_answer_is_never_read_is_given_up(native: ServerProcess) -> None:
    """The client opens the connection's window but never the stream's: that stream is reset after the stall
    timeout, and the connection goes on."""
    with Probe(native.grpc_port) as probe:
        probe.handshake()
        probe.h2.increment_flow_control_window(1 << 24)
        _call_with_1_mib_answer(probe)
        events = probe.events(lambda event: isinstance(event, StreamReset | StreamEnded), timeout=20)
        assert isinstance(events[-1], StreamReset) and events[-1].error_code == ErrorCodes.CANCEL
        assert sum(len(event.data) for event in events if isinstance(event, DataReceived)) <= 65535
        assert probe.health()


def test_a_connection_whose_answers_are_never_read_is_cut(native: ServerProcess) -> None:
    """The client never opens even the connection's window past its first 64 KiB: every answer is stuck, so the
    connection is closed after the stall timeout."""
    with Probe(native.grpc_port) as probe:
        probe.handshake()
        _call_with_1_mib_answer(probe)
        assert_calmed(probe.terminated(timeout=20))
    assert_bystander_answered(native)


# ---- the message limit, on both transports --------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["native", "grpcio"])
def test_a_message_over_the_limit_is_resource_exhausted(transport: str, request: pytest.FixtureRequest) -> None:
    server: ServerProcess = request.getfixturevalue(transport)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    for size, fits in ((MAX_INPUT // 2, True), (MAX_INPUT + 1, False)):
        tensor = grpcclient.InferInput("INPUT_UINT8", [1, size], "UINT8")
        tensor.set_data_from_numpy(np.zeros((1, size), np.uint8))
        if fits:
            assert client.infer("identity", [tensor]).as_numpy("OUTPUT_UINT8").shape == (1, size)
        else:
            with pytest.raises(InferenceServerException) as caught:
                client.infer("identity", [tensor])
            assert caught.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
    client.close()
    assert_bystander_answered(server)


def test_grpc_core_closes_a_connection_that_never_acknowledges_settings(grpcio: ServerProcess) -> None:
    """grpc-core has no reset budget, but it gives a client the handshake timeout to acknowledge SETTINGS
    (`grpc.http2.settings_timeout`): a rapid-reset flood from a client that never does is cut after it."""
    sock = _raw(grpcio.grpc_port)
    encoder = Encoder()
    started = time.monotonic()
    with contextlib.suppress(OSError):
        for batch in range(20):
            sock.sendall(b"".join(
                frame(HEADERS, 0x4, stream, encoder.encode(request_headers(INFER))) + frame(DATA, 0x1, stream, b"")
                + frame(RST_STREAM, 0, stream, b"\x00\x00\x00\x08")
                for stream in range(200 * batch + 1, 200 * batch + 200, 2)))
    assert _goaway_code(sock)[0] == ErrorCodes.SETTINGS_TIMEOUT  # not the idle timeout's INTERNAL_ERROR
    assert time.monotonic() - started < 8
    sock.close()
    assert_bystander_answered(grpcio)


def test_flags_refuse_impossible_values() -> None:
    from transerve.cli import build_parser, grpc_limits_from_args

    args = build_parser().parse_args(["serve", "--model-repository", "x", "--grpc-stall-timeout-secs", "0"])
    with pytest.raises(SystemExit):
        grpc_limits_from_args(args)
    limits = grpc_limits_from_args(build_parser().parse_args(
        ["serve", "--model-repository", "x", "--grpc-http2-min-recv-ping-interval-without-data", "1500"]))
    assert limits.min_ping_interval == 1.5 and limits.max_message == 2**31 - 1


# ---- flow control: what a connection holds is what its calls have taken, and what a client that does not read costs


def test_a_call_that_takes_nothing_gets_no_window_past_its_next_message(native: ServerProcess) -> None:
    """A unary call starts once its request has ended: a client that sends a first message and then goes on sending
    without ending it gets a stream window's worth in, then nothing more; the connection goes on."""
    with Probe(native.grpc_port) as probe:
        probe.handshake()
        stream = probe.h2.get_next_available_stream_id()
        probe.h2.send_headers(stream, request_headers(INFER))
        probe.h2.send_data(stream, grpc_message(identity_request(16)))
        chunk, sent, stuck = bytes(1 << 14), 0, 0
        while stuck < 3:  # sends what the windows allow until three reads in a row brought no more window
            room = min(probe.h2.local_flow_control_window(stream), len(chunk))
            if room:
                probe.h2.send_data(stream, chunk[:room])
                sent += room
                stuck = 0
                assert probe.send()
                continue
            _read_for(probe, 0.3)
            stuck += probe.h2.local_flow_control_window(stream) == 0
        assert STREAM_WINDOW // 2 <= sent <= STREAM_WINDOW
        probe.h2.reset_stream(stream)
        probe.send()
        assert probe.health()


def _read_for(probe: Probe, seconds: float) -> None:
    """Take in what the server sends for `seconds` (its WINDOW_UPDATEs, mostly)."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        probe.sock.settimeout(left)
        try:
            data = probe.sock.recv(1 << 20)
        except TimeoutError:
            return
        assert data, "the server closed the connection"
        probe.h2.receive_data(data)
    probe.send()


def test_a_stream_of_messages_larger_than_its_window_flows_as_the_call_takes_them(native: ServerProcess) -> None:
    """ModelStreamInfer with 8 requests of 1.5 MiB (12 MiB, three stream windows): the window comes back as the call
    takes each request, and every one is answered."""
    count, size = 8, 3 << 19
    body = b"".join(grpc_message(identity_request(size)) for _ in range(count))
    assert len(body) > 2 * STREAM_WINDOW
    with Probe(native.grpc_port) as probe:
        probe.handshake()
        stream = probe.h2.get_next_available_stream_id()
        probe.h2.send_headers(stream, request_headers(STREAM_INFER))
        received, ended, offset = bytearray(), False, 0
        deadline = time.monotonic() + 60
        while not ended and time.monotonic() < deadline:
            room = min(probe.h2.local_flow_control_window(stream), probe.h2.max_outbound_frame_size,
                       len(body) - offset)
            if room > 0:
                offset += room
                probe.h2.send_data(stream, body[offset - room:offset], end_stream=offset == len(body))
                assert probe.send()
                continue
            probe.sock.settimeout(5)
            data = probe.sock.recv(1 << 20)
            assert data, "the server closed the connection"
            for event in probe.h2.receive_data(data):
                if isinstance(event, DataReceived):
                    received += event.data
                    probe.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, StreamEnded | StreamReset) and event.stream_id == stream:
                    ended = True
            probe.send()
        assert ended and offset == len(body)
        answers, at = 0, 0
        while at < len(received):
            at += 5 + int.from_bytes(received[at + 1:at + 5], "big")
            answers += 1
        assert answers == count


def test_a_client_that_does_not_read_is_not_read_and_is_cut() -> None:
    """With no ping strikes (any number of PINGs allowed), a client that sends PINGs and never reads their ACKs is
    read no further once the server's writes back up, and is cut after the stall timeout."""
    with start_transerve(EXAMPLE_REPOSITORY, *FLAGS, "--grpc-http2-max-ping-strikes", "0") as server:
        sock = _raw(server.grpc_port)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 12)
        pings = frame(PING, 0, 0, bytes(8)) * 4096
        sock.settimeout(2)
        sent = 0
        with contextlib.suppress(OSError):  # TimeoutError: the server stopped reading; or it cut the connection
            while sent < 1 << 30:
                sock.sendall(pings)
                sent += len(pings)
        assert sent < 64 << 20  # socket buffers, and what the server read before its writes backed up
        code, _ = _goaway_code(sock, timeout=15)  # the GOAWAY may be stuck behind the unread ACKs: cut all the same
        assert code in (None, ErrorCodes.ENHANCE_YOUR_CALM)
        sock.close()
        assert_bystander_answered(server)
