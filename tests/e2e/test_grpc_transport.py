"""The native gRPC transport (transerve's own HTTP/2) seen from the wire: flow control with 64 MiB both ways, PING,
bad frames and the HTTP/2 error each one earns, gRPC's own refusals (compression, size, method, deadline), GOAWAY
on SIGTERM, and grpcio's clients (sync and aio, unary and streaming). The RPCs themselves are test_grpc.py's.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from support import EXAMPLE_REPOSITORY, ServerProcess, start_transerve
from support.h2client import (
    COMPRESSION_ERROR,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    HEALTH,
    INFER,
    INITIAL_WINDOW_SIZE,
    MAX_FRAME_SIZE,
    NO_ERROR,
    PING,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    H2Client,
    frame,
    grpc_message,
)
from support.repositories import write_model
from tritonclient.grpc import service_pb2, service_pb2_grpc

TIMEOUT_S = 60.0
BIG = 64 * 1024 * 1024
UNLIMITED = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]


@pytest.fixture(scope="module")
def native() -> Iterator[ServerProcess]:
    """A server on the native transport, whichever transport is the default."""
    with start_transerve(EXAMPLE_REPOSITORY, "--grpc-transport=native") as server:
        yield server


def add_sub_request(request_id: str = "") -> bytes:
    message = service_pb2.ModelInferRequest(model_name="add_sub", id=request_id)
    for name in ("INPUT0", "INPUT1"):
        message.inputs.add(name=name, datatype="FP32", shape=[1, 4])
        message.raw_input_contents.append(np.arange(4, dtype=np.float32).tobytes())
    return message.SerializeToString()


def identity_uint8(values: np.ndarray) -> service_pb2.ModelInferRequest:
    message = service_pb2.ModelInferRequest(model_name="identity")
    message.inputs.add(name="INPUT_UINT8", datatype="UINT8", shape=[1, values.size])
    message.raw_input_contents.append(values.tobytes())
    return message


def assert_healthy(server: ServerProcess) -> None:
    with grpc.insecure_channel(server.grpc_url) as channel:
        assert channel.unary_unary(HEALTH)(b"", timeout=TIMEOUT_S) == b"\x08\x01"


# ------------------------------------------------------------------------------------------------ flow control


def test_64_mib_both_ways_with_grpcio(native: ServerProcess) -> None:
    values = np.random.default_rng(0).integers(0, 256, BIG, dtype=np.uint8)
    with grpc.insecure_channel(native.grpc_url, options=UNLIMITED) as channel:
        response = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(identity_uint8(values),
                                                                                timeout=TIMEOUT_S)
    assert response.raw_output_contents[0] == values.tobytes()


def test_64_mib_both_ways_within_a_small_client_window(native: ServerProcess) -> None:
    """The client keeps gRPC's smallest windows (64 KiB, 16 KiB frames) and opens them only as it reads: the server
    must never send past them. It sends its 64 MiB within the server's windows, which must keep opening."""
    values = np.random.default_rng(1).integers(0, 256, BIG, dtype=np.uint8)
    body = grpc_message(identity_uint8(values).SerializeToString())
    with H2Client(native.grpc_port) as client:
        client.handshake({INITIAL_WINDOW_SIZE: 65535, MAX_FRAME_SIZE: 16384})
        stream_window = client.server_settings[INITIAL_WINDOW_SIZE]
        connection_window = 65535
        max_frame = client.server_settings[MAX_FRAME_SIZE]
        assert stream_window >= 1 << 20, "the server should announce a large stream window"
        client.send(client.headers(1, INFER))
        sent = 0
        while sent < len(body):
            room = min(stream_window, connection_window, max_frame, len(body) - sent)
            if room > 0:
                last = sent + room == len(body)
                client.send(frame(DATA, END_STREAM if last else 0, 1, body[sent:sent + room]))
                sent += room
                stream_window -= room
                connection_window -= room
                continue
            update = client.until(WINDOW_UPDATE)
            assert update is not None, "the server stopped opening its window"
            increment = struct.unpack(">I", update.payload)[0]
            if update.stream == 0:
                connection_window += increment
            else:
                stream_window += increment
        # The answer, read within our own windows: 65535 bytes a stream and the connection, reopened as we read.
        our_stream, our_connection = 65535, 65535
        received = bytearray()
        trailers = None
        while trailers is None:
            answer = client.read_frame()
            assert answer is not None
            if answer.kind == DATA and answer.stream == 1:
                assert len(answer.payload) <= 16384, "a DATA frame larger than our SETTINGS_MAX_FRAME_SIZE"
                our_stream -= len(answer.payload)
                our_connection -= len(answer.payload)
                assert our_stream >= 0 and our_connection >= 0, "the server sent past our window"
                received += answer.payload
                if our_stream < 32768:
                    client.send(frame(WINDOW_UPDATE, 0, 1, struct.pack(">I", 65535 - our_stream))
                                + frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 65535 - our_connection)))
                    our_stream = our_connection = 65535
            elif answer.kind == HEADERS and answer.stream == 1 and answer.flags & END_STREAM:
                trailers = dict(client.decoder.decode(answer.payload))
            elif answer.kind == HEADERS:
                client.decoder.decode(answer.payload)
            elif answer.kind == RST_STREAM:
                pytest.fail(f"stream reset with code {answer.error_code}")
    assert trailers.get("grpc-status") == "0", trailers
    response = service_pb2.ModelInferResponse.FromString(bytes(received[5:]))
    assert response.raw_output_contents[0] == values.tobytes()


