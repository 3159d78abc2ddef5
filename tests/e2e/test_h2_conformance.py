"""RFC 9113 conformance of the native gRPC transport, with the `h2` library as the client: the connection preface
and SETTINGS exchange, stream states, flow control, frame sizes, unknown frames, PRIORITY and padding, each answered
as the RFC says (GOAWAY or RST_STREAM with its error code, or carrying on). `h2` also checks every frame the server
sends: a frame it finds illegal fails the test. Frames `h2` refuses to send are written raw with `hyperframe`.

The hostile-client budgets (floods, timeouts) are test_grpc_hostile's; test_grpc_transport's hand-made client
covers more malformed frames. These are the RFC's cases, seen by an independent implementation.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import h2.settings
import pytest
from h2.errors import ErrorCodes
from hyperframe.frame import DataFrame, Frame, HeadersFrame, PriorityFrame, SettingsFrame
from support import ServerProcess, start_transerve
from support.fuzzing import h2_frames
from support.h2client import HEALTH, request_headers

TIMEOUT_S = 30.0
SERVING = b"\x00\x00\x00\x00\x02\x08\x01"  # a HealthCheckResponse of SERVING, framed as a gRPC message
EMPTY_MESSAGE = b"\x00\x00\x00\x00\x00"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server with no models: the transport is what is tested, health checks are its calls."""
    repository: Path = tmp_path_factory.mktemp("empty_repository")
    with start_transerve(repository, "--grpc-transport=native") as process:
        yield process


class Client:
    """One connection driven by `h2`'s client state machine."""

    def __init__(self, port: int, settings: dict[int, int] | None = None) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S)
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.h2.initiate_connection()
        if settings:
            self.h2.update_settings(settings)
        self.flush()
        self.events: list[h2.events.Event] = []
        self.closed = False

    def close(self) -> None:
        self.sock.close()

    def flush(self, change: Callable[[Frame], None] | None = None, then: bytes = b"") -> None:
        """Send what `h2` has queued, each frame first passed to `change` (h2 keeps its state: only the frames'
        form changes), and `then` in the same write, so that the server reads it in the same turn."""
        data = self.h2.data_to_send()
        if change is not None:
            data = b"".join(_changed(frame, change) for frame in _split_frames(data))
        if data or then:
            self.sock.sendall(data + then)

    def raw(self, *frames: Frame | bytes) -> None:
        """Frames `h2` would refuse to send, written past it."""
        self.sock.sendall(b"".join(f if isinstance(f, bytes) else f.serialize() for f in frames))

    def wait(self, found: Callable[[h2.events.Event], bool]) -> h2.events.Event | None:
        """Read until an event `found` accepts (returned), or the connection ends (None)."""
        for event in self.events:
            if found(event):
                self.events.remove(event)
                return event
        while not self.closed:
            try:
                data = self.sock.recv(1 << 16)
            except ConnectionResetError:
                data = b""
            if not data:
                self.closed = True
                break
            events = self.h2.receive_data(data)
            for event in events:
                if isinstance(event, h2.events.DataReceived) and event.flow_controlled_length:
                    self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            self.flush()
            self.events += events
            for event in list(self.events):
                if found(event):
                    self.events.remove(event)
                    return event
        return None

    def goaway(self) -> h2.events.ConnectionTerminated | None:
        return self.wait(lambda e: isinstance(e, h2.events.ConnectionTerminated))  # type: ignore[return-value]

    def reset(self, stream_id: int) -> h2.events.StreamReset | None:
        return self.wait(lambda e: isinstance(e, h2.events.StreamReset) and e.stream_id == stream_id)  # type: ignore

    def call(self, stream_id: int, path: str = HEALTH, body: bytes = EMPTY_MESSAGE) -> tuple[bytes, dict[str, str]]:
        """A whole unary call: its answer's DATA and trailers."""
        self.h2.send_headers(stream_id, request_headers(path))
        self.h2.send_data(stream_id, body, end_stream=True)
        self.flush()
        return self.answer(stream_id)

    def answer(self, stream_id: int) -> tuple[bytes, dict[str, str]]:
        data = b""
        while True:
            event = self.wait(lambda e: getattr(e, "stream_id", None) == stream_id
                              or isinstance(e, h2.events.ConnectionTerminated))
            assert event is not None, "the connection closed"
            if isinstance(event, h2.events.DataReceived):
                data += event.data
            elif isinstance(event, h2.events.TrailersReceived):
                return data, dict(event.headers)
            elif isinstance(event, (h2.events.StreamReset, h2.events.ConnectionTerminated)):
                pytest.fail(f"the call failed: {event}")


