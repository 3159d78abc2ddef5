"""A prompt's tokens scored by a causal LM (`prompt_logprobs`, the OpenAI API's `echo` with `logprobs`): one plain
forward over the whole prompt, each position's log-softmax, the next token's entry and the likeliest ones.

A forward of its own rather than the batch's prefill, which computes the LM head on the last position only: this
one needs every position's logits ([prompt length, vocabulary], in float32), which only such requests pay for.
"""

from __future__ import annotations

from typing import Any

from transerve.backends.generation.engine import PromptScores


def score_prompt(model: Any, ids: list[int], top: int) -> PromptScores:
    """Entry i: log p(ids[i + 1] | ids[: i + 1]), that token's rank there, and the position's `top` likeliest
    tokens."""
    import torch

    tokens = torch.tensor([ids], dtype=torch.long, device=model.device)
    logits = model(input_ids=tokens, use_cache=False).logits[0, :-1]
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    chosen = log_probs.gather(1, tokens[0, 1:, None])
    ranks = ((log_probs > chosen).sum(dim=-1) + 1).tolist()
    chosen = chosen[:, 0].tolist()
    if not top:
        return PromptScores(chosen, [[] for _ in chosen], ranks)
    values, indices = log_probs.topk(top, dim=-1)
    return PromptScores(chosen, [list(zip(i, v, strict=True)) for i, v in zip(indices.tolist(), values.tolist(),
                                                                              strict=True)], ranks)
