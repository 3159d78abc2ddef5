"""`transerve convert HF_MODEL_DIR --output REPO`: a Hugging Face generation model (T5, BART, Marian, GPT-2,
Llama-style, ...) to a model repository that the generation backend serves: the generator (converted to
CTranslate2, or the folder as it is for the torch engine), the tokenizer and detokenizer, and the text ensemble
(see `repository` for what it writes). The counterpart of the seed's FasterTransformer checkpoint converter.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from transerve.convert.architectures import check_architecture, is_encoder_decoder
from transerve.convert.repository import Options, model_names, write
from transerve.core.extras import MissingExtra, import_optional
from transerve.core.interrupts import interrupts_held
from transerve.core.model_names import ModelNameError, check_tool_name
from transerve.export.hf import ExportError, read_folder
from transerve.export.progress import Progress

ENGINES = ("ctranslate2", "torch")
QUANTIZATIONS = ("int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16", "bfloat16", "float32")
TORCH_TYPES = ("float32", "float16", "bfloat16")
#: Files the tokenizer, the detokenizer, the engines and the OpenAI layer read beside the weights: the chat
#: template is `chat_template.jinja` (transformers 5), `chat_template.json`, or a key of tokenizer_config.json
#: (older folders). The torch engine's folder is copied whole; CTranslate2's converter writes its own config.json,
#: so the Hugging Face one is not copied there (the engine reads the context length from model.bin).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "generation_config.json", "chat_template.jinja", "chat_template.json",
)


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "convert", help="convert a Hugging Face generation model to a model repository", allow_abbrev=False,
        description="Convert a Hugging Face generation model folder (config.json, weights, tokenizer.json) to a "
                    "model repository: the generator (backend 'generation'), a tokenizer, a detokenizer, and an "
                    "ensemble NAME_text (or --text-name) that takes text_input and returns text_output.",
    )
    add = parser.add_argument
    add("model_dir", type=Path, metavar="HF_MODEL_DIR")
    add("--output", type=Path, required=True, metavar="REPO", help="the model repository to write into")
    add("--engine", choices=ENGINES, default="ctranslate2",
        help="ctranslate2 (converted weights, the default) or torch (transformers, the folder as it is)")
    add("--quantization", choices=QUANTIZATIONS, default="float32",
        help="weight type; ctranslate2 takes all, torch float32, float16 or bfloat16 (default float32)")
    add("--name", help="the generator's name, and the prefix of the other models' names (default: the model "
                       "type); 'fastertransformer' gives the FasterTransformer tensor names the seed client calls")
    add("--text-name", metavar="NAME",
        help="the text ensemble's name (default: NAME_text): the model a file client calls, e.g. seed 001's "
             "'transformer'")
    add("--max-batch-size", type=int, default=8, metavar="N", help="rows one request may carry (default 8)")
    add("--decoupled", action="store_true", help="a decoupled generator, which streams tokens as they are produced")
    add("--max-input-tokens", type=int, metavar="N",
        help="the tokenizer truncates longer inputs to N tokens, special tokens included, as the Hugging Face "
             "tokenizer's truncation does (default: none; a longer input than the model takes fails alone)")


def run(args: argparse.Namespace) -> int:
    try:
        convert(args.model_dir, args.output, args.engine, args.quantization, args.name, args.max_batch_size,
                args.decoupled, args.max_input_tokens, args.text_name)
    except (ExportError, OSError) as exc:  # OSError: the output cannot be written (its message names the file)
        print(f"transerve convert: {exc}", file=sys.stderr)
        return 2
    return 0


def convert(
    model_dir: Path, output: Path, engine: str = "ctranslate2", quantization: str = "float32",
    name: str | None = None, max_batch_size: int = 8, decoupled: bool = False, max_input_tokens: int | None = None,
    text_name: str | None = None,
) -> list[str]:
    """Write the repository; return the names of the models written, the text ensemble last. Every name is
    checked before anything is read or written."""
    _check_names(name, text_name)
    folder = read_folder(model_dir)
    if engine not in ENGINES:
        raise ExportError(f"unknown engine '{engine}': choose one of {', '.join(ENGINES)}")
    if quantization not in QUANTIZATIONS:
        raise ExportError(f"unknown quantization '{quantization}': choose one of {', '.join(QUANTIZATIONS)}")
    if engine == "torch" and quantization not in TORCH_TYPES:
        raise ExportError(f"the torch engine runs {', '.join(TORCH_TYPES)}; quantization '{quantization}' needs "
                          "--engine ctranslate2")
    if max_batch_size < 1:
        raise ExportError(f"--max-batch-size must be at least 1, got {max_batch_size}")
    _check_max_input_tokens(max_input_tokens, folder.config)
    name = name or str(folder.config["model_type"]).replace("-", "_")
    names = model_names(name, text_name)
    if len(set(names)) < len(names):
        raise ExportError(f"--text-name {text_name!r} is the name of another model of the conversion "
                          f"({', '.join(names[:-1])}): choose another")
    taken = [model for model in names if (output / model).exists()]
    if taken:
        raise ExportError(f"'{output / taken[0]}' already exists: choose another --output or --name")
    progress = Progress(4 if engine == "ctranslate2" else 2, subject=model_dir)
    with progress.step("loading transformers" + (" and CTranslate2's converter" if engine == "ctranslate2" else "")):
        _import_libraries(engine)
        check_architecture(folder.config, engine)
    # CTranslate2 picks the saved weights' type where the device supports it, float32 where it does not (CPUs
    # have no float16): one repository serves on CPU and GPU instances alike.
    options = Options(name, engine, "default" if engine == "ctranslate2" else quantization, max_batch_size,
                      decoupled, decoder_only=not is_encoder_decoder(folder.config), max_input_tokens=max_input_tokens,
                      text_name=names[-1])
    created = not output.exists()
    output.mkdir(parents=True, exist_ok=True)
    try:
        target = write(output, folder.tokenizer_file, options)
        if engine == "ctranslate2":
            _convert_ctranslate2(model_dir, target, quantization, progress)
        else:
            with progress.step(f"copying the model from {model_dir}"):
                shutil.copytree(model_dir, target)
        for file in TOKENIZER_FILES:
            if (model_dir / file).is_file():
                shutil.copyfile(model_dir / file, target / file)
    except BaseException:
        for model in names:
            shutil.rmtree(output / model, ignore_errors=True)
        if created and not any(output.iterdir()):
            output.rmdir()
        raise
    progress.note(f"wrote {', '.join(names)} to {output}; serve with: transerve serve --model-repository {output}")
    return names


def _check_names(name: str | None, text_name: str | None) -> None:
    """The names given, as model names any client can call (core.model_names); the model type a default name
    comes from is one already."""
    try:
        for option, value in (("--name", name), ("--text-name", text_name)):
            if value is not None:
                check_tool_name(value, option)
    except ModelNameError as exc:
        raise ExportError(str(exc)) from None


def _import_libraries(engine: str) -> None:
    """What the engine's conversion needs, or one line naming the extra that brings it; a Ctrl-C meanwhile is
    raised once they are loaded (core.interrupts)."""
    with interrupts_held():
        for module in ("ctranslate2" if engine == "ctranslate2" else "torch", "transformers", "tokenizers"):
            try:
                import_optional(module, "generation")
            except MissingExtra as exc:
                raise ExportError(str(exc)) from None


def _check_max_input_tokens(max_input_tokens: int | None, config: dict) -> None:
    """At least 1, and no more than the model's position table (where it has one): the generator refuses longer
    inputs whatever the tokenizer lets through."""
    if max_input_tokens is None:
        return
    if max_input_tokens < 1:
        raise ExportError(f"--max-input-tokens must be at least 1, got {max_input_tokens}")
    positions = next((config[key] for key in ("max_position_embeddings", "n_positions")
                      if isinstance(config.get(key), int) and config[key] > 0), None)
    if positions is not None and max_input_tokens > positions:
        raise ExportError(f"--max-input-tokens {max_input_tokens} is more than the {positions} positions this model "
                          "has")


def _convert_ctranslate2(model_dir: Path, target: Path, quantization: str, progress: Progress) -> None:
    """Converter.convert's stages (ctranslate2 4.8), each shown as it runs."""
    from ctranslate2.converters import TransformersConverter
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # ours shows the stage; theirs would break its line
    converter = TransformersConverter(str(model_dir))
    with progress.step(f"loading the model from {model_dir}"):
        spec = converter._load()
    with progress.step(f"converting to CTranslate2 ({quantization})"):
        spec.validate()
        spec.optimize(quantization=quantization)
    with progress.step("writing the CTranslate2 model"):
        target.mkdir()
        spec.save(str(target))
