"""Tokenizer model written by `transerve export`: text in (BYTES), token ids out, from the model's tokenizer.json.

Each request's texts are padded to that request's longest; the batch of requests is tokenized in one call.
`parameters`: `max_length` (tokens, truncating longer texts), `pad_id`, and `pair: "true"` for question
answering, where QUESTION and CONTEXT are tokenized as a pair (only the context is truncated) and `offsets`
gives every token's character span in the context ([-1, -1] for tokens that are not context). QUESTION is
optional: a request without it has its CONTEXT tokenized alone (a client that sends one text, as the seed's
tutorial client does, gets the model's logits over that text).
"""

import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

try:
    from tokenizers import Tokenizer
except ImportError as exc:  # one line naming the extra, not a traceback, in the model's load error
    raise ImportError(f"tokenizers is not installed ({exc}): pip install 'transerve[export]'") from None


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        parameters = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        self.pair = parameters.get("pair", "false") == "true"
        self.pad_id = int(parameters.get("pad_id", "0"))
        self.outputs = [output["name"] for output in config["output"]]
        # The text inputs by position (TEXT; QUESTION, CONTEXT), under whatever names the export gave them.
        self.inputs = [tensor["name"] for tensor in config["input"]]
        path = Path(args["model_repository"]) / args["model_version"] / "tokenizer.json"
        max_length = int(parameters["max_length"])
        self.tokenizer = Tokenizer.from_file(str(path))
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(max_length, strategy="only_second" if self.pair else "longest_first")
        self.alone = self.tokenizer  # texts without a question: "only_second" cannot truncate a single text
        if self.pair:
            self.alone = Tokenizer.from_file(str(path))
            self.alone.no_padding()
            self.alone.enable_truncation(max_length)

    def execute(self, requests):
        groups = [self._texts(request) for request in requests]
        encodings = [None] * len(groups)
        for tokenizer in dict.fromkeys((self.tokenizer, self.alone)):  # one call per tokenizer for the batch
            members = [i for i, group in enumerate(groups) if self._tokenizer_for(group) is tokenizer]
            try:
                found = iter(tokenizer.encode_batch([text for i in members for text in groups[i]]))
            except Exception:  # some request's text cannot be tokenized: each request on its own finds out which
                continue
            for i in members:
                encodings[i] = [next(found) for _ in groups[i]]
        return [self._respond(group, encoded) for group, encoded in zip(groups, encodings, strict=True)]

    def _tokenizer_for(self, group):
        """The tokenizer for a request's texts: question-context pairs, or texts alone; None for an error."""
        if not isinstance(group, list):
            return None
        return self.tokenizer if group and isinstance(group[0], tuple) else self.alone

    def _respond(self, group, encodings):
        """The request's response, from its encodings (None: tokenize it alone), or its error."""
        if not isinstance(group, list):
            return pb_utils.InferenceResponse(error=group)
        if encodings is None:
            try:
                encodings = self._tokenizer_for(group).encode_batch(group)
            except Exception as exc:  # e.g. a question so long that no context fits in max_length
                return pb_utils.InferenceResponse(error=_invalid(f"cannot tokenize: {exc}"))
        # The context is the second sequence of a pair, the only one of a text tokenized alone.
        return self._response(encodings, context=1 if group and isinstance(group[0], tuple) else 0)

    def _texts(self, request):
        """The request's texts (question-context pairs for QA), or its error when one is not UTF-8."""
        try:
            if not self.pair:
                texts = pb_utils.get_input_tensor_by_name(request, self.inputs[0]).as_numpy().flat
                return [_text(value) for value in texts]
            asked = pb_utils.get_input_tensor_by_name(request, self.inputs[0])
            contexts = pb_utils.get_input_tensor_by_name(request, self.inputs[1]).as_numpy().flat
            if asked is None:
                return [_text(context) for context in contexts]
            questions = asked.as_numpy().flat
            return [(_text(question), _text(context)) for question, context in zip(questions, contexts, strict=True)]
        except UnicodeDecodeError:
            return _invalid("the text is not UTF-8")

    def _response(self, encodings, context=0):
        length = max((len(encoding.ids) for encoding in encodings), default=0)
        arrays = {
            "input_ids": np.full((len(encodings), length), self.pad_id, dtype=np.int64),
            "attention_mask": np.zeros((len(encodings), length), dtype=np.int64),
            "token_type_ids": np.zeros((len(encodings), length), dtype=np.int64),
            "offsets": np.full((len(encodings), length, 2), -1, dtype=np.int64),
        }
        for row, encoding in enumerate(encodings):
            size = len(encoding.ids)
            arrays["input_ids"][row, :size] = encoding.ids
            arrays["attention_mask"][row, :size] = encoding.attention_mask
            arrays["token_type_ids"][row, :size] = encoding.type_ids
            if "offsets" in self.outputs:
                tokens = np.array([sequence == context for sequence in encoding.sequence_ids], dtype=bool)
                spans = np.array(encoding.offsets, dtype=np.int64).reshape(-1, 2)
                arrays["offsets"][row, :size][tokens] = spans[tokens]
        return pb_utils.InferenceResponse([pb_utils.Tensor(name, arrays[name]) for name in self.outputs])


def _text(value):
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _invalid(message):
    return pb_utils.TritonError(message, pb_utils.TritonError.INVALID_ARG)
