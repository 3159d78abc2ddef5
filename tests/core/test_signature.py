"""Request validation against a model's configuration, with Triton's wording."""

import numpy as np
import pytest

from transerve.config.model_config import normalize, parse_config_text
from transerve.core.errors import ServerError
from transerve.core.signature import ModelSignature
from transerve.core.types import InferRequest, RequestedOutput, Tensor

ADD_SUB = """
name: "add_sub" backend: "python" max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""


def signature(text: str = ADD_SUB) -> ModelSignature:
    config = parse_config_text(text)
    normalize(config, config.name)
    return ModelSignature(config.name, config)


def fp32(name: str, shape: tuple[int, ...]) -> Tensor:
    return Tensor(name, "FP32", np.zeros(shape, np.float32))


def check(inputs, outputs=None, text=ADD_SUB, request_id=""):
    signature(text).validate(InferRequest("add_sub", inputs, id=request_id, outputs=outputs))


def test_valid_request_passes():
    check([fp32("INPUT0", (3, 4)), fp32("INPUT1", (3, 4))], [RequestedOutput("OUTPUT0")])


@pytest.mark.parametrize(
    ("inputs", "fragment"),
    [
        ([fp32("INPUT0", (1, 4))], "missing required input(s) ['INPUT1']"),
        ([fp32("INPUT0", (1, 4)), fp32("INPUT0", (1, 4))], "input 'INPUT0' already exists in request"),
        ([fp32("INPUT0", (1, 4)), fp32("INPUT1", (1, 4)), fp32("X", (1,))], "expected 2 inputs but got 3"),
        ([fp32("INPUT0", (1, 4)), fp32("X", (1, 4))], "missing required input(s) ['INPUT1']"),
        ([Tensor("INPUT0", "INT32", np.zeros((1, 4), np.int32)), fp32("INPUT1", (1, 4))],
         "inference input 'INPUT0' data-type is 'INT32', but model 'add_sub' expects 'FP32'"),
        ([fp32("INPUT0", (1, 5)), fp32("INPUT1", (1, 5))], "Expected [-1,4], got [1,5]. NOTE"),
        ([fp32("INPUT0", (4,)), fp32("INPUT1", (4,))], "Expected [-1,4], got [4]"),
        ([fp32("INPUT0", (9, 4)), fp32("INPUT1", (9, 4))], "batch-size must be <= 8"),
        ([fp32("INPUT0", (2, 4)), fp32("INPUT1", (3, 4))], "batch size does not match"),
    ],
)
def test_bad_inputs_are_refused_with_triton_wording(inputs, fragment):
    with pytest.raises(ServerError) as info:
        check(inputs)
    assert fragment in info.value.message
    assert info.value.code.name == "INVALID_ARG"


def test_request_id_prefixes_errors():
    with pytest.raises(ServerError, match=r"^\[request id: r7\] expected 2 inputs"):
        check([fp32("INPUT0", (1, 4))], request_id="r7")


def test_unknown_requested_output():
    with pytest.raises(ServerError, match="unexpected inference output 'NOPE' for model 'add_sub'"):
        check([fp32("INPUT0", (1, 4)), fp32("INPUT1", (1, 4))], [RequestedOutput("NOPE")])


def test_optional_inputs_and_wildcard_dims_without_batching():
    text = """
    name: "m" backend: "python"
    input [ { name: "A" data_type: TYPE_FP32 dims: [ -1, 2 ] },
            { name: "B" data_type: TYPE_FP32 dims: [ 1 ] optional: true } ]
    output [ { name: "C" data_type: TYPE_FP32 dims: [ -1 ] } ]
    """
    sig = signature(text)
    sig.validate(InferRequest("m", [fp32("A", (7, 2))]))
    assert sig.metadata_tensors("inputs")[0] == {"name": "A", "datatype": "FP32", "shape": [-1, 2]}
    with pytest.raises(ServerError, match=r"Expected \[-1,2\], got \[7,3\]\.$"):
        sig.validate(InferRequest("m", [fp32("A", (7, 3))]))
    with pytest.raises(ServerError) as info:  # with optional inputs, Triton words the count as a range
        sig.validate(InferRequest("m", [fp32("B", (1,))]))
    assert info.value.message == (
        "[request id: <id_unknown>] expected number of inputs between 1 and 2 but got 1 inputs for model 'm'. "
        "Got input(s) ['B'], but missing required input(s) ['A']. Please provide all required input(s).")


def test_reshape_gives_the_model_its_shape():
    text = """
    name: "m" backend: "python" max_batch_size: 4
    input [ { name: "A" data_type: TYPE_FP32 dims: [ 6 ] reshape: { shape: [ 2, 3 ] } } ]
    output [ { name: "C" data_type: TYPE_FP32 dims: [ 1 ] } ]
    """
    request = InferRequest("m", [fp32("A", (2, 6))])
    signature(text).validate(request)
    assert request.inputs[0].data.shape == (2, 2, 3)
