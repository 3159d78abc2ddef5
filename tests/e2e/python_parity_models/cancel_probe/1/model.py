"""Each request waits up to DELAY_MS for `is_cancelled()` to turn True, then writes what it saw (and what its
response sender says) as JSON into the file MARKER names, if any, and answers OUT = 1 if it was cancelled."""

import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            delay = int(pb_utils.get_input_tensor_by_name(request, "DELAY_MS").as_numpy().reshape(-1)[0])
            marker = pb_utils.get_input_tensor_by_name(request, "MARKER").as_numpy().reshape(-1)[0].decode()
            deadline = time.monotonic() + delay / 1000
            cancelled = request.is_cancelled()
            while not cancelled and time.monotonic() < deadline:
                time.sleep(0.01)
                cancelled = request.is_cancelled()
            if marker:
                with open(marker, "w") as file:
                    json.dump({"request": cancelled, "sender": request.get_response_sender().is_cancelled()}, file)
            shape = pb_utils.get_input_tensor_by_name(request, "DELAY_MS").as_numpy().shape
            out = pb_utils.Tensor("OUT", np.full(shape, int(cancelled), np.int32))
            responses.append(pb_utils.InferenceResponse([out]))
        return responses
