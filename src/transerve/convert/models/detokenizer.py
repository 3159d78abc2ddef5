"""Detokenizer model written by `transerve convert`: the generator's `output_ids`, `sequence_length` and (when
it has one) `prefix_length` in; `text_output` (BYTES) out: the best hypothesis's text, from tokenizer.json.

Only the text after the first `prefix_length` ids is returned (the prompt of a decoder-only model, and in a
stream what earlier responses already carried): visible(ids) minus visible(ids[:prefix_length]), where visible()
decodes without special tokens and drops a trailing incomplete UTF-8 character (decoded as U+FFFD). A byte-level
token can hold part of a character; the piece that completes it carries the whole character, so a streamed
piece never splits one.
"""

import os
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

try:
    from tokenizers import Tokenizer
except ImportError as exc:  # one line naming the extra, not a traceback, in the model's load error
    raise ImportError(f"tokenizers is not installed ({exc}): pip install 'transerve[generation]'") from None

REPLACEMENT = "\ufffd"


class TritonPythonModel:
    def initialize(self, args):
        path = Path(args["model_repository"]) / args["model_version"] / "tokenizer.json"
        self.tokenizer = Tokenizer.from_file(str(path))

    def execute(self, requests):
        return [self._execute(request) for request in requests]

    def _execute(self, request):
        ids = pb_utils.get_input_tensor_by_name(request, "output_ids").as_numpy()
        lengths = pb_utils.get_input_tensor_by_name(request, "sequence_length").as_numpy()
        prefix = pb_utils.get_input_tensor_by_name(request, "prefix_length")
        prefix = np.zeros(lengths.shape, np.int64) if prefix is None else prefix.as_numpy()
        texts = []
        for row in range(ids.shape[0]):  # the best hypothesis, beam 0, of each row
            tokens = ids[row, 0, :int(lengths[row, 0])].tolist()
            texts.append(self._new_text(tokens, int(prefix[row, 0])))
        return pb_utils.InferenceResponse(
            [pb_utils.Tensor("text_output", np.array([[t.encode("utf-8")] for t in texts], dtype=np.object_))]
        )

    def _new_text(self, tokens, prefix):
        full = self._visible(tokens)
        if prefix <= 0:
            return full
        head = self._visible(tokens[:prefix])
        return full[len(os.path.commonprefix([full, head])):]

    def _visible(self, tokens):
        return self.tokenizer.decode(tokens, skip_special_tokens=True).rstrip(REPLACEMENT)