def _split_frames(data: bytes) -> Iterator[Frame]:
    while data:
        frame, length = Frame.parse_frame_header(memoryview(data[:9]))
        frame.parse_body(memoryview(data[9:9 + length]))
        data = data[9 + length:]
        yield frame


def _changed(frame: Frame, change: Callable[[Frame], None]) -> bytes:
    change(frame)
    return frame.serialize()


def padded(pad: int) -> Callable[[Frame], None]:
    def pad_frame(frame: Frame) -> None:
        if isinstance(frame, (HeadersFrame, DataFrame)):
            frame.flags.add("PADDED")
            frame.pad_length = pad

    return pad_frame


def raw_frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    """Any frame, unknown types included (hyperframe's ExtensionFrame leaves its body out of its length)."""
    return struct.pack(">IBI", len(payload) << 8 | kind, flags, stream_id) + payload


@pytest.fixture
def client(server: ServerProcess) -> Iterator[Client]:
    connection = Client(server.grpc_port)
    yield connection
    connection.close()


def assert_goaway(client: Client, code: ErrorCodes) -> None:
    event = client.goaway()
    assert event is not None, "the connection closed without GOAWAY"
    assert event.error_code == code, event
    assert client.wait(lambda e: False) is None and client.closed, "the connection stayed open after GOAWAY"


def assert_serving(client: Client, stream_id: int) -> None:
    data, trailers = client.call(stream_id)
    assert trailers["grpc-status"] == "0" and data == SERVING


# ---- preface and SETTINGS ------------------------------------------------------------------------------------


def test_preface_and_settings_are_exchanged_and_acknowledged(client: Client) -> None:
    changed = client.wait(lambda e: isinstance(e, h2.events.RemoteSettingsChanged))
    assert changed is not None, "the server's preface is a SETTINGS frame"
    assert client.wait(lambda e: isinstance(e, h2.events.SettingsAcknowledged)) is not None, "our SETTINGS unacked"
    client.h2.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1 << 20,
                               h2.settings.SettingCodes.MAX_FRAME_SIZE: 1 << 15, 0xF0: 7})  # and one unknown
    client.flush()
    acked = client.wait(lambda e: isinstance(e, h2.events.SettingsAcknowledged))
    assert acked is not None and h2.settings.SettingCodes.INITIAL_WINDOW_SIZE in acked.changed_settings
    assert_serving(client, 1)


def test_settings_announce_limits_the_server_keeps(client: Client) -> None:
    changed = client.wait(lambda e: isinstance(e, h2.events.RemoteSettingsChanged))
    values = {code: setting.new_value for code, setting in changed.changed_settings.items()}  # type: ignore[union-attr]
    assert values.get(h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS, 0) > 0
    assert values.get(h2.settings.SettingCodes.MAX_FRAME_SIZE, 16384) >= 16384
    assert values.get(h2.settings.SettingCodes.ENABLE_PUSH, 0) == 0  # a server must not announce push (6.5.2)


def test_a_connection_without_the_preface_gets_goaway(server: ServerProcess) -> None:
    with socket.create_connection(("127.0.0.1", server.grpc_port), timeout=TIMEOUT_S) as sock:
        sock.sendall(SettingsFrame(0).serialize())  # SETTINGS, but no preface before it
        received = b""
        while chunk := sock.recv(1 << 16):
            received += chunk
    frames = h2_frames(received)
    assert frames[-1][0] == 0x7 and struct.unpack_from(">I", frames[-1][3], 4)[0] == ErrorCodes.PROTOCOL_ERROR


