"""The request fields of /v1/completions and /v1/chat/completions, checked and bounded once.

Fields are checked as OpenAI documents them (types, ranges). Each endpoint lists the fields it acts on; any other
field is refused with a 400 naming it, so that a client relying on a field (vLLM's `length_penalty`) never gets
an answer that silently ignored it. The only exceptions are OpenAI's pure metadata fields (`METADATA_FIELDS`), which
change no answer anywhere. vLLM's extras that the layer can honour by itself (detokenizer options, stop token ids,
truncation, chat-template switches) are taken as vLLM takes them; those the generators act on
(`repetition_penalty`, `min_p`, `priority`) are passed on as their request parameters and the request's priority.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from transerve.core.protocol_parameters import MAX_OPENAI_PRIORITY
from transerve.frontends.http.openai import tools
from transerve.frontends.http.openai.errors import bad_request

#: Bounds on what one request may ask: choices (prompts times `n`), stop strings and their length, log-probs.
MAX_CHOICES = 128
MAX_STOP = 4
MAX_STOP_CHARS = 512
MAX_TOP_LOGPROBS = 20
MAX_MESSAGES = 4096
MAX_STOP_TOKEN_IDS = 64
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
#: The largest `repetition_penalty` taken (vLLM takes any above 0): a bound like `temperature`'s.
MAX_REPETITION_PENALTY = 2.0
ROLES = ("system", "developer", "user", "assistant", "tool")

#: Fields that describe the caller, never the answer: accepted and ignored on every endpoint.
METADATA_FIELDS = frozenset({"user", "metadata", "store", "service_tier"})
#: What completions and chat both act on (some only at their neutral value, checked where they are read).
_SAMPLING_FIELDS = frozenset({
    "model", "max_tokens", "temperature", "top_p", "n", "seed", "stop", "logprobs", "stream", "stream_options",
    "presence_penalty", "frequency_penalty", "logit_bias", "min_tokens", "ignore_eos", "top_k", "stop_token_ids",
    "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "return_tokens_as_token_ids", "add_special_tokens", "priority", "prompt_logprobs", "repetition_penalty",
    "min_p",
})
#: Structured outputs (OpenAI's `response_format`, vLLM's `structured_outputs` and older `guided_*`): passed to the
#: generator as request parameters of the same names, which its grammar-constrained decoding checks and honours.
STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")
_SAMPLING_FIELDS = _SAMPLING_FIELDS | set(STRUCTURED_FIELDS)
COMPLETION_FIELDS = _SAMPLING_FIELDS | {"prompt", "echo", "suffix", "best_of"}
CHAT_FIELDS = _SAMPLING_FIELDS | {
    "messages", "max_completion_tokens", "top_logprobs", "tools", "functions", "tool_choice", "parallel_tool_calls",
    "function_call",
    "add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs", "documents",
}
EMBEDDING_FIELDS = frozenset({"model", "input", "encoding_format", "dimensions", "truncate_prompt_tokens"})
_STREAM_OPTIONS = frozenset({"include_usage", "continuous_usage_stats"})


def refuse_unknown(body: dict[str, Any], known: frozenset[str], endpoint: str) -> None:
    """A 400 naming the first field the endpoint does not act on (metadata fields aside)."""
    for name in body:
        if name not in known and name not in METADATA_FIELDS:
            raise bad_request(f"'{name}' is not supported by {endpoint} here: transerve refuses a field it does not "
                              "act on rather than ignore it (docs/openai.md lists the fields)", param=name)


@dataclass(slots=True)
class Sampling:
    """What decides the choices' tokens, shared by every choice of a request."""

    max_tokens: int | None
    min_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    n: int
    stop: list[str]
    #: None: no log-probs; 0: the chosen token's only; k: also the k likeliest.
    logprobs: int | None
    stream: bool
    include_usage: bool
    echo: bool = False
    #: vLLM's `stream_options.continuous_usage_stats`: every chunk carries its choice's usage so far.
    continuous_usage: bool = False
    #: vLLM's `stop_token_ids`: generating one ends the choice (the id counted, its text kept unless special).
    stop_token_ids: frozenset[int] = frozenset()
    include_stop_str: bool = False
    skip_special_tokens: bool = True
    #: vLLM's `return_tokens_as_token_ids`: log-probability tokens named `token_id:<id>`.
    tokens_as_ids: bool = False
    #: vLLM's `truncate_prompt_tokens`: keep the prompt's last k tokens (-1: the model's context), None: all.
    truncate: int | None = None
    #: Whether a text prompt is tokenized with the tokenizer's special tokens (vLLM: completions yes, chat no).
    add_special_tokens: bool = True
    #: The structured output asked for, as the generator's request parameter: its name and its value as JSON text
    #: (`{"guided_json": "<schema>"}`); None: free text. Tool calls decoded under a schema set it too.
    structured: dict[str, str] | None = None
    #: vLLM's `repetition_penalty` (1: none), as transformers' processor: a context token's logit is divided by
    #: it (multiplied when negative); greedy or sampled.
    repetition_penalty: float = 1.0
    #: vLLM's `min_p` (0: off): when sampling, tokens less likely than min_p times the likeliest are cut.
    min_p: float = 0.0
    #: vLLM's `priority`: lower is served earlier, 0 the default (core.protocol_parameters maps it to a level).
    priority: int = 0
    #: vLLM's `prompt_logprobs`: the prompt's tokens scored, with this many likeliest tokens each; None: not asked.
    prompt_logprobs: int | None = None

    @property
    def prompt_scores(self) -> int | None:
        """The likeliest tokens the generator is asked for at each prompt position (None: the prompt is not
        scored): completions' `echo` with `logprobs` shows the prompt's tokens too, as OpenAI's legacy API did."""
        echoed = self.logprobs if self.echo else None
        asked = [k for k in (echoed, self.prompt_logprobs) if k is not None]
        return max(asked) if asked else None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def sampling(body: dict[str, Any], chat: bool) -> Sampling:
    refuse_unknown(body, CHAT_FIELDS if chat else COMPLETION_FIELDS,
                   "/v1/chat/completions" if chat else "/v1/completions")
    _refused(body, chat)
    max_tokens = optional_int(body, "max_completion_tokens" if chat and "max_completion_tokens" in body
                               else "max_tokens", 0)
    if not chat and max_tokens is None:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    min_tokens = optional_int(body, "min_tokens", 0) or 0
    if flag(body, "ignore_eos", False):
        if max_tokens is None:
            raise bad_request("'ignore_eos' needs 'max_tokens'", param="ignore_eos")
        min_tokens = max_tokens
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad_request(f"'min_tokens' ({min_tokens}) must not exceed 'max_tokens' ({max_tokens})",
                          param="min_tokens")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise bad_request("'top_p' must be greater than 0", param="top_p")
    top_k = max(optional_int(body, "top_k", -1) or 0, 0)  # vLLM's -1 and 0 both mean off
    seed = optional_int(body, "seed", -(2**63))
    if seed is not None and not 0 <= seed < 2**63:
        raise bad_request("'seed' must be between 0 and 2^63 - 1 here", param="seed")
    n = optional_int(body, "n", 1) or 1
    if n > MAX_CHOICES:
        raise bad_request(f"'n' must be at most {MAX_CHOICES}", param="n")
    stream = flag(body, "stream", False)
    options = body.get("stream_options")
    include_usage = continuous = False
    if options is not None:
        if not stream:
            raise bad_request("'stream_options' is only allowed with 'stream': true", param="stream_options")
        if not isinstance(options, dict):
            raise bad_request("'stream_options' must be an object", param="stream_options")
        for name in options:
            if name not in _STREAM_OPTIONS:
                raise bad_request(f"'stream_options.{name}' is not supported", param=f"stream_options.{name}")
        include_usage = flag(options, "include_usage", False, "stream_options.include_usage")
        continuous = flag(options, "continuous_usage_stats", False, "stream_options.continuous_usage_stats")
        if continuous and not include_usage:  # vLLM sends per-chunk usage only with include_usage
            raise bad_request("'stream_options.continuous_usage_stats' needs 'stream_options.include_usage': true",
                              param="stream_options.continuous_usage_stats")
    flag(body, "spaces_between_special_tokens", True)  # a tokenizer.json decoder spaces special tokens itself
    priority = optional_int(body, "priority", -MAX_OPENAI_PRIORITY, MAX_OPENAI_PRIORITY) or 0
    repetition_penalty = _number(body, "repetition_penalty", 1.0, 0.0, MAX_REPETITION_PENALTY)
    if repetition_penalty == 0.0:
        raise bad_request("'repetition_penalty' must be greater than 0 (1 is no penalty)", param="repetition_penalty")
    truncate = optional_int(body, "truncate_prompt_tokens", -1)
    if truncate == 0:
        raise bad_request("'truncate_prompt_tokens' must be -1 (the model's context) or at least 1",
                          param="truncate_prompt_tokens")
    echo = not chat and flag(body, "echo", False)
    logprobs = _logprobs(body, chat)
    prompt_logprobs = _prompt_logprobs(body, stream, echo and logprobs is not None)
    if max_tokens == 0 and not echo and prompt_logprobs is None:
        name = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
        raise bad_request(f"'{name}' must be at least 1 (0 only scores the prompt: with 'echo' or "
                          "'prompt_logprobs')", param=name)
    return Sampling(max_tokens, min_tokens, temperature, top_p, top_k, seed, n, _stop(body), logprobs,
                    stream, include_usage, echo=echo, continuous_usage=continuous, prompt_logprobs=prompt_logprobs,
                    stop_token_ids=_stop_token_ids(body), include_stop_str=flag(body, "include_stop_str_in_output",
                                                                                 False),
                    skip_special_tokens=flag(body, "skip_special_tokens", True),
                    tokens_as_ids=flag(body, "return_tokens_as_token_ids", False), truncate=truncate,
                    add_special_tokens=flag(body, "add_special_tokens", not chat), structured=structured(body),
                    repetition_penalty=repetition_penalty, min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
                    priority=priority)


