"""Which served models the OpenAI API can call, and what it needs to call each: the catalog behind /v1/models.

A model takes part in one of three ways, decided from its config (docs/openai.md):

- a **generator** (backend "generation" with FasterTransformer's later tensor names, what `transerve convert`
  writes) whose tokenizer files are beside it (`<version>/<model_dir>/tokenizer.json`): completions and chat, the
  tokens going in and out as ids;
- a **text model** that opts in with `openai_api: "completions"` and names its text tensors
  (`openai_text_input`, `openai_text_output`): completions and chat, text in and out;
- an **embedding model** that opts in with `openai_api: "embeddings"` (`openai_text_input`,
  `openai_embedding_output`; `transerve export --task embedding` writes them).

`openai_tokenizer` names the folder, relative to the version folder, that holds the tokenizer; `openai_api:
"none"` keeps a model out; `openai_tool_call_parser` names the format its chat answers' tool calls are read in
(`hermes`, `llama3_json`, `mistral`; an unknown name keeps the model out, as an incomplete opt-in does). Entries
are rebuilt when a model is reloaded (a new `ModelVersion` object); the tokenizer is read once per version, in a
thread, so a large tokenizer.json never stalls the event loop.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from transerve.core.errors import ErrorCode, ServerError
from transerve.core.extras import MissingExtra
from transerve.frontends.http.openai.errors import ApiError, bad_request, model_not_found
from transerve.frontends.http.openai.text import TextTokenizer, has_tokenizer
from transerve.frontends.http.openai.tool_parsers import PARSERS
from transerve.repository.paths import inside
from transerve.server import ModelVersion, Server

GENERATE, TEXT, EMBEDDINGS = "generate", "text", "embeddings"
#: Generator tensors the layer sends and reads (FasterTransformer's later names).
_GENERATOR_INPUTS = ("input_ids", "sequence_length")
_GENERATOR_OUTPUTS = ("output_ids", "sequence_length", "prefix_length")
#: Where Hugging Face configs keep the context length, by architecture family.
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length")


@dataclass(slots=True)
class OpenAIModel:
    id: str
    kind: str
    model: ModelVersion
    tokenizer_folder: Path | None
    #: Prompt plus completion, in tokens, when the model says (its config.json or `openai_context_length`).
    context_length: int | None
    text_input: str = ""
    text_output: str = ""
    #: The model's inputs and outputs by name, for the optional ones (a per-row seed, log-probabilities).
    inputs: frozenset[str] = frozenset()
    outputs: frozenset[str] = frozenset()
    #: Embeddings: the sizes `dimensions` may cut a vector to (config `openai_matryoshka_dimensions`).
    matryoshka_dimensions: frozenset[int] = frozenset()
    #: Which tool-call format its chat answers are read in (config `openai_tool_call_parser`), None for none.
    tool_parser: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    _tokenizer: TextTokenizer | None = None
    _loading: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def decoupled(self) -> bool:
        return self.model.decoupled

    @property
    def max_batch_size(self) -> int:
        return self.model.config.max_batch_size

    async def tokenizer(self) -> TextTokenizer:
        if self._tokenizer is None:
            if self.tokenizer_folder is None:
                raise bad_request(f"model '{self.id}' names no tokenizer (config parameter openai_tokenizer)")
            async with self._loading:
                if self._tokenizer is None:
                    try:
                        self._tokenizer = await asyncio.to_thread(TextTokenizer, self.tokenizer_folder)
                    except MissingExtra as exc:  # the server's installation, not the model, lacks something
                        raise ApiError(503, f"model '{self.id}': {exc}") from None
                    except Exception as exc:  # a broken tokenizer file: the model's fault, reported as such
                        raise ApiError(500, f"model '{self.id}': its tokenizer could not be read: {exc}") from None
        return self._tokenizer

    def card(self) -> dict:
        """OpenAI's model object, with vLLM's `root` and `max_model_len` (null when the model states none)."""
        return {"id": self.id, "object": "model", "created": self.created, "owned_by": "transerve", "root": self.id,
                "parent": None, "max_model_len": self.context_length}


class Catalog:
    """The callable models, looked up by id on every request (cheap: a dict and an identity check)."""

    def __init__(self, server: Server) -> None:
        self._server = server
        self._entries: dict[str, OpenAIModel | None] = {}
        self._seen: dict[str, ModelVersion] = {}

    def models(self) -> list[OpenAIModel]:
        latest: dict[str, ModelVersion] = {}
        for model in self._server.serving_versions():
            if model.name not in latest or int(model.version) > int(latest[model.name].version):
                latest[model.name] = model
        return [entry for name in sorted(latest) if (entry := self._entry(latest[name])) is not None]

    def get(self, model_id: object, kinds: tuple[str, ...]) -> OpenAIModel:
        if not isinstance(model_id, str) or not model_id:
            raise bad_request("'model' must be a non-empty string", param="model")
        try:
            model = self._server.get_version(model_id)
        except ServerError as exc:
            if exc.code is ErrorCode.UNAVAILABLE:  # a model the server has, not ready (loading, or failed)
                raise ApiError(503, exc.message) from None
            raise model_not_found(model_id) from None
        entry = self._entry(model)
        if entry is None:
            raise model_not_found(model_id)
        if entry.kind not in kinds:
            task = "embeddings" if entry.kind == EMBEDDINGS else "completions and chat completions"
            raise bad_request(f"model '{model_id}' serves {task} only", param="model")
        return entry

    def _entry(self, model: ModelVersion) -> OpenAIModel | None:
        if self._seen.get(model.name) is not model:
            self._seen[model.name] = model
            self._entries[model.name] = _describe(model, self._step_folders(model))
        return self._entries[model.name]

    def _step_folders(self, model: ModelVersion) -> list[Path]:
        """An ensemble's steps' version folders, in step order: where its tokenizer step keeps tokenizer.json."""
        folders = []
        for step in model.config.ensemble_scheduling.step:
            try:
                path = self._server.get_version(step.model_name).path
            except ServerError:
                continue
            if path is not None:
                folders.append(path)
        return folders


def _describe(model: ModelVersion, step_folders: list[Path]) -> OpenAIModel | None:
    """The model's OpenAI entry, or None when it takes no part (or its opt-in is incomplete: logged at load would
    be better; a request then gets 404 as for any model not listed)."""
    parameters = {key: value.string_value for key, value in model.config.parameters.items()}
    api = parameters.get("openai_api", "")
    if api == "none" or model.path is None:
        return None
    inputs = frozenset(model.signature.inputs)
    outputs = frozenset(model.signature.outputs)
    tool_parser = parameters.get("openai_tool_call_parser") or None
    if tool_parser is not None and tool_parser not in PARSERS:
        return None
    try:
        context = _context_length(parameters)
        if api == "embeddings":
            return _opted_in(model, parameters, EMBEDDINGS, "openai_embedding_output", inputs, outputs, context,
                             step_folders)
        if api == "completions" and "openai_text_input" in parameters:
            entry = _opted_in(model, parameters, TEXT, "openai_text_output", inputs, outputs, context, step_folders)
            if entry is not None:
                entry.tool_parser = tool_parser
            return entry
        is_generator = model.config.backend == "generation" and set(_GENERATOR_INPUTS) <= inputs \
            and set(_GENERATOR_OUTPUTS) <= outputs
        if not is_generator or api not in ("", "completions"):
            return None
        folder = _folder(model, parameters.get("openai_tokenizer") or parameters.get("model_dir") or "model")
        if folder is None or not has_tokenizer(folder):
            return None
        return OpenAIModel(model.name, GENERATE, model, folder, context or _config_context(folder),
                           inputs=inputs, outputs=outputs, tool_parser=tool_parser)
    except ServerError:
        return None


def _opted_in(model: ModelVersion, parameters: dict[str, str], kind: str, output_key: str, inputs: frozenset[str],
              outputs: frozenset[str], context: int | None, step_folders: list[Path]) -> OpenAIModel | None:
    """Without `openai_tokenizer`, an ensemble's tokenizer is its first step's that has a tokenizer.json (what
    `transerve export` writes); another model then has none, and its usage counts are 0."""
    text_input, text_output = parameters.get("openai_text_input", ""), parameters.get(output_key, "")
    if text_input not in inputs or text_output not in outputs:
        return None
    if "openai_tokenizer" in parameters:
        folder = _folder(model, parameters["openai_tokenizer"])
        if folder is None or not has_tokenizer(folder):
            return None
    else:
        folder = next((step for step in step_folders if has_tokenizer(step)), None)
    sizes = _matryoshka(parameters.get("openai_matryoshka_dimensions", ""), model.signature.outputs[text_output].dims)
    return OpenAIModel(model.name, kind, model, folder, context, text_input=text_input, text_output=text_output,
                       inputs=inputs, outputs=outputs, matryoshka_dimensions=sizes)


def _matryoshka(text: str, dims: tuple[int, ...]) -> frozenset[int]:
    """`all` (any size below the embedding's), or a comma-separated list of sizes; a size that is not below the
    embedding's width, or a width that is not fixed, allows none."""
    width = dims[-1] if dims else -1
    if not text or width <= 1:
        return frozenset()
    if text.strip() == "all":
        return frozenset(range(1, width))
    sizes = [part.strip() for part in text.split(",")]
    if not all(size.isdigit() and 0 < int(size) < width for size in sizes):
        raise ServerError(ErrorCode.INVALID_ARG, f"openai_matryoshka_dimensions must be 'all' or sizes below {width}")
    return frozenset(int(size) for size in sizes)


def _folder(model: ModelVersion, name: str) -> Path | None:
    assert model.path is not None
    folder = inside(model.path.parent, model.path, name, "openai_tokenizer")
    return folder if folder.is_dir() else None


def _context_length(parameters: dict[str, str]) -> int | None:
    text = parameters.get("openai_context_length")
    return int(text) if text and text.isdigit() and int(text) > 0 else None


def _config_context(folder: Path) -> int | None:
    """A Hugging Face config.json's context length; else (a CTranslate2 model's config.json has none of these keys)
    the tokenizer's `model_max_length`, the bound the CTranslate2 engine itself applies; None for neither (T5's
    relative positions)."""
    config = _json_object(folder / "config.json")
    for key in _CONTEXT_KEYS:
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    limit = _json_object(folder / "tokenizer_config.json").get("model_max_length")
    return int(limit) if isinstance(limit, int | float) and 0 < limit < 10**9 else None


def _json_object(path: Path) -> dict:
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return document if isinstance(document, dict) else {}