def test_settings_ack_with_a_payload_is_a_frame_size_error(client: Client) -> None:
    frame = SettingsFrame(0, flags=["ACK"])
    client.raw(frame.serialize()[:2] + b"\x06" + frame.serialize()[3:] + b"\x00\x04\x00\x00\x10\x00")
    assert_goaway(client, ErrorCodes.FRAME_SIZE_ERROR)


# ---- stream states (section 5.1) -----------------------------------------------------------------------------


def test_data_on_an_idle_stream_is_a_protocol_error(client: Client) -> None:
    client.raw(DataFrame(5, b"x"))
    assert_goaway(client, ErrorCodes.PROTOCOL_ERROR)


def test_headers_reusing_a_closed_stream_id_is_a_protocol_error(client: Client) -> None:
    assert_serving(client, 3)
    client.raw(HeadersFrame(1, client.h2.encoder.encode(request_headers()), flags=["END_HEADERS", "END_STREAM"]))
    assert_goaway(client, ErrorCodes.PROTOCOL_ERROR)


def test_data_on_a_half_closed_stream_is_stream_closed(client: Client) -> None:
    """After the client's END_STREAM the stream is half-closed (remote): DATA on it is STREAM_CLOSED."""
    client.h2.send_headers(1, request_headers(), end_stream=True)
    client.flush(then=DataFrame(1, b"late").serialize())  # in the same read as END_STREAM: the call is still open
    reset = client.reset(1)
    assert reset is not None and reset.error_code == ErrorCodes.STREAM_CLOSED
    assert_serving(client, 3)


def test_headers_on_a_half_closed_stream_is_stream_closed(client: Client) -> None:
    client.h2.send_headers(1, request_headers(), end_stream=True)
    client.flush(then=HeadersFrame(1, client.h2.encoder.encode([("x-late", "1")]),
                                   flags=["END_HEADERS", "END_STREAM"]).serialize())
    reset = client.reset(1)
    assert reset is not None and reset.error_code == ErrorCodes.STREAM_CLOSED
    assert_serving(client, 3)


def test_data_on_a_closed_stream_leaves_the_connection_serving(client: Client) -> None:
    """Frames on a stream closed a moment ago may still be in flight: ignored (or STREAM_CLOSED), never fatal."""
    assert_serving(client, 1)
    client.raw(DataFrame(1, b"late", flags=["END_STREAM"]))
    assert_serving(client, 3)


def test_trailers_end_a_request(client: Client) -> None:
    client.h2.send_headers(1, request_headers())
    client.h2.send_data(1, EMPTY_MESSAGE)
    client.h2.send_headers(1, [("x-trailer", "1")], end_stream=True)
    client.flush()
    data, trailers = client.answer(1)
    assert trailers["grpc-status"] == "0" and data == SERVING


# ---- flow control (section 6.9) ------------------------------------------------------------------------------


def test_a_connection_window_past_2_31_is_a_flow_control_error(client: Client) -> None:
    client.raw(b"\x00\x00\x04\x08\x00\x00\x00\x00\x00" + struct.pack(">I", 2**31 - 1))
    assert_goaway(client, ErrorCodes.FLOW_CONTROL_ERROR)


def test_a_stream_window_past_2_31_is_a_stream_flow_control_error(client: Client) -> None:
    client.h2.send_headers(1, request_headers())
    client.flush()
    client.raw(b"\x00\x00\x04\x08\x00\x00\x00\x00\x01" + struct.pack(">I", 2**31 - 1))
    reset = client.reset(1)
    assert reset is not None and reset.error_code == ErrorCodes.FLOW_CONTROL_ERROR
    assert_serving(client, 3)


def test_initial_window_size_pushing_a_stream_window_past_2_31_is_a_flow_control_error(client: Client) -> None:
    """SETTINGS_INITIAL_WINDOW_SIZE changes every open stream's window (section 6.9.2): past 2^31-1 is fatal."""
    client.h2.send_headers(1, request_headers())
    client.flush()
    client.raw(b"\x00\x00\x04\x08\x00\x00\x00\x00\x01" + struct.pack(">I", 2**30))
    client.raw(SettingsFrame(0, settings={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 2**31 - 1}))
    assert_goaway(client, ErrorCodes.FLOW_CONTROL_ERROR)


