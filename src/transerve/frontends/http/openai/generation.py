"""One choice of a completion: a request to the model through the server's request path, its tokens turned into
text deltas as they arrive, stop strings found on the text, the finish reason and the token counts.

Every choice is one request to the model, so choices of one call decode side by side in the engine's in-flight
batch and count in the model's statistics like any other request. A generator gets token ids and, when it is
decoupled, streams them back (`stream` parameter); a stop string found in the text cancels the request, which
stops its sequence at the engine's next step. A text model gets the prompt text and answers with its completion.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transerve.core.errors import ServerError
from transerve.core.protocol_parameters import level_of_openai_priority
from transerve.core.types import InferRequest, RequestedOutput, Tensor
from transerve.frontends.http.openai.catalog import GENERATE, OpenAIModel
from transerve.frontends.http.openai.errors import ApiError, bad_request, from_server_error
from transerve.frontends.http.openai.params import Sampling
from transerve.frontends.http.openai.text import TextStream, TextTokenizer
from transerve.server import Server

_TOP_OUTPUTS = ("output_top_ids", "output_top_log_probs")
_PROMPT_TOP_OUTPUTS = ("prompt_top_ids", "prompt_top_log_probs")


@dataclass(slots=True)
class TokenLogProb:
    token_id: int
    logprob: float
    #: The likeliest tokens at this step, best first, as (id, log-probability).
    top: list[tuple[int, float]]
    #: The token's rank in its step's distribution (1: the likeliest), where the model reported it.
    rank: int | None = None


@dataclass(slots=True)
class Delta:
    """What a choice produced since its last delta: text, the tokens behind it (when log-probs were asked) and,
    last, why it ended."""

    index: int
    text: str
    logprobs: list[TokenLogProb] = field(default_factory=list)
    finish_reason: str | None = None
    #: The choice's completion tokens so far (vLLM's `continuous_usage_stats`).
    completion_tokens: int = 0


@dataclass(slots=True)
class Prompt:
    ids: list[int]
    #: What `echo` repeats: the prompt's text as given, or its ids decoded.
    text: str


class Choice:
    """One choice's run. `completion_tokens` counts the ids the model generated up to the end (a stop string's
    tokens included, the end token included when the model produced one), as OpenAI and vLLM count them."""

    def __init__(self, server: Server, entry: OpenAIModel, tokenizer: TextTokenizer | None, prompt: Prompt,
                 sampling: Sampling, index: int, seed: int | None, max_tokens: int | None, started: float) -> None:
        self._server = server
        self.entry = entry
        self._tokenizer = tokenizer
        self.prompt = prompt
        self._sampling = sampling
        self.index = index
        self._seed = seed
        self._max_tokens = max_tokens
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        #: When the API took the request (`time.perf_counter()`), before tokenizing: where time to first token starts.
        self._started = started
        self._first_token_at: float | None = None
        self._last_token_at = 0.0
        #: The prompt's tokens after the first, scored by the model (`Sampling.prompt_scores`), once they came.
        self.prompt_scores: list[TokenLogProb] | None = None

    async def deltas(self) -> AsyncGenerator[Delta, None]:
        """The choice's deltas, the last one with its finish reason; raises ApiError when the model refuses.
        Closing the generator (the client went away) cancels the model's request. While it runs, the choice counts
        among the model's sequences in flight (vLLM's requests running), and its end is counted by its reason."""
        timings = self.entry.model.stats.tokens
        timings.active += 1
        inner = self._generated() if self.entry.kind == GENERATE else self._text()
        try:
            async for delta in inner:
                if delta.finish_reason is not None:
                    self.finish_reason = delta.finish_reason
                yield delta
        finally:
            await inner.aclose()
            timings.active -= 1
            timings.record_finish(self.finish_reason)

    # ---- generators: ids in, ids out -------------------------------------------------------------------------

    async def _generated(self) -> AsyncGenerator[Delta, None]:
        assert self._tokenizer is not None
        stream = self._server.infer_stream(self._generator_request())
        text = TextStream(self._tokenizer, self._sampling.skip_special_tokens)
        stops = _StopFinder(self._sampling.stop, self._sampling.include_stop_str)
        stop_ids = self._sampling.stop_token_ids
        consumed = 0  # generated ids taken so far
        stopped = False
        try:
            while not stopped:
                try:
                    item, _ = await stream.receive()
                except StopAsyncIteration:
                    break
                if item is None:
                    continue
                if isinstance(item, ServerError):
                    raise from_server_error(item)
                if self._sampling.prompt_scores is not None and self.prompt_scores is None:
                    self.prompt_scores = self._scored_prompt(item.outputs)
                new_ids, logprobs = self._new_tokens(item.outputs, consumed)
                if not new_ids:
                    continue
                self._timed()
                consumed += len(new_ids)
                # With stop strings or ids, ids go one at a time so the count stops at the id that ended the choice.
                step = 1 if stops.active or stop_ids else len(new_ids)
                for start in range(0, len(new_ids), step):
                    ids = new_ids[start:start + step]
                    self.completion_tokens += len(ids)
                    released, stopped = stops.feed(text.add(ids))
                    if not stopped and stop_ids and ids[0] in stop_ids:  # vLLM's stop_token_ids: the id is kept
                        tail, by_string = stops.feed(text.finish())  # the choice ends here: its last text goes
                        released += tail + ("" if by_string else stops.flush())
                        stopped = True
                    token_logprobs = logprobs[start:start + step] if logprobs is not None else []
                    if released or token_logprobs:
                        yield Delta(self.index, released, token_logprobs, completion_tokens=self.completion_tokens)
                    if stopped:
                        break
        finally:
            if not stream.closed:
                stream.cancel()  # a stop string, or the client went away: the engine stops the sequence
        if stopped:
            yield Delta(self.index, "", finish_reason="stop", completion_tokens=self.completion_tokens)
            return
        released, stopped = stops.feed(text.finish())
        released += "" if stopped else stops.flush()
        yield Delta(self.index, released, finish_reason="stop" if stopped else self._finish_reason(text.ids),
                    completion_tokens=self.completion_tokens)

    def _generator_request(self) -> InferRequest:
        entry, sampling, ids = self.entry, self._sampling, self.prompt.ids
        spec = entry.model.signature.inputs
        inputs = [
            Tensor("input_ids", spec["input_ids"].datatype, _column(ids, spec["input_ids"].datatype)),
            Tensor("sequence_length", spec["sequence_length"].datatype,
                   _column([len(ids)], spec["sequence_length"].datatype)),
        ]
        parameters: dict[str, Any] = {}
        if self._max_tokens is not None:
            parameters["max_new_tokens"] = self._max_tokens
        if sampling.min_tokens:
            parameters["min_new_tokens"] = sampling.min_tokens
        if sampling.repetition_penalty != 1.0:
            parameters["repetition_penalty"] = sampling.repetition_penalty
        if not sampling.greedy:
            parameters.update(temperature=sampling.temperature, top_p=sampling.top_p)
            if sampling.top_k:
                parameters["top_k"] = sampling.top_k
            if sampling.min_p:
                parameters["min_p"] = sampling.min_p
            if self._seed is not None:
                if "random_seed" in spec:
                    inputs.append(Tensor("random_seed", spec["random_seed"].datatype,
                                         _column([self._seed], spec["random_seed"].datatype)))
                else:
                    parameters["random_seed"] = self._seed
        outputs = ["output_ids", "sequence_length", "prefix_length"]
        if sampling.logprobs is not None:
            if "output_log_probs" not in entry.outputs:
                raise bad_request(f"model '{entry.id}' does not return log-probabilities", param="logprobs")
            parameters["return_log_probs"] = True
            outputs.append("output_log_probs")
            if sampling.logprobs > 0:
                if not set(_TOP_OUTPUTS) <= entry.outputs:
                    raise bad_request(f"model '{entry.id}' does not return the likeliest tokens' log-probabilities "
                                      "(its config has no output_top_ids): ask logprobs without top ones",
                                      param="top_logprobs")
                parameters["top_logprobs"] = sampling.logprobs
                outputs.extend(_TOP_OUTPUTS)
        if sampling.structured:
            parameters.update(sampling.structured)
        if sampling.prompt_scores is not None:
            top = sampling.prompt_scores
            wanted = ["prompt_log_probs", *(_PROMPT_TOP_OUTPUTS if top else ())]
            if not set(wanted) <= entry.outputs:
                param = "prompt_logprobs" if sampling.prompt_logprobs is not None else "echo"
                raise bad_request(f"model '{entry.id}' does not score prompts (its config has no "
                                  f"{' or '.join(sorted(set(wanted) - entry.outputs))} output)", param=param)
            parameters["prompt_logprobs"] = top
            outputs.extend(wanted)
            if sampling.prompt_logprobs is not None and "prompt_ranks" in entry.outputs:
                outputs.append("prompt_ranks")  # vLLM's `rank` of each prompt token (configs written before lack it)
        if entry.decoupled:
            parameters["stream"] = True
        return InferRequest(model_name=entry.id, model_version=entry.model.version, inputs=inputs,
                            outputs=[RequestedOutput(name) for name in outputs], parameters=parameters,
                            priority=_level(sampling))

    def _new_tokens(self, outputs: list[Tensor], consumed: int) -> tuple[list[int], list[TokenLogProb] | None]:
        """The ids a response adds after what the choice has (`prefix_length` says what the client has: the prompt
        for a decoder-only model, and the ids of earlier responses), with their log-probs when asked."""
        by_name = {tensor.name: tensor.data for tensor in outputs}
        length = int(by_name["sequence_length"].reshape(-1)[0])
        prefix = int(by_name["prefix_length"].reshape(-1)[0])
        ids = by_name["output_ids"].reshape(by_name["output_ids"].shape[0], -1, by_name["output_ids"].shape[-1])[0, 0]
        new_ids = [int(token) for token in ids[prefix:length]]
        if self._sampling.logprobs is None or "output_log_probs" not in by_name:
            return new_ids, None
        chosen = by_name["output_log_probs"].reshape(-1)[consumed:consumed + len(new_ids)]
        top_ids, top_values = by_name.get("output_top_ids"), by_name.get("output_top_log_probs")
        if top_ids is not None and top_values is not None:  # [batch, beams, T, k]: the first beam's [T, k]
            top_ids = top_ids[(0,) * (top_ids.ndim - 2)]
            top_values = top_values[(0,) * (top_values.ndim - 2)]
        result = []
        for step, (token, value) in enumerate(zip(new_ids, chosen, strict=False), start=consumed):
            top = []
            if top_ids is not None and top_values is not None and step < top_ids.shape[0]:
                top = [(int(i), _finite(float(v))) for i, v in zip(top_ids[step], top_values[step], strict=True)]
            result.append(TokenLogProb(token, _finite(float(value)), top))
        return new_ids, result

    def _scored_prompt(self, outputs: list[Tensor]) -> list[TokenLogProb] | None:
        """The prompt's scores from the response that carries them (the generator's last): None until then."""
        by_name = {tensor.name: tensor.data for tensor in outputs}
        values = by_name.get("prompt_log_probs")
        if values is None:
            return None
        ids = self.prompt.ids[1:]
        values = values.reshape(values.shape[0], -1)[0]
        top_ids, top_values = (by_name.get(name) for name in _PROMPT_TOP_OUTPUTS)
        ranks = by_name.get("prompt_ranks")
        scored = []
        for position, (token, value) in enumerate(zip(ids, values, strict=False)):
            top = []
            if top_ids is not None and top_values is not None:
                top = [(int(i), _finite(float(v))) for i, v in zip(top_ids[0, position], top_values[0, position],
                                                                   strict=True)]
            rank = int(ranks[0, position]) if ranks is not None else None
            scored.append(TokenLogProb(token, _finite(float(value)), top, rank))
        return scored

    def _finish_reason(self, generated: list[int]) -> str:
        """`stop` for an end token (even as the last allowed one, as vLLM decides), `length` for a choice that
        reached its limit: `max_tokens`, or the model's own default when the request gave none."""
        assert self._tokenizer is not None
        if generated and generated[-1] in self._tokenizer.end_ids:
            return "stop"
        if self._max_tokens is None or len(generated) >= self._max_tokens:
            return "length"
        return "stop"

    # ---- text models: text in, text out ----------------------------------------------------------------------

    async def _text(self) -> AsyncGenerator[Delta, None]:
        entry, sampling = self.entry, self._sampling
        if sampling.structured:
            name = next(iter(sampling.structured))
            raise bad_request(f"'{name}': structured outputs are decoded by a generator model (token ids in and "
                              f"out, the torch engine); model '{entry.id}' is a text model", param=name)
        spec = entry.model.signature.inputs[entry.text_input]
        data = np.array([self.prompt.text.encode()], dtype=object).reshape((1,) * max(len(spec.shape), 1))
        parameters: dict[str, Any] = {}
        if self._max_tokens is not None:
            parameters["max_tokens"] = self._max_tokens
        if not sampling.greedy:
            parameters.update(temperature=sampling.temperature, top_p=sampling.top_p)
            if self._seed is not None:
                parameters["seed"] = self._seed
        request = InferRequest(model_name=entry.id, model_version=entry.model.version,
                               inputs=[Tensor(entry.text_input, "BYTES", data)],
                               outputs=[RequestedOutput(entry.text_output)], parameters=parameters,
                               priority=_level(sampling))
        try:
            response = await self._server.infer(request)
        except ServerError as exc:
            raise from_server_error(exc) from None
        output = next(tensor for tensor in response.outputs if tensor.name == entry.text_output)
        values = output.data.reshape(-1)
        text = values[0].decode("utf-8", "replace") if len(values) and isinstance(values[0], bytes) else ""
        stops = _StopFinder(sampling.stop, sampling.include_stop_str)
        released, stopped = stops.feed(text)
        released += "" if stopped else stops.flush()
        if self._tokenizer is not None:
            self.completion_tokens = len(self._tokenizer.encode(released, special_tokens=False))
        self._timed()
        finish = "stop" if stopped or self._max_tokens is None or self.completion_tokens < self._max_tokens \
            else "length"
        yield Delta(self.index, released, finish_reason=finish, completion_tokens=self.completion_tokens)

    # ---- timing ----------------------------------------------------------------------------------------------

    def _timed(self) -> None:
        now = time.perf_counter()
        if self._first_token_at is None:
            self._first_token_at = now
        else:
            self.entry.model.stats.tokens.inter_token.observe(now - self._last_token_at)
        self._last_token_at = now

    def record_timing(self) -> None:
        """Into the model's histograms, once the choice ended well."""
        if self._first_token_at is None:
            return
        self.entry.model.stats.tokens.record(self._first_token_at - self._started,
                                              self._last_token_at - self._first_token_at,
                                              max(self.completion_tokens - 1, 0))


