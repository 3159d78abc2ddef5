"""The OpenAI routes on the HTTP port: /v1/models, /v1/completions, /v1/chat/completions, /v1/embeddings.

Requests and answers follow OpenAI's API reference (field names, types, server-sent events ending in
`data: [DONE]`); errors come in OpenAI's shape with its statuses. What a request may ask is bounded (params.py);
every model call goes through the server's request path (scheduling, statistics, cancellation).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import orjson

from transerve.core.errors import ServerError
from transerve.frontends.http.openai import params, tools
from transerve.frontends.http.openai import prompts as prompts_of
from transerve.frontends.http.openai.catalog import EMBEDDINGS, GENERATE, TEXT, Catalog, OpenAIModel
from transerve.frontends.http.openai.embeddings import Embedder
from transerve.frontends.http.openai.errors import ApiError, bad_request, from_server_error
from transerve.frontends.http.openai.generation import Choice, Delta
from transerve.frontends.http.openai.responses import Formatter
from transerve.frontends.http.openai.service import detokenize, tokenize
from transerve.frontends.http.protocol import HttpRequest, HttpResponse
from transerve.server import Server

SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"
_DONE = b"data: [DONE]\n\n"


class OpenAIApi:
    def __init__(self, server: Server, trust_request_chat_template: bool = False) -> None:
        self._server = server
        #: `--trust-request-chat-template`: a chat request's own `chat_template` renders its messages (vLLM's flag).
        self._trust_templates = trust_request_chat_template
        self._catalog = Catalog(server)
        self._embedder = Embedder(server)

    async def handle(self, request: HttpRequest, parts: list[str]) -> HttpResponse:
        """`parts`: the path's segments after `v1`."""
        try:
            return await self._route(request, parts)
        except ApiError as exc:
            return exc.response()
        except ServerError as exc:
            return from_server_error(exc).response()

    async def service(self, request: HttpRequest, route: str) -> HttpResponse:
        """vLLM's `POST /tokenize` and `POST /detokenize` (routes.py's service table routes them here)."""
        try:
            body = _body(request)
            if route == "tokenize":
                return _json(await tokenize(self._catalog, body, self._trust_templates))
            return _json(await detokenize(self._catalog, body))
        except ApiError as exc:
            return exc.response()
        except ServerError as exc:
            return from_server_error(exc).response()

    async def _route(self, request: HttpRequest, parts: list[str]) -> HttpResponse:
        method = request.method
        if parts and parts[0] == "models" and len(parts) <= 2:
            _allow(method, "GET")
            if len(parts) == 1:
                cards = [entry.card() for entry in self._catalog.models()]
                return _json({"object": "list", "data": cards})
            for entry in self._catalog.models():
                if entry.id == parts[1]:
                    return _json(entry.card())
            raise ApiError(404, f"The model '{parts[1]}' does not exist", param="model", code="model_not_found")
        route = "/".join(parts)
        if route in ("completions", "chat/completions", "embeddings"):
            _allow(method, "POST")
            body = _body(request)
            if route == "embeddings":
                return _json(await self._embedder.answer(self._catalog.get(body.get("model"), (EMBEDDINGS,)), body))
            return await self._complete(body, chat=route == "chat/completions")
        raise ApiError(404, f"Unknown endpoint /v1/{route}")

    # ---- completions and chat --------------------------------------------------------------------------------

    async def _complete(self, body: dict[str, Any], chat: bool) -> HttpResponse:
        started = time.perf_counter()
        entry = self._catalog.get(body.get("model"), (GENERATE, TEXT))
        sampling = params.sampling(body, chat)
        tool_request = tools.tool_request(body) if chat else None
        tokenizer = await entry.tokenizer() if entry.tokenizer_folder is not None else None
        reader = tools.reader(tool_request, entry, tokenizer.special_tokens if tokenizer is not None else {})
        if reader is not None and reader.drop and entry.kind == GENERATE and "skip_special_tokens" not in body:
            sampling.skip_special_tokens = False  # the parser's markers are special tokens: decode them
        if reader is not None and reader.forced is not None:  # required or named: decoded under the schema
            if sampling.structured is not None:
                raise bad_request(f"'tool_choice' {reader.forced.choice!r} decodes the answer under the tools' "
                                  f"schemas; '{next(iter(sampling.structured))}' asks for another structured output",
                                  param="tool_choice")
            sampling.structured = reader.structured
        if entry.kind == TEXT:
            _text_model_fields(sampling)
        prompts = await (prompts_of.chat_prompt(body, entry, tokenizer, sampling,
                                                tool_request.tools if tool_request is not None else None,
                                                self._trust_templates) if chat else
                         prompts_of.completion_prompts(body, entry, tokenizer, sampling))
        if len(prompts) * sampling.n > params.MAX_CHOICES:
            raise bad_request(f"a request may ask for at most {params.MAX_CHOICES} choices (prompts times n)",
                              param="n")
        choices = []
        for number, prompt in enumerate(prompts):
            max_tokens = prompts_of.max_tokens(entry, prompt, sampling)
            for copy in range(sampling.n):
                index = number * sampling.n + copy
                # As vLLM seeds each of a prompt's n choices: the request's seed plus the choice's number.
                seed = None if sampling.seed is None else (sampling.seed + copy) % 2**63
                choices.append(Choice(self._server, entry, tokenizer, prompt, sampling, index, seed, max_tokens,
                                      started))
        formatter = Formatter(entry.id, chat, sampling, tokenizer, prompts, reader)
        if sampling.stream:
            return await _streamed(choices, formatter, started)
        results = await _gathered(choices)
        for choice in choices:
            choice.record_timing()
        answer = formatter.answer(choices, results)
        _record(entry, answer["usage"], started)
        return _json(answer)


