"""The request fields of /v1/completions and /v1/chat/completions, checked and bounded once.

Fields are checked as OpenAI documents them (types, ranges); a field transerve cannot honour is refused with a
400 naming it rather than ignored (penalties, logit_bias, tools, `suffix`, structured output). Fields it does not
know are ignored, as vLLM ignores them: clients send their own extensions. vLLM's `min_tokens`, `ignore_eos` and
`top_k` are taken too, so benchmarks and clients written for vLLM run unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from transerve.frontends.http.openai.errors import bad_request

#: Bounds on what one request may ask: choices (prompts times `n`), stop strings and their length, log-probs.
MAX_CHOICES = 128
MAX_STOP = 4
MAX_STOP_CHARS = 512
MAX_TOP_LOGPROBS = 20
MAX_MESSAGES = 4096
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
ROLES = ("system", "developer", "user", "assistant", "tool")


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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def sampling(body: dict[str, Any], chat: bool) -> Sampling:
    _refused(body, chat)
    max_tokens = _optional_int(body, "max_completion_tokens" if chat and "max_completion_tokens" in body
                               else "max_tokens", 1)
    if not chat and max_tokens is None:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    min_tokens = _optional_int(body, "min_tokens", 0) or 0
    if _bool(body, "ignore_eos", False):
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
    top_k = max(_optional_int(body, "top_k", -1) or 0, 0)  # vLLM's -1 and 0 both mean off
    seed = _optional_int(body, "seed", -(2**63))
    if seed is not None and not 0 <= seed < 2**63:
        raise bad_request("'seed' must be between 0 and 2^63 - 1 here", param="seed")
    n = _optional_int(body, "n", 1) or 1
    if n > MAX_CHOICES:
        raise bad_request(f"'n' must be at most {MAX_CHOICES}", param="n")
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad_request("'stream_options' is only allowed with 'stream': true", param="stream_options")
        if not isinstance(options, dict):
            raise bad_request("'stream_options' must be an object", param="stream_options")
        include_usage = _bool(options, "include_usage", False, "stream_options.include_usage")
    return Sampling(max_tokens, min_tokens, temperature, top_p, top_k, seed, n, _stop(body), _logprobs(body, chat),
                    stream, include_usage, echo=not chat and _bool(body, "echo", False))


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
    if chat:
        for name in ("tools", "functions"):
            if body.get(name):
                raise bad_request(f"'{name}' is not supported", param=name)
        response_format = body.get("response_format")
        if response_format is not None and response_format != {"type": "text"}:
            raise bad_request("'response_format' supports only {\"type\": \"text\"}", param="response_format")


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
        return _optional_int(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    top = _optional_int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if not _bool(body, "logprobs", False):
        if top:
            raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        return None
    return top or 0


def _optional_int(body: dict[str, Any], name: str, least: int, most: int | None = None) -> int | None:
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


def _bool(body: dict[str, Any], name: str, default: bool, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{param or name}' must be a boolean", param=param or name)
    return value


def messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Chat messages as the template sees them: role and content text (content parts of type text joined), with
    `name` and the tool-call fields kept for templates that read them."""
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
        for key in ("name", "tool_calls", "tool_call_id"):
            if key in message:
                entry[key] = message[key]
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
