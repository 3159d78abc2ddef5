"""Question-answering post-processing written by `transerve export`: start/end logits to the answer text.

The answer is the context span (start token i, end token j, i <= j < i + `max_answer_length`) that
maximizes p_start(i) * p_end(j), the probabilities being softmaxes over the context's tokens; `score` is
that product, `start`/`end` the span's character offsets in the context (-1 when no context token exists).
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"]).get("parameters", {})
        self.max_answer_length = int(parameters.get("max_answer_length", {}).get("string_value", "30"))

    def execute(self, requests):
        responses = []
        for request in requests:
            starts = pb_utils.get_input_tensor_by_name(request, "start_logits").as_numpy()
            ends = pb_utils.get_input_tensor_by_name(request, "end_logits").as_numpy()
            offsets = pb_utils.get_input_tensor_by_name(request, "offsets").as_numpy()
            contexts = pb_utils.get_input_tensor_by_name(request, "context").as_numpy().reshape(-1)
            rows = [self._answer(s, e, o, c) for s, e, o, c in zip(starts, ends, offsets, contexts, strict=True)]
            answers, scores, first, last = zip(*rows, strict=True) if rows else ((), (), (), ())
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("answer", np.array(answers, dtype=object).reshape(-1, 1)),
                pb_utils.Tensor("score", np.array(scores, dtype=np.float32).reshape(-1, 1)),
                pb_utils.Tensor("start", np.array(first, dtype=np.int64).reshape(-1, 1)),
                pb_utils.Tensor("end", np.array(last, dtype=np.int64).reshape(-1, 1)),
            ]))
        return responses

    def _answer(self, starts, ends, offsets, context):
        length = min(len(starts), len(ends), len(offsets))
        tokens = np.flatnonzero(offsets[:length, 0] >= 0)
        if tokens.size == 0:
            return b"", 0.0, -1, -1
        p_start = _softmax(starts[tokens].astype(np.float64))
        p_end = _softmax(ends[tokens].astype(np.float64))
        scores = np.triu(np.outer(p_start, p_end))  # end not before start
        scores = np.tril(scores, self.max_answer_length - 1)  # and not too far after it
        i, j = np.unravel_index(int(scores.argmax()), scores.shape)
        begin, end = int(offsets[tokens[i], 0]), int(offsets[tokens[j], 1])
        text = context.decode("utf-8") if isinstance(context, bytes) else str(context)
        return text[begin:end].encode("utf-8"), float(scores[i, j]), begin, end


def _softmax(values):
    shifted = np.exp(values - values.max())
    return shifted / shifted.sum()
