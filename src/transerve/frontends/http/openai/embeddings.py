"""/v1/embeddings: texts or token ids in, one vector each out, through the server's request path.

Texts go to the model's text input (an export's ensemble tokenizes them in its first step). Token ids (the input
LangChain's `OpenAIEmbeddings` sends by default), and texts the request asks to truncate, skip that step: the
layer gives the ensemble's later steps what its tokenizer step would have given them (`input_ids`, an
`attention_mask` of ones, `token_type_ids` of zeros), one input per request so no padding changes a vector. Every
input is checked against the model's context here, before any model runs, whatever the engine: an input that
cannot fit is a 400, never a model failure. `dimensions` cuts each vector to its first d values and renormalises
it, as Matryoshka models are trained to be cut, only for a model whose config says it may
(`openai_matryoshka_dimensions`).
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np

from transerve.core.errors import ServerError
from transerve.core.types import InferRequest, RequestedOutput, Tensor
from transerve.frontends.http.openai import params
from transerve.frontends.http.openai.catalog import OpenAIModel
from transerve.frontends.http.openai.errors import bad_request, from_server_error
from transerve.frontends.http.openai.prompts import check_ids, encoded_texts, id_list, truncation
from transerve.server import Server

#: Inputs one embeddings request may carry, as OpenAI bounds them.
MAX_EMBEDDING_INPUTS = 2048
#: What an export's tokenizer step gives the model for one text, by tensor name.
_TOKENIZER_TENSORS = frozenset({"input_ids", "attention_mask", "token_type_ids"})


class Embedder:
    def __init__(self, server: Server) -> None:
        self._server = server

    async def answer(self, entry: OpenAIModel, body: dict[str, Any]) -> dict[str, Any]:
        params.refuse_unknown(body, params.EMBEDDING_FIELDS, "/v1/embeddings")
        texts, id_inputs = _inputs(body.get("input"))
        encoding = body.get("encoding_format", "float")
        if encoding not in ("float", "base64"):
            raise bad_request("'encoding_format' must be 'float' or 'base64'", param="encoding_format")
        width = entry.model.signature.outputs[entry.text_output].dims[-1]
        dimensions = _dimensions(body.get("dimensions"), entry, width)
        keep = truncation(entry, params.optional_int(body, "truncate_prompt_tokens", -1))
        if keep == 0:
            raise bad_request("'truncate_prompt_tokens' must be -1 (the model's context) or at least 1",
                              param="truncate_prompt_tokens")
        tokenizer = await entry.tokenizer() if entry.tokenizer_folder is not None else None
        if (id_inputs is not None or keep is not None) and (tokenizer is None or _steps_after_tokenizer(entry)
                                                            is None):
            raise bad_request(f"model '{entry.id}' takes text only: its ensemble has no tokenizer step to skip, so "
                              "token ids and truncation cannot reach it", param="input" if keep is None else
                              "truncate_prompt_tokens")
        tokens = 0
        if id_inputs is not None:
            assert tokenizer is not None
            id_inputs = [check_ids(ids, entry, tokenizer, "input", keep) for ids in id_inputs]
            tokens = sum(map(len, id_inputs))
            vectors = await self._embed_ids(entry, id_inputs)
        else:
            if tokenizer is not None:
                limit = entry.context_length or tokenizer.max_length
                encoded = await encoded_texts(tokenizer, texts, limit, "input", keep=keep)
                for index, ids in enumerate(encoded):
                    if limit is not None and len(ids) > limit:
                        raise bad_request(f"input[{index}] has {len(ids)} tokens; model '{entry.id}' takes at most "
                                          f"{limit}: shorten it or ask 'truncate_prompt_tokens'", param="input")
                    tokens += len(ids)
                vectors = await (self._embed_ids(entry, encoded) if keep is not None else self._embed(entry, texts))
            else:
                vectors = await self._embed(entry, texts)
        if dimensions is not None:
            vectors = [_cut(vector, dimensions) for vector in vectors]
        data = [{"object": "embedding", "index": index,
                 "embedding": base64.b64encode(vector.astype("<f4").tobytes()).decode() if encoding == "base64"
                 else vector.tolist()}
                for index, vector in enumerate(vectors)]
        return {"object": "list", "data": data, "model": entry.id,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def _embed(self, entry: OpenAIModel, texts: list[str]) -> list[np.ndarray]:
        """The texts in batches of the model's `max_batch_size`, sent together."""
        size = entry.max_batch_size or 1
        batches = [texts[start:start + size] for start in range(0, len(texts), size)]
        spec = entry.model.signature.inputs[entry.text_input]

        async def one(batch: list[str]) -> np.ndarray:
            data = np.array([text.encode() for text in batch], dtype=object)
            data = data.reshape(len(batch), *([1] * (len(spec.shape) - 1))) if entry.max_batch_size else \
                data.reshape((1,) * max(len(spec.shape), 1))
            request = InferRequest(model_name=entry.id, model_version=entry.model.version,
                                   inputs=[Tensor(entry.text_input, "BYTES", data)],
                                   outputs=[RequestedOutput(entry.text_output)])
            outputs = await self._infer(request)
            return np.asarray(outputs[entry.text_output], dtype=np.float32).reshape(len(batch), -1)

        results = await asyncio.gather(*(one(batch) for batch in batches))
        return [vector for result in results for vector in result]

    async def _embed_ids(self, entry: OpenAIModel, inputs: list[list[int]]) -> list[np.ndarray]:
        steps = _steps_after_tokenizer(entry)
        assert steps is not None
        first, rest = steps

        async def one(ids: list[int]) -> np.ndarray:
            row = np.array([ids], dtype=np.int64)
            made = {"input_ids": row, "attention_mask": np.ones_like(row), "token_type_ids": np.zeros_like(row)}
            pool = {tensor: made[name] for name, tensor in first.items()}
            for step in rest:
                model = self._server.get_version(step.model_name)
                request = InferRequest(
                    model_name=step.model_name, model_version=model.version,
                    inputs=[Tensor(name, model.signature.inputs[name].datatype, _as(pool[tensor],
                                   model.signature.inputs[name].datatype)) for name, tensor in step.input_map.items()],
                    outputs=[RequestedOutput(name) for name in step.output_map])
                outputs = await self._infer(request)
                pool.update({step.output_map[name]: value for name, value in outputs.items()})
            return np.asarray(pool[entry.text_output], dtype=np.float32).reshape(-1)

        return list(await asyncio.gather(*(one(ids) for ids in inputs)))

    async def _infer(self, request: InferRequest) -> dict[str, np.ndarray]:
        try:
            response = await self._server.infer(request)
        except ServerError as exc:
            raise from_server_error(exc) from None
        return {tensor.name: tensor.data for tensor in response.outputs}