# ------------------------------------------------------------------------------------------------- frames


def test_ping_is_acknowledged_with_its_payload(native: ServerProcess) -> None:
    with H2Client(native.grpc_port) as client:
        client.handshake()
        client.send(frame(PING, 0, 0, b"12345678"))
        answer = client.until(PING)
        assert answer is not None and answer.flags == 1 and answer.payload == b"12345678"


def _headers_block(client: H2Client) -> bytes:
    return client.headers(1, HEALTH)[9:]


BAD_FRAMES = {
    "data_on_stream_0": (lambda c: frame(DATA, 0, 0, b"x"), PROTOCOL_ERROR),
    "data_on_an_idle_stream": (lambda c: frame(DATA, 0, 7, b"x"), PROTOCOL_ERROR),
    "settings_of_5_bytes": (lambda c: frame(SETTINGS, 0, 0, b"\0" * 5), FRAME_SIZE_ERROR),
    "settings_on_a_stream": (lambda c: frame(SETTINGS, 0, 1), PROTOCOL_ERROR),
    "settings_ack_with_payload": (lambda c: frame(SETTINGS, 1, 0, b"\0" * 6), FRAME_SIZE_ERROR),
    "initial_window_above_2_31": (lambda c: frame(SETTINGS, 0, 0, struct.pack(">HI", INITIAL_WINDOW_SIZE, 2**31)),
                                  FLOW_CONTROL_ERROR),
    "max_frame_size_too_small": (lambda c: frame(SETTINGS, 0, 0, struct.pack(">HI", MAX_FRAME_SIZE, 100)),
                                 PROTOCOL_ERROR),
    "ping_of_7_bytes": (lambda c: frame(PING, 0, 0, b"\0" * 7), FRAME_SIZE_ERROR),
    "ping_on_a_stream": (lambda c: frame(PING, 0, 1, b"\0" * 8), PROTOCOL_ERROR),
    "window_update_of_0": (lambda c: frame(WINDOW_UPDATE, 0, 0, b"\0" * 4), PROTOCOL_ERROR),
    "window_update_of_3_bytes": (lambda c: frame(WINDOW_UPDATE, 0, 0, b"\0" * 3), FRAME_SIZE_ERROR),
    "connection_window_overflow": (lambda c: frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 2**31 - 1)),
                                   FLOW_CONTROL_ERROR),
    "frame_over_max_frame_size": (lambda c: frame(DATA, 0, 1, b"\0" * (c.server_settings[MAX_FRAME_SIZE] + 1)),
                                  FRAME_SIZE_ERROR),
    "headers_on_stream_0": (lambda c: frame(HEADERS, END_HEADERS, 0, _headers_block(c)), PROTOCOL_ERROR),
    "headers_on_an_even_stream": (lambda c: frame(HEADERS, END_HEADERS, 2, _headers_block(c)), PROTOCOL_ERROR),
    "stream_ids_going_down": (lambda c: c.headers(5, HEALTH) + c.headers(3, HEALTH), PROTOCOL_ERROR),
    "bad_hpack": (lambda c: frame(HEADERS, END_HEADERS | END_STREAM, 1, b"\xff\xff\xff\xff\xff"), COMPRESSION_ERROR),
    "continuation_without_headers": (lambda c: frame(CONTINUATION, END_HEADERS, 1, b""), PROTOCOL_ERROR),
    "headers_interrupted": (lambda c: frame(HEADERS, 0, 1, _headers_block(c)) + frame(PING, 0, 0, b"\0" * 8),
                            PROTOCOL_ERROR),
    "push_promise": (lambda c: frame(PUSH_PROMISE, END_HEADERS, 1, b"\0\0\0\2"), PROTOCOL_ERROR),
    "rst_stream_on_an_idle_stream": (lambda c: frame(RST_STREAM, 0, 9, b"\0" * 4), PROTOCOL_ERROR),
}


