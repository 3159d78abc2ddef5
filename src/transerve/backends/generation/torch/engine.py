"""The PyTorch + transformers generation engine: any transformers causal or seq2seq LM, with in-flight batching.

One engine thread runs its own decoding loop (never `generate`): each iteration admits waiting sequences that fit
(`scheduler`; their encoder call or prompt prefill done ahead, by the joining thread while the batch decoded
where decoding leaves cores idle or in an earlier joining call, or done now in one batched call that also computes
waiting sequences' rows, `join_group`), merges them into the running batch and feeds every row's last token
through one forward pass (`batch_runner`, `model_runner`: a new encoder-decoder row's first decoder input is the
decoder start token; a new decoder-only row's whole prompt went through the prefill, whose last position's logits
join the step's), then chooses each sequence's next token with its own options (`selection`). A finished or
cancelled sequence leaves the batch at once. This module wires those parts: requests in, results out, and the two
threads.

What a result holds: the new tokens, the end token or stop sequence included, with the log-probabilities and
scores `selection` describes. Streaming sends each new token of a beam-width-1 sequence after the step that
produced it; beam search streams nothing (its best hypothesis is only known at the end). Sampling is on when
`options.sampling` is set and the beam width is 1.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from transerve.backends.generation.engine import (
    DoneCallback,
    GenerationRequest,
    GenerationResult,
    Hypothesis,
    PromptScores,
    TokenCallback,
)
from transerve.backends.generation.grammar.compiler import GrammarCompiler
from transerve.backends.generation.torch.batch_rows import default_batch_rows
from transerve.backends.generation.torch.batch_runner import BatchRunner, StepPlan, StepResult, ThreadPolicy
from transerve.backends.generation.torch.cache_buffers import fewest_moves
from transerve.backends.generation.torch.join_stream import JoinStream, Prepared
from transerve.backends.generation.torch.model_loading import load
from transerve.backends.generation.torch.prefix_cache import BLOCK_TOKENS, PrefixCache
from transerve.backends.generation.torch.prefix_cache import DEFAULT_TOKENS as DEFAULT_PREFIX_TOKENS
from transerve.backends.generation.torch.prompt_scores import score_prompt
from transerve.backends.generation.torch.scheduler import RequestLevel, Scheduler, Scheduling
from transerve.backends.generation.torch.selection import choose, result
from transerve.backends.generation.torch.sequence import Sequence
from transerve.backends.generation.torch.step_graphs import step_graphs_for
from transerve.core.engine_load import EngineLoad
from transerve.core.errors import ServerError, internal, invalid_arg, unavailable

if TYPE_CHECKING:
    import torch

    from transerve.backends.generation.grammar.masks import RowGrammar
    from transerve.backends.generation.torch.decoder_batch import DecoderBatch

logger = logging.getLogger(__name__)

#: Seconds an engine thread waits without work before it ends (a new one starts with the next request).
IDLE_SECONDS = 1.0
#: Sequences one joining call computes at most under in-flight scheduling (`Scheduler.join_ahead`).
JOIN_GROUP = 4
_Work = TypeVar("_Work")


class _Handle:
    def __init__(self, engine: TorchEngine, sequence: Sequence) -> None:
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
    """A transformers model on one device, decoded by one thread of its own (see the module docstring).
    `scheduling` is in-flight batching unless another is passed in (`static_scheduling`, to compare against).
    `static_steps`: decoding steps at bucketed shapes over fixed buffers (`step_graphs`), recorded as CUDA graphs
    on a GPU and run eagerly elsewhere (for tests); None: on a GPU only."""

    def __init__(
        self,
        model_dir: Path,
        device: str = "cpu",
        compute_type: str = "float32",
        intra_op_threads: int = 0,
        max_batch_rows: int | None = None,
        kv_cache_tokens: int = 65536,
        latency_threads: int = 0,
        latency_rows: int = 1,
        onednn_linear: bool = True,
        join_group: int = JOIN_GROUP,
        scheduling: Scheduling | None = None,
        static_steps: bool | None = None,
        prefix_cache_tokens: int = DEFAULT_PREFIX_TOKENS,
    ) -> None:
        if (max_batch_rows is not None and max_batch_rows < 1) or kv_cache_tokens < 1:
            raise invalid_arg("max_batch_rows and kv_cache_tokens must be positive")
        if join_group < 1:
            raise invalid_arg("join_group must be positive")
        if intra_op_threads < 0 or latency_threads < 0 or latency_rows < 0 or prefix_cache_tokens < 0:
            raise invalid_arg("intra_op_threads, latency_threads, latency_rows and prefix_cache_tokens must not be "
                              "negative")
        model_dir = Path(model_dir)
        model, onednn, facts = load(model_dir, device, compute_type, onednn_linear)
        #: Whether the model's linear layers compute on oneDNN (`onednn_linear`: CPU float32 only).
        self.onednn_linear = onednn
        self.is_encoder_decoder = facts.is_encoder_decoder
        self.eos_token_ids = facts.eos_token_ids
        self.vocab_size = facts.vocab_size
        self.input_vocab_size = facts.vocab_size
        self.max_input_length = facts.max_input_length
        self.max_positions = facts.max_positions
        self.device = model.device
        if max_batch_rows is None:  # the config does not say: 32 on the CPU, sized from free memory on a GPU
            max_batch_rows = default_batch_rows(model, self.device, facts.is_encoder_decoder, facts.max_input_length,
                                                facts.max_positions, kv_cache_tokens)
        #: Rows decoded together (each beam is a row).
        self.max_batch_rows = max_batch_rows

        from transerve.backends.generation.torch.model_runner import ModelRunner

        forward = ModelRunner(model, facts.start_id, facts.pad_id, max_batch_rows, kv_cache_tokens)
        if prefix_cache_tokens >= BLOCK_TOKENS and forward.caches_prefixes:
            forward.prefixes = PrefixCache(prefix_cache_tokens, self.device)
        #: Prompt prefixes (encoder-decoder: sources) kept for later requests; None when off (`prefix_cache`).
        self.prefix_cache = forward.prefixes
        if static_steps is None:
            static_steps = self.device.type == "cuda"
        if static_steps:
            forward.graphs = step_graphs_for(forward, facts, max_batch_rows, kv_cache_tokens)
        scheduling = scheduling or Scheduling()
        if scheduling.joins_running_batch and not forward.per_row_positions:
            logger.warning(
                "%s: the decoder's positions cannot be set per row, so sequences cannot join a running batch; "
                "batching whole requests instead", model_dir,
            )
            scheduling = RequestLevel()
        self.scheduling = scheduling
        self.runner = BatchRunner(forward, ThreadPolicy(self.device, intra_op_threads, latency_threads, latency_rows))
        #: Where the joining thread's device work runs (a CUDA stream of its own on a GPU).
        self.join_stream = JoinStream(self.device)
        self.scheduler = Scheduler(facts, self.device, max_batch_rows, kv_cache_tokens, join_group, scheduling)
        self._name = model_dir.name
        self._model_dir = model_dir
        #: Structured outputs' compiler for this model's tokenizer, made by the first constrained request.
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()
        #: The engine thread, while there is work (`_await_work`): None when idle.
        self.thread: threading.Thread | None = None
        #: The joining thread (`_prepare_ahead`), while there is work; never when decoding uses every core.
        self.joining_thread: threading.Thread | None = None
        #: Seconds a thread of the engine waits without work before it ends (`_await_work`).
        self.idle_seconds = IDLE_SECONDS

    # -- the contract --------------------------------------------------------------------------------------------

    def submit(
        self, request: GenerationRequest, on_tokens: TokenCallback | None, done: DoneCallback
    ) -> _Handle | _Refused:
        """Queue a sequence; one the engine can never serve gets `done(INVALID_ARG)` here, in the caller's thread."""
        try:
            sequence = self.scheduler.new_sequence(request, on_tokens, done)
            if request.options.constraint is not None:
                grammar = self._grammar(sequence)
                if sequence.rows > 1:
                    sequence.beam_grammars = [grammar] + [grammar.copy() for _ in range(sequence.rows - 1)]
                else:
                    sequence.grammar = grammar
        except ServerError as error:
            _report(done, error)
            return _Refused()
        scheduler = self.scheduler
        with scheduler.cond:
            closed = scheduler.closed
            if not closed:
                if request.options.max_new_tokens == 0:
                    scheduler.scoring.append(sequence)
                else:
                    scheduler.enqueue(sequence)
                self._start_threads()
                scheduler.cond.notify_all()
        if closed:
            _report(done, unavailable("the generation engine is closed"))
            return _Refused()
        return _Handle(self, sequence)

    def load(self) -> EngineLoad:
        scheduler, cache = self.scheduler, self.prefix_cache
        return EngineLoad(len(scheduler.running), len(scheduler.queue) + len(scheduler.scoring),
                          scheduler.used_tokens / scheduler.kv_cache_tokens, cache.stats if cache is not None else None)

    def close(self) -> None:
        with self.scheduler.cond:
            self.scheduler.closed = True
            self.scheduler.cond.notify_all()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the engine's threads to end (after `close`)."""
        with self.scheduler.cond:
            threads = [t for t in (self.thread, self.joining_thread) if t is not None]
        for thread in threads:
            thread.join(timeout)

    def _grammar(self, sequence: Sequence) -> RowGrammar:
        """The grammar state of a sequence under a structured-output constraint, compiled in the submitting thread
        (the first such request also builds the tokenizer's tables, `grammar.compiler`)."""
        options = sequence.request.options
        assert options.constraint is not None
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler.from_model_dir(self._model_dir, self.vocab_size, self.eos_token_ids,
                                                                self.device)
        return self._grammars.row(options.constraint, sequence.rules.end_ids)

    # -- the threads ---------------------------------------------------------------------------------------------

    def _wake(self) -> None:
        with self.scheduler.cond:
            self.scheduler.cond.notify_all()

    def _start_threads(self) -> None:
        """Called under `cond` with work queued: start the engine thread, and the joining thread if the engine has
        one, where they ended while idle."""
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name=f"torch-generation:{self._name}", daemon=True)
            self.thread.start()
        if self.runner.threads.joining_threads > 0 and self.joining_thread is None:
            self.joining_thread = threading.Thread(
                target=self._prepare_ahead, name=f"torch-generation-join:{self._name}", daemon=True
            )
            self.joining_thread.start()

    def _await_work(self, work: Callable[[], _Work | None]) -> _Work | None:
        """Called under `cond`: wait until `work()` gives something and return it; None once the engine is closed,
        or after `idle_seconds` without work, when the calling thread is to end. Threads end when idle because
        torch's OpenMP runtime keeps a pool of worker threads for every thread that has computed, while it lives,
        and when a process holds more of them than cores, every pool stops spinning between parallel regions:
        an idle engine beside a busy one made the busy one's decoding slower (docs/generation.md)."""
        scheduler = self.scheduler
        deadline = time.monotonic() + self.idle_seconds
        while not scheduler.closed:
            found = work()
            if found:
                return found
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            scheduler.cond.wait(left)
        return None

    def _run(self) -> None:
        """The engine thread: iterations while there is work; on close, every sequence it holds fails."""
        import torch

        self.runner.threads.start_thread(joining=False)
        scheduler = self.scheduler
        with torch.inference_mode():
            while True:
                with scheduler.cond:
                    if not self._await_work(lambda: bool(scheduler.queue or scheduler.running or scheduler.scoring)):
                        if scheduler.closed:
                            break
                        self.thread = None  # idle: the next submit starts another
                        return
                try:
                    self._iteration()
                except Exception as exc:  # a bug or a device failure: fail what runs, keep serving the rest
                    logger.exception("generation step failed")
                    self._fail_running(internal(f"generation failed: {exc}"))
        self._fail_running(unavailable("the generation engine was closed"))
        with scheduler.cond:
            pending = scheduler.take_queue()
        for sequence in pending:
            _report(sequence.done, unavailable("the generation engine was closed"))

    def _fail_running(self, error: ServerError) -> None:
        self.runner.clear()
        for sequence in self.scheduler.release_all():
            _report(sequence.done, error)

    def _prepare_ahead(self) -> None:
        """The joining thread: while the engine thread decodes, compute the rows (encoder call or prompt prefill)
        of the sequences next in the queue, one at a time, so that they join without the decoding waiting for that
        work; it runs on cores the decoding does not use (`joining_threads`, set here for this thread). When nothing
        runs, or there is no joining thread, the engine thread does the joining itself: at once, for every admitted
        sequence in one batched call, and on `latency_threads` while few rows run."""
        import torch

        self.runner.threads.start_thread(joining=True)
        scheduler = self.scheduler
        with torch.inference_mode():
            while True:
                with scheduler.cond:
                    sequence = self._await_work(self._next_to_prepare)
                    if sequence is None:
                        if not scheduler.closed:
                            self.joining_thread = None  # idle: the next submit or admission starts another
                        return
                    scheduler.claim(sequence)
                prepared = None
                try:
                    with self.join_stream.joining():
                        batch, first = self.runner.forward.new_rows([sequence.input_ids], [sequence.rows])
                        prepared = self.join_stream.prepared(batch, first)
                except Exception:  # the engine thread tries again, and reports a failure to the sequence
                    logger.exception("preparing a sequence failed")
                scheduler.deliver([sequence], [prepared])

    def _next_to_prepare(self) -> Sequence | None:
        """While the engine decodes, the first waiting sequence not prepared yet among those that fill the next
        `max_batch_rows` rows (called under `cond`)."""
        if not self.scheduler.running or not self.runner.forward.concurrent_joins:
            return None
        return next(self.scheduler.unprepared(), None)

    # -- one iteration of the engine thread ----------------------------------------------------------------------

    def _iteration(self) -> None:
        self._drop_cancelled()
        self._score_only()
        admitted = self._score_prompts(self._admit())
        plan = StepPlan()
        if admitted:
            prepared, fresh = self.scheduler.take_prepared(admitted)
            if self.runner.forward.fuses_joins and self.runner.batch is not None:
                # prefilled in the step's forward, after the rest
                plan.prompts = ([s.input_ids for s in fresh], [s.rows for s in fresh]) if fresh else None
                joining, fused = [s for s, _ in prepared], fresh
                computed: list[Sequence] = []
            else:
                joining, fused, computed = [s for s, _ in prepared] + fresh, [], fresh
            try:
                plan.new = self._new_rows([rows for _, rows in prepared], computed) if joining else None
            except Exception as exc:  # their rows never reached the batch: they fail, the running ones go on
                logger.exception("computing joining sequences' rows failed")
                for sequence in joining:
                    self.scheduler.release(sequence)
                    _report(sequence.done, internal(f"generation failed: {exc}"))
                joining = []
            self.scheduler.join(joining + fused)  # from here on a failure reaches them too
        step = self.runner.step(plan)
        if step is not None:
            self._advance(step)

    def _drop_cancelled(self) -> None:
        keep, cancelled = self.scheduler.drop_cancelled()
        if not cancelled:
            return
        self.runner.select(keep)
        for sequence in cancelled:
            self._finish(sequence, "cancelled")

    def _admit(self) -> list[Sequence]:
        """Waiting sequences that fit now, in order (`Scheduler.admit`); cancelled waiting ones are answered."""
        scheduler = self.scheduler
        with scheduler.cond:
            admitted, cancelled = scheduler.admit()
            if scheduler.queue:  # the joining thread: sequences wait while the batch runs
                self._start_threads()
                scheduler.cond.notify_all()
        for sequence in cancelled:
            _report(sequence.done, GenerationResult([Hypothesis([])], "cancelled"))
        return admitted

    def _score_only(self) -> None:
        """Answer the sequences that only score their prompts (`max_new_tokens` 0)."""
        with self.scheduler.cond:
            waiting = self.scheduler.take_scoring()
        for sequence in waiting:
            if sequence.cancelled:
                _report(sequence.done, GenerationResult([Hypothesis([])], "cancelled"))
                continue
            try:
                prompt = self._prompt_scores(sequence)
            except Exception as exc:  # this sequence fails; the others are served
                logger.exception("scoring a prompt failed")
                _report(sequence.done, internal(f"scoring the prompt failed: {exc}"))
                continue
            _report(sequence.done, GenerationResult([Hypothesis([])], "length", prompt=prompt))

    def _score_prompts(self, admitted: list[Sequence]) -> list[Sequence]:
        """Admitted sequences that asked for their prompts' scores get them before they join; one whose scoring
        fails leaves with the error."""
        failed = []
        for sequence in admitted:
            if sequence.request.options.prompt_logprobs is None:
                continue
            try:
                sequence.prompt = self._prompt_scores(sequence)
            except Exception as exc:
                logger.exception("scoring a prompt failed")
                failed.append(sequence)
                _report(sequence.done, internal(f"scoring the prompt failed: {exc}"))
        if not failed:
            return admitted
        self.scheduler.take_prepared(failed)  # rows prepared ahead for them are dropped
        for sequence in failed:
            self.scheduler.release(sequence)
        return [sequence for sequence in admitted if sequence not in failed]

    def _prompt_scores(self, sequence: Sequence) -> PromptScores:
        options = sequence.request.options
        assert options.prompt_logprobs is not None
        self.runner.threads.set(joining=True, used_rows=self.scheduler.used_rows)
        return score_prompt(self.runner.forward.model, sequence.input_ids, options.prompt_logprobs)

    def _new_rows(self, prepared: list[Prepared], fresh: list[Sequence]) -> tuple[DecoderBatch, torch.Tensor]:
        """The rows of joining sequences, in that order: those `prepared` ahead, then one batched encoder call or
        prefill here for `fresh`, which also prepares the rows of waiting sequences of like length
        (`_join_ahead`). Returns their batch and their first decoder inputs (encoder-decoder) or first logits
        (decoder-only)."""
        import torch

        parts = [self.join_stream.receive(rows) for rows in prepared]
        if fresh:
            self.runner.threads.set(joining=True, used_rows=self.scheduler.used_rows)
            ahead = self._join_ahead(fresh)
            ready: list[Prepared | None] = [None] * len(ahead)
            try:
                group = fresh + ahead
                batch, first = self.runner.forward.new_rows([s.input_ids for s in group], [s.rows for s in group])
                if ahead:
                    rows = row = sum(s.rows for s in fresh)
                    for index, sequence in enumerate(ahead):
                        end = row + sequence.rows
                        ready[index] = Prepared(batch.rows_range(row, end, own=True), first[row:end].clone())
                        row = end
                    batch, first = batch.rows_range(0, rows), first[:rows]
            finally:
                if ahead:
                    self.scheduler.deliver(ahead, ready)
            parts.append((batch, first))
        batch = parts[0][0]
        for other, _ in parts[1:]:
            batch.extend(other)
        return batch, torch.cat([first for _, first in parts]) if len(parts) > 1 else parts[0][1]

    def _join_ahead(self, fresh: list[Sequence]) -> list[Sequence]:
        """Waiting sequences the call for `fresh`'s rows computes too (`Scheduler.join_ahead`): only while a batch
        runs; with none, every admitted sequence joins in that one call anyway."""
        if self.runner.batch is None:
            return []
        return self.scheduler.join_ahead(fresh)

    def _advance(self, step: StepResult) -> None:
        """Choose every running sequence's next token(s) from the step's logits (`selection`); the scheduling says
        which rows decode on; finished sequences are answered."""
        choices = choose(self.scheduler.running, step.logits)
        for error in choices.errors.values():
            logger.error("a sequence failed in its step, the batch goes on", exc_info=error)
        stays = self.scheduling.decode_on(choices)
        if choices.finished:  # the rows that stay fill the places of those that left, so that few of them move
            order = fewest_moves([start for _, start, _, _ in stays], [len(rows) for _, _, rows, _ in stays])
            stays = [stays[i] for i in order]
        self.scheduler.keep([sequence for sequence, *_ in stays])
        keep = [r for _, _, rows, _ in stays for r in rows]
        self.runner.feed(keep, [token for *_, inputs in stays for token in inputs], same_sequences=not choices.finished)
        if self.runner.batch is not None:
            self.scheduling.stepped(self.runner.batch, self.max_positions)
        for sequence, token in choices.streamed:
            options = sequence.request.options
            try:
                if options.return_log_probs:
                    top = [sequence.top[-1]] if options.top_logprobs else None
                    sequence.on_tokens([token], [sequence.log_probs[-1]], top)
                else:
                    sequence.on_tokens([token])
            except Exception:
                logger.exception("on_tokens callback failed")
        for sequence, reason, _ in choices.finished:
            error = choices.errors.get(sequence)
            if error is None:
                self._finish(sequence, reason)
            else:
                self.scheduler.release(sequence)
                _report(sequence.done, internal(f"generation failed: {error}"))

    def _finish(self, sequence: Sequence, reason: str) -> None:
        self.scheduler.release(sequence)
        _report(sequence.done, result(sequence, reason))


def _report(done: DoneCallback, outcome: GenerationResult | Exception) -> None:
    try:
        done(outcome)
    except Exception:
        logger.exception("done callback failed")
