"""The PyTorch + transformers generation engine: any transformers causal or seq2seq LM, with in-flight batching.

One engine thread runs its own decoding loop (never `generate`): each iteration admits waiting sequences that fit
(their encoder call or prompt prefill done ahead, by the joining thread while the batch decoded where decoding
leaves cores idle or in an earlier joining call, or done now in one batched call that also computes waiting
sequences' rows, `join_group`), merges them into the running batch (`decoder_batch`), feeds
every row's last token through one forward pass (a new encoder-decoder row's first decoder input is the decoder
start token; a new decoder-only row's whole prompt went through the prefill, whose last position's logits join the
step's), then chooses each sequence's next token with its own options (`sampling`, `beam`). A finished or cancelled
sequence leaves the batch at once.
Admission is FIFO under two limits: `max_batch_rows` rows (a beam counts as a row) and `kv_cache_tokens`, the sum
over running sequences of (input length + max_new_tokens) * beam width. Two other schedulings exist for
comparison: `scheduling="request"` admits new sequences only when the batch is empty (request-level batching whose
finished rows still leave at once), and `scheduling="static"` is request-level batching as FasterTransformer's
backend and transformers' `generate` run it: a finished sequence's result is sent, but its rows decode on (their
tokens discarded) until the last sequence of the batch ends.

What a result holds: the new tokens, the end token or stop sequence included. Log-probabilities are those of the
distribution each token was chosen from, as transformers' `output_scores` (log-softmaxed) reports them: after the
repetition penalty, bad words, min_new_tokens and the model's forced tokens, and when sampling after temperature,
top-k and top-p. A greedy or sampled hypothesis' score is their sum; a beam hypothesis' score is transformers'
`sequences_scores` (their sum divided by length ** length_penalty). Stop sequences match the new tokens only.
Streaming sends each new token of a beam-width-1 sequence after the step that produced it; beam search streams
nothing (its best hypothesis is only known at the end). Sampling is on when `options.sampling` is set and the beam
width is 1.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from transerve.backends.generation.cache_buffers import fewest_moves
from transerve.backends.generation.engine import (
    DoneCallback,
    GenerationRequest,
    GenerationResult,
    Hypothesis,
    TokenCallback,
)
from transerve.backends.generation.sampling import ModelRules, TokenRules, apply_rules, sample, token_rules, warp
from transerve.backends.threaded import import_engine
from transerve.core.errors import ServerError, internal, invalid_arg, unavailable

if TYPE_CHECKING:
    import torch

    from transerve.backends.generation.beam import BeamSearch
    from transerve.backends.generation.decoder_batch import DecoderBatch, ModelRunner

logger = logging.getLogger(__name__)

COMPUTE_TYPES = ("float32", "float16", "bfloat16")
SCHEDULING = ("inflight", "request", "static")
#: Longest source of a model without absolute positions (T5) whose tokenizer does not say.
DEFAULT_MAX_INPUT_LENGTH = 512
#: Seconds an engine thread waits without work before it ends (a new one starts with the next request).
IDLE_SECONDS = 1.0
#: Sequences one joining call computes at most under in-flight scheduling (`TorchEngine._join_ahead`).
JOIN_GROUP = 4
_Work = TypeVar("_Work")


@dataclass(eq=False)
class _Sequence:
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
    #: Its rows, prepared ahead by the joining thread (batch, first decoder inputs or first logits), and whether
    #: that thread is at it now.
    prepared: tuple[DecoderBatch, torch.Tensor] | None = None
    preparing: bool = False
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    score: float = 0.0
    cancelled: bool = False
    #: Static scheduling: finished and reported, its rows decoding on until the batch ends.
    retired: bool = False

    @property
    def dropped(self) -> bool:
        """Cancelled while it still decodes for its client (a retired sequence was answered already)."""
        return self.cancelled and not self.retired


class _Handle:
    def __init__(self, engine: TorchEngine, sequence: _Sequence) -> None:
        self._engine = engine
        self._sequence = sequence

    def cancel(self) -> None:
        self._sequence.cancelled = True
        self._engine._wake()


class _Refused:
    """The handle of a sequence refused at submit: there is nothing to cancel."""

    def cancel(self) -> None:
        pass


class TorchEngine:
    """A transformers model on one device, decoded by one thread of its own (see the module docstring)."""

    def __init__(
        self,
        model_dir: Path,
        device: str = "cpu",
        compute_type: str = "float32",
        intra_op_threads: int = 0,
        max_batch_rows: int = 16,
        kv_cache_tokens: int = 65536,
        scheduling: str = "inflight",
        latency_threads: int = 0,
        latency_rows: int = 1,
        onednn_linear: bool = True,
        join_group: int = JOIN_GROUP,
    ) -> None:
        torch = import_engine("torch", "generation")
        transformers = import_engine("transformers", "generation")
        if compute_type not in COMPUTE_TYPES:
            raise invalid_arg(f"compute_type {compute_type!r} is not one of {', '.join(COMPUTE_TYPES)} for torch")
        if scheduling not in SCHEDULING:
            raise invalid_arg(f"scheduling {scheduling!r} is not one of {', '.join(SCHEDULING)}")
        if max_batch_rows < 1 or kv_cache_tokens < 1:
            raise invalid_arg("max_batch_rows and kv_cache_tokens must be positive")
        if join_group < 1:
            raise invalid_arg("join_group must be positive")
        if intra_op_threads < 0 or latency_threads < 0 or latency_rows < 0:
            raise invalid_arg("intra_op_threads, latency_threads and latency_rows must not be negative")
        #: Threads under load, and while at most `latency_rows` rows run (see `_set_threads`).
        self.load_threads = intra_op_threads or torch.get_num_threads()
        self.latency_threads = latency_threads or _cpu_count()
        self.latency_rows = latency_rows
        #: What the engine thread last set (0: nothing yet).
        self.threads = 0
        model_dir = Path(model_dir)
        config = transformers.AutoConfig.from_pretrained(model_dir)
        self.is_encoder_decoder = bool(config.is_encoder_decoder)
        loader = transformers.AutoModelForSeq2SeqLM if self.is_encoder_decoder else transformers.AutoModelForCausalLM
        #: Whether the model's linear layers compute on oneDNN (`onednn_linear`: CPU float32 only).
        self.onednn_linear: bool
        model, self.onednn_linear = _on_own_thread(
            lambda: _load_model(loader, model_dir, device, compute_type, onednn_linear)
        )
        generation = model.generation_config
        eos = generation.eos_token_id if generation.eos_token_id is not None else getattr(config, "eos_token_id", None)
        self.eos_token_ids: list[int] = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        text = config.get_text_config(decoder=True)
        self.vocab_size: int = text.vocab_size
        self.max_positions = _max_positions(text)
        self.max_input_length = _max_input_length(model_dir, config)
        self.early_stopping = generation.early_stopping
        self._model_rules = _model_rules(generation, self.is_encoder_decoder)
        self.max_batch_rows = max_batch_rows
        #: Sequences whose joining work (encoder call or prefill) one call computes at most (`_join_ahead`).
        self.join_group = join_group
        self.kv_cache_tokens = kv_cache_tokens
        self.scheduling = scheduling
        self.device = model.device
        pad = generation.pad_token_id if generation.pad_token_id is not None else getattr(config, "pad_token_id", None)
        pad = pad if pad is not None else (self.eos_token_ids[0] if self.eos_token_ids else 0)
        start = generation.decoder_start_token_id
        if start is None:
            start = getattr(config, "decoder_start_token_id", None)
            start = start if start is not None else getattr(config, "bos_token_id", None)
        if self.is_encoder_decoder and start is None:
            raise invalid_arg(f"{model_dir}: the model names no decoder_start_token_id")
        self._start_id = start

        from transerve.backends.generation.decoder_batch import ModelRunner

        self._runner: ModelRunner = ModelRunner(model, start, pad, max_batch_rows)
        if scheduling == "inflight" and not self._runner.per_row_positions:
            logger.warning(
                "%s: the decoder's positions cannot be set per row, so sequences cannot join a running batch; "
                "batching whole requests instead", model_dir,
            )
            self.scheduling = "request"
        self._cond = threading.Condition()
        self._queue: collections.deque[_Sequence] = collections.deque()
        self._closed = False
        #: Running sequences in batch order: each owns `rows` consecutive rows of `_batch`.
        self._running: list[_Sequence] = []
        self._batch: DecoderBatch | None = None
        self._next_tokens: torch.Tensor | None = None
        self._used_tokens = 0
        self._used_rows = 0
        self._name = model_dir.name
        #: The engine thread, while there is work (`_await_work`): None when idle.
        self.thread: threading.Thread | None = None
        #: Threads the joining thread computes with: it prepares waiting sequences' rows while the engine thread
        #: decodes (see `_prepare_ahead`), on the cores decoding leaves idle (on a GPU: the device's work,
        #: `load_threads` for the CPU side); there is no such thread when decoding uses every core (0).
        self.joining_threads = (
            self.load_threads if self.device.type != "cpu" else min(self.load_threads, _cpu_count() - self.load_threads)
        )
        self.joining_thread: threading.Thread | None = None
        #: Seconds a thread of the engine waits without work before it ends (`_await_work`).
        self.idle_seconds = IDLE_SECONDS

    # -- the contract --------------------------------------------------------------------------------------------

    def submit(
        self, request: GenerationRequest, on_tokens: TokenCallback | None, done: DoneCallback
    ) -> _Handle | _Refused:
        """Queue a sequence; one the engine can never serve gets `done(INVALID_ARG)` here, in the caller's thread."""
        try:
            sequence = self._prepare(request, on_tokens, done)
        except ServerError as error:
            _report(done, error)
            return _Refused()
        with self._cond:
            closed = self._closed
            if not closed:
                self._queue.append(sequence)
                self._start_threads()
                self._cond.notify_all()
        if closed:
            _report(done, unavailable("the generation engine is closed"))
            return _Refused()
        return _Handle(self, sequence)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the engine's threads to end (after `close`)."""
        with self._cond:
            threads = [t for t in (self.thread, self.joining_thread) if t is not None]
        for thread in threads:
            thread.join(timeout)

    # -- submit-time checks --------------------------------------------------------------------------------------

    def _prepare(self, request: GenerationRequest, on_tokens: TokenCallback | None, done: DoneCallback) -> _Sequence:
        import torch

        options = request.options
        ids = [int(token) for token in request.input_ids]
        if not ids:
            raise invalid_arg("the input has no tokens")
        if len(ids) > self.max_input_length:
            raise invalid_arg(f"the input has {len(ids)} tokens; this model accepts at most {self.max_input_length}")
        if any(not 0 <= token < self.vocab_size for token in ids):
            raise invalid_arg(f"input token ids must be in [0, {self.vocab_size})")
        if options.max_new_tokens < 1:
            raise invalid_arg("max_new_tokens must be at least 1")
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
        if options.top_k < 0 or options.repetition_penalty <= 0 or options.min_new_tokens < 0:
            raise invalid_arg("top_k and min_new_tokens must not be negative; repetition_penalty must be positive")
        if any(not word for word in options.bad_words) or any(not stop for stop in options.stop_sequences):
            raise invalid_arg("bad words and stop sequences must not be empty")
        decoder_length = (1 if self.is_encoder_decoder else len(ids)) + options.max_new_tokens
        if self.max_positions is not None and decoder_length > self.max_positions:
            raise invalid_arg(
                f"{decoder_length} decoder positions are needed (input and max_new_tokens); "
                f"this model has {self.max_positions}"
            )
        need = (len(ids) + options.max_new_tokens) * options.beam_width
        if need > self.kv_cache_tokens:
            raise invalid_arg(
                f"the sequence needs {need} tokens of KV cache ((input {len(ids)} + max_new_tokens "
                f"{options.max_new_tokens}) * beam width {options.beam_width}); this model's budget is "
                f"{self.kv_cache_tokens} (kv_cache_tokens)"
            )
        end_ids = [int(t) for t in options.end_ids] if options.end_ids is not None else list(self.eos_token_ids)
        prefix = [self._start_id] if self.is_encoder_decoder else ids
        rules = token_rules(options, end_ids, self._model_rules)
        sequence = _Sequence(request, on_tokens, done, rules, options.beam_width, need, ids, prefix)
        if options.beam_width > 1:
            from transerve.backends.generation.beam import BeamSearch

            sequence.beam = BeamSearch(
                options.beam_width, options.length_penalty, len(end_ids), options.max_new_tokens,
                self.early_stopping, self.device,
            )
        elif sampling:
            sequence.generator = torch.Generator(device=self.device)
            seed = options.random_seed if options.random_seed is not None else random.getrandbits(63)
            sequence.generator.manual_seed(seed)
        return sequence

    # -- the engine thread ---------------------------------------------------------------------------------------

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _start_threads(self) -> None:
        """Called under `_cond` with work queued: start the engine thread, and the joining thread if the engine has
        one, where they ended while idle."""
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name=f"torch-generation:{self._name}", daemon=True)
            self.thread.start()
        if self.joining_threads > 0 and self.joining_thread is None:
            self.joining_thread = threading.Thread(
                target=self._prepare_ahead, name=f"torch-generation-join:{self._name}", daemon=True
            )
            self.joining_thread.start()

    def _await_work(self, work: Callable[[], _Work | None]) -> _Work | None:
        """Called under `_cond`: wait until `work()` gives something and return it; None once the engine is closed,
        or after `idle_seconds` without work, when the calling thread is to end. Threads end when idle because
        torch's OpenMP runtime keeps a pool of worker threads for every thread that has computed, while it lives,
        and when a process holds more of them than cores, every pool stops spinning between parallel regions:
        an idle engine beside a busy one made the busy one's decoding a third slower (docs/generation.md)."""
        deadline = time.monotonic() + self.idle_seconds
        while not self._closed:
            found = work()
            if found:
                return found
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._cond.wait(left)
        return None

    def _run(self) -> None:
        import torch

        torch.get_num_threads()  # torch's lazy per-thread setup first, so that it cannot undo _set_threads later
        self.threads = 0  # a new thread: nothing set yet
        with torch.inference_mode():
            while True:
                with self._cond:
                    if not self._await_work(lambda: bool(self._queue or self._running)):
                        if self._closed:
                            break
                        self.thread = None  # idle: the next submit starts another
                        return
                try:
                    self._iteration()
                except Exception as exc:  # a bug or a device failure: fail what runs, keep serving the rest
                    logger.exception("generation step failed")
                    self._fail_running(internal(f"generation failed: {exc}"))
        self._fail_running(unavailable("the generation engine was closed"))
        with self._cond:
            pending, self._queue = list(self._queue), collections.deque()
        for sequence in pending:
            _report(sequence.done, unavailable("the generation engine was closed"))

    def _fail_running(self, error: ServerError) -> None:
        running, self._running = self._running, []
        self._batch, self._next_tokens = None, None
        self._used_tokens = self._used_rows = 0
        for sequence in running:
            if not sequence.retired:
                _report(sequence.done, error)

    def _set_threads(self, joining: bool) -> None:
        """Joining work (the encoder call or prompt prefill: compute-bound) while at most `latency_rows` rows run
        (a lone request: idle cores, and its time to first token waits on it) runs on `latency_threads`; the rest
        on `load_threads` (intra_op_threads), which leaves other cores to the server and its clients: a step of a
        few rows reads every weight for little arithmetic and gains nothing from more threads. OpenMP's thread count
        (and MKL's) belongs to the calling thread, so the engine thread itself sets it."""
        import torch

        wanted = self.latency_threads if joining and self._used_rows <= self.latency_rows else self.load_threads
        if wanted != self.threads:
            torch.set_num_threads(wanted)
            self.threads = wanted

    def _iteration(self) -> None:
        import torch

        self._drop_cancelled()
        admitted = self._admit()
        new: tuple[DecoderBatch, torch.Tensor] | None = None
        if admitted:
            admitted = self._await_prepared(admitted)
            self._running.extend(admitted)  # from here on a failure reaches them too
            new = self._new_rows(admitted)
        if self.is_encoder_decoder:  # new rows' first decoder inputs go through this step with the others'
            if new is not None:
                self._merge(new[0])
                self._next_tokens = new[1] if self._next_tokens is None else torch.cat((self._next_tokens, new[1]))
            if self._batch is not None:
                self._set_threads(joining=False)
                self._advance(self._runner.step(self._batch, self._next_tokens).float())
            return
        logits = None
        if self._batch is not None:
            self._set_threads(joining=False)
            logits = self._runner.step(self._batch, self._next_tokens)
        if new is not None:  # their prompts are in the cache already, and `new[1]` holds their first logits
            self._merge(new[0])
            logits = new[1] if logits is None else torch.cat((logits, new[1]))
        if logits is not None:
            self._advance(logits.float())

    def _await_prepared(self, admitted: list[_Sequence]) -> list[_Sequence]:
        """`admitted` once the joining thread is done with any of them, those it prepared first (the batch's row
        order: admission order does not matter past this point)."""
        with self._cond:
            while any(s.preparing for s in admitted):
                self._cond.wait()
        return [s for s in admitted if s.prepared is not None] + [s for s in admitted if s.prepared is None]

    def _new_rows(self, admitted: list[_Sequence]) -> tuple[DecoderBatch, torch.Tensor]:
        """The rows of `admitted` (prepared ones first, as `_await_prepared` ordered them): what was prepared
        ahead, and one batched encoder call or prefill here for the rest, which also prepares the rows of waiting
        sequences of like length (`_join_ahead`). Returns their batch and their first decoder inputs
        (encoder-decoder) or first logits (decoder-only)."""
        import torch

        parts = [s.prepared for s in admitted if s.prepared is not None]
        fresh = [s for s in admitted if s.prepared is None]
        for sequence in admitted:
            sequence.prepared = None
        if fresh:
            self._set_threads(joining=True)
            ahead = self._join_ahead(fresh)
            prepared: list[tuple[DecoderBatch, torch.Tensor] | None] = [None] * len(ahead)
            try:
                group = fresh + ahead
                batch, first = self._runner.new_rows([s.input_ids for s in group], [s.rows for s in group])
                if ahead:
                    rows = row = sum(s.rows for s in fresh)
                    for index, sequence in enumerate(ahead):
                        end = row + sequence.rows
                        prepared[index] = (batch.rows_range(row, end, own=True), first[row:end].clone())
                        row = end
                    batch, first = batch.rows_range(0, rows), first[:rows]
            finally:
                if ahead:
                    with self._cond:
                        for sequence, rows_ready in zip(ahead, prepared, strict=True):
                            sequence.prepared, sequence.preparing = rows_ready, False
                        self._cond.notify_all()
            parts.append((batch, first))
        batch = parts[0][0]
        for other, _ in parts[1:]:
            batch.extend(other)
        return batch, torch.cat([first for _, first in parts]) if len(parts) > 1 else parts[0][1]

    def _join_ahead(self, fresh: list[_Sequence]) -> list[_Sequence]:
        """Waiting sequences whose rows the call that computes `fresh`'s (encoder call or prefill) computes too,
        marked as being prepared: one call for several sequences reads the weights once (on the t5-small shape,
        2 cores, 0.62 ms per source token alone against 0.37 four of like length at once: `step_cost.py --joins`
        in benchmarks/README.md). Only under in-flight scheduling
        while a batch runs (request-level scheduling computes every admitted sequence in one call anyway): up to
        `join_group` sequences in all, those nearest in input length to `fresh`'s longest among the sequences that
        fill the next `max_batch_rows` rows, so that little padding is computed."""
        wanted = self.join_group - len(fresh)
        if wanted <= 0 or self.scheduling != "inflight" or self._batch is None:
            return []
        longest = max(len(s.input_ids) for s in fresh)
        with self._cond:
            ahead = sorted(self._unprepared(), key=lambda s: abs(len(s.input_ids) - longest))[:wanted]
            for sequence in ahead:
                sequence.preparing = True
        return ahead

    def _merge(self, batch: DecoderBatch) -> None:
        if self._batch is None:
            self._batch = batch
        else:
            self._batch.extend(batch)

    def _prepare_ahead(self) -> None:
        """The joining thread: while the engine thread decodes, compute the rows (encoder call or prompt prefill)
        of the sequences next in the queue, one at a time, so that they join without the decoding waiting for that
        work; it runs on cores the decoding does not use (`joining_threads`, set here for this thread). When nothing
        runs, or there is no joining thread, the engine thread does the joining itself: at once, for every admitted
        sequence in one batched call, and on `latency_threads` while few rows run."""
        import torch

        torch.get_num_threads()
        torch.set_num_threads(self.joining_threads)
        with torch.inference_mode():
            while True:
                with self._cond:
                    sequence = self._await_work(self._next_to_prepare)
                    if sequence is None:
                        if not self._closed:
                            self.joining_thread = None  # idle: the next submit or admission starts another
                        return
                    sequence.preparing = True
                prepared = None
                try:
                    prepared = self._runner.new_rows([sequence.input_ids], [sequence.rows])
                except Exception:  # the engine thread tries again, and reports a failure to the sequence
                    logger.exception("preparing a sequence failed")
                with self._cond:
                    sequence.prepared, sequence.preparing = prepared, False
                    self._cond.notify_all()

    def _next_to_prepare(self) -> _Sequence | None:
        """While the engine decodes, the first waiting sequence not prepared yet among those that fill the next
        `max_batch_rows` rows (called under `_cond`)."""
        if not self._running or not self._runner.concurrent_joins:
            return None
        return next(self._unprepared(), None)

    def _unprepared(self) -> Iterator[_Sequence]:
        """Waiting sequences, in queue order, among those that fill the next `max_batch_rows` rows, whose rows
        are neither computed nor being computed (called under `_cond`)."""
        rows = 0
        for sequence in self._queue:
            rows += sequence.rows
            if rows > self.max_batch_rows:
                return
            if not (sequence.cancelled or sequence.preparing or sequence.prepared is not None):
                yield sequence

    def _drop_cancelled(self) -> None:
        if not any(s.dropped for s in self._running):
            return
        keep, finished, row = [], [], 0
        for sequence in self._running:
            if sequence.dropped:
                finished.append(sequence)
            else:
                keep.extend(range(row, row + sequence.rows))
            row += sequence.rows
        self._running = [s for s in self._running if not s.dropped]
        self._select(keep)
        for sequence in finished:
            self._finish(sequence, "cancelled")

    def _admit(self) -> list[_Sequence]:
        """Waiting sequences that fit now, in order; request-level scheduling admits only into an empty batch."""
        admitted: list[_Sequence] = []
        cancelled: list[_Sequence] = []
        with self._cond:
            for sequence in [s for s in self._queue if s.cancelled]:
                self._queue.remove(sequence)
                cancelled.append(sequence)
            if self.scheduling == "inflight" or not self._running:  # request-level: only into an empty batch
                while self._queue:
                    sequence = self._queue[0]
                    if self._used_rows + sequence.rows > self.max_batch_rows:
                        break
                    if self._used_tokens + sequence.need > self.kv_cache_tokens:
                        break
                    self._queue.popleft()
                    self._used_rows += sequence.rows
                    self._used_tokens += sequence.need
                    admitted.append(sequence)
            if self._queue:  # the joining thread: sequences wait while the batch runs
                self._start_threads()
                self._cond.notify_all()
        for sequence in cancelled:
            _report(sequence.done, GenerationResult([Hypothesis([])], "cancelled"))
        return admitted

    def _advance(self, logits: torch.Tensor) -> None:
        """Choose every running sequence's next token(s) from `logits` [rows, vocab]; retire finished sequences."""
        import torch

        row = 0
        for sequence in self._running:
            if sequence.beam is None and not sequence.retired:
                scores = logits[row:row + 1]
                if sequence.rules.active:
                    apply_rules(scores, [sequence.prefix + sequence.tokens], len(sequence.tokens), sequence.rules)
                if sequence.generator is not None:
                    warp(scores, sequence.request.options)
            row += sequence.rows
        choice = logits.argmax(dim=-1)
        row = 0
        for sequence in self._running:
            if sequence.generator is not None and not sequence.retired:
                choice[row:row + 1] = sample(logits[row:row + 1], sequence.generator)
            row += sequence.rows
        # One log-softmax for every row: logsumexp alone costs several times more on CPU (its exp of the whole
        # vocabulary is slow where most values underflow); beams search on these log-probabilities.
        log_probs = torch.log_softmax(logits, dim=-1)
        chosen_log_probs = log_probs.gather(1, choice[:, None])[:, 0].tolist()
        tokens = choice.tolist()

        #: The sequences that stay: each with its first row now, the rows it keeps and their next input tokens.
        stays: list[tuple[_Sequence, int, list[int], list[int]]] = []
        finished: list[tuple[_Sequence, str]] = []
        streamed: list[tuple[_Sequence, int]] = []

        def decode_on(sequence: _Sequence, row: int) -> None:
            """Keep every row of `sequence` (retired: static scheduling), fed the token just chosen for it."""
            stays.append((sequence, row, list(range(row, row + sequence.rows)), tokens[row:row + sequence.rows]))

        row = 0
        for sequence in self._running:
            if sequence.retired:
                decode_on(sequence, row)
            elif sequence.beam is not None:
                rows = self._beam_step(sequence, log_probs[row:row + sequence.rows])
                if rows is None:
                    finished.append((sequence, "end"))
                else:
                    beams = [beam[-1] for beam in sequence.beam.running_tokens]
                    stays.append((sequence, row, [row + r for r in rows], beams))
            else:
                token = tokens[row]
                sequence.tokens.append(token)
                sequence.log_probs.append(chosen_log_probs[row])
                sequence.score += chosen_log_probs[row]
                if sequence.request.stream and sequence.on_tokens is not None:
                    streamed.append((sequence, token))
                reason = self._finish_reason(sequence)
                if reason is None:
                    stays.append((sequence, row, [row], [token]))
                else:
                    finished.append((sequence, reason))
            if self.scheduling == "static" and finished and finished[-1][0] is sequence:  # decodes on, discarded
                sequence.retired = True
                decode_on(sequence, row)
            row += sequence.rows
        if all(s.retired for s, *_ in stays):  # static scheduling: the batch ends with its last sequence
            stays = []
        if finished:  # the rows that stay fill the places of those that left, so that few of them move
            order = fewest_moves([start for _, start, _, _ in stays], [len(rows) for _, _, rows, _ in stays])
            stays = [stays[i] for i in order]
        self._running = [sequence for sequence, *_ in stays]
        self._next_tokens = None
        self._select([r for _, _, rows, _ in stays for r in rows], same_sequences=not finished)
        if self._batch is not None:
            next_tokens = [token for *_, inputs in stays for token in inputs]
            self._next_tokens = torch.tensor(next_tokens, dtype=torch.long, device=self.device)
            if self.scheduling == "static" and self.max_positions is not None:  # retired rows may run past the end
                self._batch.positions.clamp_(max=self.max_positions - 1)
        for sequence, token in streamed:
            try:
                sequence.on_tokens([token])
            except Exception:
                logger.exception("on_tokens callback failed")
        for sequence, reason in finished:
            self._finish(sequence, reason)

    def _beam_step(self, sequence: _Sequence, scores: torch.Tensor) -> list[int] | None:
        """Beam search processes log-probabilities (`scores`, the sequence's rows), not logits, as transformers'
        does; the rules apply to them in place."""
        beam = sequence.beam
        if sequence.rules.active:
            contexts = [sequence.prefix + tokens for tokens in beam.running_tokens]
            apply_rules(scores, contexts, beam.generated, sequence.rules)
        return beam.step(scores, lambda tokens: self._ends(sequence, tokens), sequence.request.options.return_log_probs)

    @staticmethod
    def _ends(sequence: _Sequence, tokens: list[int]) -> bool:
        if tokens[-1] in sequence.rules.end_ids:
            return True
        return any(
            len(tokens) >= len(stop) and tokens[len(tokens) - len(stop):] == stop
            for stop in sequence.rules.stops
        )

    def _finish_reason(self, sequence: _Sequence) -> str | None:
        if self._ends(sequence, sequence.tokens):
            return "end"
        if len(sequence.tokens) >= sequence.request.options.max_new_tokens:
            return "length"
        return None

    def _select(self, keep: list[int], same_sequences: bool = False) -> None:
        """Keep the batch rows `keep`, in that order (no-op when nothing changes); `same_sequences` says that rows
        only moved among their own sequence's rows (beams), whose encoder states are all alike."""
        import torch

        if self._batch is None:
            return
        if not keep:
            self._batch, self._next_tokens = None, None
            return
        if keep != list(range(self._batch.rows)):
            index = torch.tensor(keep, dtype=torch.long, device=self.device)
            self._batch.select(index, decoder_only=same_sequences)
            if self._next_tokens is not None:
                self._next_tokens = self._next_tokens.index_select(0, index)

    def _finish(self, sequence: _Sequence, reason: str) -> None:
        self._used_rows -= sequence.rows
        self._used_tokens -= sequence.need
        options = sequence.request.options
        if sequence.beam is not None:
            if reason == "cancelled":
                hypotheses = sequence.beam.partial(options.num_return_sequences, options.return_log_probs)
            else:
                hypotheses = sequence.beam.hypotheses(options.num_return_sequences, options.return_log_probs)
                best = hypotheses[0].token_ids
                reason = "end" if best and self._ends(sequence, best) else "length"
        else:
            log_probs = sequence.log_probs if options.return_log_probs else None
            hypotheses = [Hypothesis(sequence.tokens, sequence.score, log_probs)]
        _report(sequence.done, GenerationResult(hypotheses, reason))


