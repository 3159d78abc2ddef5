"""How LightSeq decodes, as the generation engine's options, and its output tensors from the engine's results.

Transformer: `source_ids` [batch, length] (rows padded with `src_padding_id`) -> `target_ids` [batch, 1, steps]
(no start token, rows padded with the end token) and `target_scores` [batch, 1] (the best hypothesis' score).
Beam search decodes `beam_size` beams for at most min(max_step, length + extra_decode_length) - 1 tokens; topk/topp
sample one sequence up to max_step - 1 tokens. Gpt: `token_ids` [batch, length] -> `result` [batch, steps]: each
prompt followed by its new tokens, up to min(max_step, length + extra_decode_length) tokens in all (max_step when
extra_decode_length is 0), rows padded with the end token; topk 1 is greedy. `length` is the batch's padded length,
as in LightSeq: every row of a request gets the same budget.

Beam search is the engine's, which ranks finished hypotheses as transformers does (log-probability over
length ** length_penalty); LightSeq uses GNMT's ((5 + length) / 6) ** length_penalty. They agree at length_penalty 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from tritonclient.grpc import model_config_pb2

from transerve.backends.generation.engine import DecodingOptions, GenerationResult, Hypothesis
from transerve.backends.lightseq.weights import FormatError, LightSeqWeights
from transerve.core.datatypes import NUMPY_DTYPES, config_to_protocol

TRANSFORMER_METHODS = ("beam_search", "topk", "topp", "topk_greedy")
GPT_METHODS = ("topk", "topp")


@dataclass(frozen=True, slots=True)
class Decoding:
    """One model's decoding, fixed by its file's model_conf."""

    model_type: str
    input_name: str
    pad_id: int
    end_id: int
    max_step: int
    extra_decode_length: int
    sampling_method: str
    beam_size: int = 1
    length_penalty: float = 1.0
    top_k: int = 1
    top_p: float = 1.0

    def prompt(self, row: np.ndarray) -> list[int]:
        """A row without its trailing padding."""
        length = len(row)
        while length and row[length - 1] == self.pad_id:
            length -= 1
        return [int(token) for token in row[:length]]

    def options(self, length: int, batch_length: int) -> DecodingOptions | None:
        """The engine's options for a prompt of `length` tokens in a batch padded to `batch_length`; None when
        LightSeq would generate nothing (a Gpt prompt already `max_step` long)."""
        if self.model_type == "Transformer":
            if self.sampling_method == "beam_search":
                limit = min(self.max_step, batch_length + self.extra_decode_length) - 1
                return DecodingOptions(max_new_tokens=max(limit, 1), beam_width=self.beam_size,
                                       length_penalty=self.length_penalty, end_ids=[self.end_id])
            return self._sampled(self.max_step - 1)
        total = self.max_step if self.extra_decode_length <= 0 else min(self.max_step,
                                                                       batch_length + self.extra_decode_length)
        return self._sampled(total - length) if total > length else None

    def _sampled(self, max_new_tokens: int) -> DecodingOptions:
        greedy = self.sampling_method == "topk_greedy" or (self.sampling_method == "topk" and self.top_k == 1)
        if greedy:
            return DecodingOptions(max_new_tokens=max_new_tokens, end_ids=[self.end_id])
        if self.sampling_method == "topk":
            return DecodingOptions(max_new_tokens=max_new_tokens, sampling=True, top_k=self.top_k,
                                   end_ids=[self.end_id])
        return DecodingOptions(max_new_tokens=max_new_tokens, sampling=True, top_p=self.top_p, end_ids=[self.end_id])

    def outputs(self, prompts: list[list[int]], results: list[GenerationResult | None]) -> dict[str, np.ndarray]:
        """LightSeq's output tensors for a request's rows (a None result: nothing generated)."""
        best = [result.hypotheses[0] if result is not None and result.hypotheses else Hypothesis([])
                for result in results]
        if self.model_type == "Transformer":
            rows = [hypothesis.token_ids for hypothesis in best]
            ids = _padded(rows, self.end_id)[:, None, :]
            scores = np.array([[hypothesis.score] for hypothesis in best], np.float32)
            return {"target_ids": ids, "target_scores": scores}
        rows = [prompt + hypothesis.token_ids for prompt, hypothesis in zip(prompts, best, strict=True)]
        return {"result": _padded(rows, self.end_id)}


def _padded(rows: list[list[int]], pad: int) -> np.ndarray:
    width = max((len(row) for row in rows), default=0)
    array = np.full((len(rows), width), pad, np.int32)
    for index, row in enumerate(rows):
        array[index, :len(row)] = row
    return array


def decoding(weights: LightSeqWeights, max_step: int) -> Decoding:
    """The decoding `weights`' model_conf asks for, or FormatError for one LightSeq has but transerve does not
    serve (Gpt's `ppl`, diverse beam search)."""
    conf = weights.conf
    method = str(conf.get("sampling_method") or ("beam_search" if weights.model_type == "Transformer" else "topk"))
    top_k = int(conf.get("topk") or 1)
    top_p = float(conf.get("topp") or 0.0)
    if weights.model_type == "Transformer":
        if method not in TRANSFORMER_METHODS:
            raise FormatError(f"sampling_method '{method}' is not one of {', '.join(TRANSFORMER_METHODS)}")
        if float(conf.get("diverse_lambda") or 0.0) != 0.0:
            raise FormatError("diverse beam search (diverse_lambda) is not served")
        return Decoding(
            "Transformer", "source_ids", int(conf.get("src_padding_id", 0)), int(conf.get("trg_end_id", 0)),
            max_step, int(conf.get("extra_decode_length", 0)), method,
            beam_size=1 if method != "beam_search" else max(int(conf.get("beam_size") or 1), 1),
            length_penalty=float(conf.get("length_penalty", 1.0)), top_k=top_k, top_p=top_p or 1.0,
        )
    if method not in GPT_METHODS:
        raise FormatError(f"Gpt sampling_method '{method}' is not served (only {', '.join(GPT_METHODS)}; "
                          "'ppl' scores sequences and is not generation)")
    return Decoding("Gpt", "token_ids", int(conf.get("src_padding_id", 0)), int(conf.get("eos_id", 0)), max_step,
                    int(conf.get("extra_decode_length", 0)), method, top_k=top_k, top_p=top_p or 1.0)


def output_types(config: model_config_pb2.ModelConfig) -> dict[str, tuple[str, Any]]:
    """The config's outputs: name -> (datatype, numpy dtype)."""
    types = {}
    for output in config.output:
        datatype = config_to_protocol(model_config_pb2.DataType.Name(output.data_type))
        types[output.name] = (datatype, NUMPY_DTYPES[datatype])
    return types
