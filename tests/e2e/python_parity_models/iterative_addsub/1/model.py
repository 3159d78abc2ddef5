"""Reschedules each request once; the second run answers OUT = 2 * IN and how many runs the request took."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self._runs = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            key = request.correlation_id()
            self._runs[key] = self._runs.get(key, 0) + 1
            if self._runs[key] == 1:
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
                responses.append(None)
                continue
            value = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            runs = self._runs.pop(key)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUT", (value * 2).astype(np.int32)),
                pb_utils.Tensor("RUNS", np.array([runs], np.int32)),
            ]))
        return responses