def _inputs(given: object) -> tuple[list[str], list[list[int]] | None]:
    """(texts, None) or ([], token-id inputs): a string, strings, token ids, or lists of token ids."""
    if isinstance(given, str) or id_list(given):
        given = [given]
    if not isinstance(given, list) or not given:
        raise bad_request("'input' must be a non-empty string, a list of strings, a list of token ids or a list of "
                          "such lists", param="input")
    if len(given) > MAX_EMBEDDING_INPUTS:
        raise bad_request(f"'input' may hold at most {MAX_EMBEDDING_INPUTS} inputs", param="input")
    if all(isinstance(text, str) and text for text in given):
        return list(given), None
    if all(id_list(ids) for ids in given):  # their other ids are checked by check_ids, after their lengths
        return [], [list(ids) for ids in given]
    raise bad_request("'input' must be non-empty strings or non-empty lists of token ids, not a mix", param="input")


def _dimensions(given: object, entry: OpenAIModel, width: int) -> int | None:
    if given is None:
        return None
    if isinstance(given, bool) or not isinstance(given, int) or given < 1:
        raise bad_request("'dimensions' must be a positive integer", param="dimensions")
    if given == width:
        return None
    if given not in entry.matryoshka_dimensions:
        sizes = sorted(entry.matryoshka_dimensions)
        allowed = f"{width}, or one of {sizes[0]}..{sizes[-1]} (config parameter openai_matryoshka_dimensions)" \
            if len(sizes) > 8 else ", ".join(str(size) for size in [*sizes, width])
        raise bad_request(f"'dimensions' {given} is not supported: model '{entry.id}' returns embeddings of "
                          f"{allowed} dimensions", param="dimensions")
    return given


def _cut(vector: np.ndarray, size: int) -> np.ndarray:
    head = np.asarray(vector[:size], dtype=np.float32)
    norm = float(np.linalg.norm(head))
    return head / norm if norm > 0 else head


def _steps_after_tokenizer(entry: OpenAIModel) -> tuple[dict[str, str], list[Any]] | None:
    """An export's ensemble: (its tokenizer step's outputs as `{tokenizer tensor name: ensemble tensor}`, the
    steps after it), when its first step turns the text input into the tensors the layer can make itself."""
    steps = list(entry.model.config.ensemble_scheduling.step)
    if len(steps) < 2 or entry.text_input not in steps[0].input_map.values():
        return None
    outputs = dict(steps[0].output_map)
    if not outputs or not set(outputs) <= _TOKENIZER_TENSORS:
        return None
    return outputs, steps[1:]


def _as(array: np.ndarray, datatype: str) -> np.ndarray:
    return array.astype({"INT64": np.int64, "INT32": np.int32, "FP32": np.float32}.get(datatype, array.dtype),
                        copy=False)
