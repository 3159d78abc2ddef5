"""Its input as outputs of several datatypes and shapes, for the classification extension's tests."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("F16", x.astype(np.float16)),
                pb_utils.Tensor("I64", (x * 10).astype(np.int64)),
                pb_utils.Tensor("U8", (x * 10).astype(np.uint8)),
                pb_utils.Tensor("I8", (x * -10).astype(np.int8)),
                pb_utils.Tensor("B", x > 0.3),
                pb_utils.Tensor("S", np.full(x.shape, b"x", dtype=np.object_)),
                pb_utils.Tensor("D3", np.stack([x, x * 2], axis=1).astype(np.float32)),
            ]))
        return responses
