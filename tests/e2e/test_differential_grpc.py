"""Differential tests over gRPC: the same requests go to transerve and to the real Triton 2.51, and the answers must
match: gRPC status codes exactly, whole ModelInferResponse messages exactly where the model is deterministic
(names, datatypes, shapes, raw output bytes, id, version), error messages by a distinctive substring of Triton's
wording.

Triton is the specification, so when the two disagree the fix belongs in transerve, except for the cases in
DELIBERATE_DIVERGENCES, each with its reason.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from google.protobuf.message import Message
from support import ServerProcess
from support.grpc_tensors import TYPED_FIELDS, InputTensor, suffix, typed
from tritonclient.grpc import service_pb2, service_pb2_grpc

TIMEOUT_S = 30.0
"""Per request; generous for a loaded 2-core CI machine, yet a hung server fails the test instead of the job."""

Stub = service_pb2_grpc.GRPCInferenceServiceStub
P = service_pb2.InferParameter

VALUES: dict[str, np.ndarray] = {
    "BOOL": np.array([True, False, True]),
    "UINT8": np.array([0, 1, 255], np.uint8),
    "UINT16": np.array([0, 1, 65535], np.uint16),
    "UINT32": np.array([0, 1, 2**32 - 1], np.uint32),
    "UINT64": np.array([0, 1, 2**64 - 1], np.uint64),
    "INT8": np.array([-128, 0, 127], np.int8),
    "INT16": np.array([-(2**15), 0, 2**15 - 1], np.int16),
    "INT32": np.array([-(2**31), 0, 2**31 - 1], np.int32),
    "INT64": np.array([-(2**63), 0, 2**63 - 1], np.int64),
    "FP16": np.array([0.0, -0.0, 1.5, 65504.0, -6e-8, np.inf, -np.inf, np.nan], np.float16),
    "FP32": np.array([0.0, -0.0, 1.1, -3.4e38, 1e-45, np.inf, np.nan], np.float32),
    "FP64": np.array([0.0, -0.1, 1e300, 5e-324, -np.inf, np.nan], np.float64),
    "BYTES": np.array([b"", b"plain", "안녕하세요".encode(), "😀 héllo".encode(), b"\x00\xff\xfe raw", b""],
                      dtype=np.object_),
}
F16 = np.arange(4, dtype=np.float32).tobytes()


# --------------------------------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def servers(triton_server: ServerProcess, transerve_server: ServerProcess) -> dict[str, ServerProcess]:
    """Both servers by name; Triton's fixture runs first so that a machine without Triton skips before starting."""
    return {"triton": triton_server, "transerve": transerve_server}


@pytest.fixture(scope="module")
def stubs(servers: dict[str, ServerProcess]) -> Iterator[dict[str, Stub]]:
    channels = {name: grpc.insecure_channel(server.grpc_url) for name, server in servers.items()}
    yield {name: Stub(channel) for name, channel in channels.items()}
    for channel in channels.values():
        channel.close()


Outcome = Message | grpc.RpcError


def call_both(stubs: dict[str, Stub], method: str, message: Message) -> dict[str, Outcome]:
    """One RPC to each server: the response, or the RpcError carrying the status."""
    outcomes: dict[str, Outcome] = {}
    for name, stub in stubs.items():
        try:
            outcomes[name] = getattr(stub, method)(message, timeout=TIMEOUT_S)
        except grpc.RpcError as exc:
            outcomes[name] = exc
    return outcomes


def by_output_name(message: Message) -> Message:
    """An infer response with its outputs sorted by name: Triton's output order follows its internal maps (it
    differs from both the request's and the config's order), and clients look outputs up by name."""
    if not isinstance(message, service_pb2.ModelInferResponse):
        return message
    order = sorted(range(len(message.outputs)), key=lambda i: message.outputs[i].name)
    result = service_pb2.ModelInferResponse()
    result.CopyFrom(message)
    del result.outputs[:]
    del result.raw_output_contents[:]
    result.outputs.extend(message.outputs[i] for i in order)
    result.raw_output_contents.extend(message.raw_output_contents[i] for i in order)
    return result


