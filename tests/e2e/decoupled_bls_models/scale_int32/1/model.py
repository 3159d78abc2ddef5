import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            factor = pb_utils.get_input_tensor_by_name(request, "FACTOR")
            scale = 2 if factor is None else int(factor.as_numpy()[0])
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * scale)]))
        return responses
