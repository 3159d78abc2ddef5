"""The `lightseq` backend: LightSeq's Triton repositories served unchanged.

A LightSeq model folder holds `config.pbtxt`, the model file it names by `default_model_filename` (beside the
config, LightSeq's `.pb` or `.hdf5` export), an empty version folder, and `parameters { key: "model_type" }`:
Transformer, Bert or Gpt. At load the file is read (`weights`) into the Hugging Face model that computes the same
(`models`). Transformer and Gpt then decode on the generation backend's torch engine (`instance`), Bert runs as an
encoder on a thread of its own (`encoder`). A file that cannot be served is UNAVAILABLE with the reason.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path
from typing import Any

from tritonclient.grpc import model_config_pb2

from transerve.backends.base import Backend, BackendModel, ModelContext, Placement, instance_placements
from transerve.backends.lightseq.decoding import output_types
from transerve.backends.lightseq.schema import MODEL_TYPES
from transerve.backends.lightseq.weights import FormatError, LightSeqWeights, read
from transerve.backends.threaded import import_engine
from transerve.core.errors import ServerError, unavailable
from transerve.repository.paths import inside


class LightSeqBackend(Backend):
    name = "lightseq"

    async def load(self, context: ModelContext) -> BackendModel:
        where = f"failed to load '{context.name}' version {context.version}"
        config = context.config
        loop = asyncio.get_running_loop()
        try:
            model_type = _model_type(config)
            path = _model_file(context)
            weights = await loop.run_in_executor(None, _read, path, model_type)
            if model_type == "Bert":
                from transerve.backends.lightseq.encoder import load_bert

                instances = await load_bert(context, weights, instance_placements(config), loop)
            else:
                instances = await _load_generation(context, weights, instance_placements(config), loop)
        except ServerError as exc:
            raise ServerError(exc.code, f"{where}: {exc.message}") from None
        return BackendModel(config, instances)


def _model_type(config: model_config_pb2.ModelConfig) -> str:
    parameter = config.parameters.get("model_type")
    model_type = parameter.string_value if parameter is not None else ""
    if model_type not in MODEL_TYPES:
        raise unavailable(f"parameter model_type is '{model_type}'; the lightseq backend serves "
                          f"{', '.join(MODEL_TYPES)}")
    return model_type


def _model_file(context: ModelContext) -> Path:
    """LightSeq's model file: `default_model_filename` in the model's folder (beside config.pbtxt), as LightSeq's
    backend reads it; never outside that folder."""
    name = context.config.default_model_filename
    if not name:
        raise unavailable("default_model_filename must name the LightSeq model file (.pb or .hdf5)")
    path = inside(context.model_path, context.model_path, name, "default_model_filename")
    if not path.is_file():
        raise unavailable(f"model file '{name}' not found in the model's folder")
    return path


def _read(path: Path, model_type: str) -> LightSeqWeights:
    try:
        return read(path, model_type)
    except FormatError as exc:
        raise unavailable(f"'{path.name}' is not a LightSeq {model_type} model that transerve serves: {exc}") from None
    except OSError as exc:
        raise unavailable(f"cannot read '{path.name}': {exc}") from None


async def _load_generation(context: ModelContext, weights: LightSeqWeights, placements: list[Placement],
                           loop: asyncio.AbstractEventLoop) -> list:
    from transerve.backends.generation.backend import open_engine
    from transerve.backends.lightseq.instance import LightSeqGenerationInstance

    folder = Path(tempfile.mkdtemp(prefix=f"transerve-lightseq-{context.name}-"))
    try:
        settings, plan = await loop.run_in_executor(None, _prepare, weights, folder, context.config)
        results = await asyncio.gather(
            *(loop.run_in_executor(None, open_engine, settings, placement) for placement in placements),
            return_exceptions=True,
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # the engines hold the weights in memory now
    engines = [result for result in results if not isinstance(result, BaseException)]
    failure = next((result for result in results if isinstance(result, BaseException)), None)
    if failure is not None:
        for engine in engines:
            engine.close()
        if isinstance(failure, ServerError):
            raise failure
        raise unavailable(f"the torch engine cannot load the model: {type(failure).__name__}: {failure}")
    outputs = output_types(context.config)
    return [
        LightSeqGenerationInstance(context.name, context.version, placement.name, engine, plan, outputs, loop)
        for placement, engine in zip(placements, engines, strict=True)
    ]


def _prepare(weights: LightSeqWeights, folder: Path, config: model_config_pb2.ModelConfig) -> tuple:
    """The Hugging Face model saved in `folder`, where the torch engine loads it from (the engine loads by folder;
    the folder goes once it has), the engine's settings and the decoding."""
    from transerve.backends.generation.settings import GenerationSettings
    from transerve.backends.lightseq.decoding import decoding
    from transerve.backends.lightseq.models import gpt_model, transformer_model

    import_engine("torch", "generation")
    import_engine("transformers", "generation")
    try:
        model = transformer_model(weights) if weights.model_type == "Transformer" else gpt_model(weights)
        max_step = model.config.max_position_embeddings if weights.model_type == "Transformer" else (
            model.config.n_positions)
        plan = decoding(weights, max_step)
    except FormatError as exc:
        raise unavailable(f"the {weights.model_type} model cannot be served: {exc}") from None
    _save(model, folder)
    parameters = {key: value.string_value for key, value in config.parameters.items()}
    settings = GenerationSettings(
        engine="torch", model_dir=folder, compute_type=parameters.get("compute_type") or "float32",
        intra_op_threads=0, max_batch_rows=None, max_concurrent_calls=1, kv_cache_tokens=65536,
        max_new_tokens=max_step, scheduling=None,
    )
    return settings, plan


def _save(model: Any, folder: Path) -> None:
    """The model as a Hugging Face folder, written without `save_pretrained`'s progress bar in the server log."""
    from safetensors.torch import save_model

    model.config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    save_model(model, str(folder / "model.safetensors"))