def _record(entry: OpenAIModel, usage: dict[str, int], started: float) -> None:
    """vLLM's counters for a request that ended well: its usage and its time."""
    entry.model.stats.tokens.record_request(usage["prompt_tokens"], usage["completion_tokens"],
                                            time.perf_counter() - started)


def _text_model_fields(sampling: params.Sampling) -> None:
    """A text model takes text in and gives text out: the fields about its tokens cannot reach it."""
    for name, given in (("stop_token_ids", bool(sampling.stop_token_ids)), ("truncate_prompt_tokens",
                        sampling.truncate is not None), ("skip_special_tokens", not sampling.skip_special_tokens),
                        ("return_tokens_as_token_ids", sampling.tokens_as_ids),
                        ("prompt_logprobs", sampling.prompt_logprobs is not None),
                        ("echo", sampling.echo and sampling.logprobs is not None),
                        ("repetition_penalty", sampling.repetition_penalty != 1.0), ("min_p", sampling.min_p > 0)):
        if given:
            raise bad_request(f"'{name}' is not supported by a text model (it takes and gives text, not tokens)",
                              param=name)


# ---- running choices -------------------------------------------------------------------------------------------

async def _gathered(choices: list[Choice]) -> list[list[Delta]]:
    async def collect(choice: Choice) -> list[Delta]:
        deltas = choice.deltas()
        try:
            return [delta async for delta in deltas]
        finally:
            await deltas.aclose()

    tasks = [asyncio.ensure_future(collect(choice)) for choice in choices]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()  # one choice failed, or the client went away: the others stop too


async def _merged(choices: list[Choice]) -> AsyncGenerator[Delta, None]:
    """Every choice's deltas as they come; one choice needs no queue."""
    if len(choices) == 1:
        deltas = choices[0].deltas()
        try:
            async for delta in deltas:
                yield delta
        finally:
            await deltas.aclose()
        return
    queue: asyncio.Queue[Delta | BaseException | None] = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        deltas = choice.deltas()
        try:
            async for delta in deltas:
                queue.put_nowait(delta)
        except Exception as exc:
            queue.put_nowait(exc)
        finally:
            await deltas.aclose()
            queue.put_nowait(None)

    tasks = [asyncio.ensure_future(pump(choice)) for choice in choices]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


async def _streamed(choices: list[Choice], formatter: Formatter, started: float) -> HttpResponse:
    """Server-sent events. The first delta is awaited before answering, so a request the model refuses gets its
    status rather than a 200 with an error event."""
    deltas = _merged(choices)
    try:
        first = await anext(deltas)
    except StopAsyncIteration:
        first = None
    except BaseException:
        await deltas.aclose()
        raise
    return HttpResponse(200, content_type=SSE_CONTENT_TYPE, stream=_events(deltas, first, choices, formatter, started))


async def _events(deltas: AsyncGenerator[Delta, None], first: Delta | None, choices: list[Choice],
                  formatter: Formatter, started: float) -> AsyncIterator[bytes]:
    try:
        for chunk in formatter.opening_chunks(choices):
            yield _event(chunk)
        try:
            if first is not None:
                for chunk in formatter.chunks(first):
                    yield _event(chunk)
                async for delta in deltas:
                    for chunk in formatter.chunks(delta):
                        yield _event(chunk)
        except (ApiError, ServerError) as exc:  # the status is sent: the error goes as an event, as OpenAI's do
            error = exc if isinstance(exc, ApiError) else from_server_error(exc)
            yield _event(error.document())
            yield _DONE
            return
        for choice in choices:
            choice.record_timing()
        _record(choices[0].entry, formatter.usage(choices), started)
        if formatter.sampling.include_usage:
            yield _event(formatter.usage_chunk(choices))
        yield _DONE
    finally:
        await deltas.aclose()  # the client went away mid-stream: the choices' sequences stop in the engine


def _event(document: dict) -> bytes:
    return b"data: " + orjson.dumps(document) + b"\n\n"


# ---- HTTP ------------------------------------------------------------------------------------------------------

def _allow(method: str, allowed: str) -> None:
    if method != allowed:
        raise ApiError(405, f"Method {method} is not allowed here; use {allowed}")


def _body(request: HttpRequest) -> dict[str, Any]:
    if request.headers.get("content-encoding", "identity") not in ("", "identity"):
        raise ApiError(415, "Unsupported content-encoding: the OpenAI API takes identity bodies only")
    try:
        document = orjson.loads(request.body)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(document, dict):
        raise bad_request("The request body must be a JSON object")
    return document


def _json(document: dict) -> HttpResponse:
    return HttpResponse(200, orjson.dumps(document))

