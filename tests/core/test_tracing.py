"""The tracer without a server: C++'s number reading, tensors as Triton's trace shows them, sampling, and when a
setting's traces reach the file (the end-to-end comparisons with Triton are in tests/e2e/test_trace.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from transerve.core.datatypes import BF16
from transerve.core.errors import ServerError
from transerve.core.tracing import TraceOptions, Tracer
from transerve.core.tracing.extension import changes_from_grpc, changes_from_json
from transerve.core.tracing.options import TENSORS, TIMESTAMPS, OutOfRange, Unparsable, stoi, stoul32
from transerve.core.tracing.trace import tensor_fields
from transerve.core.tracing.tracer import CLEAR
from transerve.core.types import InferRequest, InferResponse, Tensor


@pytest.mark.parametrize(("text", "value"), [("12", 12), ("  -7", -7), ("+3x", 3), ("12abc", 12),
                                             ("2147483647", 2147483647), ("-2147483648", -(2**31)),
                                             ("000000000000000000001", 1)])
def test_stoi_reads_as_cpp(text: str, value: int) -> None:
    assert stoi(text) == value


@pytest.mark.parametrize(("text", "error"), [("", Unparsable), ("abc", Unparsable), ("- 1", Unparsable),
                                             ("2147483648", OutOfRange), ("9" * 5000, OutOfRange)])
def test_stoi_refuses_as_cpp(text: str, error: type[Exception]) -> None:
    with pytest.raises(error):
        stoi(text)


def test_stoul32_wraps_and_truncates() -> None:
    assert stoul32("-1") == 2**32 - 1
    assert stoul32(str(2**32 + 5)) == 5
    with pytest.raises(OutOfRange):
        stoul32(str(2**64))


def test_tensors_as_tritons_trace_shows_them() -> None:
    def fields(datatype: str, data: np.ndarray) -> dict[str, str]:
        return tensor_fields(Tensor("T", datatype, data))

    assert fields("FP32", np.array([[105.5, 0.0, 1e-7, 123456789.0]], np.float32)) == {
        "name": "T", "data": "105.5,0,1e-07,1.23457e+08", "shape": "1,4", "dtype": "FP32"}
    assert fields("BOOL", np.array([True, False]))["data"] == "1,0"
    assert fields("INT8", np.array([-1, 7], np.int8))["data"] == "-1,7"
    assert fields("UINT64", np.array([2**64 - 1], np.uint64))["data"] == "18446744073709551615"
    assert fields("BYTES", np.array([b"hi", b"a,b"], dtype=np.object_))["data"] == '"hi","a,b"'
    assert fields("FP16", np.ones(3, np.float16))["data"] == ""
    assert fields("BF16", np.ones(3, BF16))["data"] == ""


def test_update_changes_read_as_triton_reads_them() -> None:
    assert changes_from_json({"trace_level": ["TENSORS", "bogus", "TIMESTAMPS"], "trace_rate": "-1",
                              "trace_count": None, "log_frequency": "5x"}) == {
        "level": TIMESTAMPS | TENSORS, "rate": 2**32 - 1, "count": CLEAR, "log_frequency": 5}
    assert changes_from_json({"trace_level": ["bogus"]}) == {}
    assert changes_from_json(["trace_rate"]) == {}
    assert changes_from_grpc({"trace_level": [], "trace_rate": []}) == {"level": CLEAR, "rate": CLEAR}
    with pytest.raises(ServerError, match="got:-2$"):
        changes_from_json({"trace_count": "-2"})
    with pytest.raises(ServerError, match="got: -2$"):
        changes_from_grpc({"trace_count": ["-2"]})


def test_off_by_default_costs_one_check() -> None:
    tracer = Tracer(TraceOptions())
    assert tracer.active is False
    assert tracer.settings() == [("trace_level", ["OFF"]), ("trace_rate", "1000"), ("trace_count", "-1"),
                                 ("log_frequency", "0"), ("trace_file", ""), ("trace_mode", "triton")]


def traced(tracer: Tracer, model: str = "m") -> bool:
    """One request through the tracer as a frontend and the core would take it; whether it was traced."""
    request = InferRequest(model, [Tensor("IN", "INT32", np.array([1, 2], np.int32))], id="r")
    trace = tracer.start(request)
    if trace is None:
        return False
    request.trace.started(model, "1", request.id, request.inputs)
    request.trace.compute_started(1)
    request.trace.compute_ended(0, 0)
    request.trace.ended(InferResponse(model, "1", [Tensor("OUT", "FP32", np.array([0.5], np.float32))]))
    trace.finish()
    return True


def options(path: Path, **values: object) -> TraceOptions:
    return TraceOptions(**{"level": TIMESTAMPS, "rate": 1, "file": str(path), **values})  # type: ignore[arg-type]


def test_rate_and_count(tmp_path: Path) -> None:
    tracer = Tracer(options(tmp_path / "t.json", rate=3, count=2))
    assert [traced(tracer) for _ in range(9)] == [False, False, True, False, False, True, False, False, False]
    assert dict(tracer.settings())["trace_count"] == "0"
    tracer.close()
    assert [entry["id"] for entry in json.loads((tmp_path / "t.json").read_text()) if "model_name" in entry] == [1, 2]
    # With every request sampled, the last trace of the count is the last request: Triton then writes the traces to
    # an indexed file at once.
    tracer = Tracer(options(tmp_path / "u.json", count=2))
    assert [traced(tracer) for _ in range(3)] == [True, True, False]
    tracer.close()
    assert [entry["id"] for entry in json.loads((tmp_path / "u.json.0").read_text()) if "model_name" in entry] == [1, 2]
    assert not (tmp_path / "u.json").exists()


def test_log_frequency_and_exit(tmp_path: Path) -> None:
    tracer = Tracer(options(tmp_path / "t.json", log_frequency=2, level=TIMESTAMPS | TENSORS))
    for _ in range(5):
        traced(tracer)
    tracer.close()
    files = {path.name: json.loads(path.read_text()) for path in tmp_path.iterdir()}
    assert sorted(files) == ["t.json.0", "t.json.1", "t.json.2"]
    assert [len([e for e in entries if "model_name" in e]) for _, entries in sorted(files.items())] == [2, 2, 1]
    first = files["t.json.0"][:8]
    assert [entry.get("timestamps", [{}])[0].get("name") or entry.get("activity") or "header" for entry in first] == [
        "header", "REQUEST_START", "QUEUE_START", "TENSOR_QUEUE_INPUT", "COMPUTE_START", "COMPUTE_INPUT_END",
        "COMPUTE_OUTPUT_START", "COMPUTE_END"]
    assert files["t.json.0"][3]["tensor"] == {"name": "IN", "data": "1,2", "shape": "2", "dtype": "INT32"}


def test_replaced_setting_writes_when_its_last_trace_ends(tmp_path: Path) -> None:
    """An update replaces the setting; what was sampled under the old one still reaches the file once its last
    trace is done, and the file is one JSON array, closed at exit."""
    tracer = Tracer(options(tmp_path / "t.json"))
    assert traced(tracer)
    request = InferRequest("m", [])
    running = tracer.start(request)
    assert running is not None
    request.trace.started("m", "1", "", [])
    tracer.update("", {"rate": 2})
    request.trace.ended(None)
    running.finish()
    assert [traced(tracer) for _ in range(2)] == [False, True]
    tracer.close()
    entries = json.loads((tmp_path / "t.json").read_text())
    assert [entry["id"] for entry in entries if "model_name" in entry] == [1, 2, 3]


def test_model_settings_fall_back_field_by_field(tmp_path: Path) -> None:
    tracer = Tracer(options(tmp_path / "t.json"), model_ready=lambda name: name == "m")
    tracer.update("m", {"rate": 5})
    tracer.update("", {"level": TIMESTAMPS | TENSORS, "rate": 7})
    assert dict(tracer.settings("m"))["trace_rate"] == "5"
    assert dict(tracer.settings("m"))["trace_level"] == ["TIMESTAMPS", "TENSORS"]
    tracer.update("m", {"rate": CLEAR})
    assert dict(tracer.settings("m"))["trace_rate"] == "7"
    assert "m" not in tracer._models  # nothing of its own left
    tracer.update("", {"level": CLEAR, "rate": CLEAR})
    assert dict(tracer.settings())["trace_rate"] == "1"
    with pytest.raises(ServerError, match="Request for unknown model : other"):
        tracer.settings("other")
    with pytest.raises(ServerError, match="Attempting to set invalid trace setting :sample rate must be non-zero"):
        tracer.update("", {"rate": 0})
    tracer.update("", {"level": 0})
    assert tracer.active is False


def test_kept_traces_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Clients can turn tracing on with log_frequency 0 (save at exit): what waits in memory is bounded, saved
    early to the same file, which ends up as it would have."""
    monkeypatch.setattr("transerve.core.tracing.settings.MAX_KEPT_CHARS", 2000)
    tracer = Tracer(options(tmp_path / "t.json"))
    for _ in range(5):
        traced(tracer)
    assert tracer._global._kept_chars <= 2000
    tracer.close()
    entries = json.loads((tmp_path / "t.json").read_text())
    assert [entry["id"] for entry in entries if "model_name" in entry] == [1, 2, 3, 4, 5]