def assert_same_response(outcomes: dict[str, Outcome]) -> Message:
    """Both succeeded with equal messages (infer outputs compared by name); returns Triton's."""
    for name, outcome in outcomes.items():
        assert not isinstance(outcome, grpc.RpcError), f"{name}: {outcome.code()} {outcome.details()}"
    assert by_output_name(outcomes["transerve"]) == by_output_name(outcomes["triton"])
    return outcomes["triton"]


def code_of(outcome: Outcome) -> str:
    return outcome.code().name if isinstance(outcome, grpc.RpcError) else "OK"


def add_sub(model: str = "add_sub", **fields: Any) -> service_pb2.ModelInferRequest:
    message = service_pb2.ModelInferRequest(model_name=model, inputs=[
        InputTensor(name="INPUT0", datatype="FP32", shape=[1, 4]),
        InputTensor(name="INPUT1", datatype="FP32", shape=[1, 4]),
    ], **fields)
    message.raw_input_contents.extend([F16, F16])
    return message


def edited(message: service_pb2.ModelInferRequest, edit: Callable[[Any], Any]) -> service_pb2.ModelInferRequest:
    edit(message)
    return message


def identity(*inputs: InputTensor, raw: list[bytes] = (), **fields: Any) -> service_pb2.ModelInferRequest:
    message = service_pb2.ModelInferRequest(model_name="identity", inputs=list(inputs), **fields)
    message.raw_input_contents.extend(raw)
    return message


def params_request(**parameters: service_pb2.InferParameter) -> service_pb2.ModelInferRequest:
    message = service_pb2.ModelInferRequest(model_name="params", inputs=[InputTensor(name="INPUT0", datatype="FP32",
                                                                                     shape=[2])])
    message.raw_input_contents.append(np.array([1, 2], np.float32).tobytes())
    for key, value in parameters.items():
        message.parameters[key].CopyFrom(value)
    return message


def assert_both_alive(stubs: dict[str, Stub]) -> None:
    for name, stub in stubs.items():
        assert stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=TIMEOUT_S).live, name


# ------------------------------------------------------------------------------------- tritonclient infer


def test_add_sub_tritonclient_sync(servers: dict[str, ServerProcess]) -> None:
    in0 = np.arange(8, dtype=np.float32).reshape(2, 4) / 3
    in1 = np.full((2, 4), 0.25, dtype=np.float32)
    responses = {}
    for name, server in servers.items():
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            inputs = [grpcclient.InferInput("INPUT0", [2, 4], "FP32"), grpcclient.InferInput("INPUT1", [2, 4], "FP32")]
            inputs[0].set_data_from_numpy(in0)
            inputs[1].set_data_from_numpy(in1)
            result = client.infer("add_sub", inputs, request_id="sync-1",
                                  outputs=[grpcclient.InferRequestedOutput(n) for n in ("OUTPUT1", "OUTPUT0")])
            responses[name] = by_output_name(result.get_response())
    assert responses["transerve"] == responses["triton"]
    assert responses["transerve"].outputs[0].name == "OUTPUT0"
    np.testing.assert_array_equal(np.frombuffer(responses["transerve"].raw_output_contents[0], np.float32),
                                  (in0 + in1).reshape(-1))


