"""OUT is JSON: `sys.argv`, and for each misuse of pb_utils the name of the exception it raised (or "ok")."""

import json
import sys

import numpy as np
import triton_python_backend_utils as pb_utils


def bls():
    """A valid BLS request's arguments (pb_utils' classes exist only once the model is loaded)."""
    return {"inputs": [pb_utils.Tensor("T", np.array([1], np.int32))], "requested_output_names": ["X"],
            "model_name": "m"}


CASES = {
    "tensor_name_none": lambda: pb_utils.Tensor(None, np.array([1])),
    "tensor_array_none": lambda: pb_utils.Tensor("T", None),
    "tensor_empty_name_none": lambda: pb_utils.Tensor("", None),
    "tensor_empty_name": lambda: pb_utils.Tensor("", np.array([1])),
    "dlpack_none": lambda: pb_utils.Tensor.from_dlpack("T", None),
    "request_inputs_none": lambda: pb_utils.InferenceRequest(**{**bls(), "inputs": None}),
    "request_input_item_none": lambda: pb_utils.InferenceRequest(**{**bls(), "inputs": [None]}),
    "request_model_none": lambda: pb_utils.InferenceRequest(**{**bls(), "model_name": None}),
    "request_outputs_none": lambda: pb_utils.InferenceRequest(**{**bls(), "requested_output_names": None}),
    "request_output_item_none": lambda: pb_utils.InferenceRequest(**{**bls(), "requested_output_names": [None]}),
    "request_correlation_none": lambda: pb_utils.InferenceRequest(**bls(), correlation_id=None),
    "request_correlation_float": lambda: pb_utils.InferenceRequest(**bls(), correlation_id=1.5),
    "request_id_none": lambda: pb_utils.InferenceRequest(**bls(), request_id=None),
    "request_version_none": lambda: pb_utils.InferenceRequest(**bls(), model_version=None),
    "request_flags_none": lambda: pb_utils.InferenceRequest(**bls(), flags=None),
    "request_empty_lists": lambda: pb_utils.InferenceRequest(inputs=[], requested_output_names=[], model_name="m"),
    "response_tensors_none": lambda: pb_utils.InferenceResponse(output_tensors=None),
    "response_tensor_item_none": lambda: pb_utils.InferenceResponse(output_tensors=[None]),
    "response_empty": lambda: pb_utils.InferenceResponse(),
    "log_level_none": lambda: pb_utils.Logger.log("x", None),
    "log_level_int": lambda: pb_utils.Logger.log("x", 1),
    "log_message_none": lambda: pb_utils.Logger.log_info(None),
    "log_ok": lambda: pb_utils.Logger.log("x"),
}


def outcome(case):
    try:
        case()
    except Exception as exc:
        return type(exc).__name__
    return "ok"


class TritonPythonModel:
    def execute(self, requests):
        report = {"argv": sys.argv, "cases": {name: outcome(case) for name, case in CASES.items()}}
        out = pb_utils.Tensor("OUT", np.array([json.dumps(report).encode()], np.object_))
        return [pb_utils.InferenceResponse([out]) for _ in requests]
