"""The tensors a generation model speaks: FasterTransformer's names, in either of its two generations.

- FasterTransformer (the later names): `input_ids` `[batch, L]` and `sequence_length` `[batch, 1]` in;
  `output_ids` `[batch, beams, T]`, `sequence_length` `[batch, beams]`, and optionally `cum_log_probs`,
  `output_log_probs`, `prefix_length`, and the likeliest tokens of each step, `output_top_ids` and
  `output_top_log_probs` `[batch, beams, T, k]` (transerve's own, for `top_logprobs`), out.
- Its first names, which the seed client uses: `INPUT_ID` and `REQUEST_INPUT_LEN` in; `OUTPUT0` (ids) and
  `OUTPUT1` (lengths) out.
- Its GPT model's names: `input_ids` and `input_lengths` in (`request_output_len` for the new tokens); the later
  names' outputs, and `response_input_lengths` (each row's input length) among them.

FasterTransformer's scalar inputs may be declared `dims: [1]` with `reshape: { shape: [] }`, as its configs do. A
caller may also pass inputs with no effect here (`Inert`): FasterTransformer's own (`beam_search_diversity_rate`,
prompt-learning tensors, ...) are accepted in a config, and a request may send them at their neutral value only.

Both take the optional decoding tensors of `options.BY_TENSOR` (`beam_width`, `runtime_top_k`, ...). Each row of
the batch axis is one sequence to generate; a response stacks the rows back, zero-padded to the longest.
Decoder-only models' output ids start with the prompt, as FasterTransformer's GPT returns them, and
`prefix_length` says how many leading ids the client already has (the prompt, and in a stream what earlier
responses carried), so a detokenizer turns only the rest into text.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
from tritonclient.grpc import model_config_pb2

from transerve.backends.generation.engine import PromptScores, TopLogProbs
from transerve.backends.generation.options import BY_TENSOR
from transerve.core.datatypes import NUMPY_DTYPES, config_to_protocol
from transerve.core.errors import invalid_arg
from transerve.core.types import InferRequest, Tensor

INTEGERS = frozenset({"UINT32", "INT32", "INT64", "UINT64"})
FLOATS = frozenset({"FP32", "FP64"})
_OPTION_RULES = {
    "int": (INTEGERS, (1,)),
    "float": (FLOATS, (1,)),
    "bool": (frozenset({"BOOL"}), (1,)),
    "words": (frozenset({"INT32", "INT64"}), (2, -1)),
}
#: Option tensors FasterTransformer declares with other dims than `[1]` (its GPT config's `request_output_len`,
#: and `REQUEST_OUTPUT_LEN` as fastertransformer_backend dev/v1.1_beta's configs may declare it).
_OPTION_DIMS = {"request_output_len": (-1,), "REQUEST_OUTPUT_LEN": (-1,)}


@dataclass(frozen=True, slots=True)
class Names:
    """One generation of FasterTransformer's tensor names."""

    title: str
    ids: str
    lengths: str
    output_ids: str
    output_lengths: str
    cum_log_probs: str | None = None
    output_log_probs: str | None = None
    prefix_length: str | None = None
    top_ids: str | None = None
    top_log_probs: str | None = None
    #: Each row's input length, per beam (FasterTransformer GPT's `response_input_lengths`).
    input_lengths: str | None = None
    #: transerve's own: the prompt's tokens scored (`prompt_logprobs`): `[batch, L - 1]`, and each position's
    #: likeliest tokens `[batch, L - 1, k]`.
    prompt_log_probs: str | None = None
    prompt_top_ids: str | None = None
    prompt_top_log_probs: str | None = None
    #: Each scored prompt token's rank in its position's distribution, `[batch, L - 1]`.
    prompt_ranks: str | None = None

    def outputs(self) -> dict[str, tuple[frozenset[str], tuple[int, ...]]]:
        rules = {self.output_ids: (INTEGERS, (-1, -1)), self.output_lengths: (INTEGERS, (-1,))}
        if self.cum_log_probs:
            rules[self.cum_log_probs] = (frozenset({"FP32"}), (-1,))
        if self.output_log_probs:
            rules[self.output_log_probs] = (frozenset({"FP32"}), (-1, -1))
        if self.prefix_length:
            rules[self.prefix_length] = (INTEGERS, (-1,))
        if self.top_ids:
            rules[self.top_ids] = (INTEGERS, (-1, -1, -1))
        if self.top_log_probs:
            rules[self.top_log_probs] = (frozenset({"FP32"}), (-1, -1, -1))
        if self.input_lengths:
            rules[self.input_lengths] = (INTEGERS, (-1,))
        if self.prompt_log_probs:
            rules[self.prompt_log_probs] = (frozenset({"FP32"}), (-1,))
        if self.prompt_top_ids:
            rules[self.prompt_top_ids] = (INTEGERS, (-1, -1))
        if self.prompt_top_log_probs:
            rules[self.prompt_top_log_probs] = (frozenset({"FP32"}), (-1, -1))
        if self.prompt_ranks:
            rules[self.prompt_ranks] = (INTEGERS, (-1,))
        return rules

    @property
    def prompt_outputs(self) -> tuple[str, ...]:
        return tuple(n for n in (self.prompt_log_probs, self.prompt_top_ids, self.prompt_top_log_probs,
                                 self.prompt_ranks) if n)


