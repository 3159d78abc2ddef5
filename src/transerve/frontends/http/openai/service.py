"""vLLM's service routes beside /v1: `POST /tokenize` and `POST /detokenize`, with vLLM's request and answer
shapes, for the generators and text models the API serves.

`/tokenize` takes a `prompt` (tokenized with the tokenizer's special tokens unless `add_special_tokens` is false)
or chat `messages` and `tools` (rendered with the model's template, or the request's `chat_template` where the
server trusts those, as /v1/chat/completions renders them, special tokens not added again unless asked), and
answers `count`, `max_model_len` and `tokens` (`token_strs` too with `return_token_strs`). `/detokenize` takes
`tokens` and answers the `prompt` they decode to. Inputs are bounded as completions' prompts are.
"""

from __future__ import annotations

from typing import Any

from transerve.frontends.http.openai import params, tools
from transerve.frontends.http.openai.catalog import GENERATE, TEXT, Catalog, OpenAIModel
from transerve.frontends.http.openai.errors import bad_request
from transerve.frontends.http.openai.prompts import check_ids, encoded_texts, id_list, render
from transerve.frontends.http.openai.text import TextTokenizer

_TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                              "continue_final_message", "chat_template_kwargs", "documents", "return_token_strs",
                              "tools", "chat_template"})
_DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


async def tokenize(catalog: Catalog, body: dict[str, Any], trust_templates: bool = False) -> dict[str, Any]:
    params.refuse_unknown(body, _TOKENIZE_FIELDS, "/tokenize")
    entry, tokenizer = await _model(catalog, body)
    chat = "messages" in body
    if chat == ("prompt" in body):
        raise bad_request("give either 'prompt' or 'messages'", param="prompt")
    special = params.flag(body, "add_special_tokens", not chat)
    if chat:
        checked = tools.tool_request({"tools": body.get("tools")})  # a chat prompt as chat renders it with tools
        text = await render(body, params.messages(body), entry, tokenizer, True,
                            tools=checked.tools if checked is not None else None, trust_templates=trust_templates)
    else:
        text = body.get("prompt")
        if not isinstance(text, str):
            raise bad_request("'prompt' must be a string", param="prompt")
        for name in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "documents", "tools",
                     "chat_template"):
            if name in body:
                raise bad_request(f"'{name}' goes with 'messages'", param=name)
    ids = (await encoded_texts(tokenizer, [text], entry.context_length, "messages" if chat else "prompt",
                               special))[0]
    answer: dict[str, Any] = {"count": len(ids), "max_model_len": entry.context_length, "tokens": ids}
    if params.flag(body, "return_token_strs", False):
        answer["token_strs"] = [tokenizer.token_text(token) for token in ids]
    return answer


async def detokenize(catalog: Catalog, body: dict[str, Any]) -> dict[str, Any]:
    params.refuse_unknown(body, _DETOKENIZE_FIELDS, "/detokenize")
    entry, tokenizer = await _model(catalog, body)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or tokens and not id_list(tokens):
        raise bad_request("'tokens' must be a list of token ids", param="tokens")
    if not tokens:
        return {"prompt": ""}
    return {"prompt": tokenizer.decode(check_ids(tokens, entry, tokenizer, "tokens", None))}


async def _model(catalog: Catalog, body: dict[str, Any]) -> tuple[OpenAIModel, TextTokenizer]:
    entry = catalog.get(body.get("model"), (GENERATE, TEXT))
    if entry.tokenizer_folder is None:
        raise bad_request(f"model '{entry.id}' names no tokenizer (config parameter openai_tokenizer)",
                          param="model")
    return entry, await entry.tokenizer()
