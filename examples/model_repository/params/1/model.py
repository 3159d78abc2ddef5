"""Multiplies INPUT0 by the config's `scale` (or the request's `scale` parameter) and echoes the parameters."""
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.config_parameters = {k: v["string_value"] for k, v in config["parameters"].items()}
        self.default_scale = float(self.config_parameters["scale"])

    def execute(self, requests):
        responses = []
        for request in requests:
            request_parameters = json.loads(request.parameters())
            scale = float(request_parameters.get("scale", self.default_scale))
            data = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            echo = json.dumps({"config": self.config_parameters, "request": request_parameters}, sort_keys=True)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUTPUT0", (data * scale).astype(np.float32)),
                pb_utils.Tensor("PARAMETERS", np.array([echo.encode()], dtype=np.object_)),
            ]))
        return responses
