import json

import numpy as np
import triton_python_backend_utils as pb_utils

ADD_SUB = {"INPUT0": np.array([[1, 2, 3, 4]], np.float32), "INPUT1": np.array([[10, 20, 30, 40]], np.float32)}


def describe(response):
    if response.has_error():
        return {"error": [int(response.error().code()), response.error().message()]}
    outputs = {}
    for tensor in response.output_tensors():
        array = tensor.as_numpy()
        outputs[tensor.name()] = [v.decode() for v in array.reshape(-1)] if array.dtype == object else array.tolist()
    return {"outputs": outputs}


def request(model, inputs, outputs, **kwargs):
    tensors = [pb_utils.Tensor(name, value) for name, value in inputs.items()]
    return pb_utils.InferenceRequest(model_name=model, inputs=tensors, requested_output_names=outputs, **kwargs)


def text(value):
    return np.array([value.encode()], dtype=object)


def run(mode):
    if mode == "add_sub":
        return describe(request("add_sub", ADD_SUB, ["OUTPUT0", "OUTPUT1"]).exec())
    if mode == "add_sub_one_output":
        return describe(request("add_sub", ADD_SUB, ["OUTPUT1"]).exec())
    if mode == "add_sub_all_outputs":
        return describe(request("add_sub", ADD_SUB, []).exec())
    if mode == "unknown_model":
        return describe(request("no_such_model", ADD_SUB, ["OUTPUT0"]).exec())
    if mode == "unknown_version":
        return describe(request("add_sub", ADD_SUB, ["OUTPUT0"], model_version=7).exec())
    if mode == "bad_dtype":
        inputs = dict(ADD_SUB, INPUT0=np.array([[1, 2, 3, 4]], np.int32))
        return describe(request("add_sub", inputs, ["OUTPUT0"], request_id="rid7").exec())
    if mode == "bad_shape":
        inputs = dict(ADD_SUB, INPUT0=np.array([[1, 2, 3]], np.float32))
        return describe(request("add_sub", inputs, ["OUTPUT0"]).exec())
    if mode == "missing_input":
        return describe(request("add_sub", {"INPUT0": ADD_SUB["INPUT0"]}, ["OUTPUT0"]).exec())
    if mode == "unknown_output":
        return describe(request("add_sub", ADD_SUB, ["NOPE"]).exec())
    if mode == "model_error":
        return describe(next(request("dec_probe", {"MODE": text("error_final_code")}, ["OUT"]).exec(decoupled=True)))
    if mode == "decoupled_without_flag":
        return describe(request("repeat_int32", {"IN": np.array([1, 2], np.int32)}, ["OUT"]).exec())
    if mode == "single_as_decoupled":
        return [describe(r) for r in request("add_sub", ADD_SUB, ["OUTPUT0"]).exec(decoupled=True)]
    if mode == "repeat":
        inputs = {"IN": np.array([4, 5, 6], np.int32)}
        return [describe(r) for r in request("repeat_int32", inputs, ["OUT", "IDX"]).exec(decoupled=True)]
    if mode == "repeat_empty":
        inputs = {"IN": np.array([], np.int32)}
        return [describe(r) for r in request("repeat_int32", inputs, ["OUT"]).exec(decoupled=True)]
    if mode == "repeat_twice":
        responses = request("repeat_int32", {"IN": np.array([1, 2], np.int32)}, ["OUT"]).exec(decoupled=True)
        first = [describe(r) for r in responses]
        return {"first": first, "again": [describe(r) for r in responses]}
    if mode == "ensemble":
        inputs = {"input_text": np.array([["héllo".encode()]], dtype=object)}
        return describe(request("text_pipeline", inputs, ["token_count", "mean_id"]).exec())
    if mode == "ensemble_bad":
        return describe(request("text_pipeline", {"input_text": np.array([[1]], np.int32)}, ["token_count"]).exec())
    if mode.startswith(("cancel:", "drop:")):  # stop the `counter` model after 3 of its 500 responses
        how, log = mode.split(":", 1)
        parameters = {"style": "thread", "log": log}
        call = request("counter", {"N": np.array([500], np.int32)}, ["OUT"], parameters=parameters)
        responses = call.exec(decoupled=True)
        first = [describe(next(responses)) for _ in range(3)]
        if how == "drop":
            del responses
            return first
        responses.cancel()
        return first + [describe(r) for r in responses]
    if mode.startswith("dec:"):
        call = request("dec_probe", {"MODE": text(mode[4:])}, ["OUT", "MSG"])
        responses = [describe(r) for r in call.exec(decoupled=True)]
        report = [describe(r) for r in request("dec_probe", {"MODE": text("report")}, ["MSG"]).exec(decoupled=True)]
        return {"responses": responses, "report": report}
    raise ValueError(f"unknown mode {mode}")


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request_ in requests:
            mode = pb_utils.get_input_tensor_by_name(request_, "MODE").as_numpy()[0].decode()
            result = pb_utils.Tensor("OUT", np.array([json.dumps(run(mode))], dtype=object))
            responses.append(pb_utils.InferenceResponse([result]))
        return responses
