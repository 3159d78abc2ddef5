"""`backend: "fastertransformer"`: a FasterTransformer repository served as it is, through the generation backend.

FasterTransformer's configs name a converted checkpoint (`model_checkpoint_path`, or by default the version
folder's `<default_model_filename>` or `<tensor_para_size>-gpu`), its `model_type` and `data_type`. At load the
checkpoint is read back into a Hugging Face model (`checkpoint`), written to a temporary folder that the torch
engine loads, and the folder is removed once the engines hold the weights: nothing is cached. The config's tensors
are FasterTransformer's, which the generation backend speaks; the ones with no effect here are accepted at their
neutral value (`interface.Inert`), and the parameters about GPUs and parallelism are logged as not applying.
fastertransformer_backend dev/v1.1_beta's configs decode by model-wide parameters (`top_k`, `beam_width`, ...,
and T5's `max_decoding_seq_len`, the tokens generated when a request does not say): `max_decoding_seq_len` becomes
the default `max_new_tokens`, and the others are served at the greedy values those configs ship with.
See docs/generation.md, "FasterTransformer repositories".
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from transerve.backends.base import Backend, BackendModel, ModelContext, Placement, instance_placements
from transerve.backends.generation.backend import failed_to_load, serve
from transerve.backends.generation.fastertransformer.checkpoint import MODEL_TYPES, read_checkpoint
from transerve.backends.generation.interface import ANY, Inert, TensorInterface
from transerve.backends.generation.settings import GenerationSettings, read_settings
from transerve.core.errors import ServerError, invalid_arg, unavailable
from transerve.repository.paths import inside

log = logging.getLogger(__name__)

#: FasterTransformer's `data_type` → the torch engine's compute type (on a GPU; a CPU computes in float32).
DATA_TYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
#: Parameters about GPUs, parallelism and FasterTransformer's kernels: nothing to do on transerve's engines.
NOT_APPLYING = ("tensor_para_size", "pipeline_para_size", "enable_custom_all_reduce", "int8_mode")
#: dev/v1.1_beta's model-wide decoding parameters, and the value each is served at (what its configs set): requests
#: choose their own decoding here, through the decoding options.
MODEL_WIDE = {"top_k": (0.0, 1.0), "top_p": (0.0,), "beam_width": (1.0,), "temperature": (1.0,),
              "repetition_penalty": (1.0,), "len_penalty": (1.0,), "beam_search_diversity_rate": (0.0,)}
#: FasterTransformer's inputs with no effect here, and the values a request may still send them at.
_INERT = {
    "beam_search_diversity_rate": Inert("diverse beam search", 0.0),
    "top_p_decay": Inert("factual-nucleus sampling", 1.0),
    "top_p_min": Inert("factual-nucleus sampling", ANY),
    "top_p_reset_ids": Inert("factual-nucleus sampling", ANY),
    "is_return_context_embeddings": Inert("context embeddings", False),
    "prompt_learning_task_name_ids": Inert("prompt learning"),
    "request_prompt_lengths": Inert("prompt learning"),
    "request_prompt_embedding": Inert("prompt learning"),
    "request_prompt_type": Inert("prompt learning"),
    "ia3_tasks": Inert("IA3 adapters"),
}
_INERT_OUTPUTS = frozenset({"context_embeddings"})
_SERVED_ELSEWHERE = (
    "serve other architectures with the generation backend: `transerve convert HF_MODEL_DIR --output REPO` "
    "turns the Hugging Face checkpoint into a repository (docs/generation.md)"
)


class FasterTransformerBackend(Backend):
    name = "fastertransformer"

    async def load(self, context: ModelContext) -> BackendModel:
        config = context.config
        parameters = {key: value.string_value for key, value in config.parameters.items()}
        loop = asyncio.get_running_loop()
        scratch = Path(tempfile.mkdtemp(prefix="transerve-ft-"))
        try:
            model_type = _model_type(parameters)
            data_type = _data_type(parameters)
            if parameters.get("engine", "torch") != "torch":
                raise invalid_arg("a fastertransformer model runs on the torch engine; leave parameter 'engine' out")
            folder = checkpoint_folder(context, parameters)
            _check_model_wide(parameters)
            _log_not_applying(context.name, parameters)
            model_dir = scratch / context.name
            start_id = await loop.run_in_executor(None, _convert, folder, model_type, model_dir, parameters)
            inert = {**_INERT, "start_id": Inert("the decoder's start token, from config.ini", start_id)}
            interface = TensorInterface(config, inert, _INERT_OUTPUTS)
            settings = read_settings(_with_defaults(config, data_type), context.version_path, model_dir)
            explicit = bool(parameters.get("compute_type"))
            if not explicit and data_type != "float32" and any(p.kind != "GPU" for p in instance_placements(config)):
                log.info("model '%s': data_type %s applies to KIND_GPU instances; KIND_CPU ones compute in float32",
                         context.name, parameters.get("data_type") or "fp16")
            return await serve(context, interface, lambda placement: _on(placement, settings, explicit))
        except ServerError as exc:
            where = failed_to_load(context)
            message = exc.message if exc.message.startswith(where) else f"{where}: {exc.message}"
            raise ServerError(exc.code, message) from None
        finally:
            # the engines hold the weights now (or failed to load): the converted folder is not needed again
            await loop.run_in_executor(None, shutil.rmtree, scratch, True)


def checkpoint_folder(context: ModelContext, parameters: dict[str, str]) -> Path:
    """The checkpoint folder, as FasterTransformer's backend finds it: `model_checkpoint_path`, else
    `<version>/<default_model_filename>`, else `<version>/<tensor_para_size>-gpu`. A relative path is taken from
    the model's folder, or where that does not exist from the server's working directory (as FasterTransformer's
    backend takes it); either way it must lie inside the model repository."""
    text = parameters.get("model_checkpoint_path", "").strip()
    if not text:
        name = context.config.default_model_filename or f"{parameters.get('tensor_para_size') or 1}-gpu"
        folder = inside(context.model_path, context.version_path, name, "default_model_filename")
        if not folder.is_dir():
            raise unavailable(f"the checkpoint folder '{folder}' does not exist (no 'model_checkpoint_path': the "
                              "version folder's default_model_filename, else '<tensor_para_size>-gpu')")
        return folder
    path = Path(text)
    candidates = [path] if path.is_absolute() else [context.model_path / path, Path.cwd() / path]
    folder = next((candidate for candidate in candidates if candidate.is_dir()), None)
    if folder is None:
        tried = " or ".join(f"'{candidate}'" for candidate in candidates)
        raise unavailable(f"model_checkpoint_path '{text}': the checkpoint folder does not exist (looked for {tried})")
    repository = Path(os.path.realpath(context.repository_path))
    roots = (repository, Path(os.path.realpath(context.model_path)))
    if not any(Path(os.path.realpath(folder)).is_relative_to(root) for root in roots):
        raise invalid_arg(f"model_checkpoint_path '{text}' leads outside the model repository '{repository}'")
    return folder


def _convert(folder: Path, model_type: str, model_dir: Path, parameters: dict[str, str]) -> int | None:
    """The checkpoint as a Hugging Face folder at `model_dir`; returns its decoder start token."""
    model = read_checkpoint(folder, model_type, parameters)
    model.save_pretrained(model_dir)
    config = model.config
    return config.decoder_start_token_id if config.is_encoder_decoder else config.bos_token_id


def _model_type(parameters: dict[str, str]) -> str:
    model_type = parameters.get("model_type") or "GPT"  # FasterTransformer's default
    if model_type not in MODEL_TYPES:
        raise unavailable(f"model_type '{model_type}' is not one transerve's fastertransformer backend serves (it "
                          f"reads {' and '.join(MODEL_TYPES)} checkpoints); {_SERVED_ELSEWHERE}")
    return model_type


def _data_type(parameters: dict[str, str]) -> str:
    data_type = parameters.get("data_type") or ("fp16" if parameters.get("is_half", "0").strip() == "1" else "fp32")
    if data_type not in DATA_TYPES:
        raise invalid_arg(f"parameter 'data_type' is '{data_type}'; it must be one of {', '.join(DATA_TYPES)}")
    return DATA_TYPES[data_type]


def _with_defaults(config: Any, compute_type: str) -> Any:
    """A copy of `config` whose `compute_type` parameter is `data_type`'s and whose `max_new_tokens` is
    `max_decoding_seq_len` (dev/v1.1_beta's T5 configs), unless it sets them itself."""
    copy = type(config)()
    copy.CopyFrom(config)
    if not copy.parameters["compute_type"].string_value:
        copy.parameters["compute_type"].string_value = compute_type
    decoding_length = config.parameters["max_decoding_seq_len"].string_value.strip() if (
        "max_decoding_seq_len" in config.parameters) else ""
    if decoding_length and not copy.parameters["max_new_tokens"].string_value:
        copy.parameters["max_new_tokens"].string_value = decoding_length
    return copy


def _check_model_wide(parameters: dict[str, str]) -> None:
    """dev/v1.1_beta's model-wide decoding parameters at the values its configs ship with; another value would
    decode every request otherwise than the config says, so it is refused with where to say it instead."""
    for key, served in MODEL_WIDE.items():
        text = parameters.get(key, "").strip()
        if not text:
            continue
        try:
            value = float(text)
        except ValueError:
            raise invalid_arg(f"parameter '{key}' must be a number, got '{text}'") from None
        if value not in served:
            raise invalid_arg(f"parameter '{key}' is {text}: model-wide decoding parameters are served at "
                              f"{' or '.join(f'{v:g}' for v in served)} only; a request chooses its own decoding "
                              f"(the '{key}' request parameter or input tensor, docs/generation.md)")


def _on(placement: Placement, settings: GenerationSettings, explicit: bool) -> GenerationSettings:
    """A CPU instance computes in float32 whatever `data_type` says (FasterTransformer's configs say fp16 for
    GPUs), unless the config sets `compute_type` itself."""
    if placement.kind == "GPU" or explicit or settings.compute_type == "float32":
        return settings
    return dataclasses.replace(settings, compute_type="float32")


def _log_not_applying(name: str, parameters: dict[str, str]) -> None:
    given = [f"{key}={parameters[key]}" for key in NOT_APPLYING if parameters.get(key, "").strip()]
    if given:
        log.info("model '%s': %s do not apply to transerve's engines and are ignored (one process computes the "
                 "whole model)", name, ", ".join(given))
