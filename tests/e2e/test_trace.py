"""Triton's trace extension end to end, against the real Triton 2.51: the settings over HTTP and gRPC (every answer
equal, byte for byte over HTTP), the JSON trace file (the same traces, ids, models, timestamps and tensors), the
files of `count` and `log-frequency`, the OpenTelemetry spans (caught by an OTLP/HTTP receiver) and the command
line's refusals. Generate, gRPC streams and BLS calls are in test_trace_streams.py.

Deliberate divergences, tested against transerve alone: a trace update that is not valid JSON, or holds a value of
the wrong type, is a 400 (Triton: 500); gRPC traces stamp GRPC_WAITREAD_START and _END at the same moment (the
service sees a call once its message is read).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import json_format
from support import EXAMPLE_REPOSITORY, REPO_ROOT, ServerProcess, require_triton, start_transerve, start_triton
from support.tracing import OtlpReceiver, read_traces, span_tree, summary
from tritonclient.grpc import service_pb2, service_pb2_grpc

from transerve.cli import build_parser, options_from_args

TIMEOUT_S = 30.0
FLAGS = ("--trace-config", "triton,file=trace.json", "--trace-config", "level=TIMESTAMPS", "--trace-config", "rate=1")


@contextlib.contextmanager
def both(*flags: str) -> Iterator[dict[str, ServerProcess]]:
    """Triton and transerve serving the example repository with the same flags (each in a folder of its own, where
    a relative trace file lands)."""
    install = require_triton()
    with start_triton(EXAMPLE_REPOSITORY, *flags, install=install) as triton, \
            start_transerve(EXAMPLE_REPOSITORY, *flags) as transerve:
        yield {"triton": triton, "transerve": transerve}


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, ServerProcess]]:
    with both(*FLAGS) as pair:
        yield pair


# ------------------------------------------------------------------------------------------------ settings

HTTP_SEQUENCE: list[tuple[str, str, Any]] = [
    ("GET", "", None),
    ("GET", "add_sub", None),
    ("GET", "no_such_model", None),
    ("POST", "no_such_model", {"trace_file": "elsewhere.json"}),
    ("POST", "", {"trace_file": "elsewhere.json"}),
    ("POST", "add_sub", {"trace_rate": "12", "log_frequency": "34"}),
    ("POST", "", {"trace_rate": "56", "trace_count": "78", "trace_level": ["OFF"]}),
    ("GET", "add_sub", None),
    ("POST", "", {"trace_rate": None, "trace_count": None}),
    ("POST", "add_sub", {"trace_rate": None, "trace_level": None}),
    ("POST", "", {"trace_level": None}),
    ("POST", "", {"trace_level": ["TIMESTAMPS", "TENSORS"]}),
    ("POST", "", {"trace_level": ["OFF", "TENSORS"]}),
    ("POST", "", {"trace_level": ["timestamps"]}),
    ("POST", "", {"trace_level": []}),
    ("POST", "", {"trace_rate": "12abc"}),
    ("POST", "", {"trace_rate": " -1"}),
    ("POST", "", {"trace_rate": "99999999999"}),
    ("POST", "", {"trace_rate": "abc"}),
    ("POST", "", {"trace_rate": "0"}),
    ("POST", "", {"trace_count": "-2"}),
    ("POST", "", {"trace_count": "0"}),
    ("POST", "", {"trace_count": "x"}),
    ("POST", "", {"trace_count": "3000000000"}),
    ("POST", "", {"log_frequency": "-3"}),
    ("POST", "", {"log_frequency": "y"}),
    ("POST", "", {"trace_level": ["OFF"], "trace_rate": "0"}),
    ("POST", "", {"trace_mode": "opentelemetry", "unknown": 1}),
    ("POST", "", []),
    ("POST", "add_sub", {"trace_count": "5"}),
    ("POST", "", {"trace_rate": "7"}),
    ("GET", "add_sub", None),
    ("POST", "add_sub", {"trace_count": None}),
    ("GET", "add_sub", None),
]
RESET = {"trace_level": None, "trace_rate": None, "trace_count": None, "log_frequency": None}


def setting_url(server: ServerProcess, model: str) -> str:
    return f"{server.base_url}/v2{f'/models/{model}' if model else ''}/trace/setting"


def reset(server: ServerProcess) -> None:
    for model in ("add_sub", ""):
        requests.post(setting_url(server, model), json=RESET, timeout=TIMEOUT_S).raise_for_status()


def test_http_settings_match_triton(servers: dict[str, ServerProcess]) -> None:
    answers: dict[str, list[tuple[int, str]]] = {}
    for name, server in servers.items():
        reset(server)
        answers[name] = [
            (answer.status_code, answer.text)
            for method, model, body in HTTP_SEQUENCE
            for answer in [requests.request(method, setting_url(server, model), json=body, timeout=TIMEOUT_S)]
        ]
        reset(server)
    for step, (transerve, triton) in enumerate(zip(answers["transerve"], answers["triton"], strict=True)):
        assert transerve == triton, HTTP_SEQUENCE[step]
    assert answers["transerve"][2] == (400, '{"error":"Request for unknown model : no_such_model"}')
    assert answers["transerve"][4] == (501, '{"error":"trace file location can not be updated through network '
                                            'protocol"}')


@pytest.mark.parametrize("path", ["/v2/trace/setting", "/v2/models/add_sub/trace/setting",
                                  "/v2/models/add_sub/versions/1/trace/setting"])
@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
def test_http_routes_match_triton(servers: dict[str, ServerProcess], method: str, path: str) -> None:
    answers = {name: requests.request(method, server.base_url + path, timeout=TIMEOUT_S)
               for name, server in servers.items()}
    assert answers["transerve"].status_code == answers["triton"].status_code
    assert answers["transerve"].json() == answers["triton"].json()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"", "failed to parse the request JSON buffer: The document is empty. at 0"),
        (b'{"trace_rate": 5}', "attempt to access JSON non-string as string"),
        (b'{"trace_level": "TIMESTAMPS"}', "attempt to access JSON non-array as array"),
        (b'{"trace_level": ["TIMESTAMPS", 1]}', "attempt to access JSON non-string as string"),
    ],
)
def test_http_malformed_update_is_400(servers: dict[str, ServerProcess], body: bytes, message: str) -> None:
    """A deliberate divergence: Triton answers these with a 500, the same words."""
    answers = {name: requests.post(setting_url(server, ""), data=body, timeout=TIMEOUT_S)
               for name, server in servers.items()}
    assert answers["triton"].status_code == 500
    assert answers["transerve"].status_code == 400
    assert answers["transerve"].json() == answers["triton"].json() == {"error": message}
    answer = requests.post(setting_url(servers["transerve"], ""), data=b"{bad", timeout=TIMEOUT_S)
    assert answer.status_code == 400
    assert answer.json()["error"].startswith("failed to parse the request JSON buffer: ")


GRPC_SEQUENCE: list[tuple[str, dict[str, list[str]]]] = [
    ("", {}),
    ("add_sub", {}),
    ("no_such_model", {}),
    ("", {"trace_file": ["elsewhere.json"]}),
    ("add_sub", {"trace_rate": ["12"], "log_frequency": ["34"]}),
    ("", {"trace_rate": ["56"], "trace_count": ["78"], "trace_level": ["OFF"]}),
    ("add_sub", {}),
    ("", {"trace_rate": [], "trace_count": []}),
    ("add_sub", {"trace_rate": [], "trace_level": []}),
    ("", {"trace_level": []}),
    ("", {"trace_level": ["TIMESTAMPS", "TENSORS"]}),
    ("", {"trace_level": ["TENSORS", "OFF"]}),
    ("", {"trace_level": ["bogus"]}),
    ("", {"trace_rate": ["1", "2"]}),
    ("", {"trace_rate": ["x"]}),
    ("", {"trace_rate": ["99999999999"]}),
    ("", {"trace_rate": ["-1"]}),
    ("", {"trace_count": ["-5"]}),
    ("", {"trace_count": ["99999999999"]}),
    ("", {"trace_count": ["0"]}),
    ("", {"log_frequency": ["x"]}),
    ("", {"log_frequency": ["7"], "unknown": ["1"]}),
    ("", {"trace_rate": [], "trace_count": [], "trace_level": [], "log_frequency": []}),
    ("add_sub", {"trace_rate": [], "trace_count": [], "trace_level": [], "log_frequency": []}),
]


def grpc_sequence(server: ServerProcess) -> list[Any]:
    outcomes: list[Any] = []
    with grpc.insecure_channel(server.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for model, settings in GRPC_SEQUENCE:
            request = service_pb2.TraceSettingRequest(model_name=model)
            for key, values in settings.items():
                request.settings[key].value.extend(values)
            try:
                outcomes.append(json_format.MessageToDict(stub.TraceSetting(request, timeout=TIMEOUT_S)))
            except grpc.RpcError as error:
                outcomes.append((error.code(), error.details()))
    return outcomes


def test_grpc_settings_match_triton(servers: dict[str, ServerProcess]) -> None:
    outcomes = {}
    for name, server in servers.items():
        reset(server)
        outcomes[name] = grpc_sequence(server)
    for step, (transerve, triton) in enumerate(zip(outcomes["transerve"], outcomes["triton"], strict=True)):
        assert transerve == triton, GRPC_SEQUENCE[step]
    assert outcomes["transerve"][2] == (grpc.StatusCode.INVALID_ARGUMENT, "Request for unknown model : no_such_model")
    client = grpcclient.InferenceServerClient(servers["transerve"].grpc_url)
    try:  # tritonclient's own calls, as users make them
        settings = client.update_trace_settings(model_name="add_sub", settings={"trace_rate": "3"}, as_json=True)
        assert settings["settings"]["trace_rate"] == {"value": ["3"]}
        assert client.get_trace_settings(as_json=True)["settings"]["trace_rate"] == {"value": ["1"]}
        client.update_trace_settings(model_name="add_sub", settings={"trace_rate": None})
    finally:
        client.close()


def test_server_metadata_lists_trace_as_triton(servers: dict[str, ServerProcess]) -> None:
    """Named as Triton's clients expect; every extension transerve lists, Triton lists in the same order."""
    metadata = {name: requests.get(f"{server.base_url}/v2", timeout=TIMEOUT_S).json()
                for name, server in servers.items()}
    assert metadata["transerve"]["name"] == metadata["triton"]["name"] == "triton"
    ours = metadata["transerve"]["extensions"]
    assert "trace" in ours
    assert [name for name in metadata["triton"]["extensions"] if name in ours] == ours
    client = grpcclient.InferenceServerClient(servers["transerve"].grpc_url)
    try:
        answer = client.get_server_metadata()
    finally:
        client.close()
    assert answer.name == "triton" and list(answer.extensions) == ours


