"""Generate, gRPC streams and BLS calls traced as the real Triton 2.51 traces them: the same trace files (ids, parent
ids, models and the multiset of timestamps of every trace) for `/generate` and `/generate_stream` (decoupled and
ordinary models, errors), ModelStreamInfer on both gRPC transports (several requests on one stream, decoupled
responses with and without the empty final one) and BLS calls with `trace=request.trace()` (sync, twice, async,
decoupled, into an ensemble, refused, and one without `trace=`); and the same OpenTelemetry spans for BLS calls and
streams that carry a client's trace context.

Deliberate divergences, tested against transerve alone: a stream request refused before it runs leaves a trace of its
GRPC_WAITREAD stamps, as a refused ModelInfer does here (Triton 2.51 never writes it); the HTTP_SEND stamps of the
generate endpoints are the send times (Triton 2.51 writes 0 for both).
"""

from __future__ import annotations

import json
import queue
import shutil
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from support import EXAMPLE_REPOSITORY, ServerProcess, require_triton, start_transerve, start_triton
from support.repositories import write_model
from support.tracing import OtlpReceiver, read_traces, span_tree, summary
from tritonclient.grpc import service_pb2, service_pb2_grpc

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 30.0
FLAGS = ("--trace-config", "triton,file=trace.json", "--trace-config", "level=TIMESTAMPS", "--trace-config", "rate=1")
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The BLS models of trace_models/, the examples they call and a decoupled model (repeat_int32)."""
    repo = tmp_path_factory.mktemp("trace_streams") / "models"
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(HERE / "trace_models", repo, ignore=ignore)
    for name in ("add_sub", "text_pipeline", "byte_tokenizer", "token_stats"):
        shutil.copytree(EXAMPLE_REPOSITORY / name, repo / name, ignore=ignore)
    shutil.copytree(HERE / "decoupled_bls_models" / "repeat_int32", repo / "repeat_int32", ignore=ignore)
    return repo


# ------------------------------------------------------------------------------------------------- requests

ADD_SUB = {"INPUT0": [1, 2, 3, 4], "INPUT1": [1, 2, 3, 4]}
GENERATE: list[tuple[str, str, Any]] = [
    ("repeat_int32", "generate", {"IN": [7]}),  # one response, then the final flag alone
    ("repeat_int32", "generate_stream", {"IN": [1, 2, 3]}),
    ("add_sub", "generate", ADD_SUB),
    ("add_sub", "generate_stream", ADD_SUB),
    ("add_sub", "generate", {"INPUT0": [1, 2, 3, 4]}),  # refused: an input missing
    ("repeat_int32", "generate", {"IN": [7, 8]}),  # two responses where one is expected
    ("bls_trace", "generate", {"MODE": "fail"}),  # the model's error response
    ("bls_trace", "generate_stream", {"MODE": "fail"}),
    ("add_sub", "generate", b"{bad"),  # a body that does not parse: traced, as sampled before it is read
]
BLS = [("bls_trace", mode) for mode in ("sync", "twice", "untraced", "decoupled", "ensemble", "refused")] + [
    ("bls_trace_async", "")]


def generate(server: ServerProcess) -> list[Any]:
    answers = []
    for model, endpoint, body in GENERATE:
        url = f"{server.base_url}/v2/models/{model}/{endpoint}"
        sent = {"data": body} if isinstance(body, bytes) else {"json": body}
        answer = requests.post(url, timeout=TIMEOUT_S, **sent)  # type: ignore[arg-type]
        if isinstance(body, bytes):  # a 400 here, a 500 in Triton, worded by another JSON parser
            answers.append(answer.status_code in (400, 500))
        elif body == {"IN": [7, 8]}:  # a 400 here, Triton's 200 after it began its answer (README's differences)
            answers.append(answer.text)
        else:
            answers.append((answer.status_code, answer.text))
    return answers


def add_sub_inputs() -> list[grpcclient.InferInput]:
    inputs = [grpcclient.InferInput(name, [1, 4], "FP32") for name in ("INPUT0", "INPUT1")]
    for tensor in inputs:
        tensor.set_data_from_numpy(np.arange(4, dtype=np.float32).reshape(1, 4))
    return inputs


def repeat_inputs(values: list[int]) -> list[grpcclient.InferInput]:
    tensor = grpcclient.InferInput("IN", [len(values)], "INT32")
    tensor.set_data_from_numpy(np.array(values, np.int32))
    return [tensor]


def stream(server: ServerProcess, model: str, requests_inputs: list[list[grpcclient.InferInput]],
           empty_final: bool = True) -> list[Any]:
    """Requests on one stream; their answers (final flag, outputs or error) once the stream has ended."""
    answers: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        for inputs in requests_inputs:
            client.async_stream_infer(model, inputs, enable_empty_final_response=empty_final)
        client.stop_stream()
    finally:
        client.close()
    received = []
    while not answers.empty():
        result, error = answers.get()
        if error is not None:
            received.append(str(error))
            continue
        response = result.get_response()
        received.append((response.parameters["triton_final_response"].bool_param,
                         sorted(output.name for output in response.outputs)))
    return received


def streams(server: ServerProcess) -> list[Any]:
    return [
        stream(server, "add_sub", [add_sub_inputs(), add_sub_inputs()]),
        stream(server, "repeat_int32", [repeat_inputs([1, 2, 3])]),
        stream(server, "repeat_int32", [repeat_inputs([])]),
        stream(server, "repeat_int32", [repeat_inputs([1, 2])], empty_final=False),
    ]


def bls(server: ServerProcess) -> list[Any]:
    answers = []
    for model, mode in BLS:
        body = {"inputs": [{"name": "MODE", "shape": [1], "datatype": "BYTES", "data": [mode]}]}
        answer = requests.post(f"{server.base_url}/v2/models/{model}/infer", json=body, timeout=TIMEOUT_S)
        assert answer.status_code == 200, answer.text
        answers.append(answer.json()["outputs"][0]["data"][0])
    return answers


def run_all(server: ServerProcess) -> list[Any]:
    return [generate(server), streams(server), bls(server)]


def traced(start: Any, repository: Path, *flags: str, **options: Any) -> tuple[list[Any], dict[str, Any]]:
    """The answers to every request of this file and the trace file they leave, written at exit."""
    with start(repository, *FLAGS, *flags, **options) as server:
        answers = run_all(server)
        assert server.stop() == 0, server.log_tail()
        files = read_traces(server.log_path.parent)
    assert list(files) == ["trace.json"]
    return answers, summary(files["trace.json"])


@pytest.fixture(scope="module")
def triton_traces(repository: Path) -> tuple[list[Any], dict[str, Any]]:
    return traced(start_triton, repository, install=require_triton())


# ---------------------------------------------------------------------------------------------- trace files


@pytest.mark.parametrize("transport", ["native", "grpcio"])
def test_trace_files_match_triton(repository: Path, triton_traces: tuple[list[Any], dict[str, Any]],
                                  transport: str) -> None:
    answers, ours = traced(start_transerve, repository, f"--grpc-transport={transport}")
    for group, (mine, theirs) in enumerate(zip(answers, triton_traces[0], strict=True)):
        for index, (answer, expected) in enumerate(zip(mine, theirs, strict=True)):
            assert answer == expected, (group, index)
    for trace_id, expected in triton_traces[1].items():
        assert ours.get(trace_id) == expected, trace_id
    assert sorted(ours) == sorted(triton_traces[1])

    def stamps(trace_id: int) -> dict[str, int]:
        return dict(ours[trace_id]["stamps"])

    models = {trace_id: (trace["header"] or {}).get("model_name") for trace_id, trace in ours.items()}
    parents = {trace_id: (trace["header"] or {}).get("parent_id") for trace_id, trace in ours.items()}
    # /generate_stream of three responses: four callbacks (the final flag alone), three events sent.
    assert stamps(2)["INFER_RESPONSE_COMPLETE"] == 4 and stamps(2)["HTTP_SEND_END"] == 3
    assert models[5] is None and set(stamps(5)) == {"HTTP_RECV_START", "HTTP_RECV_END"}  # refused
    # A decoupled stream request: the first response stamps INFER_RESPONSE_COMPLETE; each message sent is stamped.
    first_stream = min(trace_id for trace_id in ours if "GRPC_WAITREAD_END" in stamps(trace_id))
    assert [models[first_stream + n] for n in range(5)] == ["add_sub", "add_sub"] + ["repeat_int32"] * 3
    assert stamps(first_stream + 2)["INFER_RESPONSE_COMPLETE"] == 1
    assert stamps(first_stream + 2)["GRPC_SEND_END"] == 4 and stamps(first_stream + 4)["GRPC_SEND_END"] == 2
    # BLS: children under the calling request, none for the call without trace=, an id spent on the refused call.
    bls_traces = {trace_id: parents[trace_id] for trace_id, model in models.items()
                  if parents[trace_id] is not None and model in ("add_sub", "repeat_int32", "text_pipeline")}
    callers = [models[parent] for parent in bls_traces.values()]
    assert callers == ["bls_trace"] * 5 + ["bls_trace_async"] * 2
    assert [models[trace_id] for trace_id in bls_traces] == ["add_sub"] * 3 + [
        "repeat_int32", "text_pipeline"] + ["add_sub"] * 2
    refused = sorted(trace_id for trace_id, model in models.items() if model == "bls_trace")[-1]  # BLS[5]
    assert [trace_id for trace_id in range(1, max(ours)) if trace_id not in ours] == [refused + 1]


def test_refused_stream_request_leaves_its_read_stamps(tmp_path: Path) -> None:
    """Triton 2.51 never writes the trace of a stream request its core refuses; here it holds the GRPC_WAITREAD
    stamps, as a refused ModelInfer's does, and the stream goes on."""
    with start_transerve(EXAMPLE_REPOSITORY, *FLAGS) as server:
        answers = stream(server, "add_sub", [add_sub_inputs()[:1], add_sub_inputs()])
        assert server.stop() == 0
        entries = read_traces(server.log_path.parent)["trace.json"]
    assert "expected 2 inputs but got 1 inputs" in answers[0] and answers[1] == (True, ["OUTPUT0", "OUTPUT1"])
    traces = summary(entries)
    assert sorted(traces) == [1, 2]
    assert traces[1]["header"] is None and dict(traces[1]["stamps"]) == {"GRPC_WAITREAD_START": 1,
                                                                         "GRPC_WAITREAD_END": 1}
    assert traces[2]["header"]["model_name"] == "add_sub" and traces[2]["stamps"]["GRPC_SEND_END"] == 1
    waits = {entry["timestamps"][0]["name"]: entry["timestamps"][0]["ns"] for entry in entries
             if "timestamps" in entry and entry["timestamps"][0]["name"].startswith("GRPC_WAITREAD")
             and entry["id"] == 2}
    assert 0 < waits["GRPC_WAITREAD_START"] <= waits["GRPC_WAITREAD_END"]