_PROMPT_OUTPUTS = {name: name for name in ("prompt_log_probs", "prompt_top_ids", "prompt_top_log_probs",
                                            "prompt_ranks")}
FASTERTRANSFORMER = Names("FasterTransformer", "input_ids", "sequence_length", "output_ids", "sequence_length",
                          "cum_log_probs", "output_log_probs", "prefix_length", "output_top_ids",
                          "output_top_log_probs", **_PROMPT_OUTPUTS)
FASTERTRANSFORMER_V1 = Names("FasterTransformer (first names)", "INPUT_ID", "REQUEST_INPUT_LEN", "OUTPUT0", "OUTPUT1")
FASTERTRANSFORMER_GPT = Names("FasterTransformer GPT", "input_ids", "input_lengths", "output_ids", "sequence_length",
                              "cum_log_probs", "output_log_probs", "prefix_length", "output_top_ids",
                              "output_top_log_probs", "response_input_lengths", **_PROMPT_OUTPUTS)


#: `Inert.neutral` for an input whose every value is neutral.
ANY = object()


@dataclass(frozen=True, slots=True)
class Inert:
    """An input with no effect here: a request may send it only at `neutral` (`ANY`: any value; None: not at all),
    so that a client relying on another value is refused rather than answered as if it had not sent it."""

    what: str
    neutral: object = None


@dataclass(slots=True)
class Row:
    """One sequence of a request: its token ids (trimmed to its length) and its decoding tensors' values."""

    input_ids: list[int]
    index: int


@dataclass(slots=True)
class RowResult:
    """What one row produced so far: per returned sequence its output ids (prompt first for decoder-only models)."""

    sequences: list[list[int]]
    #: Per sequence: how many leading ids of it the client already has.
    prefix: list[int]
    scores: list[float] | None = None
    #: Per sequence: log-probabilities of its generated tokens.
    log_probs: list[list[float]] | None = None
    #: Per sequence: each generated token's likeliest tokens (`top_logprobs`).
    top: list[list[TopLogProbs]] | None = None
    #: The row's input length.
    input_length: int = 0
    #: The prompt's scores (`prompt_logprobs`), once known.
    prompt: PromptScores | None = None


def _datatype(tensor: model_config_pb2.ModelInput | model_config_pb2.ModelOutput) -> str:
    return config_to_protocol(model_config_pb2.DataType.Name(tensor.data_type))


def _dims(tensor: model_config_pb2.ModelInput | model_config_pb2.ModelOutput) -> tuple[int, ...]:
    return tuple(tensor.reshape.shape) if tensor.HasField("reshape") else tuple(tensor.dims)


