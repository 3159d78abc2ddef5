"""An error inside a decoding step fails only the sequence whose own work raised it; the batch decodes on.

Submit-time checks keep client options from reaching a step (test_request_isolation.py); these tests make a
sequence's rules fail inside the step (a token past the vocabulary, put into its rules after submit) to show what
happens to the sequences that share the batch when something is still missed.
"""

from __future__ import annotations

from concurrent.futures import Future

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from support.torch_engine import run, submit, tokens  # noqa: E402

from transerve.backends.generation.engine import DecodingOptions, GenerationRequest, GenerationResult  # noqa: E402
from transerve.core.errors import ServerError  # noqa: E402

PROMPT = [5, 17, 33, 41, 8]
LONG = DecodingOptions(max_new_tokens=120, min_new_tokens=120)


@pytest.mark.parametrize("beam_width", [1, 3])
def test_a_sequence_whose_rules_fail_in_a_step_fails_alone(models, beam_width):
    engine = models["gpt2"].engine
    alone = tokens(run(engine, PROMPT, LONG))
    bystander = submit(engine, PROMPT, LONG)
    failing: Future = Future()
    options = DecodingOptions(max_new_tokens=60, beam_width=beam_width)
    handle = engine.submit(GenerationRequest([9, 10, 11], options), None, failing.set_result)
    handle._sequence.rules.banned = [10**8]  # past the vocabulary: its next step's masking raises
    outcome = failing.result(timeout=60)
    assert isinstance(outcome, ServerError), outcome
    assert "generation failed" in outcome.message
    result = bystander.result(timeout=60)
    assert isinstance(result, GenerationResult), result
    assert tokens(result) == alone
    assert tokens(run(engine, PROMPT, DecodingOptions(max_new_tokens=8, min_new_tokens=8))) == [alone[0][:8]]