def test_generate_send_stamps_are_times(repository: Path, tmp_path: Path) -> None:
    """Triton 2.51 writes 0 for a generate answer's HTTP_SEND_START and _END; here they are when it was sent."""
    with start_transerve(repository, *FLAGS) as server:
        answer = requests.post(f"{server.base_url}/v2/models/repeat_int32/generate_stream", json={"IN": [1, 2]},
                               timeout=TIMEOUT_S)
        assert answer.status_code == 200 and answer.text.count("data: ") == 2
        assert server.stop() == 0
        entries = read_traces(server.log_path.parent)["trace.json"]
    stamps = [(stamp["name"], stamp["ns"]) for entry in entries for stamp in entry.get("timestamps", [])]
    sends = [ns for name, ns in stamps if name.startswith("HTTP_SEND")]
    received = next(ns for name, ns in stamps if name == "HTTP_RECV_END")
    assert len(sends) == 4 and all(ns > received for ns in sends) and sends == sorted(sends)


def test_bls_after_its_request_ended_is_not_traced(tmp_path: Path) -> None:
    """A BLS call names its parent by trace id: once that request has ended (a decoupled model calling from a
    thread after `execute` returned), the call runs untraced rather than joining a finished trace."""
    repo = tmp_path / "models"
    shutil.copytree(EXAMPLE_REPOSITORY / "add_sub", repo / "add_sub", ignore=shutil.ignore_patterns("__pycache__"))
    write_model(
        repo, "late_bls",
        'name: "late_bls" backend: "python" max_batch_size: 0 model_transaction_policy { decoupled: true }\n'
        'input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
        'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ]\n', LATE_BLS)
    with start_transerve(repo, *FLAGS) as server:
        answer = requests.post(f"{server.base_url}/v2/models/late_bls/generate", json={"X": [1, 2, 3, 4]},
                               timeout=TIMEOUT_S)
        assert answer.status_code == 200, answer.text
        assert answer.json()["Y"] == [2, 4, 6, 8]
        assert server.stop() == 0
        entries = read_traces(server.log_path.parent)["trace.json"]
    headers = [entry for entry in entries if "model_name" in entry]
    assert headers == [{"id": 1, "model_name": "late_bls", "model_version": 1},
                       {"id": 2, "model_name": "add_sub", "model_version": 1, "parent_id": 1}]