class TensorInterface:
    """A config's inputs and outputs, checked once at load, and the conversions of requests and responses."""

    def __init__(self, config: model_config_pb2.ModelConfig, inert: Mapping[str, Inert] | None = None,
                 inert_outputs: frozenset[str] = frozenset()) -> None:
        inputs = {tensor.name: tensor for tensor in config.input}
        #: Declared inputs with no effect here, and the neutral value a request may send each at.
        self.inert = {name: rule for name, rule in (inert or {}).items() if name in inputs}
        if FASTERTRANSFORMER_GPT.ids in inputs and FASTERTRANSFORMER_GPT.lengths in inputs:
            self.names = FASTERTRANSFORMER_GPT
        elif FASTERTRANSFORMER.ids in inputs:
            self.names = FASTERTRANSFORMER
        elif FASTERTRANSFORMER_V1.ids in inputs:
            self.names = FASTERTRANSFORMER_V1
        else:
            raise invalid_arg(
                "a generation model's inputs are FasterTransformer's: 'input_ids' and 'sequence_length', or "
                f"'INPUT_ID' and 'REQUEST_INPUT_LEN'; this config has {sorted(inputs) or 'none'}"
            )
        if config.max_batch_size < 1:
            raise invalid_arg("a generation model needs max_batch_size >= 1: each row of the batch axis is a sequence")
        names = self.names
        rules = {names.ids: (INTEGERS, (-1,)), names.lengths: (INTEGERS, (1,))}
        rules.update({name: _OPTION_RULES[option.kind] for name, option in BY_TENSOR.items()})
        #: fastertransformer_backend dev/v1.1_beta's configs: T5's `REQUEST_INPUT_LEN` `[-1]`, GPT's `INPUT_ID`
        #: `[-1, -1]` (`[batch, 1, L]` requests).
        other_dims = {FASTERTRANSFORMER_V1.ids: (-1, -1), FASTERTRANSFORMER_V1.lengths: (-1,)} if (
            names is FASTERTRANSFORMER_V1) else {}
        for name, tensor in inputs.items():
            if name in self.inert:
                continue
            if name not in rules:
                raise invalid_arg(f"input '{name}' is not one the generation backend knows; with {names.title} "
                                  f"names it takes: {', '.join(rules)}")
            datatypes, dims = rules[name]
            _check(f"input '{name}'", tensor, datatypes, dims, other_dims.get(name) or _OPTION_DIMS.get(name))
        #: The decoding options' input tensors this config declares.
        self.option_inputs = frozenset(name for name in inputs if name in BY_TENSOR)
        outputs = {tensor.name: tensor for tensor in config.output if tensor.name not in inert_outputs}
        #: Declared outputs never produced here: a request naming one is refused.
        self.inert_outputs = frozenset(tensor.name for tensor in config.output) - set(outputs)
        output_rules = names.outputs()
        if names.output_ids not in outputs:
            raise invalid_arg(f"a generation model with {names.title} names must declare output '{names.output_ids}'")
        for name, tensor in outputs.items():
            if name not in output_rules:
                raise invalid_arg(f"output '{name}' is not one the generation backend produces; with {names.title} "
                                  f"names it produces: {', '.join(output_rules)}")
            _check(f"output '{name}'", tensor, *output_rules[name])
        #: Declared outputs in config order: name -> (datatype, numpy dtype).
        self.outputs = {name: (_datatype(t), NUMPY_DTYPES[_datatype(t)]) for name, t in outputs.items()}
        self.log_prob_outputs = frozenset(n for n in (names.cum_log_probs, names.output_log_probs) if n in outputs)
        self.top_outputs = frozenset(n for n in (names.top_ids, names.top_log_probs) if n in outputs)
        self.prompt_outputs = frozenset(n for n in names.prompt_outputs if n in outputs)

    # ---- requests -------------------------------------------------------------------------------------------

    def rows(self, request: InferRequest) -> tuple[list[Row], dict[str, np.ndarray]]:
        """The request's rows, and its decoding tensors by name (one value per row)."""
        tensors = {tensor.name: tensor.data for tensor in request.inputs}
        ids = tensors[self.names.ids]
        lengths = tensors.get(self.names.lengths)
        if ids.ndim == 3 and ids.shape[1] == 1:  # dev/v1.1_beta's GPT config: [batch, 1, length]
            ids = ids[:, 0, :]
        if ids.ndim != 2:
            raise invalid_arg(f"input '{self.names.ids}' must be [batch, length] (or [batch, 1, length]), got shape "
                              f"{list(ids.shape)}")
        if ids.size and ids.dtype.kind == "i" and ids.min() < 0:
            raise invalid_arg(f"input '{self.names.ids}' holds a negative token id")
        rows = []
        for index in range(ids.shape[0]):
            if lengths is not None and lengths[index].size != 1:
                raise invalid_arg(f"row {index}: '{self.names.lengths}' must hold one value per row, got "
                                  f"{lengths[index].size}")
            length = ids.shape[1] if lengths is None else int(lengths[index].reshape(-1)[0])
            if not 0 <= length <= ids.shape[1]:
                raise invalid_arg(f"row {index}: '{self.names.lengths}' is {length}, but '{self.names.ids}' holds "
                                  f"{ids.shape[1]} ids per row")
            rows.append(Row(ids[index, :length].tolist(), index))
        for name, rule in self.inert.items():
            if name in tensors:
                _check_inert(name, rule, tensors[name])
        options = {name: array for name, array in tensors.items() if name in self.option_inputs}
        return rows, options

    def wanted(self, request: InferRequest, log_probs: bool, top: bool = False, prompt: bool = False) -> list[str]:
        """The outputs to produce, in config order: those asked for, else all but log-probabilities unless asked
        (`log_probs`), the top ones only when `top_logprobs` was asked (`top`), and the prompt's scores only when
        `prompt_logprobs` was asked (`prompt`), in the last response (the scores come with the result)."""
        if request.outputs is not None:
            asked = {output.name for output in request.outputs}
            if asked & self.inert_outputs:
                raise invalid_arg(f"output '{sorted(asked & self.inert_outputs)[0]}' is declared by this model's "
                                  "config, but transerve does not produce it")
            return [name for name in self.outputs if name in asked and (prompt or name not in self.prompt_outputs)]
        return [name for name in self.outputs if (log_probs or name not in self.log_prob_outputs)
                and (top or name not in self.top_outputs) and (prompt or name not in self.prompt_outputs)]

    def asks_prompt_scores(self, request: InferRequest) -> bool:
        """Whether the client named a prompt-score output (which turns `prompt_logprobs` on)."""
        return request.outputs is not None and any(o.name in self.prompt_outputs for o in request.outputs)

    def check_prompt_outputs(self, top: int) -> None:
        """INVALID_ARG unless the config declares the prompt-score outputs a `prompt_logprobs` request needs."""
        needed = [self.names.prompt_log_probs] + ([self.names.prompt_top_ids, self.names.prompt_top_log_probs]
                                                  if top else [])
        missing = [name for name in needed if name not in self.prompt_outputs]
        if missing:
            raise invalid_arg(f"prompt_logprobs needs the output(s) {', '.join(map(repr, missing))}, which this "
                              f"model's config ({self.names.title} names) does not declare (docs/generation.md)")

    def asks_log_probs(self, request: InferRequest) -> bool:
        """Whether the client named a log-probability output (which turns `return_log_probs` on)."""
        named = self.log_prob_outputs | self.top_outputs
        return request.outputs is not None and any(o.name in named for o in request.outputs)

    def check_top_outputs(self) -> None:
        """INVALID_ARG unless the config declares both top outputs: a request asking `top_logprobs` > 0 could
        not be answered with what it asked for."""
        if len(self.top_outputs) < 2:
            raise invalid_arg("top_logprobs needs the outputs 'output_top_ids' and 'output_top_log_probs' (dims "
                              f"[-1, -1, -1]), which this model's config ({self.names.title} names) does not declare")

    # ---- responses ------------------------------------------------------------------------------------------

    def response_tensors(self, results: list[RowResult], wanted: Iterable[str]) -> list[Tensor]:
        """The rows stacked: `[batch, beams, T]` ids zero-padded, `[batch, beams]` lengths, and so on."""
        names = self.names
        beams = max((len(result.sequences) for result in results), default=0)
        tensors = []
        for name in wanted:
            datatype, dtype = self.outputs[name]
            if name == names.output_ids:
                width = max((len(s) for result in results for s in result.sequences), default=0)
                array = np.zeros((len(results), beams, width), dtype)
                for row, result in enumerate(results):
                    for beam, sequence in enumerate(result.sequences):
                        array[row, beam, :len(sequence)] = sequence
            elif name == names.output_lengths:
                array = _per_beam(results, beams, dtype, lambda result: [len(s) for s in result.sequences])
            elif name == names.prefix_length:
                array = _per_beam(results, beams, dtype, lambda result: result.prefix)
            elif name == names.input_lengths:
                array = _per_beam(results, beams, dtype, lambda result: [result.input_length] * len(result.sequences))
            elif name == names.cum_log_probs:
                array = _per_beam(results, beams, dtype, lambda result: result.scores or [])
            elif name in (names.top_ids, names.top_log_probs):
                array = _top_array(results, beams, dtype, ids=name == names.top_ids)
            elif name in self.prompt_outputs:
                array = _prompt_array(results, dtype, name, names)
            else:  # output_log_probs
                width = max((len(p) for result in results for p in result.log_probs or ()), default=0)
                array = np.zeros((len(results), beams, width), dtype)
                for row, result in enumerate(results):
                    for beam, probs in enumerate(result.log_probs or ()):
                        array[row, beam, :len(probs)] = probs
            tensors.append(Tensor(name, datatype, array))
        return tensors