def test_add_sub_tritonclient_aio(servers: dict[str, ServerProcess]) -> None:
    """Sixteen concurrent requests on one aio client: each answer must belong to its own request."""

    async def run(server: ServerProcess) -> list[Message]:
        async with grpcaio.InferenceServerClient(server.grpc_url) as client:
            calls = []
            for i in range(16):
                inputs = [grpcaio.InferInput(n, [1, 4], "FP32") for n in ("INPUT0", "INPUT1")]
                inputs[0].set_data_from_numpy(np.full((1, 4), i, np.float32))
                inputs[1].set_data_from_numpy(np.arange(4, dtype=np.float32).reshape(1, 4) * i)
                calls.append(client.infer("add_sub", inputs, request_id=f"aio-{i}"))
            results = await asyncio.wait_for(asyncio.gather(*calls), TIMEOUT_S)
            return [by_output_name(result.get_response()) for result in results]

    triton = asyncio.run(run(servers["triton"]))
    transerve = asyncio.run(run(servers["transerve"]))
    assert transerve == triton


# ----------------------------------------------------------------------------------------- raw protobuf infer


@pytest.mark.parametrize("datatype", sorted(VALUES))
def test_identity_raw_every_datatype(stubs: dict[str, Stub], datatype: str) -> None:
    values = VALUES[datatype]
    raw = b"".join(len(v).to_bytes(4, "little") + v for v in values) if datatype == "BYTES" else values.tobytes()
    message = identity(InputTensor(name=f"INPUT_{suffix(datatype)}", datatype=datatype, shape=[1, len(values)]),
                       raw=[raw])
    response = assert_same_response(call_both(stubs, "ModelInfer", message))
    assert response.raw_output_contents[0] == raw


def test_identity_raw_all_datatypes_in_one_request_with_an_id(stubs: dict[str, Stub]) -> None:
    inputs, raws = [], []
    for datatype, values in VALUES.items():
        batch = np.resize(values, (2, 3))
        inputs.append(InputTensor(name=f"INPUT_{suffix(datatype)}", datatype=datatype, shape=[2, 3]))
        raws.append(b"".join(len(v).to_bytes(4, "little") + v for v in batch.reshape(-1)) if datatype == "BYTES"
                    else batch.tobytes())
    assert_same_response(call_both(stubs, "ModelInfer", identity(*inputs, raw=raws, id="ünïcode 안녕")))


@pytest.mark.parametrize("datatype", sorted(TYPED_FIELDS))
def test_identity_typed_contents_every_datatype(stubs: dict[str, Stub], datatype: str) -> None:
    values = VALUES[datatype]
    if datatype.startswith("FP"):
        values = values[np.isfinite(values)]
    tensor = typed(f"INPUT_{suffix(datatype)}", datatype, [1, len(values)],
                   **{TYPED_FIELDS[datatype]: values.tolist()})
    assert_same_response(call_both(stubs, "ModelInfer", identity(tensor)))


@pytest.mark.parametrize(
    "message",
    [
        identity(InputTensor(name="INPUT_INT32", datatype="INT32", shape=[1, 0]), raw=[b""]),
        identity(typed("INPUT_INT32", "INT32", [1, 0])),
        identity(typed("INPUT_STRING", "BYTES", [2, 1], bytes_contents=[b"", "é".encode()])),
        identity(InputTensor(name="INPUT_FP16", datatype="FP16", shape=[1, 2]), raw=[b"\x00\x3c\x00\xbc"]),
        edited(add_sub(), lambda m: m.raw_input_contents.append(b"ignored by Triton")),
        add_sub(model_version="1", id="versioned"),
        edited(add_sub(), lambda m: m.outputs.add(name="OUTPUT1")),
    ],
    ids=["empty_raw", "empty_typed", "typed_bytes_batch", "fp16_raw", "extra_raw_contents", "versioned",
         "one_requested_output"],
)
def test_infer_edge_cases(stubs: dict[str, Stub], message: service_pb2.ModelInferRequest) -> None:
    assert_same_response(call_both(stubs, "ModelInfer", message))


