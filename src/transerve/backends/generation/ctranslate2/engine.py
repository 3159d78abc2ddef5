"""The CTranslate2 engine: `Translator` for encoder-decoder models, `Generator` for decoder-only ones.

CTranslate2 has no step-level API, so this engine batches whole requests: a caller thread takes the waiting
sequences whose options CTranslate2 can run in one call (beam width, sampling settings, penalties, end tokens and
suppressed words are per call there), sorts them by input length, and decodes up to `max_batch_rows` rows
(beams count each) in one `translate_batch`/`generate_batch`. Rows leave the batch inside CTranslate2 as they
finish, and a sequence that arrives meanwhile cannot join that call (joining the running batch at the next step,
in-flight batching, is the torch engine's). So that it need not wait for the whole call, the engine runs up to
`max_concurrent_calls` calls at once: as many caller threads, over as many CTranslate2 replicas of the model
(`inter_threads`, which shares the weights), and a free thread starts the next call as soon as sequences wait.
Unless `intra_op_threads` says otherwise, the CPU's cores are divided among the replicas (at least one thread
each): CTranslate2's own default gives every replica several OpenMP threads, and replicas computing at once then
wait at each other's barriers.

With beam width 1, CTranslate2 calls back per produced token; that callback streams tokens, stops a row at its
own `max_new_tokens` (so requests asking for different lengths share a call), at a stop sequence, or when it is
cancelled. Beam search has no callback there: its rows run to the end of the call, so `max_new_tokens` is part of
the call's options and single-token stop sequences are added to the end tokens (longer ones are refused).

Log-probabilities are CTranslate2's own: each step's distribution after the repetition penalty, suppressed words and
`min_new_tokens`, before temperature, top-k and top-p (the torch engine reports them after those). `top_logprobs`
(beam width 1) asks CTranslate2 for each step's logits (`return_logits_vocab`, per call: such sequences decode in
calls of their own) and takes the likeliest of their log-softmax in the step callback; the chosen token's entry is
CTranslate2's log-probability of it, and where it ties with the first entry, it comes first.

Seeds: CTranslate2 samples from one random generator per worker thread, seeded from the global seed
(`ctranslate2.set_random_seed`) when that thread first samples and never again. A seeded sampling request
therefore runs alone, in its own call, on a replica of the model (a worker thread) that has never sampled, with
the seed set for the call: the same seed gives the same tokens whatever else is running. The first seeded
request loads that replica itself; from then on the engine keeps one such replica loaded ahead (the model's
weights once more in memory), loaded again after each seeded call, so later seeded requests do not wait for a
load. Seeds are taken modulo 2**32 - 1 (CTranslate2 seeds are 32-bit).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from transerve.backends.generation.ctranslate2.model_info import Ct2ModelInfo, read_model_info
from transerve.backends.generation.cuda_libraries import preload_cublas_once
from transerve.backends.generation.engine import (
    MAX_TOP_LOGPROBS,
    DoneCallback,
    GenerationRequest,
    GenerationResult,
    Hypothesis,
    PromptScores,
    TokenCallback,
    TopLogProbs,
    check_prompt_options,
    check_token_options,
)
from transerve.backends.threaded import import_engine
from transerve.core.engine_load import EngineLoad
from transerve.core.errors import ServerError, internal, invalid_arg, unavailable

logger = logging.getLogger(__name__)

#: `set_random_seed` is process-wide: a seed holds from setting it until the seeded replica has sampled.
_SEED_LOCK = threading.Lock()
#: CTranslate2's "no seed" value: worker threads that start later draw a seed from std::random_device.
_UNSEEDED = 2**32 - 1
#: The call's sampling options (top_k, top_p, temperature) that decode greedily.
_GREEDY = (1, 1.0, 1.0)


@dataclass(frozen=True, slots=True)
class _CallKey:
    """The options CTranslate2 takes per call: sequences with equal keys decode together."""

    beam_width: int
    num_hypotheses: int
    length_penalty: float
    sampling: tuple[int, float, float]  # top_k, top_p, temperature; (1, 1.0, 1.0) is greedy
    repetition_penalty: float
    min_new_tokens: int
    end_ids: tuple[int, ...]
    bad_words: tuple[tuple[int, ...], ...]
    #: Beam search only: beam-1 rows stop at their own length in the callback.
    max_new_tokens: int | None
    #: Seeded sampling: the seed; such a sequence runs alone.
    seed: int | None
    #: Whether the call returns each step's logits (`top_logprobs`): only calls whose sequences need them pay.
    logits: bool = False
    #: `max_new_tokens` 0: the prompts are scored (`prompt_logprobs`), nothing is generated.
    scoring_only: bool = False


@dataclass(eq=False)
class _Sequence:
    request: GenerationRequest
    on_tokens: TokenCallback | None
    done: DoneCallback
    key: _CallKey | None
    #: Set when the request can never be served; reported from a caller thread.
    error: ServerError | None = None
    cancelled: bool = False
    #: What the callback saw this call (beam width 1).
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    top: list[TopLogProbs] = field(default_factory=list)
    stopped: bool = False
    #: Tokens already streamed: a call tried again (`_decode`) streams only those past them.
    streamed: int = 0

    def cancel(self) -> None:
        self.cancelled = True

    def finish(self, outcome: GenerationResult | Exception) -> None:
        try:
            self.done(outcome)
        except Exception:  # noqa: BLE001 - a failing callback must not stop the engine
            logger.exception("generation done callback failed")


def isa_hint(device: str, compute_type: str, threads: int, cpuinfo: str, environ: Mapping[str, str]) -> str | None:
    """Advice for CTranslate2 float32 computing with several threads per call on an AMD CPU with AVX-512, where
    it multiplies with oneDNN's sgemm (MKL only on Intel CPUs): there oneDNN's AVX-512 sgemm ran slower with 2
    threads than with 1, and limited to AVX2 it gained from the second thread (benchmarks/README.md, "Figures
    behind the code").
    The limit is process-wide and slows int8 and the torch engine, so it is the operator's call, not the
    engine's."""
    if device != "cpu" or compute_type != "float32" or threads < 2:
        return None
    if "ONEDNN_MAX_CPU_ISA" in environ or "DNNL_MAX_CPU_ISA" in environ:
        return None
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    if "AuthenticAMD" not in cpuinfo or "avx512f" not in flags:
        return None
    return (f"CTranslate2 float32 with {threads} threads per call on an AMD CPU with AVX-512: "
            "ONEDNN_MAX_CPU_ISA=AVX2 in the server's environment may make it much faster, and slows int8 and torch "
            "models in the same process (docs/generation.md, 'CPU instruction set')")


_hinted = threading.Event()


def _log_isa_hint(device: str, compute_type: str, threads: int) -> None:
    """Log `isa_hint`'s advice once per process."""
    if _hinted.is_set():
        return
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return
    hint = isa_hint(device, compute_type, threads, cpuinfo, os.environ)
    if hint:
        _hinted.set()
        logger.info(hint)


def threads_per_call(calls: int) -> int:
    """This process's CPU cores shared among `calls` calls computing at once, at least one thread each."""
    return max(1, len(os.sched_getaffinity(0)) // calls)


class CTranslate2Engine:
    """One CTranslate2 model on one device, driven by `max_concurrent_calls` threads of its own."""

    def __init__(
        self,
        model_dir: Path,
        device: str = "cpu",
        device_index: int = 0,
        compute_type: str = "float32",
        intra_op_threads: int = 0,
        max_batch_rows: int = 16,
        max_concurrent_calls: int = 2,
    ) -> None:
        if device == "cuda":  # before CTranslate2 first opens cuBLAS (`cuda_libraries`)
            preload_cublas_once()
        self._ct2 = import_engine("ctranslate2", "generation")
        self._info: Ct2ModelInfo = read_model_info(Path(model_dir))
        calls = max(1, max_concurrent_calls)
        threads = intra_op_threads or (threads_per_call(calls) if device == "cpu" else 0)
        #: OpenMP threads of each replica (0: CTranslate2's default, on GPUs).
        self.intra_threads = threads
        self._load_args = (str(model_dir), device, device_index, compute_type, threads)
        try:
            self._model = self._load(replicas=calls)
        except (RuntimeError, ValueError) as exc:
            raise unavailable(f"CTranslate2 could not load {model_dir}: {exc}") from None
        _log_isa_hint(device, self._model.compute_type, threads)
        #: Rows (beams count each) one call decodes at most.
        self.max_batch_rows = max(1, max_batch_rows)
        self._target_index = {token: i for i, token in reversed(list(enumerate(self._info.target_vocabulary)))}
        self.is_encoder_decoder = self._info.is_encoder_decoder
        self.eos_token_ids = list(self._info.eos_token_ids)
        self.vocab_size = len(self._info.target_vocabulary)
        self.input_vocab_size = len(self._info.source_vocabulary)
        if self.is_encoder_decoder:
            self.max_input_length = self._info.encoder_positions or self._info.default_max_input
        else:
            positions = self._info.decoder_positions
            self.max_input_length = positions - 1 if positions else self._info.default_max_input
        self._pending: list[_Sequence] = []
        #: A replica whose worker thread has never sampled, for the next seeded sampling request.
        self._spare: Any | None = None
        self._spare_lock = threading.Lock()
        self._closed = False
        #: Sequences in the calls running now (`load`).
        self._decoding = 0
        self._wakeup = threading.Condition()
        self._callers = calls
        for number in range(calls):
            threading.Thread(target=self._serve, name=f"ctranslate2-engine-{number}", daemon=True).start()

    def _load(self, replicas: int = 1) -> Any:
        path, device, device_index, compute_type, threads = self._load_args
        kind = self._ct2.Translator if self._info.is_encoder_decoder else self._ct2.Generator
        return kind(path, device=device, device_index=device_index, compute_type=compute_type, intra_threads=threads,
                    inter_threads=replicas)

    # -- the protocol -------------------------------------------------------------------------------------------

    def submit(self, request: GenerationRequest, on_tokens: TokenCallback | None, done: DoneCallback) -> _Sequence:
        try:
            sequence = _Sequence(request, on_tokens, done, self._call_key(request))
        except ServerError as error:
            sequence = _Sequence(request, on_tokens, done, None, error=error)
        with self._wakeup:
            if self._closed:
                sequence.finish(unavailable("the generation engine is closed"))
                return sequence
            self._pending.append(sequence)
            self._wakeup.notify()
        return sequence

    def load(self) -> EngineLoad:
        """No key/value budget here: CTranslate2 sizes its memory per call."""
        return EngineLoad(self._decoding, len(self._pending))

    def close(self) -> None:
        with self._wakeup:
            self._closed = True
            pending, self._pending = self._pending, []
            self._wakeup.notify_all()
        for sequence in pending:
            sequence.finish(unavailable("the generation engine was closed before this sequence ran"))

    # -- validation ---------------------------------------------------------------------------------------------

    def _call_key(self, request: GenerationRequest) -> _CallKey:
        """The call options of a request, or INVALID_ARG for one this engine can never serve."""
        options, ids = request.options, request.input_ids
        if options.constraint is not None:
            raise invalid_arg("structured outputs (response_format, structured_outputs, guided_*) need the torch "
                              "engine (config parameter engine: torch); this model runs on CTranslate2")
        if options.sampling and options.min_p > 0.0:  # generate_batch has no min-p cut
            raise invalid_arg(f"min_p {options.min_p}: CTranslate2 has no min-p sampling; this model runs on "
                              "CTranslate2 (the torch engine, config parameter engine: torch, honours it)")
        if not ids:
            raise invalid_arg("the input has no tokens")
        if len(ids) > self.max_input_length:
            raise invalid_arg(f"the input has {len(ids)} tokens; this model takes at most {self.max_input_length}")
        vocabulary = len(self._info.source_vocabulary)
        if any(not 0 <= token < vocabulary for token in ids):
            raise invalid_arg(f"input token ids must lie in [0, {vocabulary})")
        check_prompt_options(options, self.is_encoder_decoder)
        positions = self._info.decoder_positions
        used = options.max_new_tokens + (1 if self.is_encoder_decoder else len(ids))
        if positions is not None and used > positions:
            raise invalid_arg(
                f"{'the decoder start token' if self.is_encoder_decoder else f'{len(ids)} input tokens'} plus "
                f"max_new_tokens {options.max_new_tokens} exceed the model's {positions} positions"
            )
        if options.beam_width < 1:
            raise invalid_arg("beam_width must be at least 1")
        if options.num_return_sequences < 1:
            raise invalid_arg("num_return_sequences must be at least 1")
        if not 0 <= options.top_logprobs <= MAX_TOP_LOGPROBS:
            raise invalid_arg(f"top_logprobs must lie in [0, {MAX_TOP_LOGPROBS}], got {options.top_logprobs}")
        if options.top_logprobs and options.beam_width > 1:
            raise invalid_arg("top_logprobs needs beam_width 1 with the CTranslate2 engine: beam search has no step "
                              "callback there")
        check_token_options(options, self.vocab_size)
        end_ids = tuple(options.end_ids) if options.end_ids else tuple(self.eos_token_ids)
        if any(not 0 <= t < self.vocab_size for t in end_ids):
            raise invalid_arg(f"end ids must lie in [0, {self.vocab_size})")
        beam = options.beam_width
        if beam > 1:
            if any(len(stop) > 1 for stop in options.stop_sequences):
                raise invalid_arg("stop sequences of several tokens need beam_width 1 with the CTranslate2 engine")
            end_ids += tuple(stop[0] for stop in options.stop_sequences if stop[0] not in end_ids)
        sampling = (max(options.top_k, 0), options.top_p, options.temperature) if options.sampling else _GREEDY
        seed = options.random_seed % _UNSEEDED if options.sampling and options.random_seed is not None else None
        return _CallKey(
            beam_width=beam,
            num_hypotheses=min(options.num_return_sequences, beam),
            # Beam width 1: no effect on the tokens, and 0 makes CTranslate2's score the cumulative log-probability.
            length_penalty=options.length_penalty if beam > 1 else 0.0,
            sampling=sampling,
            repetition_penalty=options.repetition_penalty,
            min_new_tokens=options.min_new_tokens,
            end_ids=end_ids,
            bad_words=tuple(tuple(word) for word in options.bad_words),
            max_new_tokens=options.max_new_tokens if beam > 1 else None,
            seed=seed,
            logits=options.top_logprobs > 0,
            scoring_only=options.max_new_tokens == 0,
        )

    # -- the caller threads -------------------------------------------------------------------------------------

    def _serve(self) -> None:
        while True:
            with self._wakeup:
                while not self._pending and not self._closed:
                    self._wakeup.wait()
                if self._closed:
                    break
                batch = self._take_batch()
                self._decoding += len(batch)
                if self._pending:  # more than one call's worth waits: a free caller takes the next
                    self._wakeup.notify()
            if batch:
                try:
                    self._decode(batch)
                finally:
                    with self._wakeup:
                        self._decoding -= len(batch)
        with self._wakeup:
            self._callers -= 1
            if not self._callers:
                self._model = self._spare = None

    def _take_batch(self) -> list[_Sequence]:
        """The oldest waiting sequence of the best priority (`GenerationRequest.priority`, lower first) with those
        like it, at most `max_batch_rows` rows, similar in length; rows left over go to like sequences of worse
        priorities, best first (`_fill`)."""
        ready = []
        for sequence in self._pending:
            if sequence.error is not None:
                sequence.finish(sequence.error)
            elif sequence.cancelled:
                sequence.finish(GenerationResult([Hypothesis([])], finish_reason="cancelled"))
            else:
                ready.append(sequence)
        if not ready:
            self._pending = []
            return []
        oldest = min(ready, key=lambda s: s.request.priority)  # the first of the best priority
        group = [s for s in ready if s.key == oldest.key and s.request.priority == oldest.request.priority] \
            if oldest.key.seed is None else [oldest]
        group.sort(key=lambda s: len(s.request.input_ids))
        rows = max(1, self.max_batch_rows // oldest.key.beam_width)
        start = min(group.index(oldest) // rows * rows, len(group))
        batch = _fill(group[start : start + rows], ready, rows)
        chosen = set(map(id, batch))
        self._pending = [s for s in ready if id(s) not in chosen]
        return batch

    def _decode(self, batch: list[_Sequence]) -> None:
        key = batch[0].key
        if key.scoring_only:
            for sequence in batch:
                self._score_only(sequence)
            return
        try:
            results = self._call(self._model, batch) if key.seed is None else self._seeded_call(batch, key.seed)
        except Exception as exc:  # noqa: BLE001 - a failed call fails its sequences, not the engine
            logger.exception("CTranslate2 call failed")
            error = exc if isinstance(exc, ServerError) else internal(f"CTranslate2 failed: {exc}")
            if len(batch) == 1:
                batch[0].finish(error)
                return
            # Which sequence failed the call is unknown: each is tried alone, so that only its culprit fails. A
            # greedy one streams on from where it was (it decodes the same tokens again); a sampled one that
            # streamed already cannot (its draws would differ), so it fails with the call.
            for sequence in batch:
                if key.sampling != _GREEDY and sequence.streamed:
                    sequence.finish(error)
                else:
                    self._decode([sequence])
            return
        for sequence, result in zip(batch, results, strict=True):
            if self._closed:
                sequence.finish(unavailable("the generation engine was closed while this sequence ran"))
            else:
                try:
                    outcome: GenerationResult | Exception = self._result(sequence, result, batch[0].key)
                except Exception as exc:  # noqa: BLE001 - scoring its prompt failed: this sequence fails
                    logger.exception("CTranslate2 result failed")
                    outcome = internal(f"CTranslate2 failed: {exc}")
                sequence.finish(outcome)
        if key.seed is not None:
            self._load_spare()

    @property
    def seeded_replica_ready(self) -> bool:
        """Whether a replica is loaded ahead for the next seeded sampling request."""
        return self._spare is not None

    def _seeded_call(self, batch: list[_Sequence], seed: int) -> list[Any]:
        """`batch` (one seeded sampling sequence) on a replica that has never sampled, so that its worker thread's
        generator starts from `seed`: the spare one when it is ready, else one loaded now."""
        with self._spare_lock:
            replica, self._spare = self._spare, None
        if replica is None:
            replica = self._load()
        with _SEED_LOCK:
            self._ct2.set_random_seed(seed)
            try:
                return self._call(replica, batch)
            finally:
                self._ct2.set_random_seed(_UNSEEDED)

    def _load_spare(self) -> None:
        """Load the replica the next seeded request will use, after this one's results went out; a failure only
        means that request loads its own."""
        if self._spare is not None or self._closed:
            return
        try:
            spare = self._load()
        except (RuntimeError, ValueError):
            logger.warning("CTranslate2 could not load a replica ahead for seeded sampling", exc_info=True)
            return
        with self._spare_lock:
            if self._spare is None and not self._closed:
                self._spare = spare

    def _call(self, model: Any, batch: list[_Sequence]) -> list[Any]:
        key = batch[0].key
        vocabulary = self._info.source_vocabulary
        target = self._info.target_vocabulary
        inputs = [[vocabulary[t] for t in s.request.input_ids] for s in batch]
        top_k, top_p, temperature = key.sampling
        options: dict[str, Any] = {
            "beam_size": key.beam_width,
            "num_hypotheses": key.num_hypotheses,
            "length_penalty": key.length_penalty,
            "repetition_penalty": key.repetition_penalty,
            "sampling_topk": top_k,
            "sampling_topp": top_p,
            "sampling_temperature": temperature,
            "end_token": list(key.end_ids),
            "return_end_token": True,
            "return_scores": True,
            "return_logits_vocab": key.logits,
        }
        if key.bad_words:
            options["suppress_sequences"] = [[target[t] for t in word] for word in key.bad_words]
        if key.beam_width == 1:
            for sequence in batch:
                sequence.tokens, sequence.log_probs, sequence.top, sequence.stopped = [], [], [], False
            options["callback"] = self._step_callback(batch)
        max_new = key.max_new_tokens or max(s.request.options.max_new_tokens for s in batch)
        if self.is_encoder_decoder:
            return model.translate_batch(
                inputs, max_decoding_length=max_new, min_decoding_length=key.min_new_tokens, max_input_length=0,
                **options,
            )
        return model.generate_batch(
            inputs, max_length=max_new, min_length=key.min_new_tokens, include_prompt_in_result=False, **options
        )

    def _step_callback(self, batch: list[_Sequence]):
        """Per produced token (beam width 1): stream it, and stop the row at its length, a stop sequence or cancel."""

        def on_step(step: Any) -> bool:
            sequence = batch[step.batch_id]
            if sequence.stopped:
                return True
            options = sequence.request.options
            sequence.tokens.append(step.token_id)
            sequence.log_probs.append(step.log_prob)
            if options.top_logprobs:
                sequence.top.append(self._top(step, options.top_logprobs))
            if sequence.on_tokens is not None and sequence.request.stream and len(sequence.tokens) > sequence.streamed:
                sequence.streamed = len(sequence.tokens)
                try:
                    if options.return_log_probs:
                        top = sequence.top[-1:] if options.top_logprobs else None
                        sequence.on_tokens([step.token_id], [step.log_prob], top)
                    else:
                        sequence.on_tokens([step.token_id])
                except Exception:  # noqa: BLE001
                    logger.exception("generation token callback failed")
            tokens = sequence.tokens
            sequence.stopped = (
                self._closed
                or sequence.cancelled
                or len(tokens) >= options.max_new_tokens
                or any(tokens[-len(stop) :] == stop for stop in options.stop_sequences)
            )
            return sequence.stopped

        return on_step

    def _top(self, step: Any, k: int) -> TopLogProbs:
        """The `k` likeliest tokens of the step's log-softmaxed logits ([1, vocab]), the chosen one at its own
        log-probability."""
        logits = step.logits
        if logits.device != "cpu":
            logits = logits.to_device(self._ct2.Device.cpu)
        if logits.dtype != self._ct2.DataType.float32:
            logits = logits.to(self._ct2.DataType.float32)
        scores = np.asarray(logits).reshape(-1)
        peak = scores.max()
        log_probs = scores - (peak + np.log(np.exp(scores - peak).sum()))
        k = min(k, log_probs.size)
        best = np.argpartition(-log_probs, k - 1)[:k]
        best = best[np.argsort(-log_probs[best], kind="stable")]
        top = [(int(token), float(log_probs[token])) for token in best]
        place = next((i for i, (token, _) in enumerate(top) if token == step.token_id), None)
        if place is not None:
            if top[place][1] == top[0][1]:
                top.insert(0, top.pop(place))
                place = 0
            top[place] = (step.token_id, step.log_prob)
        return top

    def _score_only(self, sequence: _Sequence) -> None:
        try:
            prompt = self._prompt_scores(sequence)
        except Exception as exc:  # noqa: BLE001 - this sequence fails, the engine serves on
            logger.exception("CTranslate2 prompt scoring failed")
            sequence.finish(internal(f"CTranslate2 failed to score the prompt: {exc}"))
            return
        sequence.finish(GenerationResult([Hypothesis([])], "length", prompt=prompt))

    def _prompt_scores(self, sequence: _Sequence) -> PromptScores:
        """`prompt_logprobs`: one `forward_batch` over the prompt, each position's log-softmax in float32 (on the
        host), the next token's entry and the likeliest ones."""
        ids, top = sequence.request.input_ids, sequence.request.options.prompt_logprobs or 0
        scores = self._model.forward_batch([ids], return_log_probs=True)
        if scores.device != "cpu":
            scores = scores.to_device(self._ct2.Device.cpu)
        log_probs = np.asarray(scores.to(self._ct2.DataType.float32))[0, :-1]
        chosen = log_probs[np.arange(len(ids) - 1), ids[1:]]
        ranks = ((log_probs > chosen[:, None]).sum(axis=-1) + 1).tolist()
        chosen = chosen.tolist()
        if not top:
            return PromptScores(chosen, [[] for _ in chosen], ranks)
        best = np.argpartition(-log_probs, top - 1, axis=-1)[:, :top]
        values = np.take_along_axis(log_probs, best, axis=-1)
        order = np.argsort(-values, axis=-1, kind="stable")
        best, values = np.take_along_axis(best, order, axis=-1), np.take_along_axis(values, order, axis=-1)
        return PromptScores(chosen, [list(zip(i, v, strict=True)) for i, v in zip(best.tolist(), values.tolist(),
                                                                                  strict=True)], ranks)

    def _result(self, sequence: _Sequence, result: Any, key: _CallKey) -> GenerationResult:
        if self.is_encoder_decoder:
            hypotheses = [[self._target_index[token] for token in tokens] for tokens in result.hypotheses]
        else:
            hypotheses = [list(ids) for ids in result.sequences_ids]
        scores = list(result.scores) if result.scores else [0.0] * len(hypotheses)
        options = sequence.request.options
        log_probs: list[list[float] | None] = [None] * len(hypotheses)
        if options.return_log_probs:
            log_probs = [sequence.log_probs[: len(ids)] for ids in hypotheses] if key.beam_width == 1 else (
                self._score(sequence, hypotheses)
            )
        best = hypotheses[0]
        if sequence.cancelled:
            reason = "cancelled"
        elif (best and best[-1] in key.end_ids) or any(best[-len(s) :] == s for s in options.stop_sequences):
            reason = "end"
        else:
            reason = "length" if len(best) >= options.max_new_tokens else "end"
        top = [sequence.top[: len(ids)] if options.top_logprobs else None for ids in hypotheses]
        return GenerationResult(
            [Hypothesis(ids, score, lp, tp) for ids, score, lp, tp in zip(hypotheses, scores, log_probs, top,
                                                                          strict=True)],
            finish_reason=reason,
            prompt=self._prompt_scores(sequence) if options.prompt_logprobs is not None else None,
        )

    def _score(self, sequence: _Sequence, hypotheses: list[list[int]]) -> list[list[float] | None]:
        """Each token's log-probability under the model, from a scoring pass (beam search has no step callback)."""
        target = self._info.target_vocabulary
        tokens = [[target[t] for t in ids] for ids in hypotheses]
        source = [self._info.source_vocabulary[t] for t in sequence.request.input_ids]
        if self.is_encoder_decoder:
            # score_batch appends the end token to each target: its log-probabilities come after ours.
            scored = self._model.score_batch([source] * len(tokens), tokens)
            return [list(s.log_probs[: len(ids)]) for s, ids in zip(scored, hypotheses, strict=True)]
        scored = self._model.score_batch([source + t for t in tokens])
        return [list(s.log_probs[len(s.log_probs) - len(ids) :]) if ids else [] for s, ids in
                zip(scored, hypotheses, strict=True)]


def _fill(batch: list[_Sequence], ready: list[_Sequence], rows: int) -> list[_Sequence]:
    """`batch` (one priority) with the sequences of `ready` that share its call options and come at worse
    priorities, best first, up to `rows` sequences: they ride along in a call that runs anyway."""
    key, priority = batch[0].key, batch[0].request.priority
    if len(batch) >= rows or key.seed is not None:
        return batch
    worse = sorted((s for s in ready if s.key == key and s.request.priority > priority),
                   key=lambda s: s.request.priority)
    return batch + worse[:rows - len(batch)]
