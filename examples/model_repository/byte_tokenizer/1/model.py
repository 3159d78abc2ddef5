"""Tokenizes UTF-8 text into byte ids (+1, so 0 can pad) and an attention mask, padded to the longest text."""
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            texts = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy().reshape(-1)
            encoded = [bytes(text) for text in texts]
            longest = max((len(e) for e in encoded), default=0)
            ids = np.zeros((len(encoded), longest), dtype=np.int64)
            mask = np.zeros((len(encoded), longest), dtype=np.int64)
            for row, data in enumerate(encoded):
                ids[row, : len(data)] = np.frombuffer(data, dtype=np.uint8).astype(np.int64) + 1
                mask[row, : len(data)] = 1
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("input_ids", ids), pb_utils.Tensor("attention_mask", mask)]))
        return responses
