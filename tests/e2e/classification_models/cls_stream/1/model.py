"""Decoupled: sends its scores twice, the second time doubled, then the final flag."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            scores = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().astype(np.float32)
            sender = request.get_response_sender()
            for factor in (1, 2):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("SCORES", scores * factor)]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
