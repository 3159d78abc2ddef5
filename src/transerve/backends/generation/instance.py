"""One generation instance: requests in, one engine sequence per row, responses (or a stream of them) out.

The instance schedules nothing itself: every row goes to the engine at once, so the engine's batching sees all
the work there is (`max_inflight` is high for that reason; the scheduler's queue must not hold requests back).
The engine calls back from its own thread; each call is moved onto the event loop with one
`call_soon_threadsafe`, and everything else happens on the loop.

Streaming (a decoupled model, `stream` true): each response carries every row's output ids so far and
`prefix_length`, the ids the client already has, and when the request asked for log-probabilities, those of every
generated token so far (and their top lists); tokens that arrive within one loop iteration go out in one
response. The last response carries the final flag. A cancelled stream cancels its sequences in the engine,
which stops decoding them at its next step; so does the scheduler's `cancel` when the client of a one-response
request goes away.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from transerve.backends.base import BackendInstance, ExecutionResult
from transerve.backends.generation.engine import (
    GenerationEngine,
    GenerationRequest,
    GenerationResult,
    SequenceHandle,
    TopLogProbs,
)
from transerve.backends.generation.interface import RowResult, TensorInterface
from transerve.backends.generation.options import Limits, decoding_options, parameter_values, tensor_values
from transerve.core.errors import ServerError, internal, invalid_arg
from transerve.core.types import InferRequest, InferResponse

#: Executions one instance takes at once: more than any engine decodes together; the engines queue the rest.
MAX_INFLIGHT = 4096

Outcome = InferResponse | ServerError | None


class GenerationInstance(BackendInstance):
    max_inflight = MAX_INFLIGHT
    cancellable = True

    def __init__(self, model_name: str, version: str, name: str, engine: GenerationEngine,
                 interface: TensorInterface, limits: Limits, loop: asyncio.AbstractEventLoop) -> None:
        self.name = name
        self.model_name = model_name
        self.version = version
        self.engine = engine
        self.interface = interface
        self.limits = limits
        #: Kept: engine callbacks hop onto it from the engine's thread.
        self.loop = loop
        #: The requests running, by identity: what `cancel` finds them by.
        self._runs: dict[int, _RequestRun] = {}

    def execute(self, requests: list[InferRequest]) -> asyncio.Future[ExecutionResult]:
        future: asyncio.Future[ExecutionResult] = self.loop.create_future()
        started = time.monotonic_ns()
        outcomes: list[Outcome] = [None] * len(requests)
        remaining = [len(requests)]

        def finish(index: int, outcome: Outcome) -> None:
            self._runs.pop(id(requests[index]), None)
            outcomes[index] = outcome
            remaining[0] -= 1
            if remaining[0] == 0 and not future.done():
                future.set_result(ExecutionResult(outcomes, compute_infer_ns=time.monotonic_ns() - started))

        for index, request in enumerate(requests):
            run = _RequestRun(self, request, lambda outcome, index=index: finish(index, outcome))
            self._runs[id(request)] = run
            run.start()
        return future

    def prefix_cache_stats(self) -> tuple[int, int, int, int] | None:
        cache = getattr(self.engine, "prefix_cache", None)  # the torch engine's, where it has one
        if cache is None:
            return None
        stats = cache.stats
        return stats.queried_tokens, stats.hit_tokens, stats.hits, stats.misses

    def cancel(self, request: InferRequest) -> None:
        run = self._runs.get(id(request))
        if run is not None:
            run.cancel()

    async def close(self) -> None:
        self.engine.close()


class _RequestRun:
    """One request: its rows' sequences in the engine, what they produced so far, and its answer."""

    __slots__ = ("_instance", "_request", "_finish", "_prompts", "_handles", "_results", "_generated",
                 "_generated_log_probs", "_generated_top", "_sent", "_stream", "_streaming", "_flush_due", "_over",
                 "_cancelled", "_log_probs", "_top", "_input_lengths", "_prompt_scores")

    def __init__(self, instance: GenerationInstance, request: InferRequest, finish: Callable[[Outcome], None]):
        self._instance = instance
        self._request = request
        self._finish = finish
        self._stream = request.response_stream if instance.limits.decoupled else None
        self._handles: list[SequenceHandle] = []
        self._over = False
        self._cancelled = False
        self._flush_due = False

    def start(self) -> None:
        try:
            sequences = self._sequences()
        except ServerError as error:
            self._end(error)
            return
        engine, loop = self._instance.engine, self._instance.loop
        count = len(sequences)
        self._results: list[GenerationResult | None] = [None] * count
        self._generated: list[list[int]] = [[] for _ in range(count)]
        self._generated_log_probs: list[list[float]] = [[] for _ in range(count)]
        self._generated_top: list[list[TopLogProbs]] = [[] for _ in range(count)]
        self._sent = [0] * count
        if not sequences:  # a batch of zero rows
            self._complete()
            return
        for row, sequence in enumerate(sequences):
            on_tokens = None
            if sequence.stream:
                def on_tokens(tokens: list[int], log_probs: list[float] | None = None,
                              top: list[TopLogProbs] | None = None, row: int = row) -> None:
                    loop.call_soon_threadsafe(self._tokens, row, tokens, log_probs, top)

            def done(outcome: GenerationResult | Exception, row: int = row) -> None:
                loop.call_soon_threadsafe(self._done, row, outcome)

            try:
                self._handles.append(engine.submit(sequence, on_tokens, done))
            except Exception as exc:  # an engine bug: this request fails, the instance keeps serving
                self._done(row, exc)
                return
        if self._stream is not None:
            self._stream.on_cancel(self.cancel)

    def _sequences(self) -> list[GenerationRequest]:
        """One engine sequence per row, every row's options checked before any is submitted."""
        instance, request = self._instance, self._request
        rows, tensors = instance.interface.rows(request)
        parameters = parameter_values(request.parameters)
        asks_log_probs = instance.interface.asks_log_probs(request)
        asks_prompt_scores = instance.interface.asks_prompt_scores(request)
        longest, vocabulary = instance.engine.max_input_length, instance.engine.input_vocab_size
        sequences = []
        self._log_probs = asks_log_probs
        self._top = self._prompt_scores = False
        for row in rows:
            values: dict[str, Any] = {**parameters, **tensor_values(tensors, row.index)}
            if asks_log_probs:
                values["return_log_probs"] = True
            if asks_prompt_scores:
                values.setdefault("prompt_logprobs", 0)
            options, stream = decoding_options(values, instance.limits)
            where = f"row {row.index}: " if len(rows) > 1 else ""
            if not row.input_ids:
                raise invalid_arg(f"{where}the input is empty (length 0): a generation request needs at least one "
                                  "token")
            if len(row.input_ids) > longest:
                raise invalid_arg(f"{where}the input has {len(row.input_ids)} tokens, more than the {longest} this "
                                  "model takes")
            outside = next((token for token in row.input_ids if not 0 <= token < vocabulary), None)
            if outside is not None:
                raise invalid_arg(f"{where}input '{instance.interface.names.ids}' holds token id {outside}, outside "
                                  f"this model's vocabulary [0, {vocabulary})")
            if options.top_logprobs:
                instance.interface.check_top_outputs()
                self._top = True
            if options.prompt_logprobs is not None:
                instance.interface.check_prompt_outputs(options.prompt_logprobs)
                self._prompt_scores = True
            self._log_probs = self._log_probs or options.return_log_probs
            sequences.append(GenerationRequest(row.input_ids, options, stream=stream))
        self._streaming = any(sequence.stream for sequence in sequences)
        # Decoder-only models' output ids start with the prompt, as FasterTransformer's GPT returns them.
        self._prompts = [[] if instance.engine.is_encoder_decoder else row.input_ids for row in rows]
        self._input_lengths = [len(row.input_ids) for row in rows]
        return sequences

    # ---- engine reports, on the loop ------------------------------------------------------------------------

    def _tokens(self, row: int, tokens: list[int], log_probs: list[float] | None,
                top: list[TopLogProbs] | None) -> None:
        if self._over:
            return
        self._generated[row].extend(tokens)
        if log_probs is not None:
            self._generated_log_probs[row].extend(log_probs)
        if top is not None:
            self._generated_top[row].extend(top)
        if not self._flush_due:
            self._flush_due = True
            self._instance.loop.call_soon(self._flush)

    def _flush(self) -> None:
        """One streamed response with what every row produced since the last one."""
        self._flush_due = False
        if self._over or self._cancelled:
            return
        results = [
            RowResult([prompt + generated], [len(prompt) + sent], input_length=length)
            for prompt, generated, sent, length in zip(self._prompts, self._generated, self._sent,
                                                       self._input_lengths, strict=True)
        ]
        if self._log_probs:  # every generated token's so far, as the ids are
            for result, log_probs, top in zip(results, self._generated_log_probs, self._generated_top, strict=True):
                result.scores, result.log_probs, result.top = [sum(log_probs)], [log_probs], [top]
        self._sent = [len(generated) for generated in self._generated]
        self._stream.send(self._response(results, self._log_probs, self._top))

    def _done(self, row: int, outcome: GenerationResult | Exception) -> None:
        if self._over:
            return
        if isinstance(outcome, Exception):
            error = outcome if isinstance(outcome, ServerError) else internal(
                f"model '{self._instance.model_name}': the generation engine failed: {type(outcome).__name__}: "
                f"{outcome}"
            )
            for handle in self._handles:
                handle.cancel()  # the request failed: its other rows stop too
            self._end(error)
            return
        self._results[row] = outcome
        if all(result is not None for result in self._results):
            self._complete()

    def _complete(self) -> None:
        if self._cancelled:
            self._end(None)
            return
        results = []
        for prompt, result, sent, length in zip(self._prompts, self._results, self._sent, self._input_lengths,
                                                strict=True):
            hypotheses = result.hypotheses
            results.append(RowResult(
                sequences=[prompt + hypothesis.token_ids for hypothesis in hypotheses],
                prefix=[len(prompt) + sent] * len(hypotheses),
                scores=[hypothesis.score for hypothesis in hypotheses],
                log_probs=[hypothesis.log_probs or [] for hypothesis in hypotheses],
                top=[hypothesis.top_log_probs or [] for hypothesis in hypotheses],
                input_length=length,
                prompt=result.prompt,
            ))
        if self._stream is None:
            self._end(self._response(results, self._log_probs, self._top, self._prompt_scores))
            return
        unsent = any(len(s) > p for result in results for s, p in zip(result.sequences, result.prefix, strict=True))
        if not self._streaming or unsent or self._log_probs or self._prompt_scores:
            self._stream.send(self._response(results, self._log_probs, self._top, self._prompt_scores), final=True)
        else:
            self._stream.close()
        self._end(None)

    def _response(self, results: list[RowResult], log_probs: bool, top: bool, prompt: bool = False) -> InferResponse:
        interface = self._instance.interface
        tensors = interface.response_tensors(results, interface.wanted(self._request, log_probs, top, prompt))
        return InferResponse(self._instance.model_name, self._instance.version, tensors, id=self._request.id)

    def cancel(self) -> None:
        """The client went away: stop every row at the engine's next step."""
        self._cancelled = True
        for handle in self._handles:
            handle.cancel()

    def _end(self, outcome: Outcome) -> None:
        if not self._over:
            self._over = True
            self._finish(outcome)
