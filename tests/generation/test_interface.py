"""FasterTransformer's tensor names (both generations): config checks, request rows, stacked responses."""

from __future__ import annotations

import numpy as np
import pytest

from transerve.backends.generation.interface import RowResult, TensorInterface
from transerve.config.model_config import parse_config_text
from transerve.core.errors import ErrorCode, ServerError
from transerve.core.types import InferRequest, RequestedOutput, Tensor

FT_CONFIG = """
name: "gen"
backend: "generation"
max_batch_size: 8
input [
  { name: "input_ids" data_type: TYPE_UINT32 dims: [ -1 ] },
  { name: "sequence_length" data_type: TYPE_UINT32 dims: [ 1 ] },
  { name: "beam_width" data_type: TYPE_UINT32 dims: [ 1 ] optional: true },
  { name: "runtime_top_p" data_type: TYPE_FP32 dims: [ 1 ] optional: true },
  { name: "stop_words_list" data_type: TYPE_INT32 dims: [ 2, -1 ] optional: true }
]
output [
  { name: "output_ids" data_type: TYPE_UINT32 dims: [ -1, -1 ] },
  { name: "sequence_length" data_type: TYPE_UINT32 dims: [ -1 ] },
  { name: "cum_log_probs" data_type: TYPE_FP32 dims: [ -1 ] },
  { name: "prefix_length" data_type: TYPE_UINT32 dims: [ -1 ] }
]
"""

SEED_CONFIG = """
name: "fastertransformer"
backend: "generation"
max_batch_size: 8
input [
  { name: "INPUT_ID" data_type: TYPE_UINT32 dims: [ -1 ] },
  { name: "REQUEST_INPUT_LEN" data_type: TYPE_UINT32 dims: [ 1 ] },
  { name: "REQUEST_OUTPUT_LEN" data_type: TYPE_UINT32 dims: [ 1 ] optional: true }
]
output [
  { name: "OUTPUT0" data_type: TYPE_UINT32 dims: [ -1, -1 ] },
  { name: "OUTPUT1" data_type: TYPE_UINT32 dims: [ -1 ] }
]
"""


def interface(text: str) -> TensorInterface:
    return TensorInterface(parse_config_text(text))


def refused(text: str) -> str:
    with pytest.raises(ServerError) as caught:
        interface(text)
    assert caught.value.code is ErrorCode.INVALID_ARG
    return caught.value.message


def test_the_two_generations_of_names_are_recognised():
    assert interface(FT_CONFIG).names.output_ids == "output_ids"
    assert interface(FT_CONFIG).option_inputs == {"beam_width", "runtime_top_p", "stop_words_list"}
    seed = interface(SEED_CONFIG)
    assert (seed.names.ids, seed.names.output_ids, seed.names.output_lengths) == ("INPUT_ID", "OUTPUT0", "OUTPUT1")
    assert seed.option_inputs == {"REQUEST_OUTPUT_LEN"}


def test_integer_inputs_may_be_int32_or_int64():
    text = FT_CONFIG.replace('"input_ids" data_type: TYPE_UINT32', '"input_ids" data_type: TYPE_INT64')
    assert interface(text.replace("TYPE_UINT32 dims: [ 1 ] optional", "TYPE_INT32 dims: [ 1 ] optional"))


def test_an_unknown_input_is_refused_naming_the_supported_ones():
    message = refused(FT_CONFIG.replace('"runtime_top_p"', '"top_p_runtime"'))
    assert "input 'top_p_runtime' is not one the generation backend knows" in message
    assert "runtime_top_p" in message and "beam_width" in message and "input_ids" in message


def test_configs_without_generation_inputs_or_with_wrong_types_are_refused():
    assert "'input_ids' and 'sequence_length', or 'INPUT_ID'" in refused(
        FT_CONFIG.replace('"input_ids"', '"tokens"'))
    assert "the generation backend takes FP32 or FP64" in refused(
        FT_CONFIG.replace("runtime_top_p\" data_type: TYPE_FP32", "runtime_top_p\" data_type: TYPE_INT32"))
    assert "has dims [-1]; the generation backend takes [-1, -1]" in refused(
        FT_CONFIG.replace('"output_ids" data_type: TYPE_UINT32 dims: [ -1, -1 ]',
                          '"output_ids" data_type: TYPE_UINT32 dims: [ -1 ]'))
    assert "must declare output 'OUTPUT0'" in refused(
        SEED_CONFIG.replace('{ name: "OUTPUT0" data_type: TYPE_UINT32 dims: [ -1, -1 ] },', ""))
    assert "max_batch_size >= 1" in refused(FT_CONFIG.replace("max_batch_size: 8", "max_batch_size: 0"))


