"""Decoding options of one request row: from request parameters and optional input tensors to `DecodingOptions`.

Every option has one canonical name and the names clients know it by: FasterTransformer's tensor names
(`runtime_top_k`, `len_penalty`, `max_output_len`, ...) and friendly aliases (`top_k`, `length_penalty`,
`max_tokens`, ...). A request parameter that is neither one of these nor one the protocol itself defines is
refused with the list of known names, so a misspelt option never decodes silently with defaults.

FasterTransformer's semantics are kept: `top_k` 0 and `top_p` 0 mean "off", and decoding samples only when one of
them is on (`top_k` > 1, or `top_p` > 0); `temperature` alone does not turn sampling on.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from transerve.backends.generation.engine import (
    MAX_TOP_LOGPROBS,
    MAX_WORD_TOKENS,
    DecodingOptions,
    check_token_options,
    check_word_count,
)
from transerve.backends.generation.grammar.parameters import PARAMETERS as CONSTRAINT_PARAMETERS
from transerve.backends.generation.grammar.parameters import parameter_constraint
from transerve.core.errors import invalid_arg
from transerve.core.protocol_parameters import FRONTEND_PARAMETERS, SCHEDULING_PARAMETERS


@dataclass(frozen=True, slots=True)
class Option:
    """One decoding option: its kind (`int`, `float`, `bool`, `words`) and every name it is known by."""

    name: str
    kind: str
    #: Request parameter names, the canonical one first.
    parameters: tuple[str, ...]
    #: Input tensor names that carry it.
    tensors: tuple[str, ...] = ()


OPTIONS = (
    Option("max_new_tokens", "int", ("max_new_tokens", "max_tokens", "max_output_len", "request_output_len"),
           ("max_output_len", "REQUEST_OUTPUT_LEN", "request_output_len")),
    Option("min_new_tokens", "int", ("min_new_tokens", "min_length"), ("min_length",)),
    Option("beam_width", "int", ("beam_width", "num_beams"), ("beam_width",)),
    Option("num_return_sequences", "int", ("num_return_sequences",)),
    Option("length_penalty", "float", ("length_penalty", "len_penalty"), ("len_penalty",)),
    Option("temperature", "float", ("temperature",), ("temperature",)),
    Option("top_k", "int", ("top_k", "runtime_top_k"), ("runtime_top_k",)),
    Option("top_p", "float", ("top_p", "runtime_top_p"), ("runtime_top_p",)),
    Option("min_p", "float", ("min_p",)),
    Option("repetition_penalty", "float", ("repetition_penalty",), ("repetition_penalty",)),
    Option("random_seed", "int", ("random_seed", "seed"), ("random_seed",)),
    Option("end_id", "int", ("end_id",), ("end_id",)),
    Option("stop_words", "words", ("stop", "stop_words", "stop_words_list"), ("stop_words_list",)),
    Option("bad_words", "words", ("bad_words", "bad_words_list"), ("bad_words_list",)),
    Option("return_log_probs", "bool", ("return_log_probs",), ("return_log_probs", "is_return_log_probs")),
    Option("top_logprobs", "int", ("top_logprobs",)),
    Option("prompt_logprobs", "int", ("prompt_logprobs",)),
    Option("stream", "bool", ("stream",), ("stream",)),
    #: A structured output (grammar-constrained decoding): one of vLLM's and OpenAI's names for it.
    Option("constraint", "constraint", CONSTRAINT_PARAMETERS),
)

BY_PARAMETER = {name: option for option in OPTIONS for name in option.parameters}
BY_TENSOR = {name: option for option in OPTIONS for name in option.tensors}
#: Request parameters that belong to the protocol (consumed by the frontends or the scheduler), never options.
PROTOCOL_PARAMETERS = FRONTEND_PARAMETERS | SCHEDULING_PARAMETERS
#: The longest word-list parameter read: room for MAX_WORD_TOKENS ids of any size with their separators.
MAX_WORD_LIST_CHARS = 16 * MAX_WORD_TOKENS


def known_parameter_names() -> list[str]:
    return sorted(BY_PARAMETER)


def parameter_values(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """The decoding options a request's parameters set, by canonical name; INVALID_ARG for an unknown name,
    a value of the wrong type, or one option given twice under different names."""
    values: dict[str, Any] = {}
    given_as: dict[str, str] = {}
    for key, value in parameters.items():
        option = BY_PARAMETER.get(key)
        if option is None:
            if key in PROTOCOL_PARAMETERS or key.startswith("triton_"):
                continue
            raise invalid_arg(f"unknown decoding parameter '{key}'; the generation backend takes: "
                              f"{', '.join(known_parameter_names())}")
        if option.name in given_as:
            raise invalid_arg(f"decoding option '{option.name}' is given twice, as '{given_as[option.name]}' "
                              f"and as '{key}'")
        given_as[option.name] = key
        values[option.name] = _parameter_value(option, key, value)
    return values


def tensor_values(tensors: Mapping[str, np.ndarray], row: int) -> dict[str, Any]:
    """The decoding options one row of the request's optional input tensors sets, by canonical name.

    Scalars are `[batch, 1]`; word lists `[batch, 2, L]` in FasterTransformer's flattened format.
    """
    values: dict[str, Any] = {}
    for name, array in tensors.items():
        option = BY_TENSOR[name]
        if option.name in values:
            raise invalid_arg(f"decoding option '{option.name}' is given twice, by two input tensors")
        data = array[row]
        if option.kind == "words":
            values[option.name] = _flattened_words(name, data)
            continue
        if data.size != 1:
            raise invalid_arg(f"input '{name}' must hold one value per row, got {data.size}")
        item = data.reshape(-1)[0]
        if option.kind == "bool":
            values[option.name] = bool(item)
        elif option.kind == "int":
            values[option.name] = int(item)
        else:
            values[option.name] = float(item)
    return values


def _parameter_value(option: Option, key: str, value: Any) -> Any:
    if option.kind == "bool":
        if not isinstance(value, bool):
            raise invalid_arg(f"parameter '{key}' must be true or false, got {value!r}")
        return value
    if option.kind == "int":
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise invalid_arg(f"parameter '{key}' must be an integer, got {value!r}")
        return value
    if option.kind == "constraint":
        return parameter_constraint(key, value)
    if option.kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise invalid_arg(f"parameter '{key}' must be a number, got {value!r}")
        return float(value)
    return _word_list(key, value)


def _word_list(key: str, value: Any) -> list[list[int]]:
    """Token-id sequences, as a JSON string (request parameters are scalars) or a list: `[[12, 5], [7]]`. A string
    longer than the largest list it may hold is refused unread, and a list's ids are counted before they are read:
    the parse runs on the event loop."""
    if isinstance(value, str):
        if len(value) > MAX_WORD_LIST_CHARS:
            raise invalid_arg(f"parameter '{key}' has {len(value)} characters; a word list of at most "
                              f"{MAX_WORD_TOKENS} token ids takes at most {MAX_WORD_LIST_CHARS}")
        try:
            value = json.loads(value)
        except ValueError:
            value = None
    words = value if isinstance(value, list) else None
    if words is not None:
        check_word_count(key, len(words))
        held = sum(len(word) for word in words if isinstance(word, list))
        if held > MAX_WORD_TOKENS:
            raise invalid_arg(f"parameter '{key}' holds {held} token ids in all; at most {MAX_WORD_TOKENS} are taken")
    if words is not None and all(isinstance(word, int) and not isinstance(word, bool) for word in words):
        words = [[word] for word in words]  # a flat list: one single-token sequence per id
    if words is None or not all(
        isinstance(word, list) and word and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                for t in word)
        for word in words
    ):
        raise invalid_arg(f"parameter '{key}' must be a list of token-id lists, e.g. \"[[12, 5], [7]]\"")
    return words


def _flattened_words(name: str, data: np.ndarray) -> list[list[int]]:
    """FasterTransformer's `[2, L]` word list: row 0 the concatenated ids, row 1 each word's end offset, -1 padded."""
    if data.ndim != 2 or data.shape[0] != 2:
        raise invalid_arg(f"input '{name}' must be [batch, 2, L], got a row of shape {list(data.shape)}")
    if data.shape[1] > MAX_WORD_TOKENS:
        raise invalid_arg(f"input '{name}' holds {data.shape[1]} token ids per row; at most {MAX_WORD_TOKENS} are "
                          "taken")
    ids, offsets = data[0].tolist(), [int(o) for o in data[1].tolist() if o >= 0]
    check_word_count(name, len(offsets))
    words, start = [], 0
    for end in offsets:
        if not start < end <= len(ids) or any(t < 0 for t in ids[start:end]):
            raise invalid_arg(f"input '{name}' has a bad word offset {end} (offsets must increase, within "
                              f"{len(ids)} ids)")
        words.append([int(t) for t in ids[start:end]])
        start = end
    return words


@dataclass(frozen=True, slots=True)
class Limits:
    """What the model allows, from its config: the defaults and bounds requests are checked against."""

    max_new_tokens: int
    max_batch_rows: int
    decoupled: bool
    #: Token ids an option may name (bad and stop words, end ids): `[0, vocab_size)`; None: checked by the engine.
    vocab_size: int | None = None


def decoding_options(values: Mapping[str, Any], limits: Limits) -> tuple[DecodingOptions, bool]:
    """DecodingOptions and whether to stream, from one row's values (parameters, then tensors over them)."""
    beam_width = values.get("beam_width", 1)
    if beam_width < 1:
        raise invalid_arg(f"beam_width must be at least 1, got {beam_width}")
    if beam_width > limits.max_batch_rows:
        raise invalid_arg(f"beam_width {beam_width} is above this model's max_batch_rows {limits.max_batch_rows} "
                          "(each beam is a decoded row)")
    prompt_logprobs = values.get("prompt_logprobs")
    if prompt_logprobs is not None and not 0 <= prompt_logprobs <= MAX_TOP_LOGPROBS:
        raise invalid_arg(f"prompt_logprobs must lie in [0, {MAX_TOP_LOGPROBS}] (0: each prompt token's own "
                          f"log-probability only), got {prompt_logprobs}")
    max_new_tokens = values.get("max_new_tokens", limits.max_new_tokens)
    if max_new_tokens < (0 if prompt_logprobs is not None else 1):
        raise invalid_arg(f"max_new_tokens must be at least 1 (0 only with prompt_logprobs, to score the prompt), "
                          f"got {max_new_tokens}")
    min_new_tokens = values.get("min_new_tokens", 0)
    if min_new_tokens < 0:
        raise invalid_arg(f"min_length must not be negative, got {min_new_tokens}")
    top_k = values.get("top_k", 0)
    if top_k < 0:
        raise invalid_arg(f"top_k must not be negative (0 turns it off), got {top_k}")
    top_p = values.get("top_p", 0.0)
    if not 0.0 <= top_p <= 1.0:
        raise invalid_arg(f"top_p must lie in (0, 1], or be 0 to turn it off; got {top_p}")
    min_p = values.get("min_p", 0.0)
    if not 0.0 <= min_p <= 1.0:
        raise invalid_arg(f"min_p must lie in [0, 1] (0 turns it off), got {min_p}")
    temperature = values.get("temperature", 1.0)
    if not temperature > 0.0 or math.isinf(temperature):
        raise invalid_arg(f"temperature must be above 0, got {temperature}")
    repetition_penalty = values.get("repetition_penalty", 1.0)
    if not repetition_penalty > 0.0 or math.isinf(repetition_penalty):
        raise invalid_arg(f"repetition_penalty must be above 0, got {repetition_penalty}")
    length_penalty = values.get("length_penalty", 1.0)
    if not math.isfinite(length_penalty):
        raise invalid_arg(f"length_penalty must be a finite number, got {length_penalty}")
    seed = values.get("random_seed")
    if seed is not None and not 0 <= seed < 2**64:
        raise invalid_arg(f"random_seed must lie in [0, 2**64), got {seed}")
    end_id = values.get("end_id")
    if end_id is not None and end_id < 0:
        raise invalid_arg(f"end_id must not be negative, got {end_id}")
    sampling = beam_width == 1 and (top_k > 1 or top_p > 0.0)
    returned = values.get("num_return_sequences", beam_width)
    if not 1 <= returned <= beam_width:
        raise invalid_arg(f"num_return_sequences must lie in [1, beam_width {beam_width}], got {returned}")
    top_logprobs = values.get("top_logprobs", 0)
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise invalid_arg(f"top_logprobs must lie in [0, {MAX_TOP_LOGPROBS}] (0 turns it off), got {top_logprobs}")
    if top_logprobs and beam_width > 1:
        raise invalid_arg(f"top_logprobs {top_logprobs} with beam_width {beam_width}: the likeliest tokens are "
                          "reported for beam_width 1 only (greedy or sampling)")
    constraint = values.get("constraint")
    stream = values.get("stream", False)
    if stream and not limits.decoupled:
        raise invalid_arg("stream is true, but this model is not decoupled: streaming needs "
                          "'model_transaction_policy { decoupled: true }' in its config")
    if stream and beam_width > 1:
        raise invalid_arg(f"stream is true with beam_width {beam_width}: beams change until decoding ends, so only "
                          "beam_width 1 streams; set stream false for beam search")
    options = DecodingOptions(
        max_new_tokens=max_new_tokens,
        min_new_tokens=min_new_tokens,
        beam_width=beam_width,
        num_return_sequences=returned,
        length_penalty=length_penalty,
        sampling=sampling,
        temperature=temperature,
        top_k=top_k if sampling else 0,
        top_p=top_p if sampling and top_p > 0.0 else 1.0,
        min_p=min_p if sampling else 0.0,
        repetition_penalty=repetition_penalty,
        random_seed=seed,
        end_ids=[end_id] if end_id is not None else None,
        stop_sequences=values.get("stop_words", []),
        bad_words=values.get("bad_words", []),
        return_log_probs=values.get("return_log_probs", False) or top_logprobs > 0,
        top_logprobs=top_logprobs,
        constraint=constraint,
        prompt_logprobs=prompt_logprobs,
    )
    if limits.vocab_size is not None:
        check_token_options(options, limits.vocab_size)
    return options, stream
