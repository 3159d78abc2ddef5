"""Beam-search bookkeeping for one sequence of the torch engine, step for step as transformers' `_beam_search`.

transformers keeps, per batch item, `k` running beams and `k` finished hypotheses; each step it takes the best
`max(2, 1 + number of end tokens) * k` candidates over all beams, continues with the best `k` that did not just
finish, and lets the first `k` candidates that did finish compete for the finished slots with their score divided by
`generated_length ** length_penalty` (the end token counted). It stops when no running beam can beat the worst
finished hypothesis (the `early_stopping` heuristic of the model's generation config), or when every candidate
finished. The same tensor operations run here on one item (`[1, ...]` tensors), so rounding falls exactly as in
`generate`; the engine owns the model's rows and reorders their cache by `step`'s answer.

The search runs on the host, on each beam's `keep` likeliest tokens, which the step copies back with the chosen
tokens of every other row (`selection.choose`): the best `keep` sums over all beams are among those, since a
beam's running score shifts all its tokens alike. So a step of beam search reads nothing more from a GPU. The
candidates are taken in the flattened order (beam, then token) that transformers' `topk` over the whole
`[width * vocab]` sees, so that equal sums are ranked alike where the two `topk`s break ties alike.
"""

from __future__ import annotations

from collections.abc import Callable

from transerve.backends.generation.engine import Hypothesis