def test_rows_are_trimmed_to_their_lengths():
    request = InferRequest("fastertransformer", [
        Tensor("INPUT_ID", "UINT32", np.array([[5, 6, 7, 1], [8, 1, 0, 0]], np.uint32)),
        Tensor("REQUEST_INPUT_LEN", "UINT32", np.array([[4], [2]], np.uint32)),
        Tensor("REQUEST_OUTPUT_LEN", "UINT32", np.array([[10], [20]], np.uint32)),
    ])
    rows, tensors = interface(SEED_CONFIG).rows(request)
    assert [row.input_ids for row in rows] == [[5, 6, 7, 1], [8, 1]]
    assert list(tensors) == ["REQUEST_OUTPUT_LEN"]


def test_a_length_beyond_the_ids_sent_is_refused():
    request = InferRequest("fastertransformer", [
        Tensor("INPUT_ID", "UINT32", np.array([[5, 6]], np.uint32)),
        Tensor("REQUEST_INPUT_LEN", "UINT32", np.array([[3]], np.uint32)),
    ])
    with pytest.raises(ServerError, match="'REQUEST_INPUT_LEN' is 3, but 'INPUT_ID' holds 2 ids per row"):
        interface(SEED_CONFIG).rows(request)


def test_responses_stack_rows_zero_padded_to_the_longest():
    ft = interface(FT_CONFIG)
    results = [
        RowResult(sequences=[[5, 6, 7], [5, 9]], prefix=[0, 0], scores=[-1.0, -2.5]),
        RowResult(sequences=[[4]], prefix=[0], scores=[-0.5]),
    ]
    tensors = {t.name: t for t in ft.response_tensors(results, ft.wanted(InferRequest("gen", []), log_probs=True))}
    assert list(tensors) == ["output_ids", "sequence_length", "cum_log_probs", "prefix_length"]
    assert tensors["output_ids"].data.tolist() == [[[5, 6, 7], [5, 9, 0]], [[4, 0, 0], [0, 0, 0]]]
    assert tensors["output_ids"].data.dtype == np.uint32
    assert tensors["sequence_length"].data.tolist() == [[3, 2], [1, 0]]
    assert tensors["cum_log_probs"].data.tolist() == [[-1.0, -2.5], [-0.5, 0.0]]


def test_log_probability_outputs_come_when_asked_for():
    ft = interface(FT_CONFIG)
    assert "cum_log_probs" not in ft.wanted(InferRequest("gen", []), log_probs=False)
    request = InferRequest("gen", [], outputs=[RequestedOutput("output_ids"), RequestedOutput("cum_log_probs")])
    assert ft.asks_log_probs(request)
    assert ft.wanted(request, log_probs=False) == ["output_ids", "cum_log_probs"]


def test_without_lengths_each_row_is_taken_whole():
    ft = interface(FT_CONFIG.replace('{ name: "sequence_length" data_type: TYPE_UINT32 dims: [ 1 ] },',
                                     '{ name: "sequence_length" data_type: TYPE_UINT32 dims: [ 1 ] optional: true },'))
    request = InferRequest("gen", [Tensor("input_ids", "UINT32", np.array([[5, 6, 7]], np.uint32))])
    rows, tensors = ft.rows(request)
    assert [row.input_ids for row in rows] == [[5, 6, 7]] and tensors == {}


def test_negative_token_ids_are_refused():
    text = FT_CONFIG.replace('"input_ids" data_type: TYPE_UINT32', '"input_ids" data_type: TYPE_INT32')
    request = InferRequest("gen", [Tensor("input_ids", "INT32", np.array([[5, -6]], np.int32)),
                                   Tensor("sequence_length", "UINT32", np.array([[2]], np.uint32))])
    with pytest.raises(ServerError, match="negative token id"):
        interface(text).rows(request)