# --------------------------------------------------------------------------------------------- trace files


def run_requests(server: ServerProcess, traceparent: str | None = None) -> None:
    """add_sub and the text_pipeline ensemble, over HTTP then gRPC, one at a time."""
    headers = {"traceparent": traceparent} if traceparent else None
    http = httpclient.InferenceServerClient(server.http_url)
    rpc = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        for module, client in ((httpclient, http), (grpcclient, rpc)):
            values = np.arange(4, dtype=np.float32).reshape(1, 4)
            inputs = [module.InferInput(name, [1, 4], "FP32") for name in ("INPUT0", "INPUT1")]
            for tensor in inputs:
                tensor.set_data_from_numpy(values)
            # Headers over HTTP only: tritonclient.grpc fails to send any with this grpcio.
            extra = {"headers": headers} if module is httpclient else {}
            client.infer("add_sub", inputs, request_id=f"id-{module.__name__}", **extra)
            text = module.InferInput("input_text", [1, 1], "BYTES")
            text.set_data_from_numpy(np.array([[b"hi"]], dtype=np.object_))
            client.infer("text_pipeline", [text], **extra)
    finally:
        http.close()
        rpc.close()


def served_and_stopped(flags: tuple[str, ...], work: Callable[[ServerProcess], None]) -> dict[str, Any]:
    """Run `work` on both servers, stop them (which writes what the trace files still lack) and read each one's
    trace files (in its working folder, which goes with the server)."""
    with both(*flags) as pair:
        for server in pair.values():
            work(server)
        files = {}
        for name, server in pair.items():
            assert server.stop() == 0, server.log_tail()
            files[name] = read_traces(server.log_path.parent)
    return files