def test_the_answer_keeps_within_a_small_client_window(server: ServerProcess) -> None:
    """With a 1-byte stream window the answer's DATA comes a byte at a time, as the client opens it."""
    client = Client(server.grpc_port, {h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1})
    try:
        data, trailers = client.call(1)  # h2 fails the test if the server sends past the window
        assert trailers["grpc-status"] == "0" and data == SERVING
    finally:
        client.close()


# ---- frame sizes (section 4.2) -------------------------------------------------------------------------------


@pytest.mark.parametrize(("frame", "code"), [
    (b"\x00\x00\x07\x06\x00\x00\x00\x00\x00" + b"\x00" * 7, ErrorCodes.FRAME_SIZE_ERROR),  # PING of 7 bytes
    (b"\x00\x00\x05\x03\x00\x00\x00\x00\x01" + b"\x00" * 5, ErrorCodes.FRAME_SIZE_ERROR),  # RST_STREAM of 5
    (b"\x00\x00\x03\x08\x00\x00\x00\x00\x00" + b"\x00" * 3, ErrorCodes.FRAME_SIZE_ERROR),  # WINDOW_UPDATE of 3
    (b"\x00\x00\x05\x04\x00\x00\x00\x00\x00" + b"\x00" * 5, ErrorCodes.FRAME_SIZE_ERROR),  # SETTINGS of 5
    (b"\x00\x00\x07\x07\x00\x00\x00\x00\x00" + b"\x00" * 7, ErrorCodes.FRAME_SIZE_ERROR),  # GOAWAY of 7
], ids=["ping", "rst_stream", "window_update", "settings", "goaway"])
def test_control_frames_of_the_wrong_size_are_frame_size_errors(client: Client, frame: bytes,
                                                                 code: ErrorCodes) -> None:
    client.h2.send_headers(1, request_headers())  # RST_STREAM's stream is open: only its size is wrong
    client.flush()
    client.raw(frame)
    assert_goaway(client, code)


def test_a_frame_larger_than_max_frame_size_is_a_frame_size_error(client: Client) -> None:
    client.wait(lambda e: isinstance(e, h2.events.RemoteSettingsChanged))
    limit = client.h2.remote_settings.max_frame_size
    client.h2.send_headers(1, request_headers())
    client.flush()
    client.raw(DataFrame(1, b"\x00" * (limit + 1)))
    assert_goaway(client, ErrorCodes.FRAME_SIZE_ERROR)


def test_headers_too_short_for_their_priority_is_a_frame_size_error(client: Client) -> None:
    client.raw(b"\x00\x00\x03\x01\x25\x00\x00\x00\x01" + b"\x00" * 3)  # PRIORITY flag, 3 bytes
    assert_goaway(client, ErrorCodes.FRAME_SIZE_ERROR)


# ---- unknown frames and flags (section 5.5, 4.1) -------------------------------------------------------------


def test_unknown_frame_types_and_flags_are_ignored(client: Client) -> None:
    client.raw(raw_frame(0xFA, 0xFF, 0, b"anything"))
    client.h2.send_headers(1, request_headers())
    client.flush()
    client.raw(raw_frame(0x0B, 0, 1), raw_frame(0xFF, 1, 7, b"x" * 100))
    client.raw(b"\x00\x00\x08\x06\xf0\x00\x00\x00\x00" + b"pingpong")  # PING with unknown flags set, ACK unset
    ping = client.wait(lambda e: isinstance(e, h2.events.PingAckReceived))
    assert ping is not None and ping.ping_data == b"pingpong"
    client.h2.send_data(1, EMPTY_MESSAGE, end_stream=True)
    client.flush()
    data, trailers = client.answer(1)
    assert trailers["grpc-status"] == "0" and data == SERVING