def _per_beam(results: list[RowResult], beams: int, dtype: np.dtype, values) -> np.ndarray:
    array = np.zeros((len(results), beams), dtype)
    for row, result in enumerate(results):
        row_values = values(result)
        array[row, :len(row_values)] = row_values
    return array


def _top_array(results: list[RowResult], beams: int, dtype: np.dtype, ids: bool) -> np.ndarray:
    """`[batch, beams, T, k]` of the top lists' ids or log-probabilities, zero-padded."""
    tops = [top for result in results for top in result.top or ()]
    width = max((len(top) for top in tops), default=0)
    k = max((len(step) for top in tops for step in top), default=0)
    array = np.zeros((len(results), beams, width, k), dtype)
    part = 0 if ids else 1
    for row, result in enumerate(results):
        for beam, top in enumerate(result.top or ()):
            for t, step in enumerate(top):
                array[row, beam, t, :len(step)] = [pair[part] for pair in step]
    return array


def _prompt_array(results: list[RowResult], dtype: np.dtype, name: str, names: Names) -> np.ndarray:
    """`[batch, L - 1]` prompt log-probabilities or ranks, or `[batch, L - 1, k]` of their top lists' ids or
    values, zero-padded."""
    prompts = [result.prompt for result in results]
    width = max((len(p.log_probs) for p in prompts if p is not None), default=0)
    if name in (names.prompt_log_probs, names.prompt_ranks):
        array = np.zeros((len(results), width), dtype)
        for row, prompt in enumerate(prompts):
            if prompt is not None:
                values = prompt.log_probs if name == names.prompt_log_probs else prompt.ranks
                array[row, :len(values)] = values
        return array
    k = max((len(step) for p in prompts if p is not None for step in p.top), default=0)
    array = np.zeros((len(results), width, k), dtype)
    part = 0 if name == names.prompt_top_ids else 1
    for row, prompt in enumerate(prompts):
        for t, step in enumerate(prompt.top if prompt is not None else ()):
            array[row, t, :len(step)] = [pair[part] for pair in step]
    return array