LATE_BLS = """
import threading
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy().reshape(1, 4)
            trace = request.trace()

            def call():
                return pb_utils.InferenceRequest(
                    model_name="add_sub", requested_output_names=["OUTPUT0"], trace=trace,
                    inputs=[pb_utils.Tensor("INPUT0", x), pb_utils.Tensor("INPUT1", x)]).exec()

            call()  # while the request runs: traced under it

            def later(sender=request.get_response_sender()):
                out = pb_utils.get_output_tensor_by_name(call(), "OUTPUT0").as_numpy().reshape(4)
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("Y", out)]),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

            threading.Timer(0.2, later).start()
        return None
"""


# ------------------------------------------------------------------------------------------- OpenTelemetry


def otel_requests(server: ServerProcess) -> list[str]:
    """BLS calls over HTTP, and a stream request carrying the client's trace context in its metadata; the
    `traceparent` each BLS model's `request.trace().get_context()` gave."""
    contexts = []
    for mode in ("sync", "decoupled", "ensemble"):
        body = {"inputs": [{"name": "MODE", "shape": [1], "datatype": "BYTES", "data": [mode]}]}
        answer = requests.post(f"{server.base_url}/v2/models/bls_trace/infer", json=body, timeout=TIMEOUT_S)
        assert answer.status_code == 200, answer.text
        context = json.loads(json.loads(answer.json()["outputs"][0]["data"][0])["context"])
        assert list(context) == ["traceparent"]
        contexts.append(context["traceparent"])
    request = service_pb2.ModelInferRequest(model_name="repeat_int32", id="s1")
    tensor = request.inputs.add(name="IN", datatype="INT32", shape=[2])
    tensor.contents.int_contents.extend([1, 2])
    with grpc.insecure_channel(server.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        metadata = (("traceparent", f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"),)
        answers = list(stub.ModelStreamInfer(iter([request]), metadata=metadata, timeout=TIMEOUT_S))
    assert [answer.error_message for answer in answers] == ["", ""]
    return contexts


@pytest.mark.slow
def test_opentelemetry_spans_match_triton(repository: Path) -> None:
    """A BLS call's spans sit under its caller's, as Triton's; a stream request continues the client's trace. A
    python model's `request.trace().get_context()` is its request span's context, in both."""
    install = require_triton()
    trees = {}
    for name, start in (("triton", start_triton), ("transerve", start_transerve)):
        receiver = OtlpReceiver()
        try:
            flags = ("--trace-config", "mode=opentelemetry", "--trace-config", "level=TIMESTAMPS",
                     "--trace-config", "rate=1", "--trace-config", f"opentelemetry,url={receiver.url}",
                     "--trace-config", "opentelemetry,bsp_schedule_delay=50")
            with start(repository, *flags, **({"install": install} if name == "triton" else {})) as server:
                contexts = otel_requests(server)
                receiver.wait_for(21)  # every span of otel_requests, at once when they arrive
            spans = receiver.spans()
        finally:
            receiver.close()
        model_spans = {f"00-{span.trace_id.hex()}-{span.span_id.hex()}-01" for _, _, span in spans
                       if span.name == "bls_trace"}
        assert set(contexts) == model_spans, name
        client_spans = [span.parent_span_id for _, _, span in spans
                        if span.name == "InferRequest" and span.parent_span_id]
        assert client_spans, (name, sorted((span.name, span.parent_span_id.hex()) for _, _, span in spans))
        client_span = client_spans[0]
        trees[name] = span_tree(spans, client_span)
    assert trees["transerve"] == trees["triton"]
    paths = [span[0] for span in trees["transerve"]]
    assert ("", "InferRequest", "bls_trace", "text_pipeline", "byte_tokenizer", "compute") in paths
    assert ("", "InferRequest", "bls_trace", "repeat_int32", "compute") in paths
    assert ("client", "InferRequest", "repeat_int32", "compute") in paths


@pytest.mark.parametrize("transport", ["native", "grpcio"])
def test_model_infer_continues_the_clients_trace(repository: Path, transport: str) -> None:
    """ModelInfer reads `traceparent` from its metadata in OpenTelemetry mode, on both transports (as Triton)."""
    receiver = OtlpReceiver()
    try:
        flags = ("--trace-config", "mode=opentelemetry", "--trace-config", "level=TIMESTAMPS",
                 "--trace-config", "rate=0", "--trace-config", f"opentelemetry,url={receiver.url}",
                 "--trace-config", "opentelemetry,bsp_schedule_delay=50", f"--grpc-transport={transport}")
        with start_transerve(repository, *flags) as server:
            request = service_pb2.ModelInferRequest(model_name="add_sub")
            for name in ("INPUT0", "INPUT1"):
                request.inputs.add(name=name, datatype="FP32", shape=[1, 4]).contents.fp32_contents.extend(
                    [1, 2, 3, 4])
            with grpc.insecure_channel(server.grpc_url) as channel:
                stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
                stub.ModelInfer(request, timeout=TIMEOUT_S)  # rate=0: not traced without a context
                stub.ModelInfer(request, metadata=(("traceparent", f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"),),
                                timeout=TIMEOUT_S)
            receiver.wait_for(3)
        spans = receiver.spans()
    finally:
        receiver.close()
    assert sorted(span.name for _, _, span in spans) == ["InferRequest", "add_sub", "compute"]
    root = next(span for _, _, span in spans if span.name == "InferRequest")
    assert root.trace_id.hex() == CLIENT_TRACE and root.parent_span_id.hex() == CLIENT_SPAN
