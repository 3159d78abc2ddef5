"""Logits processing and token choice for one sequence of the torch engine, as transformers' `generate` does it.

The engine calls these on the rows of one sequence (one row, or one per beam) of the batch's logits, so sequences
with different options share a forward pass. Order and arithmetic follow transformers' processors so that outputs
match `generate` token for token: repetition penalty, bad words, min new tokens; then, when sampling, temperature,
top-k, top-p, min-p (transformers' warpers, in its order) and a draw from the sequence's own `torch.Generator`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from transerve.backends.generation.engine import DecodingOptions
from transerve.backends.generation.torch.host_copies import to_device

if TYPE_CHECKING:
    import torch


@dataclass(slots=True)
class TokenRules:
    """The processors one sequence asks for, prepared once at submit."""

    end_ids: list[int]
    repetition_penalty: float
    min_new_tokens: int
    #: Single-token bad words (masked always).
    banned: list[int]
    #: Multi-token bad words, by prefix length then prefix: the last tokens masked right after that prefix (one
    #: look-up per length and row each step, however many words a sequence bans).
    banned_after: dict[int, dict[tuple[int, ...], list[int]]]
    #: The model's own constraints (its generation config): the first token, and the end tokens at the last step.
    forced_first: int | None = None
    forced_last: list[int] | None = None
    max_new_tokens: int = 0
    no_repeat_ngram_size: int = 0
    #: Token sequences that end generation once produced, by length (one look-up per length each step).
    stops: dict[int, set[tuple[int, ...]]] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return (
            self.repetition_penalty != 1.0 or self.min_new_tokens > 0 or bool(self.banned or self.banned_after)
            or self.forced_first is not None or self.forced_last is not None or self.no_repeat_ngram_size > 0
        )


@dataclass(slots=True)
class ModelRules:
    """What a model's generation config imposes on every sequence, as `generate` applies it."""

    bad_words: list[list[int]] = field(default_factory=list)
    #: `forced_bos_token_id` (encoder-decoder models): the first new token.
    forced_first: int | None = None
    #: `forced_eos_token_id`: the token(s) allowed at the last step (max_new_tokens reached).
    forced_last: list[int] | None = None
    #: `no_repeat_ngram_size`: no n-gram of the decoder's tokens occurs twice.
    no_repeat_ngram_size: int = 0


def token_rules(options: DecodingOptions, end_ids: list[int], model: ModelRules | None = None) -> TokenRules:
    """Rules for `options`; a bad word that is exactly an end token is ignored, as transformers ignores it."""
    model = model or ModelRules()
    words = [[int(t) for t in word] for word in options.bad_words] + [word for word in model.bad_words if word]
    single = [word[0] for word in words if len(word) == 1 and word[0] not in end_ids]
    multi: dict[int, dict[tuple[int, ...], list[int]]] = {}
    for word in words:
        if len(word) > 1:
            multi.setdefault(len(word) - 1, {}).setdefault(tuple(word[:-1]), []).append(word[-1])
    return TokenRules(
        end_ids, options.repetition_penalty, options.min_new_tokens, single, multi, model.forced_first,
        model.forced_last, options.max_new_tokens, model.no_repeat_ngram_size,
        _by_length(options.stop_sequences),
    )


def _by_length(words: list[list[int]]) -> dict[int, set[tuple[int, ...]]]:
    by_length: dict[int, set[tuple[int, ...]]] = {}
    for word in words:
        by_length.setdefault(len(word), set()).add(tuple(int(t) for t in word))
    return by_length


def apply_rules(scores: torch.Tensor, contexts: list[list[int]], generated: int, rules: TokenRules) -> None:
    """Process `scores` ([rows, vocab], in place): row i continues `contexts[i]` (the decoder's tokens so far:
    the prompt or the decoder start token, then the new tokens); `generated` new tokens exist so far."""
    import torch

    def ids(values: list[int] | list[list[int]]) -> torch.Tensor:  # a list index would wait for a GPU
        return to_device(values, scores.device, torch.long)

    if rules.repetition_penalty != 1.0:
        index = ids(contexts)
        picked = torch.gather(scores, 1, index)
        penalty = rules.repetition_penalty
        scores.scatter_(1, index, torch.where(picked < 0, picked * penalty, picked / penalty))
    if rules.no_repeat_ngram_size:
        for row, context in enumerate(contexts):
            repeated = _repeated_ngram_ends(context, rules.no_repeat_ngram_size)
            if repeated:
                scores[row].index_fill_(0, ids(repeated), -math.inf)
    if rules.banned:
        scores.index_fill_(1, ids(rules.banned), -math.inf)
    for row, context in enumerate(contexts):
        for length, prefixes in rules.banned_after.items():
            if len(context) >= length:
                for last in prefixes.get(tuple(context[len(context) - length:]), ()):
                    scores[row, last] = -math.inf
    if generated < rules.min_new_tokens and rules.end_ids:
        scores.index_fill_(1, ids(rules.end_ids), -math.inf)
    if rules.forced_first is not None and generated == 0:
        scores.fill_(-math.inf)
        scores[:, rules.forced_first] = 0
    if rules.forced_last is not None and generated == rules.max_new_tokens - 1:
        scores.fill_(-math.inf)
        scores.index_fill_(1, ids(rules.forced_last), 0)


def _repeated_ngram_ends(context: list[int], size: int) -> list[int]:
    """Tokens that would complete an n-gram already in `context` (transformers' NoRepeatNGramLogitsProcessor)."""
    if len(context) < size:
        return []
    prefix = context[len(context) - size + 1:]
    return sorted({
        context[i + size - 1] for i in range(len(context) - size + 1) if context[i:i + size - 1] == prefix
    })


def warp(scores: torch.Tensor, options: DecodingOptions) -> None:
    """Temperature, top-k, top-p and min-p on `scores` ([1, vocab], in place), as transformers' logits warpers."""
    import torch

    if options.temperature != 1.0:
        scores.div_(options.temperature)
    if options.top_k > 0:
        top_k = min(options.top_k, scores.size(-1))
        threshold = torch.topk(scores, top_k)[0][..., -1, None]
        scores.masked_fill_(scores < threshold, -math.inf)
    if options.top_p < 1.0:
        sorted_logits, sorted_indices = torch.sort(scores, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        sorted_remove = cumulative <= (1 - options.top_p)
        sorted_remove[..., -1:] = False
        scores.masked_fill_(sorted_remove.scatter(1, sorted_indices, sorted_remove), -math.inf)
    if options.min_p > 0.0:
        cut_min_p(scores, options.min_p)


def cut_min_p(scores: torch.Tensor, min_p: float) -> None:
    """Tokens whose probability is below `min_p` (in [0, 1]) times the likeliest's get -inf (`scores` [rows,
    vocab], in place), as transformers' MinPLogitsWarper cuts them; the likeliest token is never below that."""
    import torch

    probs = torch.softmax(scores, dim=-1)
    scores.masked_fill_(probs < min_p * probs.amax(dim=-1, keepdim=True), -math.inf)


def sample(scores: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token id ([1]) drawn from softmax(`scores`) ([1, vocab]) with the sequence's own generator."""
    import torch

    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).view(1)