def _load_model(loader: Any, model_dir: Path, device: str, compute_type: str, onednn_linear: bool) -> tuple[Any, bool]:
    """The model on its device, and whether its linear layers compute on oneDNN (`onednn_linear`: CPU float32)."""
    import torch

    model = loader.from_pretrained(model_dir, dtype=getattr(torch, compute_type))
    model.to(torch.device(device)).eval()
    if not (onednn_linear and model.device.type == "cpu" and compute_type == "float32"):
        return model, False
    from transerve.backends.generation.onednn_linear import onednn_available, use_onednn_linears

    if onednn_available(torch):
        return model, use_onednn_linears(model) > 0
    logger.warning("%s: this torch build has no working oneDNN linear; using torch's own", model_dir)
    return model, False


def _on_own_thread(function: Callable[[], Any]) -> Any:
    """`function()` on a thread that ends with it. torch's OpenMP runtime (libgomp) keeps a pool of worker threads
    for each thread that has run a parallel region, for as long as that thread lives; once a process holds more
    such threads than cores, every pool's workers stop spinning between regions and go to sleep, and waking them
    costs each parallel region time. Loading runs parallel regions (packing weights for oneDNN does), so it must
    not leave a pool behind in the caller's thread (an executor's, which lives on), or the engine thread decodes
    slower: on a 2-core machine, a 16-row GPT-2 small step (packed oneDNN weights) took 65.7 ms with 1.5 cores
    busy after the model was loaded in a thread that lived on, 55.8 ms with 2 cores busy after loading in a thread
    that had ended."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch-generation-load") as loader:
        return loader.submit(function).result()


def _cpu_count() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _model_rules(generation: Any, encoder_decoder: bool) -> ModelRules:
    """The constraints of the model's generation config that `generate` applies whatever the call asks."""
    forced_last = generation.forced_eos_token_id
    return ModelRules(
        bad_words=[list(word) for word in generation.bad_words_ids or []],
        forced_first=generation.forced_bos_token_id if encoder_decoder else None,
        forced_last=None if forced_last is None else [forced_last] if isinstance(forced_last, int) else forced_last,
        no_repeat_ngram_size=generation.no_repeat_ngram_size or 0,
    )


def _report(done: DoneCallback, outcome: GenerationResult | Exception) -> None:
    try:
        done(outcome)
    except Exception:
        logger.exception("done callback failed")


def _max_positions(config: Any) -> int | None:
    """Decoder positions the model has (absolute position embeddings), None when unbounded (relative)."""
    for name in ("n_positions", "max_position_embeddings"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _max_input_length(model_dir: Path, config: Any) -> int:
    """Longest input: the model's position table, else the tokenizer's `model_max_length`, else 512."""
    positions = _max_positions(config)
    if positions is not None:
        return positions
    tokenizer_config = model_dir / "tokenizer_config.json"
    if tokenizer_config.is_file():
        value = json.loads(tokenizer_config.read_text()).get("model_max_length")
        if isinstance(value, int) and 0 < value < 1_000_000:
            return value
    return DEFAULT_MAX_INPUT_LENGTH
