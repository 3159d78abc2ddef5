"""`transerve export HF_MODEL_DIR --task ... --format ... --output REPO`: a Hugging Face model folder to a
model repository that serves text in and the task's outputs out (see `repository` for what it writes)."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from transerve.core.interrupts import interrupts_held
from transerve.core.model_names import ModelNameError, check_tool_name
from transerve.export import convert
from transerve.export.hf import ExportError, read_folder
from transerve.export.names import parse, parse_tokenizer_inputs, step_names
from transerve.export.progress import Progress
from transerve.export.repository import Options, model_names, write

TASKS = ("seqcls", "qa", "encode", "embedding")


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "export", help="export a Hugging Face model folder to a model repository", allow_abbrev=False,
        description="Export a Hugging Face model folder (config.json, weights, tokenizer.json) to a model repository: "
                    "a tokenizer, the model as ONNX or TorchScript, the task's post-processing, and an ensemble "
                    "that takes text and returns the task's outputs.",
    )
    add = parser.add_argument
    add("model_dir", type=Path, metavar="HF_MODEL_DIR")
    add("--task", choices=TASKS, required=True,
        help="seqcls: label and probabilities; qa: answer span; encode: token states; embedding: sentence vectors")
    add("--format", dest="fmt", choices=("onnx", "torchscript"), required=True)
    add("--output", type=Path, required=True, metavar="REPO", help="the model repository to write into")
    add("--name", help="the ensemble's name, and the prefix of its models' names (default: the task)")
    add("--max-batch-size", type=int, default=8, metavar="N")
    add("--dynamic-batching", action="store_true", help="let every model batch concurrent requests")
    add("--bucketed", action="store_true",
        help="dynamic batching of the model by token count (transerve's length buckets): less padding")
    add("--model-instances", type=int, default=0, metavar="N",
        help="ONNX only: N instances of the exported model with one onnxruntime thread each, instead of one "
             "instance with onnxruntime's default threads (less thread hand-off per batch on small CPUs)")
    add("--input-name", action="append", default=[], metavar="OLD=NEW",
        help="call the ensemble's input OLD (input_text; qa: question, context) NEW instead, e.g. input_text=TEXT; "
             "repeatable")
    add("--output-name", action="append", default=[], metavar="OLD=NEW",
        help="call the ensemble's output OLD NEW instead, e.g. logits=LOGITS, last_hidden_state=HIDDEN_STATE, "
             "start_logits=START_LOGITS; repeatable")
    add("--step-names", metavar="TOKENIZER,MODEL[,POSTPROCESS]",
        help="the step models' names instead of NAME_tokenizer, NAME_model, NAME_postprocess, e.g. tokenizer,model "
             "as the seed tutorial's repository has them")
    add("--tokenizer-input-name", action="append", default=[], metavar="OLD=NEW",
        help="call the tokenizer model's input OLD (TEXT; qa: QUESTION, CONTEXT) NEW instead, e.g. TEXT=text; "
             "repeatable")
    add("--allow-random-head", action="store_true",
        help="export a checkpoint that has no weights for the task's head (a base model as seqcls or qa): "
             "transformers initializes the head at random")


def run(args: argparse.Namespace) -> int:
    try:
        export(args.model_dir, args.task, args.fmt, args.output, args.name or args.task, args.max_batch_size,
               args.dynamic_batching, args.bucketed, input_names=args.input_name, output_names=args.output_name,
               allow_random_head=args.allow_random_head, steps=args.step_names,
               tokenizer_inputs=args.tokenizer_input_name, model_instances=args.model_instances)
    except (ExportError, OSError) as exc:  # OSError: the output cannot be written (its message names the file)
        print(f"transerve export: {exc}", file=sys.stderr)
        return 2
    return 0


def export(
    model_dir: Path, task_name: str, fmt: str, output: Path, name: str, max_batch_size: int = 8,
    dynamic_batching: bool = False, bucketed: bool = False, input_names: list[str] | None = None,
    output_names: list[str] | None = None, allow_random_head: bool = False, steps: str | None = None,
    tokenizer_inputs: list[str] | None = None, model_instances: int = 0,
) -> list[str]:
    """Write the repository; return the names of the models written, the ensemble last. `input_names`,
    `output_names` and `tokenizer_inputs` are `--input-name`/`--output-name`/`--tokenizer-input-name` values,
    OLD=NEW; `steps` is `--step-names`; `model_instances` is `--model-instances` (0: one instance)."""
    try:
        check_tool_name(name, "--name")
    except ModelNameError as exc:
        raise ExportError(str(exc)) from None
    folder = read_folder(model_dir)
    if max_batch_size < 1:
        raise ExportError(f"--max-batch-size must be at least 1, got {max_batch_size}")
    if model_instances < 0 or (model_instances and fmt != "onnx"):
        raise ExportError(f"--model-instances takes a count of at least 1, for --format onnx only, got "
                          f"{model_instances} with --format {fmt}")
    task = convert.TASKS[task_name]
    renamed = parse(task_name, input_names or [], output_names or [])
    tokenizer_renamed = parse_tokenizer_inputs(task_name, tokenizer_inputs or [])
    step_models = step_names(name, task_name, steps)
    names = model_names(name, task, step_models)
    taken = [model for model in names if (output / model).exists()]
    if taken:
        raise ExportError(f"'{output / taken[0]}' already exists: choose another --output or --name")
    progress = Progress(4, subject=model_dir)
    with progress.step("loading torch and transformers"), interrupts_held():
        convert.import_libraries(fmt)
    with progress.step(f"loading the model from {model_dir}"):
        module, inputs = convert.load_model(folder, task, allow_random_head)
    options = Options(name, fmt, max_batch_size, dynamic_batching, bucketed, renamed, step_models, tokenizer_renamed,
                      model_instances)
    output.mkdir(parents=True, exist_ok=True)
    try:
        target = write(output, folder, task, inputs, options)
        with progress.step(f"exporting to {'ONNX' if fmt == 'onnx' else 'TorchScript'}"):
            example = convert.tokenize(folder, task, convert.TRACE_TEXTS, inputs)
            convert.export(module, inputs, task, example, fmt, target)
        with progress.step("checking the exported model against transformers"):
            checked = convert.tokenize(folder, task, convert.CHECK_TEXTS, inputs)
            difference = convert.check(module, inputs, checked, fmt, target)
    except BaseException:
        for model in names:
            shutil.rmtree(output / model, ignore_errors=True)
        raise
    progress.note(f"largest difference {difference:.1e} (relative to the outputs' scale)")
    progress.note(f"wrote {', '.join(names)} to {output}; serve with: transerve serve --model-repository {output}")
    return names
