"""A LightSeq Bert instance: `token_ids` [batch, length] (padding: `src_padding_id`, masked) -> `encoder_output`
[batch, length, hidden], the last hidden states, computed by the Hugging Face BertModel on a thread of its own.

The output goes out in the datatype the config declares, as LightSeq's backend sends it: it copies the encoder's
float buffer under that type, so LightSeq's example config (`TYPE_INT32`) carries the float32 values' bytes, which
its clients read with `.view(np.float32)`. TYPE_FP32 (or TYPE_FP16) carries the values themselves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np

from transerve.backends.base import ModelContext, Placement
from transerve.backends.lightseq.decoding import output_types
from transerve.backends.lightseq.weights import FormatError, LightSeqWeights
from transerve.backends.threaded import ThreadedInstance, import_engine, open_engines
from transerve.core.errors import invalid_arg, unavailable

OUTPUT = "encoder_output"
INPUT = "token_ids"


class BertEncoder:
    """The engine of one instance: called from its thread only."""

    def __init__(self, model: Any, device: str, pad_id: int, dtype: np.dtype) -> None:
        self._model = model.to(device)
        self._device = device
        self._pad_id = pad_id
        self._dtype = dtype

    def run(self, inputs: dict[str, np.ndarray], outputs: Sequence[str]) -> dict[str, np.ndarray]:
        import torch

        tokens = inputs.get(INPUT)
        if tokens is None or tokens.ndim != 2:
            raise invalid_arg(f"input '{INPUT}' must be [batch, length] token ids")
        config = self._model.config
        if tokens.size and (int(tokens.max()) >= config.vocab_size or int(tokens.min()) < 0):
            raise invalid_arg(f"input '{INPUT}' holds ids outside the vocabulary (0..{config.vocab_size - 1})")
        if tokens.shape[1] > config.max_position_embeddings:
            raise invalid_arg(f"input '{INPUT}' is longer than the model's {config.max_position_embeddings} positions")
        ids = torch.from_numpy(tokens.astype(np.int64)).to(self._device)
        with torch.inference_mode():
            hidden = self._model(input_ids=ids, attention_mask=(ids != self._pad_id).long()).last_hidden_state
        values = hidden.float().cpu().numpy()
        if self._dtype.kind == "f":
            return {OUTPUT: values.astype(self._dtype)}
        return {OUTPUT: values.view(self._dtype)}  # LightSeq's bytes under the declared type


async def load_bert(context: ModelContext, weights: LightSeqWeights, placements: list[Placement],
                    loop: asyncio.AbstractEventLoop) -> list[ThreadedInstance]:
    from transerve.backends.lightseq.models import bert_model

    outputs = output_types(context.config)
    if OUTPUT not in outputs:
        raise unavailable(f"a LightSeq Bert model's output is '{OUTPUT}'; the config declares "
                          f"{', '.join(outputs) or 'none'}")
    dtype = np.dtype(outputs[OUTPUT][1])
    if dtype.itemsize != 4 and dtype != np.float16:
        raise unavailable(f"output '{OUTPUT}' must be declared with a 4-byte type (LightSeq's float32 bytes) or "
                          "TYPE_FP16")
    import_engine("torch", "generation")
    import_engine("transformers", "generation")
    try:
        model = await loop.run_in_executor(None, bert_model, weights)
    except FormatError as exc:
        raise unavailable(f"the Bert model cannot be served: {exc}") from None
    pad_id = int(weights.conf.get("src_padding_id", 0))

    def opener(placement: Placement) -> BertEncoder:
        device = f"cuda:{placement.device_id}" if placement.kind == "GPU" else "cpu"
        return BertEncoder(model if len(placements) == 1 else _copy(model), device, pad_id, dtype)

    pairs = await open_engines(loop, placements, opener, f"lightseq-{context.name}")
    return [
        ThreadedInstance(context.name, context.version, placement.name, context.config, executor, engine, loop)
        for placement, (executor, engine) in zip(placements, pairs, strict=True)
    ]


def _copy(model: Any) -> Any:
    import copy

    return copy.deepcopy(model)