def test_trace_file_matches_triton() -> None:
    """Timestamps and tensors of plain and ensemble requests over both protocols, written to `file` at exit."""
    flags = ("--trace-config", "triton,file=trace.json", "--trace-config", "level=TIMESTAMPS",
             "--trace-config", "level=TENSORS", "--trace-config", "rate=1")
    files = served_and_stopped(flags, run_requests)
    assert list(files["transerve"]) == list(files["triton"]) == ["trace.json"]
    ours, theirs = summary(files["transerve"]["trace.json"]), summary(files["triton"]["trace.json"])
    assert ours == theirs
    assert [trace["header"]["model_name"] for _, trace in sorted(ours.items())] == [
        "add_sub", "text_pipeline", "byte_tokenizer", "token_stats", "add_sub", "text_pipeline", "byte_tokenizer",
        "token_stats"]
    assert ours[3]["header"]["parent_id"] == 2 and ours[1]["header"]["request_id"] == "id-tritonclient.http"
    assert ours[1]["stamps"]["HTTP_SEND_END"] == 1 and ours[5]["stamps"]["GRPC_SEND_END"] == 1


def test_count_and_log_frequency_match_triton() -> None:
    """count stops tracing after N sampled requests, log-frequency writes every N traces to `file.<n>`, rate samples
    every N-th request; a model's own rate samples that model's requests on their own."""
    flags = ("--trace-config", "triton,file=trace.json", "--trace-config", "level=TIMESTAMPS",
             "--trace-config", "rate=2", "--trace-config", "count=5", "--trace-config", "triton,log-frequency=2")

    def work(server: ServerProcess) -> None:
        run_requests(server)
        run_requests(server)
        url = setting_url(server, "add_sub")
        assert requests.post(url, json={"trace_rate": "1"}, timeout=TIMEOUT_S).json()["trace_count"] == "1"
        run_requests(server)

    files = {name: {file: sorted((e["id"], e["model_name"]) for e in entries if "model_name" in e)
                    for file, entries in written.items()}
             for name, written in served_and_stopped(flags, work).items()}
    assert files["transerve"] == files["triton"]
    # Two files of two traces; the model's own setting's one trace once its count ran out; the rest at exit.
    assert set(files["transerve"]) == {"trace.json.0", "trace.json.1", "trace.json.2", "trace.json.3"}


