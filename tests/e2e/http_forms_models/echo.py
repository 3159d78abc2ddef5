"""Answers each input as the output at the same position in the configuration (absent optional inputs give
none), so a test sees exactly the tensor the server built from the request."""

import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.pairs = [(i["name"], o["name"]) for i, o in zip(config["input"], config["output"], strict=True)]

    def execute(self, requests):
        responses = []
        for request in requests:
            outputs = []
            for input_name, output_name in self.pairs:
                tensor = pb_utils.get_input_tensor_by_name(request, input_name)
                if tensor is not None:
                    outputs.append(pb_utils.Tensor(output_name, tensor.as_numpy()))
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses
