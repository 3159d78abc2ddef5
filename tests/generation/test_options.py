"""Request parameters and decoding tensors -> DecodingOptions, with FasterTransformer's semantics and clear 400s."""

from __future__ import annotations

import numpy as np
import pytest

from transerve.backends.generation.options import Limits, decoding_options, parameter_values, tensor_values
from transerve.core.errors import ErrorCode, ServerError

LIMITS = Limits(max_new_tokens=64, max_batch_rows=16, decoupled=False)
STREAMING = Limits(max_new_tokens=64, max_batch_rows=16, decoupled=True)


def options(parameters: dict, limits: Limits = LIMITS):
    return decoding_options(parameter_values(parameters), limits)


def refused(parameters: dict, limits: Limits = LIMITS) -> str:
    with pytest.raises(ServerError) as caught:
        options(parameters, limits)
    assert caught.value.code is ErrorCode.INVALID_ARG
    return caught.value.message


def test_defaults_decode_greedily_with_the_configs_length():
    decoded, stream = options({})
    assert (decoded.max_new_tokens, decoded.beam_width, decoded.num_return_sequences) == (64, 1, 1)
    assert not decoded.sampling and decoded.top_k == 0 and decoded.top_p == 1.0
    assert decoded.end_ids is None and not stream


def test_friendly_aliases_and_fastertransformer_names_set_the_same_options():
    friendly, _ = options({"max_tokens": 8, "top_k": 5, "top_p": 0.9, "seed": 7, "length_penalty": 0.5,
                           "min_new_tokens": 2, "stop": "[[4, 5], [9]]", "bad_words": "[3]"})
    ft, _ = options({"max_output_len": 8, "runtime_top_k": 5, "runtime_top_p": 0.9, "random_seed": 7,
                     "len_penalty": 0.5, "min_length": 2, "stop_words_list": "[[4, 5], [9]]",
                     "bad_words_list": "[[3]]"})
    assert friendly == ft
    assert friendly.max_new_tokens == 8 and friendly.random_seed == 7 and friendly.min_new_tokens == 2
    assert friendly.stop_sequences == [[4, 5], [9]] and friendly.bad_words == [[3]]
    assert friendly.sampling and friendly.top_k == 5 and friendly.top_p == 0.9


@pytest.mark.parametrize(
    ("parameters", "sampling", "top_k", "top_p"),
    [
        ({"top_k": 0, "top_p": 0.0}, False, 0, 1.0),  # both off: greedy
        ({"top_k": 1}, False, 0, 1.0),  # top-1 is greedy
        ({"temperature": 0.7}, False, 0, 1.0),  # temperature alone does not sample (as in FasterTransformer)
        ({"top_p": 1.0, "temperature": 0.7}, True, 0, 1.0),  # sampling from the whole distribution
        ({"top_k": 40}, True, 40, 1.0),
        ({"top_p": 0.5}, True, 0, 0.5),
        ({"top_k": 40, "beam_width": 4}, False, 0, 1.0),  # beam search ignores sampling options
    ],
)
def test_sampling_is_on_only_when_top_k_or_top_p_is(parameters, sampling, top_k, top_p):
    decoded, _ = options(parameters)
    assert (decoded.sampling, decoded.top_k, decoded.top_p) == (sampling, top_k, top_p)


def test_beam_search_returns_every_beam_unless_asked_for_fewer():
    assert options({"beam_width": 4})[0].num_return_sequences == 4
    assert options({"num_beams": 4, "num_return_sequences": 2})[0].num_return_sequences == 2


@pytest.mark.parametrize(
    ("parameters", "words"),
    [
        ({"beam_width": 0}, "beam_width must be at least 1, got 0"),
        ({"beam_width": -2}, "beam_width must be at least 1"),
        ({"beam_width": 17}, "above this model's max_batch_rows 16"),
        ({"beam_width": 2, "num_return_sequences": 3}, "num_return_sequences must lie in [1, beam_width 2]"),
        ({"top_p": 1.5}, "top_p must lie in (0, 1]"),
        ({"top_p": -0.1}, "top_p must lie in (0, 1]"),
        ({"temperature": 0}, "temperature must be above 0"),
        ({"top_k": -1}, "top_k must not be negative"),
        ({"max_tokens": 0}, "max_new_tokens must be at least 1"),
        ({"min_length": -1}, "min_length must not be negative"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be above 0"),
        ({"end_id": -3}, "end_id must not be negative"),
        ({"stream": True}, "this model is not decoupled"),
        ({"top_k": "5"}, "parameter 'top_k' must be an integer"),
        ({"top_k": True}, "parameter 'top_k' must be an integer"),
        ({"stream": 1}, "parameter 'stream' must be true or false"),
        ({"stop": "[[1, -2]]"}, "must be a list of token-id lists"),
        ({"stop": "not json"}, "must be a list of token-id lists"),
        ({"top_k": 3, "runtime_top_k": 4}, "'top_k' is given twice, as 'top_k' and as 'runtime_top_k'"),
    ],
)
def test_bad_options_are_invalid_arg_with_the_reason(parameters, words):
    assert words in refused(parameters)


def test_streaming_needs_beam_width_1_on_a_decoupled_model():
    assert options({"stream": True}, STREAMING)[1] is True
    assert "only beam_width 1 streams" in refused({"stream": True, "beam_width": 2}, STREAMING)


def test_an_unknown_parameter_is_refused_naming_the_known_ones():
    message = refused({"temprature": 0.5})
    assert "unknown decoding parameter 'temprature'" in message
    assert "temperature" in message and "max_tokens" in message and "runtime_top_k" in message


def test_protocol_parameters_are_not_decoding_options():
    values = parameter_values({"binary_data_output": True, "priority": 1, "timeout": 5, "sequence_id": 3,
                               "triton_enable_empty_final_response": True, "max_tokens": 4})
    assert values == {"max_new_tokens": 4}


def test_tensor_values_per_row_and_fastertransformer_word_lists():
    tensors = {
        "runtime_top_k": np.array([[1], [40]], np.uint32),
        "temperature": np.array([[1.0], [0.5]], np.float32),
        "return_log_probs": np.array([[False], [True]]),
        # row 0: words [5, 6] and [7]; row 1: word [8]
        "stop_words_list": np.array([[[5, 6, 7], [2, 3, -1]], [[8, 0, 0], [1, -1, -1]]], np.int32),
    }
    first, second = tensor_values(tensors, 0), tensor_values(tensors, 1)
    assert first == {"top_k": 1, "temperature": 1.0, "return_log_probs": False, "stop_words": [[5, 6], [7]]}
    assert second == {"top_k": 40, "temperature": 0.5, "return_log_probs": True, "stop_words": [[8]]}


def test_bad_word_offsets_are_refused():
    with pytest.raises(ServerError, match="bad word offset 5"):
        tensor_values({"bad_words_list": np.array([[[5, 6], [5, -1]]], np.int32)}, 0)
