"""Translate with a FasterTransformer T5 model served by transerve (docs/tutorials/fastertransformer-t5.md).

Sends the tensors FasterTransformer's T5 clients send (`input_ids`, `sequence_length`, `max_output_len` and the
decoding tensors at FasterTransformer's greedy settings) over HTTP with tritonclient, and prints one translation
per line of input. Needs `pip install 'tritonclient[http]' transformers tokenizers`.
"""

from __future__ import annotations

import argparse

import numpy as np
import tritonclient.http as httpclient
from transformers import AutoTokenizer
from tritonclient.utils import np_to_triton_dtype


def prepare_tensor(name: str, array: np.ndarray) -> httpclient.InferInput:
    tensor = httpclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
    tensor.set_data_from_numpy(array)
    return tensor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("texts", nargs="+", help="sentences to translate")
    parser.add_argument("--url", default="localhost:8000")
    parser.add_argument("--model", default="fastertransformer")
    parser.add_argument("--tokenizer", default="t5-small", help="the Hugging Face folder the checkpoint came from")
    parser.add_argument("--max-output-len", type=int, default=32)
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    encoded = tokenizer([f"translate English to German: {text}" for text in args.texts], return_tensors="np",
                        padding=True)
    batch = len(args.texts)

    def column(value, dtype) -> np.ndarray:
        return np.full([batch, 1], value, dtype)

    inputs = [
        prepare_tensor("input_ids", encoded.input_ids.astype(np.uint32)),
        prepare_tensor("sequence_length", encoded.attention_mask.sum(axis=1, keepdims=True).astype(np.uint32)),
        prepare_tensor("max_output_len", column(args.max_output_len, np.uint32)),
        prepare_tensor("runtime_top_k", column(1, np.uint32)),
        prepare_tensor("runtime_top_p", column(0.0, np.float32)),
        prepare_tensor("beam_search_diversity_rate", column(0.0, np.float32)),
        prepare_tensor("temperature", column(1.0, np.float32)),
        prepare_tensor("len_penalty", column(0.0, np.float32)),
        prepare_tensor("repetition_penalty", column(1.0, np.float32)),
        prepare_tensor("random_seed", column(0, np.uint64)),
        prepare_tensor("is_return_log_probs", column(True, bool)),
        prepare_tensor("beam_width", column(1, np.uint32)),
        prepare_tensor("start_id", column(0, np.uint32)),
        prepare_tensor("end_id", column(1, np.uint32)),
        # FasterTransformer's word lists, [batch, 2, L]: no word (offset -1)
        prepare_tensor("bad_words_list", np.array([[[0], [-1]]] * batch, np.int32)),
        prepare_tensor("stop_words_list", np.array([[[0], [-1]]] * batch, np.int32)),
    ]
    with httpclient.InferenceServerClient(args.url) as client:
        result = client.infer(args.model, inputs)
    output_ids, lengths = result.as_numpy("output_ids"), result.as_numpy("sequence_length")
    for row in range(batch):
        print(tokenizer.decode(output_ids[row, 0, : lengths[row, 0]], skip_special_tokens=True))


if __name__ == "__main__":
    main()
