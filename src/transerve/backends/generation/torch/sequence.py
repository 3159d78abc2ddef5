"""One sequence inside the torch engine: what the scheduler queues and admits, the runner computes rows for, and
token selection advances. A part of its own because all three read and write it (`engine` wires them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from transerve.backends.generation.engine import DoneCallback, GenerationRequest, TokenCallback, TopLogProbs
from transerve.backends.generation.torch.sampling import TokenRules

if TYPE_CHECKING:
    import torch

    from transerve.backends.generation.torch.beam import BeamSearch
    from transerve.backends.generation.torch.join_stream import Prepared


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
    #: Its rows, prepared ahead (by the joining thread, or by an earlier joining call), and whether the joining
    #: thread is at it now.
    prepared: Prepared | None = None
    preparing: bool = False
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    #: Each new token's step's likeliest tokens, when `top_logprobs` is asked for.
    top: list[TopLogProbs] = field(default_factory=list)
    score: float = 0.0
    cancelled: bool = False