class _StopFinder:
    """Stop strings found in text as it streams: text that could be the start of a stop string is held back until
    the next text settles it, so no returned text ever holds a stop string or its first part."""

    __slots__ = ("_stops", "_held", "active", "_include")

    def __init__(self, stops: list[str], include: bool = False) -> None:
        self._stops = stops
        self._held = ""
        self.active = bool(stops)
        #: vLLM's `include_stop_str_in_output`: the stop string itself goes out too.
        self._include = include

    def feed(self, text: str) -> tuple[str, bool]:
        """(text that can go out, whether a stop string ended the choice: the text before it went out, and the
        stop string when it is included)."""
        if not self.active:
            return text, False
        self._held += text
        found = [(index, -len(stop)) for stop in self._stops if (index := self._held.find(stop)) >= 0]
        if found:
            index, longest = min(found)  # the first match; of those starting there, the longest
            released, self._held = self._held[:index - longest if self._include else index], ""
            return released, True
        keep = max((_overlap(self._held, stop) for stop in self._stops), default=0)
        released = self._held[:len(self._held) - keep]
        self._held = self._held[len(self._held) - keep:]
        return released, False

    def flush(self) -> str:
        released, self._held = self._held, ""
        return released


def _overlap(text: str, stop: str) -> int:
    """The longest end of `text` that is a beginning of `stop` (shorter than `stop`)."""
    for size in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:size]):
            return size
    return 0


#: What OpenAI writes for a token the sampling rules cut out (JSON has no -inf).
_CUT_OUT = -9999.0


def _finite(value: float) -> float:
    return value if value > _CUT_OUT else _CUT_OUT


def _level(sampling: Sampling) -> int:
    """The request's Triton priority level for vLLM's `priority` (0, the default level, for vLLM's default)."""
    return level_of_openai_priority(sampling.priority) if sampling.priority else 0


_DTYPES = {"UINT32": np.uint32, "INT32": np.int32, "INT64": np.int64, "UINT64": np.uint64}


def _column(values: list[int], datatype: str) -> np.ndarray:
    dtype = _DTYPES.get(datatype)
    if dtype is None:
        raise ApiError(500, f"the generator's token tensors are {datatype}; the OpenAI API sends integer ids")
    return np.array([values], dtype=dtype)