@pytest.mark.parametrize(
    "parameters",
    [
        {},
        {"scale": P(int64_param=3)},
        {"scale": P(double_param=0.5), "label": P(string_param="héllo 안녕 😀")},
        {"flag": P(bool_param=True), "off": P(bool_param=False), "negative": P(int64_param=-7),
         "empty": P(string_param="")},
        {"sequence_id": P(int64_param=5), "sequence_start": P(bool_param=True), "priority": P(uint64_param=1),
         "timeout": P(int64_param=10_000_000)},
    ],
    ids=["none", "int", "double_and_string", "mixed", "protocol_only"],
)
def test_params_echo(stubs: dict[str, Stub], parameters: dict[str, service_pb2.InferParameter]) -> None:
    """Request parameters reach the model with their types (the model echoes them as JSON); the protocol's own
    parameters (sequence, priority, timeout) do not."""
    response = assert_same_response(call_both(stubs, "ModelInfer", params_request(**parameters)))
    echo = json.loads(response.raw_output_contents[1][4:])
    assert set(echo["request"]) == {k for k in parameters if k not in ("sequence_id", "sequence_start", "priority",
                                                                       "timeout")}


# ----------------------------------------------------------------------------------------------- streams


def test_stream_with_errors_in_the_middle(servers: dict[str, ServerProcess]) -> None:
    """The same stream to both servers: good requests, unknown models, a wrong byte size, good again. Every request
    gets one answer, in order; errors are answers (`error_message`, with the request's id) and the stream goes on."""
    sequence = [
        add_sub(id="first"),
        add_sub("no_such_model", id="unknown"),
        add_sub("no_such_model"),
        edited(add_sub(id="short"), lambda m: m.raw_input_contents.__setitem__(0, F16[:12])),
        edited(add_sub(id="typed_and_raw"), lambda m: m.inputs[0].contents.fp32_contents.append(1.0)),
        add_sub(),
        add_sub(id="last"),
    ]
    unknown = "Request for unknown model: 'no_such_model' is not found"
    fragments = [None, unknown, unknown,
                 "input byte size mismatch for input 'INPUT0' for model 'add_sub'. Expected 16, got 12",
                 "contents field must not be specified when using raw_input_contents for 'INPUT0'", None, None]

    async def run(server: ServerProcess) -> list[service_pb2.ModelStreamInferResponse]:
        async with grpc.aio.insecure_channel(server.grpc_url) as channel:
            call = Stub(channel).ModelStreamInfer(timeout=TIMEOUT_S)
            for message in sequence:
                await call.write(message)
            await call.done_writing()
            return [answer async for answer in call]

    def without_error_message(answer: service_pb2.ModelStreamInferResponse) -> service_pb2.ModelStreamInferResponse:
        rest = service_pb2.ModelStreamInferResponse()
        rest.CopyFrom(answer)
        rest.ClearField("error_message")
        if rest.HasField("infer_response"):
            rest.infer_response.CopyFrom(by_output_name(rest.infer_response))
        return rest

    answers = {name: asyncio.run(run(server)) for name, server in servers.items()}
    assert len(answers["triton"]) == len(answers["transerve"]) == len(sequence)
    for fragment, want, got in zip(fragments, answers["triton"], answers["transerve"], strict=True):
        if fragment is None:
            assert want.error_message == got.error_message == ""
        else:
            assert fragment in want.error_message, f"the reference changed: {want.error_message}"
            assert fragment in got.error_message
        assert without_error_message(got) == without_error_message(want)


# ---------------------------------------------------------------------------------------- health and metadata


@pytest.mark.parametrize("model", ["add_sub", "identity", "strings", "params"])
@pytest.mark.parametrize("version", ["", "1"])
def test_model_metadata(stubs: dict[str, Stub], model: str, version: str) -> None:
    assert_same_response(call_both(stubs, "ModelMetadata", service_pb2.ModelMetadataRequest(name=model,
                                                                                            version=version)))


