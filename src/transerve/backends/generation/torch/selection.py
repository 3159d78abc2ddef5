"""Token selection for the torch engine: each running sequence's next token(s) from one step's logits, with its
own options (`sampling`: rules, warpers, draws; `beam`: beam search), and its result once it ends.

Log-probabilities are those of the distribution each token was chosen from, as transformers' `output_scores`
(log-softmaxed) reports them: after the repetition penalty, bad words, min_new_tokens and the model's forced tokens,
and when sampling after temperature, top-k and top-p. A greedy or sampled hypothesis' score is their sum; a beam
hypothesis' score is transformers' `sequences_scores` (their sum divided by length ** length_penalty). Stop
sequences match the new tokens only. Sequences under a structured-output grammar get their token masks first
(`grammar.masks`, one fill for the batch), and end when their grammar takes no more tokens. With `top_logprobs` k, a
sequence's step also reports the k likeliest tokens of that same distribution (one `topk` over the rows that ask),
so the chosen token's log-probability is exactly its entry there, and a greedy step's first entry is its token. An
error in one sequence's own work (its rules, its draw, its beams) fails that sequence only: it leaves with reason
"failed" and its error, the others go on. A part of its own because it is pure arithmetic on logits: it never
touches the batch's cache or the queue, and the schedulings share it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from transerve.backends.generation.engine import GenerationResult, Hypothesis, TopLogProbs
from transerve.backends.generation.grammar.masks import GrammarError, RowGrammar, apply_masks
from transerve.backends.generation.torch.host_copies import to_device
from transerve.backends.generation.torch.sampling import apply_rules, sample, warp
from transerve.backends.generation.torch.sequence import Sequence

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
    #: The error of each sequence that finished "failed".
    errors: dict[Sequence, Exception] = field(default_factory=dict)


def choose(running: list[Sequence], logits: torch.Tensor) -> Choices:
    """Choose every running sequence's next token(s) from a step's logits [rows, vocab] (`StepResult.logits`:
    each sequence owns `rows` consecutive rows, in `running`'s order; processed in place)."""
    import torch

    errors: dict[Sequence, Exception] = {}
    _mask(running, logits, errors)
    row = 0
    for sequence in running:
        if sequence.beam is None:
            scores = logits[row:row + 1]
            try:
                if sequence.rules.active:
                    apply_rules(scores, [sequence.prefix + sequence.tokens], len(sequence.tokens), sequence.rules)
                if sequence.generator is not None:
                    warp(scores, sequence.request.options)
            except Exception as error:  # noqa: BLE001 - this sequence fails, the batch goes on
                errors[sequence] = error
        row += sequence.rows
    choice = logits.argmax(dim=-1)
    row = 0
    for sequence in running:
        if sequence.generator is not None and sequence not in errors:
            try:
                choice[row:row + 1] = sample(logits[row:row + 1], sequence.generator)
            except Exception as error:  # noqa: BLE001
                errors[sequence] = error
        row += sequence.rows
    # One log-softmax for every row: logsumexp alone costs several times more on CPU (its exp of the whole
    # vocabulary is slow where most values underflow); beams search on these log-probabilities.
    log_probs = torch.log_softmax(logits, dim=-1)
    beam_rows, keep = _beam_rows(running, log_probs, errors)
    asking = _asking_top(running)
    asking_rows = [row for row, _ in asking]
    top_k = min(max((wanted for _, wanted in asking), default=0), log_probs.shape[-1])
    # The step's one copy to the host (on a GPU each copy waits for the device), ids exact in float64: every row's
    # chosen token and its log-probability, then the likeliest `keep` tokens of each beam and theirs, then those
    # of the rows that ask for `top_logprobs`.
    parts = [choice.double(), log_probs.gather(1, choice[:, None])[:, 0].double()]
    for rows, k in ((beam_rows, keep), (asking_rows, top_k)):
        if rows:
            values, ids = torch.topk(log_probs.index_select(0, to_device(rows, log_probs.device, torch.long)), k)
            parts += [ids.double().flatten(), values.double().flatten()]
    copied = torch.cat(parts).tolist()
    count = logits.shape[0]
    tokens, chosen_log_probs = [int(token) for token in copied[:count]], copied[count:2 * count]
    beam_tops, start = _likeliest(copied, 2 * count, beam_rows, keep)
    tops = _top_log_probs(asking, _likeliest(copied, start, asking_rows, top_k)[0], tokens)

    stays: list[Stay] = []
    finished: list[tuple[Sequence, str, int]] = []
    streamed: list[tuple[Sequence, int]] = []
    row = 0
    for sequence in running:
        if sequence not in errors:
            try:
                _advance(sequence, row, tokens, chosen_log_probs, beam_tops, tops, stays, finished, streamed)
            except Exception as error:  # noqa: BLE001
                errors[sequence] = error
        if sequence in errors:
            finished.append((sequence, "failed", row))
        row += sequence.rows
    return Choices(stays, finished, streamed, tokens, errors)


def _advance(sequence: Sequence, row: int, tokens: list[int], chosen_log_probs: list[float],
             beam_tops: dict[int, tuple[list[int], list[float]]], tops: dict[int, TopLogProbs], stays: list[Stay],
             finished: list[tuple[Sequence, str, int]], streamed: list[tuple[Sequence, int]]) -> None:
    """One sequence's part of a step, from the step's copy: its beams' step, or its token appended; it stays
    (`stays`) or ends (`finished`), and a streaming one's token is `streamed`."""
    if sequence.beam is not None:
        ranked = sequence.beam.keep
        ids, values = zip(*(beam_tops[row + beam] for beam in range(sequence.rows)), strict=True)
        grammars = sequence.beam_grammars

        def ends(beam: int, candidate: list[int]) -> bool:
            return _ends(sequence, candidate) or (grammars is not None and grammars[beam].ends_with(candidate[-1]))

        rows = sequence.beam.step([top[:ranked] for top in ids], [top[:ranked] for top in values], ends)
        if rows is None:
            finished.append((sequence, "end", row))
        else:
            beams = [beam[-1] for beam in sequence.beam.running_tokens]
            if grammars is not None:
                sequence.beam_grammars = _branched(grammars, rows, beams)
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
        ended = sequence.grammar is not None and sequence.grammar.consume(token)
        reason = "end" if ended else _finish_reason(sequence)
        if reason is None:
            stays.append((sequence, row, [row], [token]))
        else:
            finished.append((sequence, reason, row))


def _branched(grammars: list[RowGrammar], parents: list[int], tokens: list[int]) -> list[RowGrammar]:
    """The next beams' grammar states: each its parent's, past its new token. A beam that carries a token its
    grammar refused has no likelihood left (its candidates were masked to -inf, taken only for want of others): it
    keeps its parent's state, and stays last in every ranking."""
    branched = []
    for parent, token in zip(parents, tokens, strict=True):
        grammar = grammars[parent].copy()
        if not grammar.matcher.consume_token(token):  # a refused token leaves its matcher in an error state
            grammar = grammars[parent].copy()
        branched.append(grammar)
    return branched


def _mask(running: list[Sequence], logits: torch.Tensor, errors: dict[Sequence, Exception]) -> None:
    """The token masks of the sequences decoding under a grammar, on their rows of `logits` (one fill for them
    all, `grammar.masks`), before any rule or draw; a sequence whose grammar failed is in `errors`."""
    constrained, row = [], 0
    for sequence in running:
        for beam, grammar in enumerate(sequence.beam_grammars or [sequence.grammar]):
            if grammar is None:
                continue
            if grammar.matcher.is_error():
                errors[sequence] = GrammarError(f"its grammar failed: {grammar.matcher.get_error()}")
            else:
                constrained.append((row + beam, grammar))
        row += sequence.rows
    apply_masks(constrained, logits)


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
    return GenerationResult(hypotheses, reason, prompt=sequence.prompt)


def _asking_top(running: list[Sequence]) -> list[tuple[int, int]]:
    """The rows whose sequence asks for `top_logprobs`, with how many each asks for."""
    asking, row = [], 0
    for sequence in running:
        if sequence.beam is None and sequence.request.options.top_logprobs:
            asking.append((row, sequence.request.options.top_logprobs))
        row += sequence.rows
    return asking


def _top_log_probs(asking: list[tuple[int, int]], likeliest: dict[int, tuple[list[int], list[float]]],
                   tokens: list[int]) -> dict[int, TopLogProbs]:
    """By row, the `top_logprobs` of each asking row (`asking`: row and count; `likeliest`: by row, the likeliest
    ids and log-probabilities, as many as the most any row asks). Where the chosen token ties with the first
    entry, it comes first."""
    tops = {}
    for row, wanted in asking:
        ids, values = likeliest[row]
        top = list(zip(ids[:wanted], values[:wanted], strict=True))
        chosen = tokens[row]
        place = next((i for i, (token, _) in enumerate(top) if token == chosen), None)
        if place and top[place][1] == top[0][1]:
            top.insert(0, top.pop(place))
        tops[row] = top
    return tops


def _beam_rows(running: list[Sequence], log_probs: torch.Tensor,
               errors: dict[Sequence, Exception]) -> tuple[list[int], int]:
    """The rows of beam searches, with the rules applied to their log-probabilities (in place: beam search
    processes log-probabilities, not logits, as transformers' does), and how many of each row's likeliest tokens
    the searches rank (the most any of them keeps). A search whose rules fail is in `errors`."""
    rows, keep, row = [], 0, 0
    for sequence in running:
        beam = sequence.beam
        if beam is not None:
            if sequence.rules.active:
                contexts = [sequence.prefix + tokens for tokens in beam.running_tokens]
                try:
                    apply_rules(log_probs[row:row + sequence.rows], contexts, beam.generated, sequence.rules)
                except Exception as error:  # noqa: BLE001 - this search fails, the batch goes on
                    errors[sequence] = error
            rows.extend(range(row, row + sequence.rows))
            keep = max(keep, beam.keep)
        row += sequence.rows
    return rows, min(keep, log_probs.shape[-1])


def _likeliest(copied: list[float], start: int, rows: list[int], k: int,
               ) -> tuple[dict[int, tuple[list[int], list[float]]], int]:
    """By row of `rows`, its `k` likeliest ids and their log-probabilities, read from the step's copy at `start`
    (the ids of all rows, then their values); and where the copy goes on after them."""
    size = len(rows) * k
    likeliest = {
        row: ([int(token) for token in copied[start + index * k:start + (index + 1) * k]],
              copied[start + size + index * k:start + size + (index + 1) * k])
        for index, row in enumerate(rows)
    }
    return likeliest, start + 2 * size


def _ends(sequence: Sequence, tokens: list[int]) -> bool:
    if tokens[-1] in sequence.rules.end_ids:
        return True
    return any(
        len(tokens) >= length and tuple(tokens[len(tokens) - length:]) in stops
        for length, stops in sequence.rules.stops.items()
    )


def _finish_reason(sequence: Sequence) -> str | None:
    if _ends(sequence, sequence.tokens):
        return "end"
    if len(sequence.tokens) >= sequence.request.options.max_new_tokens:
        return "length"
    return None
