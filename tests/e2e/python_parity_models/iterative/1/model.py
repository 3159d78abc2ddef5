"""Sends one response per run and reschedules the request until IN responses were sent. Each response reports the
responses left, the request's flags and its START control input in that run."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self._left = {}

    def execute(self, requests):
        for request in requests:
            key = request.correlation_id()
            if key not in self._left:
                self._left[key] = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            self._left[key] -= 1
            left = self._left[key]
            start = int(pb_utils.get_input_tensor_by_name(request, "START").as_numpy()[0])
            outputs = [
                pb_utils.Tensor("LEFT", np.array([left], np.int32)),
                pb_utils.Tensor("FLAGS", np.array([request.flags()], np.int32)),
                pb_utils.Tensor("START_SEEN", np.array([start], np.int32)),
            ]
            sender = request.get_response_sender()
            if left > 0:
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
                sender.send(pb_utils.InferenceResponse(outputs))
            else:
                del self._left[key]
                sender.send(pb_utils.InferenceResponse(outputs), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
