"""model_warmup samples: the data they carry, how often and where they run, and Triton's wording on failure."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from transerve.backends.base import BackendInstance, ExecutionResult
from transerve.config.model_config import normalize, parse_config_text
from transerve.core.datatypes import serialize_bytes
from transerve.core.errors import ErrorCode, ServerError
from transerve.core.types import InferRequest, InferResponse
from transerve.scheduling.warmup import warm_up


class Recorder(BackendInstance):
    def __init__(self, name: str, error: str = "") -> None:
        self.name = name
        self.error = error
        self.calls: list[list[InferRequest]] = []

    async def execute(self, requests: list[InferRequest]) -> ExecutionResult:
        self.calls.append(requests)
        if self.error:
            return ExecutionResult([ServerError(ErrorCode.INTERNAL, self.error)] * len(requests))
        return ExecutionResult([InferResponse("m", "1", []) for _ in requests])

    async def close(self) -> None:
        pass


def config(warmup: str, max_batch_size: int = 4):
    text = f"""
    name: "m" backend: "python" max_batch_size: {max_batch_size}
    input [ {{ name: "IDS" data_type: TYPE_INT32 dims: [ -1 ] }},
            {{ name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] }} ]
    model_warmup [ {warmup} ]
    """
    parsed = parse_config_text(text)
    normalize(parsed, "m")
    return parsed


def sample(inputs: str, batch_size: int = 1, count: int = 0, name: str = "s") -> str:
    return f'{{ name: "{name}" batch_size: {batch_size} count: {count} {inputs} }}'


def ids(kind: str, dims: str = "3") -> str:
    return f'inputs {{ key: "IDS" value: {{ data_type: TYPE_INT32 dims: [ {dims} ] {kind} }} }}'


TEXT_ZERO = 'inputs { key: "TEXT" value: { data_type: TYPE_STRING dims: [ 1 ] zero_data: true } }'


def warm(cfg, path: Path, *instances: Recorder) -> None:
    asyncio.run(warm_up("m", cfg, path, list(instances)))


def tensors(request: InferRequest) -> dict[str, np.ndarray]:
    return {tensor.name: tensor.data for tensor in request.inputs}


def test_every_instance_runs_every_sample_count_times_in_order(tmp_path):
    first, second = Recorder("m_0"), Recorder("m_1")
    cfg = config(sample(ids("zero_data: true") + TEXT_ZERO, batch_size=3, count=2, name="a") + ", "
                 + sample(ids("random_data: true"), name="b"))
    warm(cfg, tmp_path, first, second)
    for instance in (first, second):
        assert [len(call) for call in instance.calls] == [3, 3, 1]
        data = tensors(instance.calls[0][0])
        assert data["IDS"].tolist() == [[0, 0, 0]] and data["IDS"].dtype == np.int32
        assert data["TEXT"].tolist() == [[b""]]
        assert tensors(instance.calls[2][0])["IDS"].shape == (1, 3)


def test_a_sample_of_batch_size_0_is_skipped_and_no_samples_run_nothing(tmp_path):
    instance = Recorder("m_0")
    warm(config(sample(ids("zero_data: true"), batch_size=0)), tmp_path, instance)
    warm(config(""), tmp_path, instance)
    assert instance.calls == []


def test_data_files_from_the_warmup_folder(tmp_path):
    (tmp_path / "warmup").mkdir()
    (tmp_path / "warmup" / "ids").write_bytes(np.array([7, 8, 9, 10], np.int32).tobytes())
    (tmp_path / "warmup" / "text").write_bytes(serialize_bytes(np.array([b"hello"], object)))
    instance = Recorder("m_0")
    text = 'inputs { key: "TEXT" value: { data_type: TYPE_STRING dims: [ 1 ] input_data_file: "text" } }'
    warm(config(sample(ids('input_data_file: "ids"') + text)), tmp_path, instance)
    data = tensors(instance.calls[0][0])
    assert data["IDS"].tolist() == [[7, 8, 9]] and data["TEXT"].tolist() == [[b"hello"]]


def test_a_model_without_batching_gets_the_dims_as_they_are(tmp_path):
    instance = Recorder("m_0")
    warm(config(sample(ids("zero_data: true", "2, 2")), max_batch_size=0), tmp_path, instance)
    assert tensors(instance.calls[0][0])["IDS"].shape == (2, 2)


def test_inputs_the_config_does_not_declare_keep_their_shape(tmp_path):
    instance = Recorder("m_0")
    control = 'inputs { key: "START" value: { data_type: TYPE_INT32 dims: [ 1 ] zero_data: true } }'
    warm(config(sample(ids("zero_data: true") + control)), tmp_path, instance)
    assert tensors(instance.calls[0][0])["START"].shape == (1,)


@pytest.mark.parametrize(
    ("warmup", "message"),
    [
        (sample(ids("zero_data: true", "-1")), "warmup setting expects all variable-size dimensions are specified "
                                               "for input 'IDS'"),
        (sample(ids('input_data_file: "short"')), "warmup setting expects 12 bytes, but the data provided from short "
                                                  "only has 4 bytes"),
        (sample(ids('input_data_file: "missing"')), "failed to read warmup data file"),
        (sample(ids('input_data_file: "../config.pbtxt"')), "input_data_file '../config.pbtxt' points outside the "
                                                            "folder 'warmup'"),
        (sample(ids('input_data_file: "/etc/hostname"')), "must be a relative path inside the folder 'warmup'"),
        (sample(ids('input_data_file: "escape"')), "leads outside the folder 'warmup' through a symbolic link"),
        (sample(ids("")), "warmup setting expects input 'IDS' to have input_data_type set"),
    ],
)
def test_bad_samples_fail_the_load(tmp_path, warmup, message):
    (tmp_path / "warmup").mkdir()
    (tmp_path / "warmup" / "short").write_bytes(b"1234")
    (tmp_path / "warmup" / "escape").symlink_to(tmp_path / "config.pbtxt")
    with pytest.raises(ServerError) as caught:
        warm(config(warmup), tmp_path, Recorder("m_0"))
    assert caught.value.code is ErrorCode.INVALID_ARG and message in caught.value.message


def test_a_failing_sample_fails_with_tritons_wording(tmp_path):
    instance = Recorder("m_0", error="boom")
    with pytest.raises(ServerError) as caught:
        warm(config(sample(ids("zero_data: true"), batch_size=2, count=5, name="zeros")), tmp_path, instance)
    assert caught.value.code is ErrorCode.INVALID_ARG
    assert caught.value.message == "failed to run warmup sample 'zeros': boom; boom; "
    assert len(instance.calls) == 1  # the first failure ends the warmup
