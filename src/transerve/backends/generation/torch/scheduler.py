"""Admission for the torch engine: the submit-time checks, the queue of waiting sequences, the budgets they are
admitted under, and the scheduling that says when they may join the running batch.

Admission is in order of priority (`GenerationRequest.priority`, lower first), then arrival, under two limits:
`max_batch_rows` rows (a beam counts as a row) and `kv_cache_tokens`, the sum
over running sequences of (input length + max_new_tokens) * beam width. Under in-flight scheduling (`Scheduling`,
the engine's own) waiting sequences join the running batch at any step; `RequestLevel` admits them only into an
empty batch (what a decoder whose positions cannot be set per row gets). Other schedulings, kept to compare against,
live in `static_scheduling` and reach the engine only when passed in. A part of its own because it decides who runs
and never computes: its condition is the one lock the engine's threads share.
"""

from __future__ import annotations

import collections
import random
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from transerve.backends.generation.engine import (
    MAX_TOP_LOGPROBS,
    DoneCallback,
    GenerationRequest,
    TokenCallback,
    check_prompt_options,
    check_token_options,
)
from transerve.backends.generation.torch.sampling import token_rules
from transerve.backends.generation.torch.sequence import Sequence
from transerve.core.errors import invalid_arg

if TYPE_CHECKING:
    import torch

    from transerve.backends.generation.torch.decoder_batch import DecoderBatch
    from transerve.backends.generation.torch.join_stream import Prepared
    from transerve.backends.generation.torch.model_loading import ModelFacts
    from transerve.backends.generation.torch.selection import Choices, Stay


class Scheduling:
    """In-flight batching, the production scheduling: waiting sequences join the running batch at the next step
    and finished ones leave it at once. Subclasses (other schedulings, for comparison) change the hooks."""

    name = "inflight"
    #: Whether waiting sequences may join a batch that is running (else only an empty one).
    joins_running_batch = True

    def decode_on(self, choices: Choices) -> list[Stay]:
        """The rows that decode on after a step: those of the sequences that go on."""
        return choices.stays

    def stepped(self, batch: DecoderBatch, max_positions: int | None) -> None:
        """Called with the batch once its rows for the next step are chosen."""


class RequestLevel(Scheduling):
    """Request-level batching: new sequences join only an empty batch; finished rows still leave at once. The
    engine falls back to it for a decoder whose positions cannot be set per row (its rows must stay in lockstep)."""

    name = "request"
    joins_running_batch = False