@pytest.mark.parametrize(("make", "code"), BAD_FRAMES.values(), ids=BAD_FRAMES.keys())
def test_a_bad_frame_ends_the_connection_with_goaway(native: ServerProcess, make, code: int) -> None:
    with H2Client(native.grpc_port) as client:
        client.handshake()
        client.send(make(client))
        goaway = client.until(GOAWAY)
        assert goaway is not None, "the connection closed without GOAWAY"
        assert goaway.error_code == code, goaway.payload[8:]
        assert client.read_frame() is None, "the connection stayed open after GOAWAY"
    assert_healthy(native)


@pytest.mark.parametrize("preface", [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n"],
                         ids=["http1", "almost_a_preface"])
def test_a_bad_preface_closes_the_connection(native: ServerProcess, preface: bytes) -> None:
    with H2Client(native.grpc_port) as client:
        client.send(preface)
        goaway = client.until(GOAWAY)
        assert goaway is not None and goaway.error_code == PROTOCOL_ERROR
        assert client.read_frame() is None
    assert_healthy(native)


def test_a_first_frame_other_than_settings_is_a_protocol_error(native: ServerProcess) -> None:
    with H2Client(native.grpc_port) as client:
        client.send(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(PING, 0, 0, b"\0" * 8))
        goaway = client.until(GOAWAY)
        assert goaway is not None and goaway.error_code == PROTOCOL_ERROR


BAD_STREAMS = {
    "window_update_of_0": (lambda c: c.headers(1, HEALTH) + frame(WINDOW_UPDATE, 0, 1, b"\0" * 4), PROTOCOL_ERROR),
    "uppercase_header": (lambda c: c.headers(1, HEALTH, extra=[("X-Upper", "1")]), PROTOCOL_ERROR),
    "connection_header": (lambda c: c.headers(1, HEALTH, extra=[("connection", "keep-alive")]), PROTOCOL_ERROR),
    "data_after_end_stream": (lambda c: c.headers(1, HEALTH, end_stream=True) + frame(DATA, 0, 1, b"x"),
                              None),  # answered or reset: either way the connection lives
    "priority_of_4_bytes": (lambda c: frame(2, 0, 1, b"\0" * 4), FRAME_SIZE_ERROR),
}


@pytest.mark.parametrize(("make", "code"), BAD_STREAMS.values(), ids=BAD_STREAMS.keys())
def test_a_bad_stream_is_reset_and_the_connection_goes_on(native: ServerProcess, make, code: int | None) -> None:
    with H2Client(native.grpc_port) as client:
        client.handshake()
        client.send(make(client))
        if code is not None:
            reset = client.until(RST_STREAM, stream=1)
            assert reset is not None and reset.error_code == code
        client.send(client.headers(3, HEALTH) + frame(DATA, END_STREAM, 3, grpc_message(b"")))
        _, data, trailers = client.response(3)
        assert trailers["grpc-status"] == "0" and data == grpc_message(b"\x08\x01")


# ------------------------------------------------------------------------------------------------ gRPC refusals


def test_refusals(native: ServerProcess) -> None:
    """Each refusal ends its call with the right status and leaves the connection serving."""
    with H2Client(native.grpc_port) as client:
        client.handshake()
        client.send(client.headers(1, INFER) + frame(DATA, END_STREAM, 1, grpc_message(add_sub_request(), True)))
        assert client.response(1)[2]["grpc-status"] == "12"  # UNIMPLEMENTED: compressed
        client.send(client.headers(3, INFER, extra=[("grpc-encoding", "gzip")]))
        client.send(frame(DATA, END_STREAM, 3, grpc_message(add_sub_request())))
        head, _, trailers = client.response(3)
        assert trailers["grpc-status"] == "12" and head.get("grpc-accept-encoding") == "identity"
        client.send(client.headers(5, INFER) + frame(DATA, 0, 5, b"\0\xff\xff\xff\xff"))
        assert client.response(5)[2]["grpc-status"] == "8"  # RESOURCE_EXHAUSTED: over 2^31-1 bytes
        client.send(client.headers(7, "/inference.GRPCInferenceService/TraceSetting")
                    + frame(DATA, END_STREAM, 7, grpc_message(b"")))
        assert client.response(7)[2]["grpc-status"] == "0"  # implemented (it was the example of a missing method)
        client.send(client.headers(9, "/no.Such/Method", end_stream=True))
        assert client.response(9)[2]["grpc-status"] == "12"
        client.send(client.headers(11, INFER, method="GET", end_stream=True))
        assert client.response(11)[0][":status"] == "405"
        client.send(client.headers(13, INFER, end_stream=True, extra=[("grpc-timeout", "soon")]))
        assert client.response(13)[2]["grpc-status"] == "13"
        client.send(client.headers(15, INFER, end_stream=True))
        trailers = client.response(15)[2]
        assert trailers["grpc-status"] == "13" and "exactly one request message" in trailers["grpc-message"]
        client.send(client.headers(17, INFER) + frame(DATA, END_STREAM, 17, grpc_message(b"\xff\xff")))
        assert client.response(17)[2]["grpc-status"] == "13"  # not a ModelInferRequest
        client.send(client.headers(19, INFER) + frame(DATA, END_STREAM, 19, grpc_message(add_sub_request("ok"))))
        _, data, trailers = client.response(19)
        assert trailers["grpc-status"] == "0"
        assert service_pb2.ModelInferResponse.FromString(data[5:]).id == "ok"


def test_error_messages_are_percent_encoded(native: ServerProcess) -> None:
    message = service_pb2.ModelInferRequest(model_name="nö_such 100%")
    with H2Client(native.grpc_port) as client:
        client.handshake()
        client.send(client.headers(1, INFER) + frame(DATA, END_STREAM, 1, grpc_message(message.SerializeToString())))
        trailers = client.response(1)[2]
    assert trailers["grpc-status"] == "5"
    assert "'n%C3%B6_such 100%25'" in trailers["grpc-message"]
    with grpc.insecure_channel(native.grpc_url) as channel, pytest.raises(grpc.RpcError) as caught:
        service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(message, timeout=TIMEOUT_S)
    assert "'nö_such 100%'" in caught.value.details()


# --------------------------------------------------------------------------------------------- grpcio clients


def test_grpcio_aio_client_unary_and_streaming(native: ServerProcess) -> None:
    async def run() -> tuple[list[bytes], list[service_pb2.ModelStreamInferResponse]]:
        async with grpc.aio.insecure_channel(native.grpc_url) as channel:
            call = channel.unary_unary(INFER)
            unary = await asyncio.gather(*(call(add_sub_request(str(i)), timeout=TIMEOUT_S) for i in range(32)))
            stream = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(timeout=TIMEOUT_S)
            for i in range(50):
                await stream.write(service_pb2.ModelInferRequest.FromString(add_sub_request(f"s{i}")))
            await stream.done_writing()
            return unary, [answer async for answer in stream]

    unary, streamed = asyncio.run(run())
    assert [service_pb2.ModelInferResponse.FromString(answer).id for answer in unary] == [str(i) for i in range(32)]
    assert [answer.infer_response.id for answer in streamed] == [f"s{i}" for i in range(50)]


def test_grpcio_sync_client_streams_64_mib(native: ServerProcess) -> None:
    """Big messages both ways on a bidirectional stream, interleaved with small ones, answered in order."""
    values = np.random.default_rng(2).integers(0, 256, BIG, dtype=np.uint8)
    small = np.arange(16, dtype=np.uint8)
    requests = [identity_uint8(small), identity_uint8(values), identity_uint8(small)]
    with grpc.insecure_channel(native.grpc_url, options=UNLIMITED) as channel:
        answers = list(service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(iter(requests),
                                                                                            timeout=TIMEOUT_S))
    assert [a.infer_response.raw_output_contents[0] for a in answers] == [small.tobytes(), values.tobytes(),
                                                                          small.tobytes()]


def test_a_cancelled_stream_leaves_the_connection_serving(native: ServerProcess) -> None:
    async def run() -> service_pb2.ServerLiveResponse:
        async with grpc.aio.insecure_channel(native.grpc_url) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            stream = stub.ModelStreamInfer()
            await stream.write(service_pb2.ModelInferRequest.FromString(add_sub_request("x")))
            await stream.read()
            stream.cancel()
            return await stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=TIMEOUT_S)

    assert asyncio.run(run()).live


