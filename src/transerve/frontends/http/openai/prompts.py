"""Prompts as the model gets them: completions' `prompt` (text or token ids) and chat's rendered `messages`, each
bounded by the model's context before it is tokenized or decoded, and truncated when the request asks.

vLLM's `truncate_prompt_tokens` keeps a prompt's last k tokens: token ids are cut from the left, and a text is
tokenized as transformers truncates from the left (`truncation_side="left"`, as vLLM loads its tokenizers), its
special tokens kept. A prompt that is truncated may be longer than the context before it is cut, so its bound is
the one of a model with no stated context.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from transerve.frontends.http.openai import params
from transerve.frontends.http.openai.catalog import GENERATE, OpenAIModel
from transerve.frontends.http.openai.errors import bad_request
from transerve.frontends.http.openai.generation import Prompt
from transerve.frontends.http.openai.text import INLINE_CHARACTERS, MAX_REQUEST_TEMPLATE_CHARS, TextTokenizer

#: Chat histories longer than this render on a worker thread.
_INLINE_MESSAGES = 64
#: Documents a chat request may give its template (vLLM's `documents`), and the characters they may hold together
#: are the messages' bound.
MAX_DOCUMENTS = 64


async def completion_prompts(body: dict[str, Any], entry: OpenAIModel, tokenizer: TextTokenizer | None,
                             sampling: params.Sampling) -> list[Prompt]:
    """/v1/completions' `prompt`: a string, a list of strings, token ids, or a list of token-id lists."""
    given = body.get("prompt")
    if isinstance(given, str) or id_list(given):
        given = [given]
    if not isinstance(given, list) or not given:
        raise bad_request("'prompt' must be a string, a list of strings, a list of token ids or a list of such "
                          "lists, and not empty", param="prompt")
    if len(given) > params.MAX_CHOICES:
        raise bad_request(f"a request may ask for at most {params.MAX_CHOICES} choices (prompts times n)",
                          param="prompt")
    keep = truncation(entry, sampling)
    prompts: list[Prompt | None] = []
    texts: list[str] = []
    for item in given:
        if isinstance(item, str):
            if tokenizer is None:
                prompts.append(Prompt([], item))
            else:
                texts.append(item)
                prompts.append(None)
        elif id_list(item):
            if entry.kind != GENERATE or tokenizer is None:
                raise bad_request(f"model '{entry.id}' takes text prompts, not token ids", param="prompt")
            ids = check_ids(item, entry, tokenizer, "prompt", keep)
            prompts.append(Prompt(ids, tokenizer.decode(ids)))
        else:
            raise bad_request("each prompt must be a string or a list of token ids", param="prompt")
    if texts and tokenizer is not None:
        encoded = iter(await encoded_texts(tokenizer, texts, entry.context_length, "prompt",
                                           sampling.add_special_tokens, keep))
        text_of = iter(texts)
        prompts = [prompt if prompt is not None else _text_prompt(next(encoded), next(text_of), keep, tokenizer)
                   for prompt in prompts]
    complete = [prompt for prompt in prompts if prompt is not None]
    if entry.kind == GENERATE and any(not prompt.ids for prompt in complete):
        raise bad_request("the prompt is empty: it must have at least one token", param="prompt")
    return complete


def _text_prompt(ids: list[int], text: str, keep: int | None, tokenizer: TextTokenizer) -> Prompt:
    """What `echo` repeats is the prompt the model saw: a truncated prompt's ids decoded."""
    return Prompt(ids, text if keep is None else tokenizer.decode(ids))


def truncation(entry: OpenAIModel, sampling_or_keep: params.Sampling | int | None) -> int | None:
    """The tokens a prompt keeps (`truncate_prompt_tokens`; -1 is the model's context), None for all."""
    keep = sampling_or_keep.truncate if isinstance(sampling_or_keep, params.Sampling) else sampling_or_keep
    if keep == -1:
        if entry.context_length is None:
            raise bad_request(f"'truncate_prompt_tokens': -1 needs the model's context length, which model "
                              f"'{entry.id}' does not state", param="truncate_prompt_tokens")
        return entry.context_length
    if keep is not None and entry.context_length is not None and keep > entry.context_length:
        raise bad_request(f"'truncate_prompt_tokens' ({keep}) must not exceed the model's context "
                          f"({entry.context_length} tokens)", param="truncate_prompt_tokens")
    return keep


def check_ids(item: list[int], entry: OpenAIModel, tokenizer: TextTokenizer, param: str,
              keep: int | None) -> list[int]:
    """A token-id input (`id_list`), cut to its last `keep` ids; one longer than the context (uncut) is refused
    before its ids are read."""
    if keep is not None:
        item = item[-keep:]
    if entry.context_length is not None and len(item) > entry.context_length:
        raise bad_request(f"a token-id {param} has {len(item)} tokens; model '{entry.id}' takes at most "
                          f"{entry.context_length}", param=param)
    vocabulary = tokenizer.vocabulary_size()
    if not item or not all(is_id(x) and x < vocabulary for x in item):
        raise bad_request(f"a token-id {param} must be non-empty, its ids in the vocabulary [0, {vocabulary})",
                          param=param)
    return list(item)


