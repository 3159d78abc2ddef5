"""Runs pb_utils.load_model / unload_model / is_model_ready; RESULT is what it returned or the exception's text."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            action = pb_utils.get_input_tensor_by_name(request, "ACTION").as_numpy()[0].decode()
            name = pb_utils.get_input_tensor_by_name(request, "NAME").as_numpy()[0].decode()
            try:
                if action == "load":
                    result = pb_utils.load_model(name)
                elif action == "unload":
                    result = pb_utils.unload_model(name)
                elif action == "bad_version":
                    result = pb_utils.is_model_ready(name, "one")
                else:
                    result = pb_utils.is_model_ready(name)
            except pb_utils.TritonModelException as exc:
                result = f"TritonModelException: {exc}"
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("RESULT", np.array([str(result).encode()], np.object_))]))
        return responses