def _check_inert(name: str, rule: Inert, values: np.ndarray) -> None:
    if rule.neutral is ANY:
        return
    if rule.neutral is None:
        raise invalid_arg(f"input '{name}' ({rule.what}) is not supported by transerve; leave it out")
    if values.size and not np.all(values == rule.neutral):
        raise invalid_arg(f"input '{name}' ({rule.what}) is not supported by transerve; send {rule.neutral} or "
                          "leave it out")


def _check(where: str, tensor, datatypes: frozenset[str], dims: tuple[int, ...],
           other_dims: tuple[int, ...] | None = None) -> None:
    """The tensor's type and dims (`dims`, or `other_dims`); `[1]` dims may be reshaped to `[]` (FasterTransformer's
    configs do)."""
    datatype = _datatype(tensor)
    if datatype not in datatypes:
        raise invalid_arg(f"{where} is {datatype}; the generation backend takes {' or '.join(sorted(datatypes))}")
    declared = tuple(tensor.dims)
    reshaped = _dims(tensor)
    allowed = [list(d) for d in (dims, other_dims) if d is not None]
    if declared not in (dims, other_dims) or (reshaped != declared and not (declared == (1,) and reshaped == ())):
        shown = list(reshaped) if reshaped == declared else f"{list(declared)} (reshaped to {list(reshaped)})"
        raise invalid_arg(f"{where} has dims {shown}; the generation backend takes "
                          f"{' or '.join(str(d) for d in allowed)}")
