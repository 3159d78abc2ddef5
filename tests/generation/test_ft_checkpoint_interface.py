"""The FasterTransformer backend's example configs through the generation backend's tensor interface: reshaped
scalars, its GPT names, and its inputs and outputs without effect here (accepted at their neutral value only)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from transerve.backends.generation.fastertransformer import _INERT, _INERT_OUTPUTS
from transerve.backends.generation.interface import Inert, RowResult, TensorInterface
from transerve.config.model_config import parse_config_text
from transerve.core.errors import ErrorCode, ServerError
from transerve.core.types import InferRequest, RequestedOutput, Tensor

CONFIGS = Path(__file__).parents[1] / "e2e" / "ft_repository_models"


def ft_interface(model: str) -> TensorInterface:
    inert = {**_INERT, "start_id": Inert("the decoder's start token", 0)}
    return TensorInterface(parse_config_text((CONFIGS / f"{model}.pbtxt").read_text()), inert, _INERT_OUTPUTS)


def request(*tensors: Tensor, outputs: list[str] | None = None) -> InferRequest:
    wanted = None if outputs is None else [RequestedOutput(name) for name in outputs]
    return InferRequest("fastertransformer", list(tensors), outputs=wanted)


def test_the_generation_backend_alone_names_the_input_it_does_not_know():
    with pytest.raises(ServerError, match="input 'beam_search_diversity_rate' is not one the generation backend"):
        TensorInterface(parse_config_text((CONFIGS / "t5.pbtxt").read_text()))


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
