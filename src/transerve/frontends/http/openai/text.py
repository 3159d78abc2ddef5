"""A model's tokenizer as the OpenAI layer uses it: prompts to ids, ids to text as they stream, chat templates.

Built on the `tokenizers` library (the Rust tokenizer transformers' fast tokenizers wrap) from the folder's
`tokenizer.json`, with `tokenizer_config.json` for the special tokens and the chat template. transformers itself
is not imported: it takes seconds to import and is not needed to serve. The chat template is rendered as
transformers' `apply_chat_template` renders it (a sandboxed Jinja environment with `trim_blocks` and
`lstrip_blocks`, loop controls, `raise_exception`, `strftime_now` and its `tojson`, the special tokens as
variables), and its text is encoded without adding special tokens again, as transformers encodes it; the tests
compare both against transformers. A template sent with a request (vLLM's `chat_template`, taken only with
`--trust-request-chat-template`) renders in the same environment with bounds of its own (`_request_template`).
"""

from __future__ import annotations

import asyncio
import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from transerve.core.extras import MissingExtra, import_optional
from transerve.frontends.http.openai.errors import ApiError, bad_request

TOKENIZER_FILE = "tokenizer.json"
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
#: The generated text's boundary may fall inside a character; a decoder shows the partial one as this.
_REPLACEMENT = "\ufffd"
#: Texts longer than this in all are encoded on a worker thread: `encode_batch` releases the GIL, `encode` does not.
INLINE_CHARACTERS = 16_384
#: The characters a text may have when the model states no context length: past the HTTP body limit's reach only
#: by a little, and enough for any real prompt.
UNBOUNDED_CONTEXT_CHARACTERS = 1 << 20
#: The longest `chat_template` a request may send.
MAX_REQUEST_TEMPLATE_CHARS = 64 * 1024
#: The longest string or list a request's template may build with `*`, and the most bits of an integer `**`.
_MAX_REPEAT = 1 << 20
_MAX_POWER_BITS = 1 << 16
#: Variables the server gives a chat template itself, which `chat_template_kwargs` may not replace.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages"})
#: transformers' `clean_up_tokenization`, applied when tokenizer_config.json asks for it.
_CLEANUPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
             (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


def has_tokenizer(folder: Path) -> bool:
    return (folder / TOKENIZER_FILE).is_file()


class TextTokenizer:
    """Encode, decode and chat-format for one model; built once per loaded model version, off the event loop."""

    def __init__(self, folder: Path) -> None:
        tokenizers = import_optional("tokenizers", "generation")
        decoders = tokenizers.decoders

        self._tokenizer = tokenizers.Tokenizer.from_file(str(folder / TOKENIZER_FILE))
        # A tokenizer.json may carry padding and truncation (all-MiniLM-L6-v2's: both fixed at 128), which would pad
        # prompts and miscount usage; transformers applies them only when a call asks. Limits are checked, not cut.
        self._tokenizer.no_padding()
        self._tokenizer.no_truncation()
        config = _read_json(folder / "tokenizer_config.json")
        specials = {**_read_json(folder / "special_tokens_map.json"), **config}
        #: The special tokens' text, the variables a chat template sees (`bos_token`, `eos_token`, ...).
        self.special_tokens = {key: text for key in _SPECIAL_TOKEN_KEYS
                               if (text := _token_text(specials.get(key))) is not None}
        self.chat_template = _chat_template(folder, config)
        self._clean_up = bool(config.get("clean_up_tokenization_spaces", False))
        limit = config.get("model_max_length")
        #: tokenizer_config.json's `model_max_length` when it is a real bound (transformers writes 1e30 for none).
        self.max_length = int(limit) if isinstance(limit, int | float) and 0 < limit < 10**9 else None
        self._byte_level = isinstance(self._tokenizer.decoder, decoders.ByteLevel)
        #: The most characters one token stands for: a text longer than this times a context cannot fit in it.
        self.longest_token = max((len(piece) for piece in self._tokenizer.get_vocab()), default=1) or 1
        #: The ids that end a sequence: the tokenizer's end token and generation_config.json's `eos_token_id`.
        self.end_ids = _end_ids(self._tokenizer, self.special_tokens.get("eos_token"),
                                _read_json(folder / "generation_config.json").get("eos_token_id"))

    def encode(self, text: str, special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=special_tokens).ids

    def encode_truncated(self, text: str, keep: int, special_tokens: bool = True, side: str = "left") -> list[int]:
        """At most `keep` ids, as transformers truncates (`truncation=True, max_length=keep`): the text's own tokens
        are cut on `side`, then the special tokens are added, so they survive the cut."""
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        room = keep - (self._tokenizer.num_special_tokens_to_add(False) if special_tokens else 0)
        if len(encoding.ids) > max(room, 0):
            encoding.truncate(max(room, 0), direction=side)
        return self._tokenizer.post_process(encoding, add_special_tokens=special_tokens).ids

    def character_limit(self, context: int | None) -> int:
        """The characters a text may have and still fit in `context` tokens: each token covers at most
        `longest_token` of them (normalizers that drop characters aside)."""
        return UNBOUNDED_CONTEXT_CHARACTERS if context is None else context * self.longest_token

    async def encode_all(self, texts: list[str], special_tokens: bool = True) -> list[list[int]]:
        """`encode` for each text; a long input is encoded on a worker thread, so the event loop keeps serving."""
        if sum(len(text) for text in texts) <= INLINE_CHARACTERS:
            return [self.encode(text, special_tokens) for text in texts]
        encodings = await asyncio.to_thread(self._tokenizer.encode_batch, texts, add_special_tokens=special_tokens)
        return [encoding.ids for encoding in encodings]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        if self._clean_up:
            for before, after in _CLEANUPS:
                text = text.replace(before, after)
        return text

    def vocabulary_size(self) -> int:
        return self._tokenizer.get_vocab_size()

    def token_text(self, token_id: int) -> str:
        """One token as text (special tokens included); a partial character shows as U+FFFD."""
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def token_label(self, token_id: int) -> str:
        """One token as the legacy completions log-probabilities name it: its text, or, for a token that holds
        only part of a character, `bytes:` and its bytes (`bytes:\\xe2\\x80`), as OpenAI names such tokens; U+FFFD
        would give several tokens one name, and `top_logprobs` is a map keyed by the name."""
        data = bytes(self.token_bytes(token_id))
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{byte:02x}" for byte in data)

    def token_bytes(self, token_id: int) -> list[int]:
        """One token's bytes: exact for byte-level vocabularies (GPT-2's), the UTF-8 of its text otherwise."""
        piece = self._tokenizer.id_to_token(token_id)
        if self._byte_level and piece is not None:
            table = _unicode_to_byte()
            if all(char in table for char in piece):
                return [table[char] for char in piece]
        return list(self.token_text(token_id).encode("utf-8", "replace"))

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    arguments: dict[str, Any] | None = None, continue_final_message: bool = False,
                    documents: list[dict[str, Any]] | None = None, tools: list[dict[str, Any]] | None = None,
                    template: str | None = None, max_chars: int = UNBOUNDED_CONTEXT_CHARACTERS) -> str:
        """The template's text, as transformers' `apply_chat_template(tokenize=False)` gives it for the same
        arguments (`tools`: the JSON-schema dicts, as it passes them); `continue_final_message` ends the text with
        the last message's content, left open. `template`: the request's own (checked by the caller), rendered
        instead of the model's, its text bounded by `max_chars`; any error it raises is the request's (a 400)."""
        if template is not None:
            return self._render_request_template(template, max_chars, messages, add_generation_prompt, arguments,
                                                 continue_final_message, documents, tools)
        if self.chat_template is None:
            raise bad_request("this model has no chat template (its tokenizer_config.json or chat_template.jinja "
                              "names none): use /v1/completions", param="messages")
        try:
            import_optional("jinja2", "generation")
        except MissingExtra as exc:
            raise ApiError(503, str(exc)) from None
        from jinja2.exceptions import TemplateError

        messages, variables = self._template_variables(messages, add_generation_prompt, arguments,
                                                       continue_final_message, documents, tools)
        try:
            compiled = _compiled(self.chat_template)
            text = compiled.render(messages=messages, **variables)
        except TemplateError as exc:
            raise bad_request(f"the model's chat template refused the messages: {exc}", param="messages") from None
        return _left_open(text) if continue_final_message else text

    def _template_variables(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                            arguments: dict[str, Any] | None, continue_final_message: bool,
                            documents: list[dict[str, Any]] | None,
                            tools: list[dict[str, Any]] | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The messages and the other variables a template renders with."""
        reserved = RESERVED_TEMPLATE_VARIABLES.intersection(arguments or ())
        if reserved:
            raise bad_request(f"'chat_template_kwargs' may not set {', '.join(sorted(reserved))}: the request's own "
                              "field gives it", param="chat_template_kwargs")
        # As transformers' apply_chat_template: the request's variables replace the special tokens' defaults.
        variables = {**self.special_tokens, "add_generation_prompt": add_generation_prompt, **(arguments or {})}
        if documents is not None:
            variables["documents"] = documents
        if tools is not None:
            variables["tools"] = tools
        if continue_final_message:
            messages = [*messages[:-1], {**messages[-1], "content": (messages[-1].get("content") or "") + _OPEN_END}]
        return messages, variables

    def _render_request_template(self, template: str, max_chars: int, messages: list[dict[str, Any]],
                                 add_generation_prompt: bool, arguments: dict[str, Any] | None,
                                 continue_final_message: bool, documents: list[dict[str, Any]] | None,
                                 tools: list[dict[str, Any]] | None) -> str:
        try:
            import_optional("jinja2", "generation")
        except MissingExtra as exc:
            raise ApiError(503, str(exc)) from None
        messages, variables = self._template_variables(messages, add_generation_prompt, arguments,
                                                       continue_final_message, documents, tools)
        limit = max_chars + len(_OPEN_END)
        pieces, size = [], 0
        try:
            for piece in _request_template(template).generate(messages=messages, **variables):
                size += len(piece)
                if size > limit:
                    raise bad_request(f"the request's 'chat_template' renders more than the {max_chars} characters "
                                      "a prompt may have here", param="chat_template")
                pieces.append(piece)
        except ApiError:
            raise
        except Exception as exc:  # noqa: BLE001 - the client's template code failed: its error, a 400
            raise bad_request(f"the request's 'chat_template' failed: {type(exc).__name__}: {exc}",
                              param="chat_template") from None
        text = "".join(pieces)
        return _left_open(text) if continue_final_message else text


#: Marks the end of the final message's content for `continue_final_message` (transformers marks it the same way).
_OPEN_END = "CONTINUE_FINAL_MESSAGE_TAG "


def _left_open(text: str) -> str:
    """The rendered chat cut where the final message's marked content ends; a template that trimmed the space
    after the mark trimmed the message's trailing whitespace too, so the cut is stripped as well."""
    at = text.rfind(_OPEN_END.strip())
    if at < 0:
        raise bad_request("'continue_final_message': the chat template's text does not hold the final message's "
                          "content", param="continue_final_message")
    return text[:at] if text[at:at + len(_OPEN_END)] == _OPEN_END else text[:at].rstrip()


class TextStream:
    """Generated ids to text as they arrive, never splitting a character: text is released only when the decoded
    window does not end in a partial character. Each step decodes a short window (the previous step's ids and the
    new ones), so a long completion costs linear time, and the window's first ids give the new ones the context
    that decides a leading space (SentencePiece vocabularies)."""

    __slots__ = ("_tokenizer", "ids", "_start", "_read", "_skip")

    def __init__(self, tokenizer: TextTokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self.ids: list[int] = []
        self._start = 0
        self._read = 0
        self._skip = skip_special_tokens

    def add(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        before = self._tokenizer.decode(self.ids[self._start:self._read], self._skip)
        window = self._tokenizer.decode(self.ids[self._start:], self._skip)
        if len(window) <= len(before) or window.endswith(_REPLACEMENT):
            return ""
        self._start, self._read = self._read, len(self.ids)
        return window[len(before):]

    def finish(self) -> str:
        """What is left at the end, a partial character included (the model produced it)."""
        before = self._tokenizer.decode(self.ids[self._start:self._read], self._skip)
        window = self._tokenizer.decode(self.ids[self._start:], self._skip)
        self._start = self._read = len(self.ids)
        return window[len(before):] if len(window) > len(before) else ""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return document if isinstance(document, dict) else {}


def _end_ids(tokenizer: Any, eos_token: str | None, configured: Any) -> frozenset[int]:
    ids = set(configured) if isinstance(configured, list) else {configured}
    if eos_token is not None:
        ids.add(tokenizer.token_to_id(eos_token))
    return frozenset(token for token in ids if isinstance(token, int) and not isinstance(token, bool))


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: its text, or an AddedToken's `content`."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """Where transformers finds it: `chat_template.jinja` (transformers 5), `chat_template.json`, or the
    tokenizer config's `chat_template` (a string, or named templates of which `default` is used)."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = _read_json(folder / "chat_template.json").get("chat_template", config.get("chat_template"))
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


@lru_cache(maxsize=32)
def _compiled(source: str) -> Any:
    """The model's template, compiled once."""
    return _environment(bounded=False).from_string(source)


@lru_cache(maxsize=8)
def _request_template(source: str) -> Any:
    """A request's template, compiled once (a cache of its own: requests' templates never push out the models'),
    in the models' environment with `*` and `**` bounded: a template cannot build one huge string or number."""
    return _environment(bounded=True).from_string(source)


def _environment(bounded: bool) -> Any:
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; it renders its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message: str) -> None:
        from jinja2.exceptions import TemplateError

        raise TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    class _Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            from jinja2.exceptions import SecurityError

            if operator == "*":
                for items, times in ((left, right), (right, left)):
                    if isinstance(items, str | list | tuple) and isinstance(times, int) \
                            and len(items) * times > _MAX_REPEAT:
                        raise SecurityError(f"a repetition past {_MAX_REPEAT} items")
            elif isinstance(left, int) and isinstance(right, int) and right > 0 \
                    and abs(left).bit_length() * right > _MAX_POWER_BITS:
                raise SecurityError(f"a power past {_MAX_POWER_BITS} bits")
            return super().call_binop(context, operator, left, right)

    kind = _Bounded if bounded else ImmutableSandboxedEnvironment
    environment = kind(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return environment


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """Byte-level BPE's alphabet: printable bytes stand for themselves, the others for code points from 256 up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(byte): byte for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in printable:
            table[chr(256 + extra)] = byte
            extra += 1
    return table
