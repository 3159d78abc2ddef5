"""Doubles its input and says how many times it has executed, so that a cached answer shows."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.executions = 0

    def execute(self, requests):
        self.executions += 1
        responses = []
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            count = np.full(values.shape[:-1] + (1,), self.executions, np.int64)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUT", values * 2), pb_utils.Tensor("COUNT", count),
            ]))
        return responses
