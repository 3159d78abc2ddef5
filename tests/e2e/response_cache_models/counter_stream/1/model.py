"""Decoupled, so its config's response_cache is refused at load."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            request.get_response_sender().send(
                pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.zeros(1, np.float32))]),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
