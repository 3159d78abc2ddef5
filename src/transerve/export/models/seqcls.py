"""Sequence-classification post-processing written by `transerve export`: logits to class probabilities,
the most likely label (from the model's id2label, in `parameters` `labels`) and its probability."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"]).get("parameters", {})
        self.labels = np.array([label.encode("utf-8") for label in json.loads(parameters["labels"]["string_value"])],
                               dtype=object)

    def execute(self, requests):
        responses = []
        for request in requests:
            logits = pb_utils.get_input_tensor_by_name(request, "logits").as_numpy().astype(np.float32)
            shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
            probabilities = shifted / shifted.sum(axis=1, keepdims=True)
            best = probabilities.argmax(axis=1)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("label", self.labels[best].reshape(-1, 1)),
                pb_utils.Tensor("score", probabilities.max(axis=1, keepdims=True)),
                pb_utils.Tensor("probabilities", probabilities),
            ]))
        return responses
