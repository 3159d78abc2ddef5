"""Echoes its scores as FP32, INT32 and FP64 outputs, for the classification extension's tests."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            scores = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("SCORES", scores.astype(np.float32)),
                pb_utils.Tensor("IDS", scores.astype(np.int32)),
                pb_utils.Tensor("NOLABEL", scores.astype(np.float64)),
            ]))
        return responses
