"""Load-time rule for ensembles with a decoupled step (Triton's): a step, and the ensemble's outputs, may not join
tensors that originate from different decoupled steps, or from a decoupled step and from none."""

from __future__ import annotations

import pytest

from transerve.backends.ensemble.graph import Step
from transerve.backends.ensemble.streaming import check_decoupled_origins
from transerve.config.model_config import ConfigError


def step(index: int, inputs: dict[str, str], outputs: dict[str, str]) -> Step:
    return Step(index, f"m{index}", "", inputs, outputs)


TOKENIZE = step(0, {"TEXT": "text"}, {"IDS": "ids"})
GENERATE = step(1, {"IDS": "ids"}, {"OUT": "tokens"})  # the decoupled one
DETOKENIZE = step(2, {"TOKENS": "tokens"}, {"TEXT": "piece"})


def test_a_pipeline_after_a_decoupled_step_is_accepted():
    check_decoupled_origins("e", [TOKENIZE, GENERATE, DETOKENIZE], {1}, ["piece", "tokens"])


def test_joining_a_decoupled_branch_with_the_ensemble_input_is_refused():
    join = step(2, {"TOKENS": "tokens", "TEXT": "text"}, {"TEXT": "piece"})
    with pytest.raises(ConfigError, match="step 2 .* originate from different decoupled models"):
        check_decoupled_origins("e", [TOKENIZE, GENERATE, join], {1}, ["piece"])


def test_outputs_of_different_origins_are_refused():
    with pytest.raises(ConfigError, match="the ensemble's output receives inputs that originate from different"):
        check_decoupled_origins("e", [TOKENIZE, GENERATE, DETOKENIZE], {1}, ["piece", "ids"])


def test_two_decoupled_steps_in_a_row_are_one_origin_each():
    second = step(2, {"TOKENS": "tokens"}, {"MORE": "more"})
    check_decoupled_origins("e", [TOKENIZE, GENERATE, second], {1, 2}, ["more"])
    with pytest.raises(ConfigError):
        check_decoupled_origins("e", [TOKENIZE, GENERATE, second], {1, 2}, ["more", "tokens"])
