"""Answers with the request's parameters as the python backend shows them (`request.parameters()`, JSON).

The folder has no config.pbtxt: the server must find the python backend from this file, and this
`auto_complete_config` declares the inputs and outputs, as for Triton.
"""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        config.add_input({"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [1]})
        config.add_output({"name": "PARAMETERS", "data_type": "TYPE_STRING", "dims": [1]})
        config.set_max_batch_size(0)
        return config

    def execute(self, requests):
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("PARAMETERS", np.array([request.parameters()], dtype=object))])
            for request in requests
        ]