def test_trace_ending_after_exit_is_dropped(tmp_path: Path) -> None:
    tracer = Tracer(options(tmp_path / "t.json"))
    request = InferRequest("m", [])
    late = tracer.start(request)
    assert late is not None
    tracer.close()
    late.finish()
    tracer.update("", {"rate": 3})  # replaces (and retires) the setting after exit: nothing is written
    assert not list(tmp_path.iterdir())


def test_bls_calls_join_running_requests_only(tmp_path: Path) -> None:
    """A BLS call names its caller's trace id: it becomes that request's child while the request runs, when the
    request is the calling model's; a model that is told its request's trace gets no context in Triton's mode."""
    tracer = Tracer(options(tmp_path / "t.json"))
    request = InferRequest("caller", [])
    trace = tracer.start(request)
    assert trace is not None and request.trace.for_model() == (1, None)
    assert tracer.bls_child(1, "caller") is None  # not started yet
    request.trace.started("caller", "1", "", [])
    assert tracer.bls_child(1, "other_model") is None
    child = tracer.bls_child(1, "caller")
    assert child is not None and (child.id, child.parent_id) == (2, 1)
    child.started("callee", "1", "", [])
    grandchild = tracer.bls_child(2, "callee")
    assert grandchild is not None and grandchild.parent_id == 2
    refused = tracer.bls_child(1, "caller")  # a call the core then refuses: an id spent, nothing written
    assert refused is not None and not refused.begun
    child.ended(None)
    request.trace.ended(None)
    assert tracer.bls_child(1, "caller") is None  # ended: later calls are not traced
    trace.finish()
    tracer.close()
    headers = [entry for entry in json.loads((tmp_path / "t.json").read_text()) if "model_name" in entry]
    assert headers == [{"id": 1, "model_name": "caller", "model_version": 1},
                       {"id": 2, "model_name": "callee", "model_version": 1, "parent_id": 1}]


def test_sampling_before_the_request_is_read(tmp_path: Path) -> None:
    """Generate requests are sampled by model name before their body is read; one that cannot be read still
    writes the frontend's stamps."""
    tracer = Tracer(options(tmp_path / "t.json", rate=2))
    assert tracer.sample("m") is None
    trace = tracer.sample("m")
    assert trace is not None
    trace.capture("HTTP_RECV_START", 5)
    trace.finish()
    tracer.close()
    assert json.loads((tmp_path / "t.json").read_text()) == [
        {"id": 1, "timestamps": [{"name": "HTTP_RECV_START", "ns": 5}]}]