class Scheduler:
    """The queue, the running sequences, the budgets, and the rows prepared ahead for waiting sequences. `cond`
    guards the queue, `closed` and the prepared rows (`claim`, `deliver`, `take_prepared`: the joining work runs
    on another thread), and wakes the engine's threads; `running` and the budgets change on the engine thread
    only, through `admit`, `join`, `keep`, `drop_cancelled` and `release_all`."""

    def __init__(
        self, model: ModelFacts, device: torch.device, max_batch_rows: int, kv_cache_tokens: int, join_group: int,
        scheduling: Scheduling,
    ) -> None:
        self.model = model
        self.device = device
        self.max_batch_rows = max_batch_rows
        self.kv_cache_tokens = kv_cache_tokens
        #: Sequences whose joining work (encoder call or prefill) one call computes at most (`join_ahead`).
        self.join_group = join_group
        self.scheduling = scheduling
        self.cond = threading.Condition()
        self.queue: collections.deque[Sequence] = collections.deque()
        #: Sequences that only score their prompts (`max_new_tokens` 0): they never join the batch.
        self.scoring: collections.deque[Sequence] = collections.deque()
        self.closed = False
        #: Running sequences in batch order: each owns `rows` consecutive rows of the runner's batch.
        self.running: list[Sequence] = []
        self.used_tokens = 0
        self.used_rows = 0
        #: Waiting (or just admitted) sequences whose rows the joining work is computing now, and those it computed.
        self._preparing: set[Sequence] = set()
        self._prepared: dict[Sequence, Prepared] = {}

    # -- submit-time checks --------------------------------------------------------------------------------------

    def new_sequence(self, request: GenerationRequest, on_tokens: TokenCallback | None, done: DoneCallback) -> Sequence:
        """The sequence `request` asks for, or INVALID_ARG for one the engine can never serve."""
        import torch

        model = self.model
        options = request.options
        ids = [int(token) for token in request.input_ids]
        if not ids:
            raise invalid_arg("the input has no tokens")
        if len(ids) > model.max_input_length:
            raise invalid_arg(f"the input has {len(ids)} tokens; this model accepts at most {model.max_input_length}")
        if any(not 0 <= token < model.vocab_size for token in ids):
            raise invalid_arg(f"input token ids must be in [0, {model.vocab_size})")
        check_prompt_options(options, model.is_encoder_decoder)
        if options.beam_width < 1:
            raise invalid_arg("beam_width must be at least 1")
        if not 1 <= options.num_return_sequences <= options.beam_width:
            raise invalid_arg(
                f"num_return_sequences must be between 1 and the beam width ({options.beam_width}), "
                f"got {options.num_return_sequences}"
            )
        if options.beam_width > self.max_batch_rows:
            raise invalid_arg(
                f"beam_width {options.beam_width} exceeds the rows this model decodes together ({self.max_batch_rows})"
            )
        sampling = options.sampling and options.beam_width == 1
        if sampling and options.temperature <= 0:
            raise invalid_arg("temperature must be positive when sampling")
        if sampling and not 0 < options.top_p <= 1:
            raise invalid_arg("top_p must be in (0, 1]")
        if not 0 <= options.min_p <= 1:
            raise invalid_arg("min_p must be in [0, 1]")
        if options.top_k < 0 or options.repetition_penalty <= 0 or options.min_new_tokens < 0:
            raise invalid_arg("top_k and min_new_tokens must not be negative; repetition_penalty must be positive")
        if not 0 <= options.top_logprobs <= MAX_TOP_LOGPROBS:
            raise invalid_arg(f"top_logprobs must lie in [0, {MAX_TOP_LOGPROBS}], got {options.top_logprobs}")
        if options.top_logprobs and options.beam_width > 1:
            raise invalid_arg("top_logprobs needs beam_width 1: the likeliest tokens are reported for greedy and "
                              "sampled sequences only")
        check_token_options(options, model.vocab_size)
        decoder_length = (1 if model.is_encoder_decoder else len(ids)) + options.max_new_tokens
        if model.max_positions is not None and decoder_length > model.max_positions:
            raise invalid_arg(
                f"{decoder_length} decoder positions are needed (input and max_new_tokens); "
                f"this model has {model.max_positions}"
            )
        need = (len(ids) + options.max_new_tokens) * options.beam_width
        if need > self.kv_cache_tokens:
            raise invalid_arg(
                f"the sequence needs {need} tokens of KV cache ((input {len(ids)} + max_new_tokens "
                f"{options.max_new_tokens}) * beam width {options.beam_width}); this model's budget is "
                f"{self.kv_cache_tokens} (kv_cache_tokens)"
            )
        end_ids = [int(t) for t in options.end_ids] if options.end_ids is not None else list(model.eos_token_ids)
        prefix = [model.start_id] if model.is_encoder_decoder else ids
        rules = token_rules(options, end_ids, model.rules)
        sequence = Sequence(request, on_tokens, done, rules, options.beam_width, need, ids, prefix)
        if options.beam_width > 1:
            from transerve.backends.generation.torch.beam import BeamSearch

            sequence.beam = BeamSearch(
                options.beam_width, options.length_penalty, len(end_ids), options.max_new_tokens,
                model.early_stopping,
            )
        elif sampling:
            sequence.generator = torch.Generator(device=self.device)
            seed = options.random_seed if options.random_seed is not None else random.getrandbits(63)
            sequence.generator.manual_seed(seed)
        return sequence

    # -- admission -----------------------------------------------------------------------------------------------

    def admit(self) -> tuple[list[Sequence], list[Sequence]]:
        """Called under `cond`: the waiting sequences that fit now, in order (taken off the queue and counted in
        the budgets), and the cancelled ones taken off it."""
        admitted: list[Sequence] = []
        cancelled = [s for s in self.queue if s.cancelled]
        for sequence in cancelled:
            self.queue.remove(sequence)
            self._prepared.pop(sequence, None)
        if self.scheduling.joins_running_batch or not self.running:
            while self.queue:
                sequence = self.queue[0]
                if self.used_rows + sequence.rows > self.max_batch_rows:
                    break
                if self.used_tokens + sequence.need > self.kv_cache_tokens:
                    break
                self.queue.popleft()
                self.used_rows += sequence.rows
                self.used_tokens += sequence.need
                admitted.append(sequence)
        return admitted, cancelled

    def enqueue(self, sequence: Sequence) -> None:
        """Called under `cond`: `sequence` waits behind every waiting sequence of its priority or a better one
        (a lower number), ahead of the worse ones; with one priority the queue stays in arrival order."""
        queue, priority = self.queue, sequence.request.priority
        index = len(queue)
        while index and queue[index - 1].request.priority > priority:
            index -= 1
        queue.insert(index, sequence)

    def release(self, sequence: Sequence) -> None:
        """`sequence` left the batch: its rows and KV share are free."""
        self.used_rows -= sequence.rows
        self.used_tokens -= sequence.need

    def join(self, sequences: list[Sequence]) -> None:
        """`sequences` (admitted) join the running batch, after the running ones, in the order of their rows."""
        self.running.extend(sequences)

    def keep(self, sequences: list[Sequence]) -> None:
        """After a step: the sequences that decode on, in the order of their rows now (the others were released)."""
        self.running = sequences

    def drop_cancelled(self) -> tuple[list[int], list[Sequence]]:
        """Cancelled running sequences leave: the batch rows the others keep, in order, and the cancelled ones
        (still to be released and answered)."""
        if not any(s.cancelled for s in self.running):
            return [], []
        keep, cancelled, row = [], [], 0
        for sequence in self.running:
            if sequence.cancelled:
                cancelled.append(sequence)
            else:
                keep.extend(range(row, row + sequence.rows))
            row += sequence.rows
        self.running = [s for s in self.running if not s.cancelled]
        return keep, cancelled

    def release_all(self) -> list[Sequence]:
        """Every running sequence leaves (a failed step): returns them."""
        running, self.running = self.running, []
        self.used_tokens = self.used_rows = 0
        return running

    def take_scoring(self) -> list[Sequence]:
        """Called under `cond`: the sequences waiting to have their prompts scored only, taken off their queue."""
        waiting, self.scoring = list(self.scoring), collections.deque()
        return waiting

    def take_queue(self) -> list[Sequence]:
        """Called under `cond` once the engine is closed: every waiting sequence, taken off the queue."""
        pending, self.queue = list(self.queue) + list(self.scoring), collections.deque()
        self.scoring = collections.deque()
        self._prepared.clear()
        return pending

    # -- what the joining work computes next ---------------------------------------------------------------------

    def unprepared(self) -> Iterator[Sequence]:
        """Waiting sequences, in queue order, among those that fill the next `max_batch_rows` rows, whose rows
        are neither computed nor being computed (called under `cond`)."""
        rows = 0
        for sequence in self.queue:
            rows += sequence.rows
            if rows > self.max_batch_rows:
                return
            if not (sequence.cancelled or sequence in self._preparing or sequence in self._prepared):
                yield sequence

    def claim(self, sequence: Sequence) -> None:
        """Called under `cond`: the joining work computes `sequence`'s rows now."""
        self._preparing.add(sequence)

    def deliver(self, sequences: list[Sequence], prepared: list[Prepared | None]) -> None:
        """The joining work is done with `sequences`: their rows (None where it failed, and the engine thread
        computes them when they join); a cancelled sequence's rows are dropped. Wakes a thread waiting for them."""
        with self.cond:
            for sequence, rows in zip(sequences, prepared, strict=True):
                self._preparing.discard(sequence)
                if rows is not None and not sequence.cancelled:
                    self._prepared[sequence] = rows
            self.cond.notify_all()

    def take_prepared(self, admitted: list[Sequence]) -> tuple[list[tuple[Sequence, Prepared]], list[Sequence]]:
        """`admitted`, once the joining work is done with any of them: those with rows prepared ahead (taken from
        here), and the rest, whose rows are still to compute. The batch's row order is that: prepared first
        (admission order does not matter past this point)."""
        with self.cond:
            while any(s in self._preparing for s in admitted):
                self.cond.wait()
            prepared = [(s, self._prepared.pop(s)) for s in admitted if s in self._prepared]
        taken = {id(s) for s, _ in prepared}
        return prepared, [s for s in admitted if id(s) not in taken]

    def join_ahead(self, fresh: list[Sequence]) -> list[Sequence]:
        """While a batch runs, the waiting sequences whose rows the call that computes `fresh`'s (encoder call or
        prefill) computes too, claimed (`claim`): one call for several sequences reads the weights once
        (`step_cost.py --joins` in benchmarks/README.md). Only when sequences join a running batch (request-level
        scheduling computes every admitted sequence in one call anyway): up to `join_group` sequences in all,
        those nearest in input length to `fresh`'s longest among the sequences that fill the next
        `max_batch_rows` rows, so that little padding is computed."""
        wanted = self.join_group - len(fresh)
        if wanted <= 0 or not self.scheduling.joins_running_batch:
            return []
        longest = max(len(s.input_ids) for s in fresh)
        with self.cond:
            ahead = sorted(self.unprepared(), key=lambda s: abs(len(s.input_ids) - longest))[:wanted]
            for sequence in ahead:
                self.claim(sequence)
        return ahead
