"""A decoupled model for the generate endpoints. It answers PROMPT as TEXT, with the request's parameters as
JSON in PARAMETERS, `repeat` times (a request parameter, 1 by default); when the request has an `error`
parameter it then sends an error response with that message; the final flag ends the request."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            parameters = json.loads(request.parameters())
            sender = request.get_response_sender()
            prompt = pb_utils.get_input_tensor_by_name(request, "PROMPT").as_numpy()
            seen = np.array([json.dumps(parameters, sort_keys=True).encode()], dtype=np.object_)
            response = pb_utils.InferenceResponse(
                [pb_utils.Tensor("TEXT", prompt), pb_utils.Tensor("PARAMETERS", seen)]
            )
            for _ in range(int(parameters.get("repeat", 1))):
                sender.send(response)
            error = parameters.get("error")
            last = None if error is None else pb_utils.InferenceResponse(error=pb_utils.TritonError(str(error)))
            sender.send(last, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
