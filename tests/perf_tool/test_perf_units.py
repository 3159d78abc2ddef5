"""transerve perf's pieces without a server: ranges, shapes, perf_analyzer's JSON data, batching of steps,
percentiles, the stability rule and the statistics deltas."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from transerve.perf.inputs import ModelSpec, batches, model_spec, read_data_file, synthetic_step
from transerve.perf.measure import LevelResult, ServerStats, is_stable, percentile_of, server_stats
from transerve.perf.options import MAX_LEVELS, PerfError, concurrency_levels, parse_range, parse_shape

METADATA = {"inputs": [{"name": "IDS", "datatype": "INT32", "shape": [-1, -1]},
                       {"name": "TEXT", "datatype": "BYTES", "shape": [-1, 1]},
                       {"name": "MASK", "datatype": "BOOL", "shape": [-1, 2]}],
            "outputs": [{"name": "OUT", "datatype": "FP32", "shape": [-1, 1]}]}
CONFIG = {"max_batch_size": 4, "input": [{"name": "MASK", "optional": True}]}


def spec() -> ModelSpec:
    return model_spec(METADATA, CONFIG)


def test_ranges_are_perf_analyzers_start_end_step():
    assert parse_range("2", "--concurrency-range", integer=True) == (2,)
    assert parse_range("1:7:3", "--concurrency-range", integer=True) == (1, 4, 7)
    assert parse_range("10:30:10", "--request-rate-range", integer=False) == (10.0, 20.0, 30.0)
    assert parse_range("0.5:1", "--request-rate-range", integer=False) == (0.5,)  # step 1 from 0.5 passes 1
    for bad in ("", "1:", "1:2:3:4", "x", "3:1", "0:4", "1:4:0"):
        with pytest.raises(PerfError):
            parse_range(bad, "--concurrency-range", integer=True)


def test_perf_analyzers_older_concurrency_flags_and_open_ends():
    assert concurrency_levels(1, 5) == (1, 2, 3, 4, 5)  # -t1 -c5
    assert concurrency_levels(3, 1) == (3,)  # -t3 alone: perf_analyzer's search runs its first level
    assert concurrency_levels(2, 0) == tuple(range(2, 2 + MAX_LEVELS))  # -c 0: no limit but the bounds
    assert concurrency_levels(250, 0) == tuple(range(250, 257))  # concurrency up to 256
    assert parse_range("1:0:2", "--concurrency-range", integer=True, open_end=True)[:3] == (1, 3, 5)
    assert parse_range("10:0:10", "--request-rate-range", integer=False, open_end=True)[-1] == 10.0 * MAX_LEVELS
    for start, end in ((0, 5), (1, -1), (1, 300), (1, 100)):
        with pytest.raises(PerfError):
            concurrency_levels(start, end)
    with pytest.raises(PerfError, match="end at least start"):
        parse_range("1:0", "--concurrency-range", integer=True)  # END 0 only with a latency limit


def test_random_integers_are_valid_ids_masks_and_token_types():
    metadata = {"inputs": [{"name": name, "datatype": "INT64", "shape": [-1, -1]}
                           for name in ("input_ids", "attention_mask", "token_type_ids")], "outputs": []}
    step = synthetic_step(model_spec(metadata, {"max_batch_size": 8}),
                          {name: [128] for name in ("input_ids", "attention_mask", "token_type_ids")}, "random", None)
    for array in step.values():
        assert array.dtype == np.int64 and set(np.unique(array)) == {0, 1}


def test_shapes():
    assert parse_shape("IDS:3,5") == ("IDS", [3, 5])
    assert parse_shape("a:b:7") == ("a:b", [7])
    for bad in ("IDS", "IDS:", "IDS:-1", "IDS:1,,2", ":3"):
        with pytest.raises(PerfError):
            parse_shape(bad)


def test_model_spec_reads_grpc_strings_and_optional_inputs():
    grpc_metadata = {"inputs": [{"name": "X", "datatype": "FP32", "shape": ["-1", "4"]}], "outputs": []}
    assert model_spec(grpc_metadata, {"max_batch_size": 8}).inputs[0].dims == [4]
    assert model_spec(grpc_metadata, {}).inputs[0].dims == [-1, 4]  # max_batch_size 0 is left out of gRPC's JSON
    assert [entry.optional for entry in spec().inputs] == [False, False, True]


def test_synthetic_steps_leave_optional_inputs_out_unless_shaped():
    step = synthetic_step(spec(), {"IDS": [3]}, "random", None)
    assert set(step) == {"IDS", "TEXT"} and step["IDS"].shape == (3,) and step["IDS"].dtype == np.int32
    zero = synthetic_step(spec(), {"IDS": [2], "MASK": [2]}, "zero", "hi")
    assert zero["IDS"].tolist() == [0, 0] and zero["TEXT"].tolist() == [b"hi"] and zero["MASK"].dtype == np.bool_
    with pytest.raises(PerfError, match="give it with --shape IDS:N"):
        synthetic_step(spec(), {}, "random", None)
    with pytest.raises(PerfError, match="more than"):
        synthetic_step(spec(), {"IDS": [10**9]}, "random", None)


def test_json_data_steps(tmp_path):
    path = tmp_path / "data.json"
    path.write_text(json.dumps({"data": [
        {"IDS": {"content": [1, 2, 3, 4], "shape": [4]}, "TEXT": ["é"]},
        {"IDS": {"b64": base64.b64encode(np.array([7, 8, 9, 10], "<i4").tobytes()).decode()},
         "TEXT": {"content": {"b64": base64.b64encode(b"\x00raw").decode()}, "shape": [1]},
         "MASK": [[True, False]]},
    ]}))
    steps = read_data_file(path, spec(), {})
    assert steps[0]["IDS"].tolist() == [1, 2, 3, 4] and steps[0]["TEXT"].tolist() == ["é".encode()]
    assert steps[1]["IDS"].tolist() == [7, 8, 9, 10] and steps[1]["TEXT"].tolist() == [b"\x00raw"]
    assert "MASK" not in steps[0] and steps[1]["MASK"].tolist() == [True, False]
    path.write_text(json.dumps({"data": [{"IDS": [1], "TEXT": ["a"], "MASK": {"content": [1, 0], "shape": [1, 2]}}]}))
    with pytest.raises(PerfError, match=r"shape \[1, 2\] does not fit dims \[2\]"):
        read_data_file(path, spec(), {})


def test_batches_stack_consecutive_steps_and_wrap():
    steps = [{"IDS": np.array([i, i], np.int32), "TEXT": np.array([b"t"], np.object_)} for i in range(3)]
    requests = batches(steps, spec(), 2)
    assert len(requests) == 3
    assert requests[2]["IDS"][1].tolist() == [[2, 2], [0, 0]] and requests[2]["IDS"][0] == "INT32"
    unbatched = ModelSpec(spec().inputs, [], 0)
    assert batches(steps, unbatched, 1)[1]["IDS"][1].shape == (2,)
    steps[1]["IDS"] = np.array([1, 1, 1], np.int32)
    with pytest.raises(PerfError, match="same shapes"):
        batches(steps, spec(), 2)


def test_nearest_rank_percentiles():
    values = list(range(1, 101))
    assert [percentile_of(values, p) for p in (50, 90, 95, 99)] == [50, 90, 95, 99]
    assert percentile_of([5], 99) == 5


def _result(throughput: float, latency: float) -> LevelResult:
    return LevelResult(1, 10, throughput, latency, 0, {95: latency * 2}, 0, 0, 0, ServerStats(), True)


def test_stability_is_every_window_within_the_percentage_of_the_mean():
    assert is_stable([_result(100, 10), _result(104, 10.5), _result(98, 9.8)], 10, None)
    assert not is_stable([_result(100, 10), _result(130, 10), _result(100, 10)], 10, None)
    assert not is_stable([_result(100, 10), _result(100, 10), _result(100, 14)], 10, 95)
    assert is_stable([_result(100, 10), _result(130, 10), _result(100, 10)], 50, None)


def test_server_stats_sum_a_models_versions_from_http_or_grpc_json():
    document = {"model_stats": [
        {"name": "m", "version": "1", "inference_count": 4, "execution_count": 2,
         "inference_stats": {"success": {"count": 2, "ns": 2000}, "queue": {"count": 2, "ns": 200}}},
        {"name": "m", "version": "2", "inference_count": "1", "execution_count": "1",
         "inference_stats": {"success": {"count": "1", "ns": "900"}, "compute_infer": {"count": "1", "ns": "700"}}},
        {"name": "other", "inference_count": 99},
    ]}
    stats = server_stats(document, "m")
    assert (stats.success_count, stats.success_ns, stats.inference_count, stats.execution_count) == (3, 2900, 5, 3)
    assert stats.parts_ns == {"queue": 200, "compute_input": 0, "compute_infer": 700, "compute_output": 0}
    delta = stats.minus(server_stats({"model_stats": [document["model_stats"][0]]}, "m"))
    assert delta.success_count == 1 and delta.parts_ns["compute_infer"] == 700
