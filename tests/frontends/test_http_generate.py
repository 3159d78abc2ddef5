"""The generate extension's request mapping: members to inputs or parameters, in order, as Triton maps them."""

import numpy as np
import pytest

from transerve.config.model_config import normalize, parse_config_text
from transerve.core.errors import ServerError
from transerve.core.signature import ModelSignature
from transerve.core.types import InferResponse, Tensor
from transerve.frontends.http.generate import decode_generate_request, encode_generate_response

CHAT = """
name: "chat" backend: "python" max_batch_size: 4
input [ { name: "PROMPT" data_type: TYPE_STRING dims: [ 1 ] }, { name: "PAIR" data_type: TYPE_INT32 dims: [ 2 ] },
        { name: "IDS" data_type: TYPE_INT64 dims: [ 3, -1 ] optional: true } ]
output [ { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] } ]
"""


def decode(body: bytes):
    config = parse_config_text(CHAT)
    normalize(config, config.name)
    return decode_generate_request("chat", "", ModelSignature("chat", config), body)


def test_members_become_inputs_or_parameters():
    request = decode(b'{"id": "r1", "PROMPT": "hi", "PAIR": [1, 2, 3, 4], "IDS": [1, 2, 3, 4, 5, 6], "t": 0.5, '
                     b'"parameters": {"top": 3, "big": 18446744073709551616}}')
    shapes = {tensor.name: tensor.data.shape for tensor in request.inputs}
    assert shapes == {"PROMPT": (1, 1), "PAIR": (2, 2), "IDS": (1, 3, 2)}  # the batch takes what is left over
    assert request.id == "r1"
    assert request.parameters == {"id": "r1", "t": 0.5, "top": 3, "big": 2.0**64}


def test_parameters_may_hold_inputs_and_a_repeated_parameter_keeps_its_first_value():
    request = decode(b'{"PROMPT": "hi", "x": 1, "x": 2, "parameters": {"PAIR": [5, 6], "x": 3}}')
    assert [tensor.name for tensor in request.inputs] == ["PROMPT", "PAIR"]
    assert request.parameters == {"x": 1}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"PROMPT": "a", "PROMPT": "b"}', "[request id: <id_unknown>] input 'PROMPT' already exists in request"),
        (b'{"id": "7", "PAIR": [1, 2], "parameters": {"PAIR": [1, 2]}}',
         "Converting keyword: 'parameters': [request id: 7] input 'PAIR' already exists in request"),
        (b'{"id": 7}', "Unable to parse 'id': attempt to access JSON non-string as string"),
        (b'{"p": [1]}', "parameter 'p' has invalid type. It should be either 'int', 'bool', or 'string'."),
        (b'{"parameters": [1]}', "Expected JSON object for keyword: 'parameters': attempt to access JSON non-object"),
        (b'{"parameters": {"q": {}}}', "Converting keyword: 'parameters': parameter 'q' has invalid type."),
        (b'{"PROMPT": ["a", 1]}', "attempt to access JSON non-string as string"),
        (b'{"PAIR": [1, 2, 3]}', "The schema can not convert input 'PAIR' to tensor with proper shape"),
        (b'{"IDS": [1, 2]}', "The schema can not convert input 'IDS' to tensor with proper shape"),
        (b'{"PAIR": [[1, 2], [3, 4]]}', "Shape does not match true shape of 'data' field"),
        (b'{"PAIR": [1.5, 2]}', "attempt to access JSON non-signed-integer as signed-integer"),
        (b"[1]", "the generate request must be a JSON object"),
        (b'{"a": NaN}', "failed to parse the request JSON buffer"),
        (b'{"a": "\\ud800"}', "failed to parse the request JSON buffer"),
        (b'{"a": -Infinity}', "failed to parse the request JSON buffer: -Infinity is not valid JSON"),
        (b'{"a": "\\udc00\\ud800"}', "failed to parse the request JSON buffer"),
        (b'{"a": "\xff"}', "failed to parse the request JSON buffer"),
        (b'{"a": "\xed\xa0\x80"}', "failed to parse the request JSON buffer"),  # a surrogate, UTF-8 encoded
        (b"[" * 100_000, "failed to parse the request JSON buffer"),
        (b"", "failed to parse the request JSON buffer"),
    ],
)
def test_refusals_in_tritons_words(body: bytes, message: str):
    with pytest.raises(ServerError) as info:
        decode(body)
    assert message in info.value.message
    assert info.value.code.name == "INVALID_ARG"


def test_response_is_flat_and_in_tritons_order():
    response = InferResponse("chat", "1", [Tensor("TEXT", "BYTES", np.array([[b"hi"]], dtype=object)),
                                           Tensor("N", "INT32", np.array([1, 2], np.int32))],
                             id="r1", parameters={"done": True})
    document = encode_generate_response(response)
    assert list(document) == ["N", "TEXT", "done", "id", "model_name", "model_version"]
    assert document == {"N": [1, 2], "TEXT": "hi", "done": True, "id": "r1", "model_name": "chat",
                        "model_version": "1"}
    assert "id" not in encode_generate_response(InferResponse("chat", "1", []))


def test_a_surrogate_pair_and_other_unicode_escapes_are_read():
    request = decode(b'{"PROMPT": "\\ud83d\\ude00 \\u00e9", "p": "\\ud83d\\ude00"}')
    assert request.inputs[0].data.tolist() == [["\U0001f600 \u00e9".encode()]]
    assert request.parameters == {"p": "\U0001f600"}
