"""The FasterTransformer backend's example configs (examples/fastertransformer/) through the generation backend's
tensor interface: main's reshaped scalars, its GPT names, and its inputs and outputs without effect here (accepted
at their neutral value only); dev/v1.1_beta's T5 `REQUEST_INPUT_LEN` `[-1]` and GPT `INPUT_ID` `[-1, -1]`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from transerve.backends.generation.fastertransformer.backend import _INERT, _INERT_OUTPUTS
from transerve.backends.generation.interface import Inert, RowResult, TensorInterface
from transerve.config.model_config import parse_config_text
from transerve.core.errors import ErrorCode, ServerError
from transerve.core.types import InferRequest, RequestedOutput, Tensor

CONFIGS = Path(__file__).parents[2] / "examples" / "fastertransformer"


def ft_interface(model: str, generation: str = "main") -> TensorInterface:
    inert = {**_INERT, "start_id": Inert("the decoder's start token", 0)}
    text = (CONFIGS / generation / model / "config.pbtxt").read_text()
    return TensorInterface(parse_config_text(text), inert, _INERT_OUTPUTS)


def request(*tensors: Tensor, outputs: list[str] | None = None) -> InferRequest:
    wanted = None if outputs is None else [RequestedOutput(name) for name in outputs]
    return InferRequest("fastertransformer", list(tensors), outputs=wanted)


def test_the_generation_backend_alone_names_the_input_it_does_not_know():
    with pytest.raises(ServerError, match="input 'beam_search_diversity_rate' is not one the generation backend"):
        TensorInterface(parse_config_text((CONFIGS / "main" / "t5" / "config.pbtxt").read_text()))


def test_the_t5_example_takes_reshaped_scalars():
    interface = ft_interface("t5")
    assert interface.names.lengths == "sequence_length"
    assert {"max_output_len", "runtime_top_k", "is_return_log_probs", "len_penalty"} <= interface.option_inputs
    # `reshape: { shape: [] }`: the server hands the backend one value per row, not [batch, 1]
    rows, options = interface.rows(request(
        Tensor("input_ids", "UINT32", np.array([[5, 6, 0]], np.uint32)),
        Tensor("sequence_length", "UINT32", np.array([2], np.uint32)),
        Tensor("beam_search_diversity_rate", "FP32", np.array([0.0], np.float32)),
        Tensor("start_id", "UINT32", np.array([0], np.uint32)),
    ))
    assert rows[0].input_ids == [5, 6] and options == {}


def test_the_gpt_example_has_its_own_names():
    interface = ft_interface("gpt")
    assert (interface.names.lengths, interface.names.input_lengths) == ("input_lengths", "response_input_lengths")
    assert "request_output_len" in interface.option_inputs  # dims [-1]: one value per row
    assert "context_embeddings" not in interface.outputs
    tensors = interface.response_tensors([RowResult([[5, 6, 7, 8]], [2], input_length=2)],
                                         ["output_ids", "response_input_lengths"])
    assert tensors[1].data.tolist() == [[2]]


@pytest.mark.parametrize(("name", "array", "says"), [
    ("beam_search_diversity_rate", np.array([0.5], np.float32), "send 0.0 or leave it out"),
    ("request_prompt_lengths", np.array([0], np.uint32), "prompt learning) is not supported by transerve; leave"),
    ("start_id", np.array([2], np.uint32), "send 0 or leave it out"),
])
def test_inputs_without_effect_are_refused_unless_neutral(name, array, says):
    interface = ft_interface("t5")
    with pytest.raises(ServerError) as caught:
        interface.rows(request(
            Tensor("input_ids", "UINT32", np.array([[5, 6]], np.uint32)),
            Tensor("sequence_length", "UINT32", np.array([2], np.uint32)),
            Tensor(name, "FP32" if array.dtype == np.float32 else "UINT32", array),
        ))
    assert caught.value.code is ErrorCode.INVALID_ARG and says in caught.value.message


def test_an_output_never_produced_is_refused_when_asked_for():
    interface = ft_interface("gpt")
    with pytest.raises(ServerError, match="'context_embeddings' is declared by this model's config"):
        interface.wanted(request(outputs=["output_ids", "context_embeddings"]), log_probs=False)
    assert "context_embeddings" not in interface.wanted(request(), log_probs=True)


def test_the_v1_t5_config_takes_one_length_per_row_in_dims_minus_one():
    """dev/v1.1_beta's T5: REQUEST_INPUT_LEN `[-1]`, the tutorial client's `[batch, 1]`; more values is a 400."""
    interface = ft_interface("t5", "v1.1_beta")
    assert (interface.names.ids, interface.names.lengths) == ("INPUT_ID", "REQUEST_INPUT_LEN")
    ids = Tensor("INPUT_ID", "UINT32", np.array([[5, 6, 0], [7, 8, 9]], np.uint32))
    rows, _ = interface.rows(request(ids, Tensor("REQUEST_INPUT_LEN", "UINT32", np.array([[2], [3]], np.uint32))))
    assert [row.input_ids for row in rows] == [[5, 6], [7, 8, 9]]
    with pytest.raises(ServerError, match="row 0: 'REQUEST_INPUT_LEN' must hold one value per row, got 2"):
        interface.rows(request(ids, Tensor("REQUEST_INPUT_LEN", "UINT32", np.array([[2, 2], [3, 3]], np.uint32))))


def test_the_v1_gpt_config_takes_ids_with_a_beam_axis():
    """dev/v1.1_beta's GPT: INPUT_ID `[-1, -1]`, sent `[batch, 1, L]` as its clients send it."""
    interface = ft_interface("gpt", "v1.1_beta")
    assert "REQUEST_OUTPUT_LEN" in interface.option_inputs and list(interface.outputs) == ["OUTPUT0"]
    rows, options = interface.rows(request(
        Tensor("INPUT_ID", "UINT32", np.array([[[5, 6, 7]]], np.uint32)),
        Tensor("REQUEST_INPUT_LEN", "UINT32", np.array([[3]], np.uint32)),
        Tensor("REQUEST_OUTPUT_LEN", "UINT32", np.array([[4]], np.uint32)),
    ))
    assert rows[0].input_ids == [5, 6, 7] and options["REQUEST_OUTPUT_LEN"].tolist() == [[4]]
    with pytest.raises(ServerError, match=r"\(or \[batch, 1, length\]\), got shape \[1, 2, 3\]"):
        interface.rows(request(Tensor("INPUT_ID", "UINT32", np.zeros([1, 2, 3], np.uint32)),
                               Tensor("REQUEST_INPUT_LEN", "UINT32", np.array([[3]], np.uint32))))


def test_a_length_input_with_other_dims_is_refused_naming_both_it_takes():
    text = (CONFIGS / "v1.1_beta" / "t5" / "config.pbtxt").read_text().replace("dims: [ -1 ]\n  }\n]\noutput",
                                                                                "dims: [ 2 ]\n  }\n]\noutput", 1)
    with pytest.raises(ServerError, match=r"input 'REQUEST_INPUT_LEN' has dims \[2\]; the generation backend takes "
                                          r"\[1\] or \[-1\]"):
        TensorInterface(parse_config_text(text))
