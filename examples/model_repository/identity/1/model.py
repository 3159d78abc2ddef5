"""Returns each given INPUT_<TYPE> tensor unchanged as OUTPUT_<TYPE>."""
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            outputs = [
                pb_utils.Tensor("OUTPUT_" + tensor.name()[len("INPUT_"):], tensor.as_numpy())
                for tensor in request.inputs()
            ]
            responses.append(pb_utils.InferenceResponse(output_tensors=outputs))
        return responses
