"""Embedding post-processing written by `transerve export`: token states to one sentence vector each.

Pools over the tokens the attention mask keeps (`pooling`: `mean`, as sentence-transformers' mean pooling,
or `cls`), then scales to unit length when `normalize` is `true`.
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"]).get("parameters", {})
        self.pooling = parameters.get("pooling", {}).get("string_value", "mean")
        self.normalize = parameters.get("normalize", {}).get("string_value", "true") == "true"

    def execute(self, requests):
        return [self._embed(request) for request in requests]

    def _embed(self, request):
        hidden = pb_utils.get_input_tensor_by_name(request, "last_hidden_state").as_numpy()
        mask = pb_utils.get_input_tensor_by_name(request, "attention_mask").as_numpy()[:, : hidden.shape[1]]
        if self.pooling == "cls":
            pooled = hidden[:, 0]
        else:
            weights = mask.astype(np.float32)[:, :, None]
            pooled = (hidden * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)
        if self.normalize:
            pooled = pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
        return pb_utils.InferenceResponse([pb_utils.Tensor("embedding", pooled.astype(np.float32))])