async def encoded_texts(tokenizer: TextTokenizer, texts: list[str], context: int | None, param: str,
                        special_tokens: bool = True, keep: int | None = None) -> list[list[int]]:
    """The texts' ids; a text that cannot fit in the context is refused before it is tokenized (a truncated one
    is bounded as for a model with no stated context)."""
    limit = tokenizer.character_limit(None if keep is not None else context)
    for index, text in enumerate(texts):
        if len(text) > limit:
            where = param if len(texts) == 1 else f"{param}[{index}]"
            raise bad_request(f"{where} has {len(text)} characters, more than the {limit} that "
                              + (f"the model's {context} tokens can hold" if context is not None and keep is None
                                 else "a text may have") + ": shorten it", param=param)
    if keep is None:
        return await tokenizer.encode_all(texts, special_tokens)

    def cut() -> list[list[int]]:
        return [tokenizer.encode_truncated(text, keep, special_tokens) for text in texts]

    return await asyncio.to_thread(cut) if sum(map(len, texts)) > INLINE_CHARACTERS else cut()


def is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def id_list(value: object) -> bool:
    """Whether `value` is meant as token ids: a list whose first item is one. Its other items are checked by
    `check_ids`, after its length: a list of a million ids is refused by its length, not read on the loop."""
    return isinstance(value, list) and bool(value) and is_id(value[0])


async def chat_prompt(body: dict[str, Any], entry: OpenAIModel, tokenizer: TextTokenizer | None,
                      sampling: params.Sampling, tools: list[dict[str, Any]] | None = None,
                      trust_templates: bool = False) -> list[Prompt]:
    messages = params.messages(body)
    if tokenizer is None:
        raise bad_request(f"model '{entry.id}' names no tokenizer, so it has no chat template: use /v1/completions",
                          param="model")
    keep = truncation(entry, sampling)
    text = await render(body, messages, entry, tokenizer, True, keep, tools, trust_templates)
    ids = (await encoded_texts(tokenizer, [text], entry.context_length, "messages",
                               special_tokens=sampling.add_special_tokens, keep=keep))[0]
    if entry.kind == GENERATE and not ids:
        raise bad_request("the chat prompt is empty", param="messages")
    return [Prompt(ids, text)]


async def render(body: dict[str, Any], messages: list[dict[str, Any]], entry: OpenAIModel,
                 tokenizer: TextTokenizer, default_generation_prompt: bool, keep: int | None = None,
                 tools: list[dict[str, Any]] | None = None, trust_templates: bool = False) -> str:
    """The chat template's text for the request's template fields (vLLM's `add_generation_prompt`,
    `continue_final_message`, `chat_template_kwargs`, `documents`, and `chat_template` where the server trusts
    requests' templates) and its checked `tools`."""
    template = request_template(body, trust_templates)
    arguments = body.get("chat_template_kwargs")
    if arguments is not None and not isinstance(arguments, dict):
        raise bad_request("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    add_generation_prompt = params.flag(body, "add_generation_prompt", default_generation_prompt)
    continue_final = params.flag(body, "continue_final_message", False)
    if continue_final and add_generation_prompt:
        raise bad_request("'continue_final_message' and 'add_generation_prompt' cannot both be true",
                          param="continue_final_message")
    documents = _documents(body)
    context = None if keep is not None else entry.context_length  # a truncated prompt may be longer at first
    limit = tokenizer.character_limit(context)
    size = sum(len(message["content"] or "") for message in messages)
    size += sum(len(str(value)) for document in documents or () for value in document.values())
    size += len(json.dumps(tools)) if tools else 0
    size += sum(len(json.dumps(message["tool_calls"])) for message in messages if "tool_calls" in message)
    if size > limit:
        raise bad_request(f"the messages have more than the {limit} characters that "
                          + (f"the model's {context} tokens can hold" if context else
                             "a prompt may have") + ": shorten them", param="messages")
    options: dict[str, Any] = {"arguments": arguments, "continue_final_message": continue_final,
                               "documents": documents, "tools": tools}
    if template is not None:  # the client's code: on a worker thread, whatever time it takes
        return await asyncio.to_thread(tokenizer.render_chat, messages, add_generation_prompt, **options,
                                       template=template, max_chars=limit)
    if len(messages) > _INLINE_MESSAGES:  # a long history renders on a worker thread: Jinja takes its time
        return await asyncio.to_thread(tokenizer.render_chat, messages, add_generation_prompt, **options)
    return tokenizer.render_chat(messages, add_generation_prompt, **options)


def request_template(body: dict[str, Any], trusted: bool) -> str | None:
    """vLLM's `chat_template`: a Jinja template the request sends to render its messages with instead of the
    model's. It is code the server runs, so, as vLLM, only a server started with --trust-request-chat-template
    takes it (sandboxed and bounded all the same); otherwise a 400 naming the flag."""
    template = body.get("chat_template")
    if template is None:
        return None
    if not trusted:
        raise bad_request("'chat_template' is refused: a template sent with a request is code the server would run; "
                          "a server started with --trust-request-chat-template takes it (the model's own template is "
                          "used otherwise)", param="chat_template")
    if not isinstance(template, str) or not template:
        raise bad_request("'chat_template' must be a non-empty string (a Jinja template)", param="chat_template")
    if len(template) > MAX_REQUEST_TEMPLATE_CHARS:
        raise bad_request(f"'chat_template' has {len(template)} characters; at most {MAX_REQUEST_TEMPLATE_CHARS} are "
                          "taken", param="chat_template")
    return template


def _documents(body: dict[str, Any]) -> list[dict[str, str]] | None:
    documents = body.get("documents")
    if documents is None:
        return None
    if not isinstance(documents, list) or not all(
            isinstance(document, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in document.items())
            for document in documents):
        raise bad_request("'documents' must be a list of objects of strings (e.g. 'title' and 'text')",
                          param="documents")
    if len(documents) > MAX_DOCUMENTS:
        raise bad_request(f"'documents' may hold at most {MAX_DOCUMENTS} documents", param="documents")
    return documents


def max_tokens(entry: OpenAIModel, prompt: Prompt, sampling: params.Sampling) -> int | None:
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