def test_propagated_context_is_not_a_trace_in_triton_mode(tmp_path: Path) -> None:
    """A traceparent header matters only to OpenTelemetry mode; with tracing off nothing is written."""
    with start_transerve(EXAMPLE_REPOSITORY, "--trace-config", f"triton,file={tmp_path / 'trace.json'}") as server:
        run_requests(server, "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
        assert requests.get(setting_url(server, ""), timeout=TIMEOUT_S).json()["trace_level"] == ["OFF"]
    assert not list(tmp_path.glob("trace.json*"))


# ------------------------------------------------------------------------------------------- OpenTelemetry

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


def test_opentelemetry_spans_match_triton() -> None:
    """Triton's spans for a plain model and an ensemble, continuing the client's trace context over HTTP; the
    settings as Triton shows them in this mode."""
    install = require_triton()
    receivers = {"triton": OtlpReceiver(), "transerve": OtlpReceiver()}
    trees, settings, resources = {}, {}, {}
    try:
        for name, start in (("triton", start_triton), ("transerve", start_transerve)):
            flags = ("--trace-config", "mode=opentelemetry", "--trace-config", "level=TIMESTAMPS",
                     "--trace-config", "rate=1", "--trace-config", f"opentelemetry,url={receivers[name].url}",
                     "--trace-config", "opentelemetry,resource=test.key=test.value",
                     "--trace-config", "opentelemetry,resource=second.key=2",
                     "--trace-config", "opentelemetry,bsp_schedule_delay=50")
            with start(EXAMPLE_REPOSITORY, *flags, **({"install": install} if name == "triton" else {})) as server:
                settings[name] = requests.get(setting_url(server, ""), timeout=TIMEOUT_S).text
                http = httpclient.InferenceServerClient(server.http_url)
                try:
                    text = httpclient.InferInput("input_text", [1, 1], "BYTES")
                    text.set_data_from_numpy(np.array([[b"hi"]], dtype=np.object_))
                    http.infer("text_pipeline", [text], request_id="r1",
                               headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
                    inputs = [httpclient.InferInput(n, [1, 4], "FP32") for n in ("INPUT0", "INPUT1")]
                    for tensor in inputs:
                        tensor.set_data_from_numpy(np.ones((1, 4), np.float32))
                    http.infer("add_sub", inputs)
                finally:
                    http.close()
                receivers[name].wait_for(9)
            spans = receivers[name].spans()
            client_span = next(span.parent_span_id for _, _, span in spans
                               if span.name == "InferRequest" and span.parent_span_id)
            trees[name] = span_tree(spans, client_span)
            # What identifies the SDK differs (C++ / Python; Python's adds a random service.instance.id).
            resources[name] = {(scope, key, value) for resource, scope, _ in spans for key, value in resource.items()
                               if not key.startswith("telemetry.sdk") and key != "service.instance.id"}
    finally:
        for receiver in receivers.values():
            receiver.close()
    assert settings["transerve"].replace(receivers["transerve"].url, "URL") == \
        settings["triton"].replace(receivers["triton"].url, "URL")
    assert trees["transerve"] == trees["triton"]
    assert resources["transerve"] == resources["triton"] == {
        ("triton-server", "service.name", "triton-inference-server"), ("triton-server", "test.key", "test.value"),
        ("triton-server", "second.key", "2")}
    assert settings["transerve"].count('"resource":') == 2  # listed twice, as given
    paths = [span[0] for span in trees["transerve"]]
    assert ("client", "InferRequest", "text_pipeline", "byte_tokenizer", "compute") in paths


def test_opentelemetry_refused_without_the_sdk(tmp_path: Path) -> None:
    """mode=opentelemetry without `transerve[trace]` installed fails at start, saying what to install."""
    script = (
        "import sys, importlib.abc\n"
        "class Hide(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'opentelemetry':\n"
        "            raise ImportError(name)\n"
        "sys.meta_path.insert(0, Hide())\n"
        "from transerve.cli import main\n"
        f"sys.exit(main(['serve', '--model-repository', {str(tmp_path)!r}, '--trace-config', 'mode=opentelemetry']))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            env={"PYTHONPATH": str(REPO_ROOT / "src"), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 1
    assert "pip install 'transerve[trace]'" in result.stderr


# -------------------------------------------------------------------------------------------- command line

BAD_FLAGS = [
    ["--trace-config", "level=FOO"],
    ["--trace-config", "rate=abc"],
    ["--trace-config", "rate=99999999999"],
    ["--trace-config", "count=x"],
    ["--trace-config", "mode=bogus"],
    ["--trace-config", "bogus,file=x"],
    ["--trace-config", ",file=x"],
    ["--trace-config", "level"],
    ["--trace-config", "level="],
    ["--trace-config", "triton,log-frequency=x"],
    ["--trace-config", "mode=opentelemetry", "--trace-config", "opentelemetry,bsp_max_queue_size=x"],
    ["--trace-rate", "x"],
    ["--trace-level", "FOO"],
    ["--trace-count", "99999999999"],
]


@pytest.mark.parametrize("flags", BAD_FLAGS, ids=[" ".join(flags) for flags in BAD_FLAGS])
def test_bad_flags_refused_with_tritons_words(flags: list[str], tmp_path: Path) -> None:
    install = require_triton()
    triton = subprocess.run([str(install.binary), f"--model-repository={tmp_path}", *flags], capture_output=True,
                            text=True, timeout=60, env=install.env())
    assert triton.returncode == 1
    expected = triton.stderr.strip().splitlines()[-2:]
    with pytest.raises(SystemExit) as refusal:
        options_from_args(build_parser().parse_args(["serve", "--model-repository", str(tmp_path), *flags]))
    message = str(refusal.value.code)
    assert message.startswith("transerve serve: ")
    assert message.removeprefix("transerve serve: ").splitlines() == expected


def test_good_flags_as_triton_reads_them() -> None:
    """Levels add up (OFF anywhere wins), numbers read as C++ reads them, the deprecated flags still work and
    --trace-config overrides them."""
    args = build_parser().parse_args([
        "serve", "--model-repository", ".", "--trace-level", "TIMESTAMPS", "--trace-rate", "5", "--trace-file", "a",
        "--trace-config", "level=tensors", "--trace-config", "rate=7x", "--trace-config", "count= -3",
        "--trace-config", "triton,file=b", "--trace-config", "triton,log-frequency=-1",
    ])
    trace = options_from_args(args).trace
    assert (trace.level, trace.rate, trace.count, trace.file, trace.log_frequency) == (3, 7, -3, "b", 2**32 - 1)
    off = build_parser().parse_args(["serve", "--model-repository", ".", "--trace-config", "level=TIMESTAMPS",
                                     "--trace-config", "level=OFF"])
    assert options_from_args(off).trace.level == 0