class BeamSearch:
    def __init__(
        self, width: int, length_penalty: float, end_count: int, max_new_tokens: int, early_stopping: bool | str,
    ) -> None:
        import torch

        self.width = width
        self.length_penalty = length_penalty
        self.max_new_tokens = max_new_tokens
        self.early_stopping = early_stopping
        #: Candidates each step ranks: the likeliest tokens of each beam that `step` is given.
        self.keep = max(2, 1 + end_count) * width
        self.top_mask = torch.cat(
            (torch.ones(width, dtype=torch.bool), torch.zeros(self.keep - width, dtype=torch.bool))
        )
        self.running_scores = torch.zeros((1, width), dtype=torch.float)
        self.running_scores[:, 1:] = -1e9
        self.running_tokens: list[list[int]] = [[] for _ in range(width)]
        self.running_log_probs: list[list[float]] = [[] for _ in range(width)]
        self.finished_scores = torch.full((1, width), -1e9, dtype=torch.float)
        self.finished_tokens: list[list[int]] = [[] for _ in range(width)]
        self.finished_log_probs: list[list[float]] = [[] for _ in range(width)]
        self.is_finished = torch.zeros((1, width), dtype=torch.bool)
        self.can_improve = torch.ones((1, 1), dtype=torch.bool)
        #: New tokens of every running beam so far.
        self.generated = 0

    def step(
        self, top_tokens: list[list[int]], top_log_probs: list[list[float]], ends: Callable[[int, list[int]], bool],
    ) -> list[int] | None:
        """Advance with each running beam's `keep` likeliest next tokens and their (processed) log-probabilities;
        `ends(beam, tokens)` says whether a candidate's new tokens, continuing `beam`, end it (an end token, a stop
        sequence or a grammar that takes no more; the length limit is checked here). Returns, for each next running
        beam, the row (beam) it continues, or None when the search is over."""
        import torch

        pairs = [(beam, token, value) for beam in range(self.width)
                 for token, value in sorted(zip(top_tokens[beam], top_log_probs[beam], strict=True))]
        log_probs = torch.tensor([value for _, _, value in pairs], dtype=torch.float)
        shift = self.running_scores[0].repeat_interleave(len(pairs) // self.width)
        top_scores, top_indices = torch.topk((log_probs + shift).reshape(1, -1), k=self.keep)
        picked = [pairs[index] for index in top_indices[0].tolist()]
        beams = [beam for beam, _, _ in picked]
        candidates = [self.running_tokens[beam] + [token] for beam, token, _ in picked]
        candidate_log_probs = [self.running_log_probs[beam] + [value] for beam, _, value in picked]
        at_limit = self.generated + 1 >= self.max_new_tokens
        hits = torch.tensor([[at_limit or ends(beam, tokens) for beam, tokens in zip(beams, candidates, strict=True)]])

        # The best `width` candidates that did not just finish run on.
        running_candidates = top_scores + hits.to(torch.float32) * -1.0e9
        next_indices = torch.topk(running_candidates, k=self.width)[1]
        self.running_scores = torch.take_along_dim(running_candidates, next_indices, dim=1)
        chosen = next_indices[0].tolist()
        self.running_tokens = [candidates[index] for index in chosen]
        self.running_log_probs = [candidate_log_probs[index] for index in chosen]

        # The first `width` candidates that finished compete for the finished slots.
        just_finished = hits & self.top_mask[None, :]
        finished_scores = top_scores / ((self.generated + 1) ** self.length_penalty)
        full = torch.all(self.is_finished, dim=-1, keepdim=True) & (self.early_stopping is True)
        finished_scores += full.to(torch.float32) * -1.0e9
        finished_scores += (~self.can_improve).to(torch.float32) * -1.0e9
        finished_scores += (~just_finished) * -1.0e9
        merged_scores = torch.cat((self.finished_scores, finished_scores), dim=1)
        merged_finished = torch.cat((self.is_finished, just_finished), dim=1)
        kept = torch.topk(merged_scores, k=self.width)[1]
        self.finished_scores = torch.take_along_dim(merged_scores, kept, dim=1)
        self.is_finished = torch.take_along_dim(merged_finished, kept, dim=1)
        merged_tokens = self.finished_tokens + candidates
        merged_log_probs = self.finished_log_probs + candidate_log_probs
        self.finished_tokens = [merged_tokens[index] for index in kept[0].tolist()]
        self.finished_log_probs = [merged_log_probs[index] for index in kept[0].tolist()]

        self.generated += 1
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_length = self.max_new_tokens
        else:
            best_length = self.generated
        best_possible = self.running_scores[:, :1] / (best_length ** self.length_penalty)
        worst_finished = torch.where(
            self.is_finished, torch.min(self.finished_scores, dim=1, keepdim=True)[0], -1.0e9
        )
        self.can_improve = self.can_improve & torch.any(best_possible > worst_finished, dim=-1, keepdim=True)
        all_full = bool(self.is_finished.all()) and self.early_stopping is True
        if not bool(self.can_improve.any()) or all_full or bool(hits.all()):
            return None
        return [beams[index] for index in chosen]

    def hypotheses(self, count: int, with_log_probs: bool) -> list[Hypothesis]:
        """The best `count` finished hypotheses, best first (transformers' `sequences[:num_return_sequences]`)."""
        scores = self.finished_scores[0].tolist()
        return [
            Hypothesis(self.finished_tokens[i], scores[i], self.finished_log_probs[i] if with_log_probs else None)
            for i in range(count)
        ]

    def partial(self, count: int, with_log_probs: bool) -> list[Hypothesis]:
        """The best `count` hypotheses when the search is stopped early (cancelled): finished ones and running
        beams ranked together by length-penalised score."""
        pool = [
            (score, tokens, log_probs)
            for score, tokens, log_probs, done in zip(
                self.finished_scores[0].tolist(), self.finished_tokens, self.finished_log_probs,
                self.is_finished[0].tolist(), strict=True,
            )
            if done
        ]
        length = max(self.generated, 1) ** self.length_penalty
        for score, tokens, log_probs in zip(
            self.running_scores[0].tolist(), self.running_tokens, self.running_log_probs, strict=True,
        ):
            if score > -1e8:
                pool.append((score / length, tokens, log_probs))
        pool.sort(key=lambda item: -item[0])
        return [
            Hypothesis(tokens, score, log_probs if with_log_probs else None)
            for score, tokens, log_probs in pool[:count]
        ]
