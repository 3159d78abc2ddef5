"""Token selection for the torch engine: each running sequence's next token(s) from one step's logits, with its
own options (`sampling`: rules, warpers, draws; `beam`: beam search), and its result once it ends.

Log-probabilities are those of the distribution each token was chosen from, as transformers' `output_scores`
(log-softmaxed) reports them: after the repetition penalty, bad words, min_new_tokens and the model's forced tokens,
and when sampling after temperature, top-k and top-p. A greedy or sampled hypothesis' score is their sum; a beam
hypothesis' score is transformers' `sequences_scores` (their sum divided by length ** length_penalty). Stop
sequences match the new tokens only. With `top_logprobs` k, a sequence's step also reports the k likeliest tokens
of that same distribution (one `topk` over the rows that ask), so the chosen token's log-probability is exactly its
entry there, and a greedy step's first entry is its token. A part of its own because it is pure arithmetic on
logits: it never touches the batch's cache or the queue, and the schedulings share it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from transerve.backends.generation.engine import GenerationResult, Hypothesis, TopLogProbs
from transerve.backends.generation.sampling import apply_rules, sample, warp
from transerve.backends.generation.torch_sequence import Sequence

if TYPE_CHECKING:
    import torch

#: A sequence that decodes on after a step: it, its first row in the batch now, the rows it keeps (in order) and
#: their next input tokens.
Stay = tuple[Sequence, int, list[int], list[int]]


@dataclass(slots=True)
class Choices:
    """What one step chose, for the engine to apply: the rows that stay, who finished and what is streamed."""

    stays: list[Stay]
    #: Sequences that ended this step, with their reason and their first row in the batch before the step.
    finished: list[tuple[Sequence, str, int]]
    streamed: list[tuple[Sequence, int]]
    #: The token chosen for every row of the step (beams: each row's best, which beam search does not feed on).
    tokens: list[int]


def choose(running: list[Sequence], logits: torch.Tensor) -> Choices:
    """Choose every running sequence's next token(s) from `logits` [rows, vocab] (each sequence owns `rows`
    consecutive rows, in `running`'s order)."""
    import torch

    row = 0
    for sequence in running:
        if sequence.beam is None:
            scores = logits[row:row + 1]
            if sequence.rules.active:
                apply_rules(scores, [sequence.prefix + sequence.tokens], len(sequence.tokens), sequence.rules)
            if sequence.generator is not None:
                warp(scores, sequence.request.options)
        row += sequence.rows
    choice = logits.argmax(dim=-1)
    row = 0
    for sequence in running:
        if sequence.generator is not None:
            choice[row:row + 1] = sample(logits[row:row + 1], sequence.generator)
        row += sequence.rows
    # One log-softmax for every row: logsumexp alone costs several times more on CPU (its exp of the whole
    # vocabulary is slow where most values underflow); beams search on these log-probabilities.
    log_probs = torch.log_softmax(logits, dim=-1)
    # The step's one copy to the host (on a GPU each copy waits for the device): ids are exact in float64.
    chosen = torch.stack((choice.double(), log_probs.gather(1, choice[:, None])[:, 0].double())).tolist()
    tokens, chosen_log_probs = [int(token) for token in chosen[0]], chosen[1]
    tops = _top_log_probs(running, log_probs, tokens)

    stays: list[Stay] = []
    finished: list[tuple[Sequence, str, int]] = []
    streamed: list[tuple[Sequence, int]] = []
    row = 0
    for sequence in running:
        if sequence.beam is not None:
            rows = _beam_step(sequence, log_probs[row:row + sequence.rows])
            if rows is None:
                finished.append((sequence, "end", row))
            else:
                beams = [beam[-1] for beam in sequence.beam.running_tokens]
                stays.append((sequence, row, [row + r for r in rows], beams))
        else:
            token = tokens[row]
            sequence.tokens.append(token)
            sequence.log_probs.append(chosen_log_probs[row])
            if row in tops:
                sequence.top.append(tops[row])
            sequence.score += chosen_log_probs[row]
            if sequence.request.stream and sequence.on_tokens is not None:
                streamed.append((sequence, token))
            reason = _finish_reason(sequence)
            if reason is None:
                stays.append((sequence, row, [row], [token]))
            else:
                finished.append((sequence, reason, row))
        row += sequence.rows
    return Choices(stays, finished, streamed, tokens)


def result(sequence: Sequence, reason: str) -> GenerationResult:
    """The result of a sequence that ended for `reason` ("end", "length", "cancelled"); a beam search's reason is
    its best hypothesis'."""
    options = sequence.request.options
    if sequence.beam is not None:
        if reason == "cancelled":
            hypotheses = sequence.beam.partial(options.num_return_sequences, options.return_log_probs)
        else:
            hypotheses = sequence.beam.hypotheses(options.num_return_sequences, options.return_log_probs)
            best = hypotheses[0].token_ids
            reason = "end" if best and _ends(sequence, best) else "length"
    else:
        log_probs = sequence.log_probs if options.return_log_probs else None
        top = sequence.top if options.top_logprobs else None
        hypotheses = [Hypothesis(sequence.tokens, sequence.score, log_probs, top)]
    return GenerationResult(hypotheses, reason)


def _top_log_probs(running: list[Sequence], log_probs: torch.Tensor, tokens: list[int]) -> dict[int, TopLogProbs]:
    """The likeliest tokens of each row whose sequence asks for `top_logprobs`, by row: one `topk` of the largest
    k asked over those rows. Where the chosen token ties with the first entry, it comes first."""
    asking, row = [], 0
    for sequence in running:
        if sequence.beam is None and sequence.request.options.top_logprobs:
            asking.append((row, sequence.request.options.top_logprobs))
        row += sequence.rows
    if not asking:
        return {}
    import torch

    rows = [row for row, _ in asking]
    k = min(max(k for _, k in asking), log_probs.shape[-1])
    values, indices = torch.topk(log_probs[rows], k)
    tops = {}
    for (row, wanted), ids, lps in zip(asking, indices.tolist(), values.tolist(), strict=True):
        top = list(zip(ids[:wanted], lps[:wanted], strict=True))
        chosen = tokens[row]
        place = next((i for i, (token, _) in enumerate(top) if token == chosen), None)
        if place and top[place][1] == top[0][1]:
            top.insert(0, top.pop(place))
        tops[row] = top
    return tops


def _beam_step(sequence: Sequence, scores: torch.Tensor) -> list[int] | None:
    """Beam search processes log-probabilities (`scores`, the sequence's rows), not logits, as transformers' does;
    the rules apply to them in place."""
    beam = sequence.beam
    if sequence.rules.active:
        contexts = [sequence.prefix + tokens for tokens in beam.running_tokens]
        apply_rules(scores, contexts, beam.generated, sequence.rules)
    return beam.step(scores, lambda tokens: _ends(sequence, tokens), sequence.request.options.return_log_probs)


def _ends(sequence: Sequence, tokens: list[int]) -> bool:
    if tokens[-1] in sequence.rules.end_ids:
        return True
    return any(
        len(tokens) >= len(stop) and tokens[len(tokens) - len(stop):] == stop
        for stop in sequence.rules.stops
    )


def _finish_reason(sequence: Sequence) -> str | None:
    if _ends(sequence, sequence.tokens):
        return "end"
    if len(sequence.tokens) >= sequence.request.options.max_new_tokens:
        return "length"
    return None
