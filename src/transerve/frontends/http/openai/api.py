"""The OpenAI routes on the HTTP port: /v1/models, /v1/completions, /v1/chat/completions, /v1/embeddings.

Requests and answers follow OpenAI's API reference (field names, types, server-sent events ending in
`data: [DONE]`); errors come in OpenAI's shape with its statuses. What a request may ask is bounded (params.py);
every model call goes through the server's request path (scheduling, statistics, cancellation).
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import numpy as np
import orjson

from transerve.core.errors import ServerError
from transerve.core.types import InferRequest, RequestedOutput, Tensor
from transerve.frontends.http.openai import params
from transerve.frontends.http.openai.catalog import EMBEDDINGS, GENERATE, TEXT, Catalog, OpenAIModel
from transerve.frontends.http.openai.errors import ApiError, bad_request, from_server_error
from transerve.frontends.http.openai.generation import Choice, Delta, Prompt
from transerve.frontends.http.openai.responses import Formatter
from transerve.frontends.http.openai.text import TextTokenizer
from transerve.frontends.http.protocol import HttpRequest, HttpResponse
from transerve.server import Server

SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"
#: Inputs one embeddings request may carry, as OpenAI bounds them.
MAX_EMBEDDING_INPUTS = 2048
#: Chat histories longer than this render on a worker thread.
_INLINE_MESSAGES = 64
_DONE = b"data: [DONE]\n\n"


class OpenAIApi:
    def __init__(self, server: Server) -> None:
        self._server = server
        self._catalog = Catalog(server)

    async def handle(self, request: HttpRequest, parts: list[str]) -> HttpResponse:
        """`parts`: the path's segments after `v1`."""
        try:
            return await self._route(request, parts)
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
                return await self._embeddings(body)
            return await self._complete(body, chat=route == "chat/completions")
        raise ApiError(404, f"Unknown endpoint /v1/{route}")

    # ---- completions and chat --------------------------------------------------------------------------------

    async def _complete(self, body: dict[str, Any], chat: bool) -> HttpResponse:
        started = time.perf_counter()
        entry = self._catalog.get(body.get("model"), (GENERATE, TEXT))
        sampling = params.sampling(body, chat)
        tokenizer = await entry.tokenizer() if entry.tokenizer_folder is not None else None
        prompts = await (_chat_prompt(body, entry, tokenizer) if chat else _prompts(body, entry, tokenizer))
        if len(prompts) * sampling.n > params.MAX_CHOICES:
            raise bad_request(f"a request may ask for at most {params.MAX_CHOICES} choices (prompts times n)",
                              param="n")
        choices = []
        for number, prompt in enumerate(prompts):
            max_tokens = _max_tokens(entry, prompt, sampling)
            for copy in range(sampling.n):
                index = number * sampling.n + copy
                seed = None if sampling.seed is None else (sampling.seed + index) % 2**63
                choices.append(Choice(self._server, entry, tokenizer, prompt, sampling, index, seed, max_tokens,
                                      started))
        formatter = Formatter(entry.id, chat, sampling, tokenizer, prompts)
        if sampling.stream:
            return await _streamed(choices, formatter)
        results = await _gathered(choices)
        for choice in choices:
            choice.record_timing()
        return _json(formatter.answer(choices, results))

    # ---- embeddings ------------------------------------------------------------------------------------------

    async def _embeddings(self, body: dict[str, Any]) -> HttpResponse:
        entry = self._catalog.get(body.get("model"), (EMBEDDINGS,))
        texts = body.get("input")
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, list) or not texts or not all(isinstance(text, str) and text for text in texts):
            raise bad_request("'input' must be a non-empty string or a non-empty list of non-empty strings (this "
                              "model takes text, not token ids)", param="input")
        if len(texts) > MAX_EMBEDDING_INPUTS:
            raise bad_request(f"'input' may hold at most {MAX_EMBEDDING_INPUTS} texts", param="input")
        encoding = body.get("encoding_format", "float")
        if encoding not in ("float", "base64"):
            raise bad_request("'encoding_format' must be 'float' or 'base64'", param="encoding_format")
        width = entry.model.signature.outputs[entry.text_output].dims[-1:]
        dimensions = body.get("dimensions")
        if dimensions is not None and (isinstance(dimensions, bool) or dimensions not in width):
            raise bad_request(f"'dimensions' is not supported: model '{entry.id}' returns embeddings of "
                              f"{width[0] if width else 'its own'} dimensions only", param="dimensions")
        tokens = 0
        if entry.tokenizer_folder is not None:
            tokenizer = await entry.tokenizer()
            limit = entry.context_length or tokenizer.max_length
            for index, ids in enumerate(await _encoded(tokenizer, texts, limit, "input")):
                if limit is not None and len(ids) > limit:
                    raise bad_request(f"input[{index}] has {len(ids)} tokens; model '{entry.id}' takes at most "
                                      f"{limit}", param="input")
                tokens += len(ids)
        vectors = await self._embed(entry, texts)
        data = [{"object": "embedding", "index": index,
                 "embedding": base64.b64encode(vector.astype("<f4").tobytes()).decode() if encoding == "base64"
                 else vector.tolist()}
                for index, vector in enumerate(vectors)]
        return _json({"object": "list", "data": data, "model": entry.id,
                      "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    async def _embed(self, entry: OpenAIModel, texts: list[str]) -> list[np.ndarray]:
        """The texts in batches of the model's `max_batch_size`, sent together."""
        size = entry.max_batch_size or 1
        batches = [texts[start:start + size] for start in range(0, len(texts), size)]
        spec = entry.model.signature.inputs[entry.text_input]

        async def one(batch: list[str]) -> np.ndarray:
            data = np.array([text.encode() for text in batch], dtype=object)
            data = data.reshape(len(batch), *([1] * (len(spec.shape) - 1))) if entry.max_batch_size else \
                data.reshape((1,) * max(len(spec.shape), 1))
            request = InferRequest(model_name=entry.id, model_version=entry.model.version,
                                   inputs=[Tensor(entry.text_input, "BYTES", data)],
                                   outputs=[RequestedOutput(entry.text_output)])
            try:
                response = await self._server.infer(request)
            except ServerError as exc:
                raise from_server_error(exc) from None
            output = next(tensor for tensor in response.outputs if tensor.name == entry.text_output)
            return np.asarray(output.data, dtype=np.float32).reshape(len(batch), -1)

        results = await asyncio.gather(*(one(batch) for batch in batches))
        return [vector for result in results for vector in result]


# ---- prompts -------------------------------------------------------------------------------------------------

async def _prompts(body: dict[str, Any], entry: OpenAIModel, tokenizer: TextTokenizer | None) -> list[Prompt]:
    """/v1/completions' `prompt`: a string, a list of strings, token ids, or a list of token-id lists. Each is
    bounded by the model's context before it is decoded or encoded."""
    given = body.get("prompt")
    if isinstance(given, str) or (isinstance(given, list) and given and all(_is_id(x) for x in given)):
        given = [given]
    if not isinstance(given, list) or not given:
        raise bad_request("'prompt' must be a string, a list of strings, a list of token ids or a list of such "
                          "lists, and not empty", param="prompt")
    if len(given) > params.MAX_CHOICES:
        raise bad_request(f"a request may ask for at most {params.MAX_CHOICES} choices (prompts times n)",
                          param="prompt")
    prompts: list[Prompt | None] = []
    texts: list[str] = []
    for item in given:
        if isinstance(item, str):
            if tokenizer is None:
                prompts.append(Prompt([], item))
            else:
                texts.append(item)
                prompts.append(None)
        elif isinstance(item, list) and all(_is_id(x) for x in item):
            if entry.kind != GENERATE or tokenizer is None:
                raise bad_request(f"model '{entry.id}' takes text prompts, not token ids", param="prompt")
            if entry.context_length is not None and len(item) > entry.context_length:
                raise bad_request(f"a token-id prompt has {len(item)} tokens; model '{entry.id}' takes at most "
                                  f"{entry.context_length}", param="prompt")
            vocabulary = tokenizer.vocabulary_size()
            if not item or any(x >= vocabulary for x in item):
                raise bad_request(f"a token-id prompt must be non-empty, its ids in the vocabulary [0, {vocabulary})",
                                  param="prompt")
            prompts.append(Prompt(list(item), tokenizer.decode(item)))
        else:
            raise bad_request("each prompt must be a string or a list of token ids", param="prompt")
    if texts and tokenizer is not None:
        encoded = iter(await _encoded(tokenizer, texts, entry.context_length, "prompt"))
        text_of = iter(texts)
        prompts = [prompt if prompt is not None else Prompt(next(encoded), next(text_of)) for prompt in prompts]
    complete = [prompt for prompt in prompts if prompt is not None]
    if entry.kind == GENERATE and any(not prompt.ids for prompt in complete):
        raise bad_request("the prompt is empty: it must have at least one token", param="prompt")
    return complete


async def _encoded(tokenizer: TextTokenizer, texts: list[str], context: int | None, param: str,
                   special_tokens: bool = True) -> list[list[int]]:
    """The texts' ids; a text that cannot fit in the context is refused before it is tokenized."""
    limit = tokenizer.character_limit(context)
    for index, text in enumerate(texts):
        if len(text) > limit:
            where = param if len(texts) == 1 else f"{param}[{index}]"
            raise bad_request(f"{where} has {len(text)} characters, more than the {limit} that "
                              + (f"the model's {context} tokens can hold" if context is not None else
                                 "a text may have") + ": shorten it", param=param)
    return await tokenizer.encode_all(texts, special_tokens)


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


async def _chat_prompt(body: dict[str, Any], entry: OpenAIModel, tokenizer: TextTokenizer | None) -> list[Prompt]:
    messages = params.messages(body)
    if tokenizer is None:
        raise bad_request(f"model '{entry.id}' names no tokenizer, so it has no chat template: use /v1/completions",
                          param="model")
    arguments = body.get("chat_template_kwargs")
    if arguments is not None and not isinstance(arguments, dict):
        raise bad_request("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    limit = tokenizer.character_limit(entry.context_length)
    if sum(len(message["content"] or "") for message in messages) > limit:
        raise bad_request(f"the messages have more than the {limit} characters that "
                          + (f"the model's {entry.context_length} tokens can hold" if entry.context_length else
                             "a prompt may have") + ": shorten them", param="messages")
    if len(messages) > _INLINE_MESSAGES:  # a long history renders on a worker thread: Jinja takes its time
        text = await asyncio.to_thread(tokenizer.render_chat, messages, arguments=arguments)
    else:
        text = tokenizer.render_chat(messages, arguments=arguments)
    ids = (await _encoded(tokenizer, [text], entry.context_length, "messages", special_tokens=False))[0]
    if entry.kind == GENERATE and not ids:
        raise bad_request("the chat prompt is empty", param="messages")
    return [Prompt(ids, text)]


def _max_tokens(entry: OpenAIModel, prompt: Prompt, sampling: params.Sampling) -> int | None:
    """The tokens the choice may generate; a prompt and completion longer than the model's context is refused as
    OpenAI refuses it. Chat without a limit gets the rest of the context (the model's default when unknown)."""
    context, used = entry.context_length, len(prompt.ids)
    if context is None:
        return sampling.max_tokens
    if sampling.max_tokens is None:
        if used >= context:
            raise bad_request(f"This model's maximum context length is {context} tokens. However, your messages "
                              f"resulted in {used} tokens. Please reduce the length of the messages.",
                              param="messages")
        return context - used
    if used + sampling.max_tokens > context:
        raise bad_request(f"This model's maximum context length is {context} tokens. However, you requested "
                          f"{used + sampling.max_tokens} tokens ({used} in the prompt, {sampling.max_tokens} for the "
                          "completion). Please reduce the prompt or the completion length.", param="max_tokens")
    return sampling.max_tokens


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


async def _streamed(choices: list[Choice], formatter: Formatter) -> HttpResponse:
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
    return HttpResponse(200, content_type=SSE_CONTENT_TYPE, stream=_events(deltas, first, choices, formatter))


async def _events(deltas: AsyncGenerator[Delta, None], first: Delta | None, choices: list[Choice],
                  formatter: Formatter) -> AsyncIterator[bytes]:
    try:
        for chunk in formatter.opening_chunks(choices):
            yield _event(chunk)
        try:
            if first is not None:
                yield _event(formatter.chunk(first))
                async for delta in deltas:
                    yield _event(formatter.chunk(delta))
        except (ApiError, ServerError) as exc:  # the status is sent: the error goes as an event, as OpenAI's do
            error = exc if isinstance(exc, ApiError) else from_server_error(exc)
            yield _event(error.document())
            yield _DONE
            return
        for choice in choices:
            choice.record_timing()
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

