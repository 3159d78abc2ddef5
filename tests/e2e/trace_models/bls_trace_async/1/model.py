import asyncio

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            values = np.arange(4, dtype=np.float32).reshape(1, 4)
            calls = [
                pb_utils.InferenceRequest(
                    model_name="add_sub", requested_output_names=["OUTPUT0"], trace=request.trace(),
                    inputs=[pb_utils.Tensor("INPUT0", values), pb_utils.Tensor("INPUT1", values)]).async_exec()
                for _ in range(2)
            ]
            answers = await asyncio.gather(*calls)
            failed = sum(answer.has_error() for answer in answers)
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", np.array([f"{len(answers)} answers, {failed} failed".encode()], np.object_))]))
        return responses