# --------------------------------------------------------------------------- deadlines, shutdown, the grpcio transport

SLOW_CONFIG = '''
name: "slow" backend: "python"
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
'''
SLOW_MODEL = '''
import time, numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        time.sleep(1.0)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([7], np.int32))]) for _ in requests]
'''


def slow_request() -> bytes:
    message = service_pb2.ModelInferRequest(model_name="slow")
    message.inputs.add(name="IN", datatype="INT32", shape=[1])
    message.raw_input_contents.append(np.array([1], np.int32).tobytes())
    return grpc_message(message.SerializeToString())


@pytest.fixture
def slow_repo(tmp_path: Path) -> Path:
    write_model(tmp_path / "repo", "slow", SLOW_CONFIG, SLOW_MODEL)
    shutil.copytree(EXAMPLE_REPOSITORY / "add_sub", tmp_path / "repo" / "add_sub")
    return tmp_path / "repo"


def test_deadline_then_goaway_on_sigterm(slow_repo: Path) -> None:
    """grpc-timeout ends a call with DEADLINE_EXCEEDED on time. On SIGTERM the server sends GOAWAY (NO_ERROR,
    naming the last stream it took), refuses newer streams, answers the one in flight, then closes."""
    with start_transerve(slow_repo, "--exit-timeout-secs=30", "--grpc-transport=native") as server, \
            H2Client(server.grpc_port) as client:
        client.handshake()
        started = time.monotonic()
        client.send(client.headers(1, INFER, extra=[("grpc-timeout", "200m")]) + frame(DATA, END_STREAM, 1,
                                                                                        slow_request()))
        trailers = client.response(1)[2]
        assert trailers["grpc-status"] == "4" and time.monotonic() - started < 0.9
        time.sleep(1.0)  # the cancelled call's execution ends
        client.send(client.headers(3, INFER) + frame(DATA, END_STREAM, 3, slow_request()))
        time.sleep(0.3)  # inside execute() now
        server.process.send_signal(signal.SIGTERM)
        goaway = client.until(GOAWAY)
        assert goaway is not None and goaway.error_code == NO_ERROR
        assert struct.unpack(">I", goaway.payload[:4])[0] == 3
        client.send(client.headers(5, INFER) + frame(DATA, END_STREAM, 5, slow_request()))
        refused = head = None
        data = b""
        while (received := client.read_frame()) is not None:
            if received.kind == RST_STREAM and received.stream == 5:
                refused = received.error_code
            elif received.kind == HEADERS and received.stream == 3:
                head = dict(client.decoder.decode(received.payload))
            elif received.kind == DATA and received.stream == 3:
                data += received.payload
        assert refused == REFUSED_STREAM
        assert head is not None and head["grpc-status"] == "0"
        assert service_pb2.ModelInferResponse.FromString(data[5:]).raw_output_contents[0] == b"\7\0\0\0"
        assert server.process.wait(timeout=TIMEOUT_S) == 0


@pytest.fixture(scope="module")
def grpcio_server() -> Iterator[ServerProcess]:
    with start_transerve(EXAMPLE_REPOSITORY, "--grpc-transport=grpcio") as server:
        yield server


def test_grpcio_transport_stays_selectable(grpcio_server: ServerProcess) -> None:
    with grpcclient.InferenceServerClient(grpcio_server.grpc_url) as client:
        inputs = [grpcclient.InferInput(name, [1, 4], "FP32") for name in ("INPUT0", "INPUT1")]
        for tensor in inputs:
            tensor.set_data_from_numpy(np.ones((1, 4), np.float32))
        np.testing.assert_array_equal(client.infer("add_sub", inputs).as_numpy("OUTPUT0"), np.full((1, 4), 2.0))
    with H2Client(grpcio_server.grpc_port) as client:
        client.handshake()  # grpcio's own settings, not ours
        assert client.server_settings.get(MAX_FRAME_SIZE) != 1 << 20
    assert_healthy(grpcio_server)
