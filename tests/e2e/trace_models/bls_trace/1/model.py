import json

import numpy as np
import triton_python_backend_utils as pb_utils


def add_sub_inputs():
    values = np.arange(4, dtype=np.float32).reshape(1, 4)
    return [pb_utils.Tensor("INPUT0", values), pb_utils.Tensor("INPUT1", values)]


def call(model, inputs, outputs, trace):
    """One BLS call (traced under `trace` unless it is None); its error message, or None."""
    traced = {} if trace is None else {"trace": trace}
    answer = pb_utils.InferenceRequest(
        model_name=model, inputs=inputs, requested_output_names=outputs, **traced).exec()
    return answer.error().message() if answer.has_error() else None


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            mode = pb_utils.get_input_tensor_by_name(request, "MODE").as_numpy()[0].decode()
            trace = request.trace()
            seen = {"context": trace.get_context()}
            if mode == "fail":
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("it failed")))
                continue
            if mode in ("sync", "twice"):
                seen["errors"] = [call("add_sub", add_sub_inputs(), ["OUTPUT0"], trace)
                                  for _ in range(2 if mode == "twice" else 1)]
            elif mode == "untraced":
                seen["errors"] = [call("add_sub", add_sub_inputs(), ["OUTPUT0"], None)]
            elif mode == "refused":
                seen["errors"] = [call("add_sub", [], ["OUTPUT0"], trace)]
            elif mode == "ensemble":
                text = pb_utils.Tensor("input_text", np.array([[b"hi"]], np.object_))
                seen["errors"] = [call("text_pipeline", [text], ["token_count"], trace)]
            elif mode == "decoupled":
                request_values = [pb_utils.Tensor("IN", np.array([4, 5, 6], np.int32))]
                answers = pb_utils.InferenceRequest(
                    model_name="repeat_int32", inputs=request_values, requested_output_names=["OUT", "IDX"],
                    trace=trace).exec(decoupled=True)
                seen["responses"] = sum(1 for _ in answers)
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", np.array([json.dumps(seen, sort_keys=True).encode()], np.object_))]))
        return responses
