"""One sequence inside the torch engine: what the scheduler queues and admits and token selection advances (its
tokens, beams and draws). A part of its own because both read it (`engine` wires them); its rows in the batch
belong to the batch runner, and rows prepared before it joins to the scheduler (`Scheduler.take_prepared`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from transerve.backends.generation.engine import (
    DoneCallback,
    GenerationRequest,
    PromptScores,
    TokenCallback,
    TopLogProbs,
)
from transerve.backends.generation.torch.sampling import TokenRules

if TYPE_CHECKING:
    import torch

    from transerve.backends.generation.grammar.masks import RowGrammar
    from transerve.backends.generation.torch.beam import BeamSearch


@dataclass(eq=False)
class Sequence:
    """One submitted sequence and its decoding state."""

    request: GenerationRequest
    on_tokens: TokenCallback | None
    done: DoneCallback
    rules: TokenRules
    #: Rows it occupies (its beam width) and its share of the KV budget.
    rows: int
    need: int
    #: The input (source or prompt) and the decoder's tokens before the new ones: the prompt (decoder-only) or the
    #: decoder start token.
    input_ids: list[int]
    prefix: list[int]
    generator: torch.Generator | None = None
    beam: BeamSearch | None = None
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    #: Each new token's step's likeliest tokens, when `top_logprobs` is asked for.
    top: list[TopLogProbs] = field(default_factory=list)
    score: float = 0.0
    cancelled: bool = False
    #: Its grammar's state, when it decodes under a structured-output constraint (beam_width 1).
    grammar: RowGrammar | None = None
    #: Under a constraint with beams: each running beam's grammar state, in the beams' order.
    beam_grammars: list[RowGrammar] | None = None
    #: Its prompt's scores, computed when it is admitted, where `prompt_logprobs` asks for them.
    prompt: PromptScores | None = None
