"""Counts the unmasked tokens of each row and averages their ids."""
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            ids = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy()
            mask = pb_utils.get_input_tensor_by_name(request, "attention_mask").as_numpy()
            count = mask.sum(axis=1, keepdims=True)
            mean = (ids * mask).sum(axis=1, keepdims=True) / np.maximum(count, 1)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("token_count", count.astype(np.int64)),
                pb_utils.Tensor("mean_id", mean.astype(np.float32))]))
        return responses