def test_an_unknown_frame_inside_a_header_block_is_a_protocol_error(client: Client) -> None:
    block = client.h2.encoder.encode(request_headers())
    client.raw(HeadersFrame(1, block[:4]), raw_frame(0xFA, 0, 1),
               b"\x00\x00" + bytes([len(block) - 4]) + b"\x09\x04\x00\x00\x00\x01" + block[4:])
    assert_goaway(client, ErrorCodes.PROTOCOL_ERROR)


# ---- PRIORITY (section 5.3, 6.3) -----------------------------------------------------------------------------


def test_priority_frames_are_accepted_on_idle_open_and_closed_streams(client: Client) -> None:
    client.raw(PriorityFrame(9, depends_on=0, stream_weight=200))  # idle: does not open it
    assert_serving(client, 1)
    client.raw(PriorityFrame(1, depends_on=3, stream_weight=1, exclusive=True))  # closed
    client.h2.send_headers(3, request_headers())
    client.flush()
    client.raw(PriorityFrame(3, depends_on=9))  # open
    client.h2.send_data(3, EMPTY_MESSAGE, end_stream=True)
    client.flush()
    assert client.answer(3)[1]["grpc-status"] == "0"
    assert_serving(client, 9)  # the PRIORITY before did not use up stream 9


def test_an_idle_stream_depending_on_itself_is_a_protocol_error(client: Client) -> None:
    """A stream that is not open cannot be reset: the connection ends, as nghttp2 ends it."""
    client.raw(PriorityFrame(5, depends_on=5))
    assert_goaway(client, ErrorCodes.PROTOCOL_ERROR)


def test_priority_on_stream_0_is_a_protocol_error(client: Client) -> None:
    client.raw(b"\x00\x00\x05\x02\x00\x00\x00\x00\x00" + b"\x00\x00\x00\x01\x10")
    assert_goaway(client, ErrorCodes.PROTOCOL_ERROR)


def test_a_priority_frame_of_the_wrong_size_is_a_stream_frame_size_error(client: Client) -> None:
    client.h2.send_headers(1, request_headers())
    client.flush()
    client.raw(b"\x00\x00\x04\x02\x00\x00\x00\x00\x01" + b"\x00" * 4)
    reset = client.reset(1)
    assert reset is not None and reset.error_code == ErrorCodes.FRAME_SIZE_ERROR
    assert_serving(client, 3)


@pytest.mark.parametrize("how", ["headers", "priority"])
def test_a_stream_depending_on_itself_is_a_stream_protocol_error(client: Client, how: str) -> None:
    if how == "headers":  # h2 refuses to send it: the dependency is changed on the way
        client.h2.send_headers(1, request_headers(), end_stream=True, priority_depends_on=3)
        client.flush(lambda frame: setattr(frame, "depends_on", frame.stream_id))
    else:
        client.h2.send_headers(1, request_headers())
        client.flush(then=PriorityFrame(1, depends_on=1).serialize())
    reset = client.reset(1)
    assert reset is not None and reset.error_code == ErrorCodes.PROTOCOL_ERROR
    assert_serving(client, 3)


# ---- padding (section 6.1, 6.2) ------------------------------------------------------------------------------


def test_padded_headers_and_data_are_read_past_their_padding(client: Client) -> None:
    client.h2.send_headers(1, request_headers())
    client.h2.send_data(1, EMPTY_MESSAGE[:2])
    client.flush(padded(17))
    client.h2.send_data(1, EMPTY_MESSAGE[2:], end_stream=True)
    client.flush(padded(255))
    data, trailers = client.answer(1)
    assert trailers["grpc-status"] == "0" and data == SERVING


@pytest.mark.parametrize("kind", ["data", "headers"])
def test_padding_as_long_as_the_frame_is_a_protocol_error(client: Client, kind: str) -> None:
    if kind == "data":
        client.h2.send_headers(1, request_headers())
        client.flush()
        client.raw(b"\x00\x00\x04\x00\x08\x00\x00\x00\x01\x04abc")  # pad length 4 in a 4-byte payload
    else:
        client.raw(b"\x00\x00\x04\x01\x0c\x00\x00\x00\x01\x09abc")  # HEADERS: pad length 9 in a 4-byte payload
    assert_goaway(client, ErrorCodes.PROTOCOL_ERROR)
