"""Triton's auto-complete and load checks against a model file's tensors (no engine needed)."""

from __future__ import annotations

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from transerve.backends.autocomplete import ModelTensor, auto_complete, check
from transerve.config.model_config import ConfigError

INPUTS = [ModelTensor("ids", "TYPE_INT64", (-1, -1)), ModelTensor("mask", "TYPE_INT64", (-1, -1))]
OUTPUTS = [ModelTensor("states", "TYPE_FP32", (-1, -1, 8))]


def config(text: str = "") -> model_config_pb2.ModelConfig:
    return text_format.Parse('name: "m"\n' + text, model_config_pb2.ModelConfig())


def io(config: model_config_pb2.ModelConfig) -> list[tuple[str, str, list[int]]]:
    tensors = [*config.input, *config.output]
    return [(t.name, model_config_pb2.DataType.Name(t.data_type), list(t.dims)) for t in tensors]


def test_an_empty_config_gets_everything_and_batching():
    completed = config()
    auto_complete(completed, INPUTS, OUTPUTS)
    assert completed.max_batch_size == 4
    assert completed.HasField("dynamic_batching")
    assert io(completed) == [
        ("ids", "TYPE_INT64", [-1]), ("mask", "TYPE_INT64", [-1]), ("states", "TYPE_FP32", [-1, 8])]
    check(completed, INPUTS, OUTPUTS)


def test_what_the_config_says_is_kept():
    completed = config('max_batch_size: 16 sequence_batching { } input [ { name: "mask" dims: [ 7 ] } ]')
    auto_complete(completed, INPUTS, OUTPUTS)
    assert completed.max_batch_size == 16 and not completed.HasField("dynamic_batching")
    assert io(completed)[0] == ("mask", "TYPE_INT64", [7])


def test_full_shapes_in_the_config_mean_no_batching():
    completed = config('input [ { name: "ids" data_type: TYPE_INT64 dims: [ -1, -1 ] } ]')
    auto_complete(completed, INPUTS, OUTPUTS)
    assert completed.max_batch_size == 0 and not completed.HasField("dynamic_batching")
    assert io(completed)[1] == ("mask", "TYPE_INT64", [-1, -1])


def test_a_model_without_a_batch_axis_gets_no_batching():
    fixed = [ModelTensor("x", "TYPE_FP32", (3, 4))]
    completed = config()
    auto_complete(completed, fixed, fixed)
    assert completed.max_batch_size == 0 and io(completed)[0] == ("x", "TYPE_FP32", [3, 4])
    with pytest.raises(ConfigError, match="the first dimension must be -1"):
        check(config('max_batch_size: 2 input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]'), fixed, [])


def test_the_default_batch_size_comes_from_the_backend():
    completed = config()
    auto_complete(completed, INPUTS, OUTPUTS, default_max_batch_size=32)
    assert completed.max_batch_size == 32


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('input [ { name: "ids" data_type: TYPE_INT32 dims: [ -1, -1 ] } ]',
         "unexpected datatype TYPE_INT32 for input 'ids', model provides TYPE_INT64"),
        ('output [ { name: "logits" data_type: TYPE_FP32 dims: [ 2 ] } ]',
         "unexpected inference output 'logits', allowed outputs are: states"),
        ('input [ { name: "ids" data_type: TYPE_INT64 dims: [ -1 ] } ]',
         "the model expects shape [-1, -1] but the model configuration specifies [-1]"),
        ('input [ { name: "ids" data_type: TYPE_INT64 dims: [ -1, -1 ] } ]',
         "configuration expects 1 inputs, model provides 2"),
    ],
)
def test_a_config_that_does_not_fit_the_model_is_refused(text: str, message: str):
    with pytest.raises(ConfigError) as caught:
        check(config(text), INPUTS, OUTPUTS)
    assert message in str(caught.value)
