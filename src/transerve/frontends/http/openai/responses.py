"""OpenAI's response documents for completions and chat completions, whole and as stream chunks."""

from __future__ import annotations

import time
import uuid
from typing import Any

from transerve.frontends.http.openai.generation import Choice, Delta, Prompt, TokenLogProb
from transerve.frontends.http.openai.params import Sampling
from transerve.frontends.http.openai.text import TextTokenizer
from transerve.frontends.http.openai.tool_answers import StreamedCalls, tool_message
from transerve.frontends.http.openai.tools import ToolReader


class Formatter:
    """One request's documents: its id and creation time are shared by every chunk of a stream."""

    def __init__(self, model: str, chat: bool, sampling: Sampling, tokenizer: TextTokenizer | None,
                 prompts: list[Prompt], tools: ToolReader | None = None) -> None:
        self.model = model
        self.chat = chat
        self.sampling = sampling
        self._tokenizer = tokenizer
        self._prompts = prompts
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        #: Completions' `text_offset`: where each choice's next token starts in its text.
        self._offsets: dict[int, int] = {}
        #: `tool_choice: "auto"`: how the answers' tool calls are read, and the streamed choices' parsers.
        self._tools = tools
        self._streamed_calls = StreamedCalls(tools) if tools is not None else None

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    # ---- whole answers ---------------------------------------------------------------------------------------

    def answer(self, choices: list[Choice], results: list[list[Delta]]) -> dict[str, Any]:
        documents = []
        for choice, deltas in zip(choices, results, strict=True):
            text = "".join(delta.text for delta in deltas)
            finish = deltas[-1].finish_reason if deltas else "stop"
            tokens = [token for delta in deltas for token in delta.logprobs]
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if self._tools is not None:
                    message, called = tool_message(self._tools, text)
                    finish = "tool_calls" if called and finish == "stop" else finish
                documents.append({"index": choice.index, "message": message,
                                  "logprobs": self._chat_logprobs(tokens), "finish_reason": finish})
            else:
                prefix = choice.prompt.text if self.sampling.echo else ""
                logprobs = self._completion_logprobs(choice.index, tokens, len(prefix))
                if self.sampling.echo and logprobs is not None:
                    logprobs = self._echoed_logprobs(choice, logprobs)
                documents.append({"index": choice.index, "text": prefix + text, "logprobs": logprobs,
                                  "finish_reason": finish})
                if self.sampling.prompt_logprobs is not None:
                    documents[-1]["prompt_logprobs"] = self._prompt_logprobs(choice)
        answer = {**self._head("chat.completion" if self.chat else "text_completion"), "choices": documents,
                  "usage": self.usage(choices)}
        if self.chat and self.sampling.prompt_logprobs is not None:  # vLLM: one list, the choices share the prompt
            answer["prompt_logprobs"] = self._prompt_logprobs(choices[0]) if choices else None
        return answer

    def usage(self, choices: list[Choice]) -> dict[str, int]:
        prompt = sum(len(prompt.ids) for prompt in self._prompts)
        if self._tokenizer is not None and any(not prompt.ids for prompt in self._prompts):  # text models
            prompt = sum(len(self._tokenizer.encode(prompt.text)) for prompt in self._prompts)
        completion = sum(choice.completion_tokens for choice in choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    # ---- stream chunks ---------------------------------------------------------------------------------------

    def opening_chunks(self, choices: list[Choice]) -> list[dict[str, Any]]:
        """Chat: each choice's role first, as OpenAI streams it. Completions with `echo`: each prompt."""
        if self.chat:
            chunks = [self._chat_chunk(choice.index, {"role": "assistant", "content": ""}, None, None)
                      for choice in choices]
        elif self.sampling.echo:
            chunks = [self._completion_chunk(choice.index, choice.prompt.text, None, None) for choice in choices]
        else:
            return []
        for chunk, choice in zip(chunks, choices, strict=True):
            self._continuous(chunk, choice.index, 0)
        return chunks

    def chunks(self, delta: Delta) -> list[dict[str, Any]]:
        """The chunks a delta makes: one, or with tool calls read from the text, one per content piece or call
        delta (none while the text is held back), the finish reason last (`tool_calls` when the choice called)."""
        calls = self._streamed_calls
        if calls is None:
            return [self.chunk(delta)]
        pieces = calls.deltas(delta.index, delta.text, delta.finish_reason is not None)
        logprobs = self._chat_logprobs(delta.logprobs) if delta.logprobs else None
        finish = delta.finish_reason
        if finish == "stop" and calls.called(delta.index):
            finish = "tool_calls"
        chunks = [self._chat_chunk(delta.index, piece, logprobs if number == 0 else None, None)
                  for number, piece in enumerate(pieces)]
        if finish is not None or (not pieces and logprobs is not None):
            chunks.append(self._chat_chunk(delta.index, {}, None if pieces else logprobs, finish))
        return [self._continuous(chunk, delta.index, delta.completion_tokens) for chunk in chunks]

    def chunk(self, delta: Delta) -> dict[str, Any]:
        if self.chat:
            content = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
            chunk = self._chat_chunk(delta.index, content, self._chat_logprobs(delta.logprobs), delta.finish_reason)
        else:
            offset = len(self._prompts[delta.index // self.sampling.n].text) if self.sampling.echo else 0
            chunk = self._completion_chunk(delta.index, delta.text,
                                           self._completion_logprobs(delta.index, delta.logprobs, offset),
                                           delta.finish_reason)
        return self._continuous(chunk, delta.index, delta.completion_tokens)

    def _continuous(self, chunk: dict[str, Any], index: int, completion: int) -> dict[str, Any]:
        """vLLM's `continuous_usage_stats`: the chunk's choice's prompt and its tokens so far."""
        if self.sampling.continuous_usage:
            prompt = len(self._prompts[index // self.sampling.n].ids)
            chunk["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion,
                              "total_tokens": prompt + completion}
        return chunk

    def usage_chunk(self, choices: list[Choice]) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(kind), "choices": [], "usage": self.usage(choices)}

    def _chat_chunk(self, index: int, delta: dict[str, Any], logprobs: Any, finish: str | None) -> dict[str, Any]:
        document = {**self._head("chat.completion.chunk"),
                    "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        if self.sampling.include_usage:
            document["usage"] = None
        return document

    def _completion_chunk(self, index: int, text: str, logprobs: Any, finish: str | None) -> dict[str, Any]:
        document = {**self._head("text_completion"),
                    "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}
        if self.sampling.include_usage:
            document["usage"] = None
        return document

    # ---- log-probabilities -----------------------------------------------------------------------------------

    def _name(self, token_id: int, label: bool = False) -> str:
        """A token as log-probabilities show it: its text (completions: its label), or vLLM's `token_id:<id>` with
        `return_tokens_as_token_ids`."""
        assert self._tokenizer is not None
        if self.sampling.tokens_as_ids:
            return f"token_id:{token_id}"
        return self._tokenizer.token_label(token_id) if label else self._tokenizer.token_text(token_id)

    def _chat_logprobs(self, tokens: list[TokenLogProb]) -> dict[str, Any] | None:
        if self.sampling.logprobs is None or self._tokenizer is None:
            return None
        tokenizer = self._tokenizer

        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            return {"token": self._name(token_id), "logprob": logprob,
                    "bytes": tokenizer.token_bytes(token_id)}

        return {"content": [{**entry(token.token_id, token.logprob),
                             "top_logprobs": [entry(i, v) for i, v in token.top[:self.sampling.logprobs]]}
                            for token in tokens], "refusal": None}

    def _echoed_logprobs(self, choice: Choice, generated: dict[str, Any]) -> dict[str, Any]:
        """`echo` with `logprobs`: the prompt's tokens first in each list, the first one's log-probability and top
        map null (nothing comes before it), each token's `text_offset` its start in the echoed prompt."""
        scored = choice.prompt_scores or []
        ids = choice.prompt.ids[:1 + len(scored)]
        labels = [self._name(token_id, label=True) for token_id in ids]
        offsets, offset = [], 0
        for token_id in ids:
            offsets.append(offset)
            offset += len(self._tokenizer.token_text(token_id)) if self._tokenizer is not None else 0
        tops: list[dict[str, float] | None] = [None]
        for token, label in zip(scored, labels[1:], strict=True):
            top = {self._name(i, label=True): v for i, v in token.top[:self.sampling.logprobs]}
            top.setdefault(label, token.logprob)
            tops.append(top)
        return {"tokens": labels + generated["tokens"],
                "token_logprobs": [None, *(token.logprob for token in scored), *generated["token_logprobs"]],
                "top_logprobs": tops[:len(ids)] + generated["top_logprobs"],
                "text_offset": offsets + generated["text_offset"]}

    def _prompt_logprobs(self, choice: Choice) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's `prompt_logprobs`: null for the first token, then per token a map from token id to its
        log-probability, rank and text, the prompt's own token and the likeliest ones (a model whose config lacks
        `prompt_ranks` gives the prompt token's rank only where it is among those)."""
        assert self._tokenizer is not None and self.sampling.prompt_logprobs is not None
        tokenizer, k = self._tokenizer, self.sampling.prompt_logprobs
        entries: list[dict[str, dict[str, Any]] | None] = [None]
        for token in choice.prompt_scores or []:
            top = token.top[:k]
            ranks = {token_id: place for place, (token_id, _) in enumerate(token.top, start=1)}
            rank = token.rank if token.rank is not None else ranks.get(token.token_id)
            entry = {str(token.token_id): {"logprob": token.logprob, "rank": rank,
                                           "decoded_token": tokenizer.token_text(token.token_id)}}
            for place, (token_id, value) in enumerate(top, start=1):
                entry.setdefault(str(token_id), {"logprob": value, "rank": place,
                                                 "decoded_token": tokenizer.token_text(token_id)})
            entries.append(entry)
        return entries

    def _completion_logprobs(self, index: int, tokens: list[TokenLogProb], start: int) -> dict[str, Any] | None:
        """The legacy shape: parallel lists, `top_logprobs` a {token: logprob} map per token (the chosen token's
        own when `logprobs` is 0), `text_offset` each token's start in the choice's text."""
        if self.sampling.logprobs is None or self._tokenizer is None:
            return None
        tokenizer = self._tokenizer
        texts = [tokenizer.token_text(token.token_id) for token in tokens]
        labels = [self._name(token.token_id, label=True) for token in tokens]
        offset = self._offsets.get(index, start)
        offsets = []
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        self._offsets[index] = offset
        tops = []
        for token, label in zip(tokens, labels, strict=True):
            top = {self._name(i, label=True): v for i, v in token.top[:self.sampling.logprobs]}
            top.setdefault(label, token.logprob)
            tops.append(top)
        return {"tokens": labels, "token_logprobs": [token.logprob for token in tokens], "top_logprobs": tops,
                "text_offset": offsets}