@pytest.mark.parametrize("model", ["add_sub", "identity", "strings", "params"])
def test_model_config(stubs: dict[str, Stub], model: str) -> None:
    """The fields that describe the model; auto-filled defaults (optimization, instance names...) are Triton's
    implementation details and may differ."""
    outcomes = call_both(stubs, "ModelConfig", service_pb2.ModelConfigRequest(name=model))

    def key_fields(response: service_pb2.ModelConfigResponse) -> dict[str, Any]:
        config = response.config
        return {"name": config.name, "backend": config.backend, "max_batch_size": config.max_batch_size,
                "input": [(t.name, t.data_type, list(t.dims), t.optional) for t in config.input],
                "output": [(t.name, t.data_type, list(t.dims)) for t in config.output],
                "parameters": {k: v.string_value for k, v in config.parameters.items()},
                "version_policy": config.version_policy}

    assert key_fields(outcomes["transerve"]) == key_fields(outcomes["triton"])


@pytest.mark.parametrize("ready", [False, True])
def test_repository_index(stubs: dict[str, Stub], ready: bool) -> None:
    outcomes = call_both(stubs, "RepositoryIndex", service_pb2.RepositoryIndexRequest(ready=ready))
    entries = {name: sorted((m.name, m.version, m.state, m.reason) for m in outcome.models)
               for name, outcome in outcomes.items()}
    assert entries["transerve"] == entries["triton"]


def test_server_metadata_shape(stubs: dict[str, Stub]) -> None:
    """`name` and `version` identify the implementation; the extensions these tests exercise must be on both."""
    for name, response in call_both(stubs, "ServerMetadata", service_pb2.ServerMetadataRequest()).items():
        assert response.name and response.version, name
        assert {"binary_tensor_data", "parameters", "model_configuration", "model_repository",
                "statistics"} <= set(response.extensions), name


@pytest.mark.parametrize(
    ("method", "message"),
    [
        ("ServerLive", service_pb2.ServerLiveRequest()),
        ("ServerReady", service_pb2.ServerReadyRequest()),
        ("ModelReady", service_pb2.ModelReadyRequest(name="add_sub")),
        ("ModelReady", service_pb2.ModelReadyRequest(name="add_sub", version="1")),
        ("ModelReady", service_pb2.ModelReadyRequest(name="add_sub", version="2")),
        ("ModelReady", service_pb2.ModelReadyRequest(name="no_such_model")),
    ],
    ids=["live", "ready", "model", "model_v1", "model_v2", "unknown_model"],
)
def test_readiness(stubs: dict[str, Stub], method: str, message: Message) -> None:
    assert_same_response(call_both(stubs, method, message))


@pytest.mark.parametrize("service", [b"", b"inference.GRPCInferenceService", b"anything.Else"])
def test_grpc_health_check(servers: dict[str, ServerProcess], service: bytes) -> None:
    """Triton answers SERVING for any service name while it is ready; so must transerve."""
    request = bytes([0x0A, len(service)]) + service if service else b""
    answers = {}
    for name, server in servers.items():
        with grpc.insecure_channel(server.grpc_url) as channel:
            answers[name] = channel.unary_unary("/grpc.health.v1.Health/Check")(request, timeout=TIMEOUT_S)
    assert answers["transerve"] == answers["triton"] == b"\x08\x01"


def test_statistics_shape(stubs: dict[str, Stub]) -> None:
    """The numbers differ by nature; the structure (which model versions, which counters are kept) must not."""
    call_both(stubs, "ModelInfer", add_sub())
    outcomes = call_both(stubs, "ModelStatistics", service_pb2.ModelStatisticsRequest(name="add_sub"))
    for name, response in outcomes.items():
        assert [(s.name, s.version) for s in response.model_stats] == [("add_sub", "1")], name
        stats = response.model_stats[0]
        assert stats.inference_count >= 1 and stats.execution_count >= 1, name
        assert stats.inference_stats.success.count >= 1 and stats.inference_stats.success.ns > 0, name
        assert stats.batch_stats and all(b.batch_size >= 1 for b in stats.batch_stats), name


