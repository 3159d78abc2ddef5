"""Tokenizer model written by `transerve convert`: `text_input` (BYTES) in; `input_ids` and `sequence_length`
(UINT32) out, as FasterTransformer's generator takes them, from the model's tokenizer.json.

Special tokens are added as the model's own tokenizer adds them (its template: T5's and Marian's `</s>`, BART's
`<s> ... </s>`, none for GPT-2). A request's rows are padded with 0 to its longest row; `sequence_length` says
how many ids each row really has.

With the config parameter `max_input_tokens` (`transerve convert --max-input-tokens N`), a longer input keeps its
first tokens and the special tokens the template adds (Marian's and T5's closing `</s>`), N in all, as the Hugging
Face tokenizer's `truncation=True, max_length=N` does. Without it nothing is truncated: the generator refuses an
input longer than its model takes, that request alone.
"""

import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

try:
    from tokenizers import Tokenizer
except ImportError as exc:  # one line naming the extra, not a traceback, in the model's load error
    raise ImportError(f"tokenizers is not installed ({exc}): pip install 'transerve[generation]'") from None


class TritonPythonModel:
    def initialize(self, args):
        path = Path(args["model_repository"]) / args["model_version"] / "tokenizer.json"
        self.tokenizer = Tokenizer.from_file(str(path))
        self.tokenizer.no_padding()
        limit = json.loads(args["model_config"]).get("parameters", {}).get("max_input_tokens")
        if limit is None:
            self.tokenizer.no_truncation()
        else:
            self.tokenizer.enable_truncation(max_length=int(limit["string_value"]))

    def execute(self, requests):
        groups = [self._texts(request) for request in requests]
        texts = [text for group in groups if isinstance(group, list) for text in group]
        encodings = iter(self.tokenizer.encode_batch(texts))
        return [self._response([next(encodings) for _ in group]) if isinstance(group, list)
                else pb_utils.InferenceResponse(error=group) for group in groups]

    def _texts(self, request):
        """The request's texts, or its error when one is not UTF-8."""
        try:
            values = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().flat
            return [value.decode("utf-8") if isinstance(value, bytes) else str(value) for value in values]
        except UnicodeDecodeError:
            return pb_utils.TritonError("text_input is not UTF-8", pb_utils.TritonError.INVALID_ARG)

    def _response(self, encodings):
        width = max((len(encoding.ids) for encoding in encodings), default=0)
        ids = np.zeros((len(encodings), width), dtype=np.uint32)
        lengths = np.zeros((len(encodings), 1), dtype=np.uint32)
        for row, encoding in enumerate(encodings):
            ids[row, :len(encoding.ids)] = encoding.ids
            lengths[row, 0] = len(encoding.ids)
        tensors = [pb_utils.Tensor("input_ids", ids), pb_utils.Tensor("sequence_length", lengths)]
        return pb_utils.InferenceResponse(tensors)