def structured(body: dict[str, Any]) -> dict[str, str] | None:
    """The one structured-output field of the request, as the generator's parameter (None: free text, or
    `response_format` text); the generator checks the schema or grammar and answers a 400 naming what is wrong."""
    given = [name for name in STRUCTURED_FIELDS if body.get(name) is not None]
    if body.get("response_format") == {"type": "text"}:
        given.remove("response_format")
    if len(given) > 1:
        raise bad_request(f"'{given[0]}' and '{given[1]}' both ask for a structured output: give one",
                          param=given[1])
    if not given:
        return None
    value = body[given[0]]
    if given[0] in ("guided_regex", "guided_grammar"):
        if not isinstance(value, str):
            raise bad_request(f"'{given[0]}' must be a string", param=given[0])
        return {given[0]: value}
    if given[0] in ("response_format", "structured_outputs") and not isinstance(value, dict):
        raise bad_request(f"'{given[0]}' must be an object", param=given[0])
    return {given[0]: value if isinstance(value, str) else json.dumps(value)}


def _prompt_logprobs(body: dict[str, Any], stream: bool, echoed: bool) -> int | None:
    """vLLM's `prompt_logprobs` (0 to `MAX_TOP_LOGPROBS`); a stream cannot carry the prompt's log-probabilities,
    which come with the generator's last response, so streaming with them is refused, as vLLM refuses it."""
    value = optional_int(body, "prompt_logprobs", 0, MAX_TOP_LOGPROBS)
    if stream and (value is not None or echoed):
        name = "prompt_logprobs" if value is not None else "echo"
        raise bad_request(f"'{name}' with log-probabilities cannot stream: the prompt's log-probabilities come with "
                          "the last response; set 'stream' false", param=name)
    return value