# ----------------------------------------------------------------------------------------------- bad input


@dataclass(frozen=True)
class BadCall:
    """One bad RPC, Triton 2.51's status for it, and words of Triton's message that transerve's must contain."""

    id: str
    message: Message
    code: str
    substrings: tuple[str, ...] = ()
    method: str = "ModelInfer"


_I0 = "INPUT0"

BAD_CALLS = [
    BadCall("statistics_unknown_model", service_pb2.ModelStatisticsRequest(name="no_such_model"), "INVALID_ARGUMENT",
            ("requested model 'no_such_model' is not available",), "ModelStatistics"),
    BadCall("statistics_unknown_version", service_pb2.ModelStatisticsRequest(name="add_sub", version="2"),
            "INVALID_ARGUMENT", ("requested model version is not available for model 'add_sub'",), "ModelStatistics"),
    BadCall("unknown_model", add_sub("no_such_model"), "NOT_FOUND", ("unknown model", "'no_such_model'")),
    BadCall("unknown_version", add_sub(model_version="2"), "NOT_FOUND", ("unknown model", "version 2")),
    BadCall("version_not_a_number", add_sub(model_version="abc"), "INVALID_ARGUMENT",
            ("version string 'abc'", "version should be an integral value > 0")),
    BadCall("missing_input", edited(add_sub(), lambda m: (m.inputs.pop(), m.raw_input_contents.pop())),
            "INVALID_ARGUMENT", ("expected 2 inputs but got 1 inputs", "'INPUT1'")),
    BadCall("extra_input", edited(add_sub(), lambda m: (m.inputs.add(name="INPUT9", datatype="FP32", shape=[1, 4]),
                                                        m.raw_input_contents.append(F16))),
            "INVALID_ARGUMENT", ("expected 2 inputs but got 3 inputs",)),
    BadCall("duplicate_input", edited(add_sub(), lambda m: (m.inputs.insert(0, m.inputs[0]),
                                                            m.raw_input_contents.append(F16))),
            "INVALID_ARGUMENT", ("input 'INPUT0' already exists",)),
    BadCall("wrong_datatype", edited(add_sub(), lambda m: setattr(m.inputs[0], "datatype", "INT32")),
            "INVALID_ARGUMENT", ("data-type is 'INT32'", "expects 'FP32'")),
    BadCall("invalid_datatype", edited(add_sub(), lambda m: setattr(m.inputs[0], "datatype", "FLOAT")),
            "INVALID_ARGUMENT", (_I0,)),
    BadCall("shape_mismatch", edited(add_sub(), lambda m: (m.inputs[0].shape.__setitem__(1, 5),
                                                           m.raw_input_contents.__setitem__(0, F16 + F16[:4]))),
            "INVALID_ARGUMENT", ("unexpected shape for input 'INPUT0'", "Expected [-1,4], got [1,5]")),
    BadCall("negative_dimension", edited(add_sub(), lambda m: m.inputs[0].shape.__setitem__(0, -1)),
            "INVALID_ARGUMENT", (_I0,)),
    BadCall("batch_over_max_batch_size", edited(add_sub(), lambda m: (
        [t.shape.__setitem__(0, 9) for t in m.inputs], m.ClearField("raw_input_contents"),
        m.raw_input_contents.extend([F16 * 9] * 2))), "INVALID_ARGUMENT", ("batch-size must be <= 8",)),
    BadCall("unknown_requested_output", edited(add_sub(), lambda m: m.outputs.add(name="OUTPUT9")),
            "INVALID_ARGUMENT", ("unexpected inference output 'OUTPUT9'",)),
    BadCall("raw_byte_size", edited(add_sub(), lambda m: m.raw_input_contents.__setitem__(0, F16[:12])),
            "INVALID_ARGUMENT", ("input byte size mismatch for input 'INPUT0' for model 'add_sub'",
                                 "Expected 16, got 12")),
    BadCall("raw_missing_for_an_input", edited(add_sub(), lambda m: m.raw_input_contents.pop()),
            "INVALID_ARGUMENT", ("unable to find data for input tensor 'INPUT1' for model 'add_sub'",)),
    BadCall("no_data_at_all", edited(add_sub(), lambda m: m.ClearField("raw_input_contents")),
            "INVALID_ARGUMENT", ("unable to find data for input tensor 'INPUT0'",)),
    BadCall("raw_and_typed", edited(add_sub(), lambda m: m.inputs[0].contents.fp32_contents.extend([1, 2, 3, 4])),
            "INVALID_ARGUMENT", ("contents field must not be specified when using raw_input_contents for 'INPUT0'",)),
    BadCall("typed_count", add_sub_typed := service_pb2.ModelInferRequest(model_name="add_sub", inputs=[
        typed("INPUT0", "FP32", [1, 4], fp32_contents=[1, 2, 3]), typed("INPUT1", "FP32", [1, 4],
                                                                        fp32_contents=[1, 2, 3, 4])]),
            "INVALID_ARGUMENT", (_I0,)),
    BadCall("typed_field_of_another_type", edited(service_pb2.ModelInferRequest(), lambda m: (
        m.CopyFrom(add_sub_typed), m.inputs[0].contents.ClearField("fp32_contents"),
        m.inputs[0].contents.int_contents.extend([1, 2, 3, 4]))), "INVALID_ARGUMENT",
            ("unexpected explicit tensor data for input tensor 'INPUT0' for model 'add_sub' of type 'INT32', "
             "expected datatype 'FP32'",)),
    BadCall("typed_fp16", identity(typed("INPUT_FP16", "FP16", [1, 2], fp32_contents=[1, 2])), "INVALID_ARGUMENT",
            ("of type 'FP32', expected datatype 'FP16'",)),
    BadCall("two_typed_fields", identity(typed("INPUT_INT32", "INT32", [1, 2], int_contents=[1, 2],
                                               fp32_contents=[1, 2])), "INVALID_ARGUMENT",
            ("binary data was already supplied",)),
    BadCall("empty_typed_for_a_non_empty_shape", identity(typed("INPUT_INT32", "INT32", [1, 2])),
            "INVALID_ARGUMENT", ("INPUT_INT32",)),
    BadCall("raw_bytes_truncated", identity(InputTensor(name="INPUT_STRING", datatype="BYTES", shape=[1, 2]),
                                            raw=[b"\x05\x00\x00\x00ab"]), "INVALID_ARGUMENT"),
    BadCall("raw_bytes_count", identity(InputTensor(name="INPUT_STRING", datatype="BYTES", shape=[1, 2]),
                                        raw=[b"\x01\x00\x00\x00a"]), "INVALID_ARGUMENT"),
    BadCall("reserved_parameter_prefix", params_request(triton_x=P(int64_param=1)), "INVALID_ARGUMENT",
            ("parameter keys starting with 'triton_' are reserved for Triton usage",)),
    BadCall("parameter_without_value", params_request(nothing=P()), "INVALID_ARGUMENT",
            ("invalid value type for 'nothing' parameter",)),
    BadCall("sequence_id_of_wrong_type", params_request(sequence_id=P(bool_param=True)), "INVALID_ARGUMENT",
            ("invalid value type for 'sequence_id' parameter, expected int64_param or string_param",)),
    BadCall("priority_of_wrong_type", params_request(priority=P(string_param="high")), "INVALID_ARGUMENT",
            ("invalid value type for 'priority' parameter, expected int64_param or uint64_param",)),
    BadCall("metadata_unknown_model", service_pb2.ModelMetadataRequest(name="no_such_model"), "NOT_FOUND",
            ("unknown model",), "ModelMetadata"),
    BadCall("metadata_unknown_version", service_pb2.ModelMetadataRequest(name="add_sub", version="2"), "NOT_FOUND",
            ("version 2",), "ModelMetadata"),
    BadCall("config_unknown_model", service_pb2.ModelConfigRequest(name="no_such_model"), "NOT_FOUND",
            ("unknown model",), "ModelConfig"),
    BadCall("config_version_not_a_number", service_pb2.ModelConfigRequest(name="add_sub", version="abc"),
            "INVALID_ARGUMENT", ("version should be an integral value > 0",), "ModelConfig"),
    BadCall("ready_version_not_a_number", service_pb2.ModelReadyRequest(name="add_sub", version="abc"),
            "INVALID_ARGUMENT", ("version should be an integral value > 0",), "ModelReady"),
    BadCall("index_of_a_named_repository", service_pb2.RepositoryIndexRequest(repository_name="other"),
            "UNIMPLEMENTED", ("'repository_name' specification is not supported",), "RepositoryIndex"),
    BadCall("load_without_explicit_control", service_pb2.RepositoryModelLoadRequest(model_name="add_sub"),
            "UNAVAILABLE", ("explicit model load / unload is not allowed if polling is enabled",),
            "RepositoryModelLoad"),
    BadCall("unload_without_explicit_control", service_pb2.RepositoryModelUnloadRequest(model_name="add_sub"),
            "UNAVAILABLE", ("explicit model load / unload is not allowed if polling is enabled",),
            "RepositoryModelUnload"),
]


