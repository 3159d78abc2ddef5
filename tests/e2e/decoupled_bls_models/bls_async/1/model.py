import asyncio
import time

import numpy as np
import triton_python_backend_utils as pb_utils


def call(model, inputs, outputs):
    tensors = [pb_utils.Tensor(name, value) for name, value in inputs.items()]
    return pb_utils.InferenceRequest(model_name=model, inputs=tensors, requested_output_names=outputs)


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            count = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            started = time.monotonic()
            ones = np.ones((1, 4), np.float32)
            pending = [call("slow_add", {"INPUT0": np.full((1, 4), i, np.float32), "INPUT1": ones}, ["OUTPUT0"])
                       for i in range(count)]
            answers = await asyncio.gather(*(bls.async_exec() for bls in pending))
            elapsed = time.monotonic() - started
            sums = [float(answer.output_tensors()[0].as_numpy().sum()) for answer in answers]
            stream = await call("repeat_int32", {"IN": np.array([7, 8, 9], np.int32)}, ["OUT"]).async_exec(
                decoupled=True)
            streamed = [int(r.output_tensors()[0].as_numpy()[0]) for r in stream if r.output_tensors()]
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("ELAPSED", np.array([elapsed], np.float32)),
                pb_utils.Tensor("SUMS", np.array(sums, np.float32)),
                pb_utils.Tensor("STREAMED", np.array(streamed, np.int32)),
            ]))
        return responses