def _stop_token_ids(body: dict[str, Any]) -> frozenset[int]:
    given = body.get("stop_token_ids")
    if given is None:
        return frozenset()
    if not isinstance(given, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                              for x in given):
        raise bad_request("'stop_token_ids' must be a list of token ids", param="stop_token_ids")
    if len(given) > MAX_STOP_TOKEN_IDS:
        raise bad_request(f"'stop_token_ids' may hold at most {MAX_STOP_TOKEN_IDS} ids", param="stop_token_ids")
    return frozenset(given)


def _refused(body: dict[str, Any], chat: bool) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        value = body.get(name)
        if value is not None and value != 0:
            raise bad_request(f"'{name}' is not supported (only 0); transerve's engines implement "
                              "repetition_penalty instead", param=name)
    if body.get("logit_bias"):
        raise bad_request("'logit_bias' is not supported", param="logit_bias")
    if not chat and body.get("suffix") is not None:
        raise bad_request("'suffix' is not supported: the models served here do not fill in the middle",
                          param="suffix")
    if not chat and (body.get("best_of") or 1) != 1:
        raise bad_request("'best_of' is not supported", param="best_of")


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(text, str) for text in stops):
        raise bad_request("'stop' must be a string or a list of strings", param="stop")
    if len(stops) > MAX_STOP:
        raise bad_request(f"'stop' may hold at most {MAX_STOP} sequences", param="stop")
    if any(not text or len(text) > MAX_STOP_CHARS for text in stops):
        raise bad_request(f"each 'stop' sequence must have 1 to {MAX_STOP_CHARS} characters", param="stop")
    return list(stops)


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """Completions: `logprobs` is the number of likeliest tokens (0 for the chosen one's only). Chat: `logprobs`
    is a boolean and `top_logprobs` the number."""
    if not chat:
        return optional_int(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    top = optional_int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if not flag(body, "logprobs", False):
        if top:
            raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        return None
    return top or 0


def optional_int(body: dict[str, Any], name: str, least: int, most: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{name}' must be an integer", param=name)
    if value < least or (most is not None and value > most):
        bound = f"between {least} and {most}" if most is not None else f"at least {least}"
        raise bad_request(f"'{name}' must be {bound}, got {value}", param=name)
    return value


def _number(body: dict[str, Any], name: str, default: float, least: float, most: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad_request(f"'{name}' must be a number", param=name)
    if not least <= value <= most:
        raise bad_request(f"'{name}' must be between {least:g} and {most:g}, got {value}", param=name)
    return float(value)


def flag(body: dict[str, Any], name: str, default: bool, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{param or name}' must be a boolean", param=param or name)
    return value


def messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Chat messages as the template sees them: role and content text (content parts of type text joined), with
    `name`, and the tool fields as templates read them (tools.history_fields)."""
    given = body.get("messages")
    if not isinstance(given, list) or not given:
        raise bad_request("'messages' must be a non-empty list", param="messages")
    if len(given) > MAX_MESSAGES:
        raise bad_request(f"'messages' may hold at most {MAX_MESSAGES} messages", param="messages")
    result = []
    for index, message in enumerate(given):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise bad_request(f"'{where}' must be an object", param=where)
        role = message.get("role")
        if role not in ROLES:
            raise bad_request(f"'{where}.role' must be one of {', '.join(ROLES)}, got {role!r}",
                              param=f"{where}.role")
        content = message.get("content")
        if isinstance(content, list):
            content = _text_parts(content, where)
        elif content is not None and not isinstance(content, str):
            raise bad_request(f"'{where}.content' must be a string or a list of text parts",
                              param=f"{where}.content")
        if content is None and role != "assistant":
            raise bad_request(f"'{where}.content' is required for role '{role}'", param=f"{where}.content")
        entry: dict[str, Any] = {"role": role, "content": content}
        if "name" in message:
            entry["name"] = message["name"]
        entry.update(tools.history_fields(message, role, where))
        result.append(entry)
    return result


def _text_parts(parts: list[Any], where: str) -> str:
    texts = []
    for part in parts:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_request(f"'{where}.content' parts must be {{\"type\": \"text\", \"text\": ...}}: this model "
                              "takes text only", param=f"{where}.content")
        texts.append(part["text"])
    return "".join(texts)