@pytest.mark.parametrize("case", BAD_CALLS, ids=lambda c: c.id)
def test_bad_input_same_status(stubs: dict[str, Stub], case: BadCall) -> None:
    outcomes = call_both(stubs, case.method, case.message)
    assert code_of(outcomes["triton"]) == case.code, f"the reference changed: {outcomes['triton']}"
    assert code_of(outcomes["transerve"]) == case.code, outcomes["transerve"]
    for name, outcome in outcomes.items():
        for substring in case.substrings:
            assert substring in outcome.details(), f"{name}: {substring!r} not in {outcome.details()!r}"
    assert_both_alive(stubs)


@dataclass(frozen=True)
class Divergence:
    """A request Triton 2.51 and transerve answer differently on purpose, each side's status, and why."""

    id: str
    message: Message
    triton: str
    transerve: str
    why: str


DELIBERATE_DIVERGENCES = [
    Divergence("typed_int8_out_of_range", identity(typed("INPUT_INT8", "INT8", [1, 2], int_contents=[1, -300])),
               "OK", "INVALID_ARGUMENT",
               "Triton keeps the low byte of each 32-bit value, so -300 arrives as -44; transerve builds tensors "
               "with the core's range checks (as for HTTP JSON) and refuses rather than corrupt the value."),
    Divergence("typed_uint16_out_of_range", identity(typed("INPUT_UINT16", "UINT16", [1, 1], uint_contents=[70000])),
               "OK", "INVALID_ARGUMENT", "as above: Triton wraps 70000 to 4464."),
    Divergence("uint64_parameter", params_request(big=P(uint64_param=2**64 - 1)), "INVALID_ARGUMENT", "OK",
               "InferParameter defines uint64_param and Python holds it exactly; Triton 2.51's request path only "
               "takes bool, int64, double and string for model parameters."),
]


@pytest.mark.parametrize("case", DELIBERATE_DIVERGENCES, ids=lambda c: c.id)
def test_deliberate_divergence(stubs: dict[str, Stub], case: Divergence) -> None:
    """Known, deliberate divergences (see each case's `why`). Triton's answer is asserted too, so that a Triton
    upgrade that changes it shows here."""
    outcomes = call_both(stubs, "ModelInfer", case.message)
    assert code_of(outcomes["triton"]) == case.triton, f"the reference changed: {outcomes['triton']}"
    assert code_of(outcomes["transerve"]) == case.transerve, outcomes["transerve"]
    assert_both_alive(stubs)
