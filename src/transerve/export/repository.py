"""The model repository `transerve export` writes: configs built as Triton's ModelConfig, python models copied.

For a name N (the task's name unless `--name` says otherwise):

- `N_tokenizer` (python): `TEXT` (QA: `QUESTION`, `CONTEXT`) in, or the names `--tokenizer-input-name` gives
  them, the model's token tensors out;
- `N_model` (onnxruntime or pytorch): token tensors in, the task's raw outputs out;
- `N_postprocess` (python, not for `encode`): pooling, softmax and labels, or answer spans;
- `N` (ensemble): what clients call, text in and the task's outputs out: the post-processing's and the model's
  raw ones (`logits`; `start_logits`, `end_logits`), under the names `--input-name`/`--output-name` give them.

`--step-names` names the three step models otherwise (the seed tutorial's repository: `tokenizer`, `model`).

For `seqcls`, `probabilities` names a `labels.txt` (`label_filename`, in the post-processing's and the ensemble's
folders), so that a client asking for `class_count` k gets the k likeliest classes by name (Triton's
classification extension).

With `--dynamic-batching` every model batches requests; with `--bucketed` the exported model batches only
requests of similar token counts (transerve's length buckets, see docs/batching.md), padded by the backend.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from transerve.export.convert import Task
from transerve.export.hf import ModelFolder
from transerve.export.names import OUTPUTS

ModelConfig = model_config_pb2.ModelConfig

#: The class names of a `seqcls` export's `probabilities`, one per line.
LABEL_FILE = "labels.txt"

#: Bucket bounds in tokens (each ~1.5x the last), cut at the model's max_length.
BUCKET_BOUNDARIES = (8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


@dataclass(frozen=True, slots=True)
class Options:
    name: str
    fmt: str
    max_batch_size: int
    dynamic_batching: bool
    bucketed: bool
    #: The ensemble's tensors renamed: default name -> the name clients call (`names.parse`).
    renamed: dict[str, str] = field(default_factory=dict)
    #: Step -> model name where `--step-names` gave one (`names.step_names`); `N_<step>` otherwise.
    steps: dict[str, str] = field(default_factory=dict)
    #: The tokenizer model's inputs renamed: TEXT (QUESTION, CONTEXT) -> its own name (`names.parse_tokenizer_inputs`).
    tokenizer_inputs: dict[str, str] = field(default_factory=dict)
    #: `--model-instances`: ONNX instances of one intra-op thread each; 0 for one with onnxruntime's default.
    model_instances: int = 0

    def step(self, step: str) -> str:
        return self.steps.get(step, f"{self.name}_{step}")


def model_names(name: str, task: Task, steps: dict[str, str] | None = None) -> list[str]:
    """The folders an export writes, the ensemble last; `steps` as `names.step_names` gives them."""
    kinds = ["tokenizer", "model"] + (["postprocess"] if task.name != "encode" else [])
    return [(steps or {}).get(step, f"{name}_{step}") for step in kinds] + [name]


def write(repository: Path, folder: ModelFolder, task: Task, inputs: list[str], options: Options) -> Path:
    """Write every model but the engine's file, which the caller puts at the returned path."""
    name = options.name
    tokenizer = _tokenizer(options.step("tokenizer"), folder, task, inputs, options)
    _write_python(repository, tokenizer, "tokenizer.py", extra={"tokenizer.json": folder.tokenizer_file})
    model = _model(options.step("model"), folder, task, inputs, options)
    _write_config(repository, model)
    postprocess = _postprocess(options.step("postprocess"), folder, task, options)
    if postprocess is not None:
        _write_python(repository, postprocess, f"{task.name}.py")
    _write_config(repository, _ensemble(name, tokenizer, model, postprocess, task, options, folder.max_length))
    if task.name == "seqcls":
        labels = "".join(" ".join(label.split()) + "\n" for label in folder.labels)
        for model_name in (postprocess.name, name):
            (repository / model_name / LABEL_FILE).write_text(labels, encoding="utf-8")
    filename = "model.onnx" if options.fmt == "onnx" else "model.pt"
    return repository / model.name / "1" / filename


def _tokenizer(name: str, folder: ModelFolder, task: Task, inputs: list[str], options: Options) -> ModelConfig:
    config = _base(name, options, backend="python")
    texts = ["QUESTION", "CONTEXT"] if task.name == "qa" else ["TEXT"]
    for text in texts:  # the tokenizer model reads them in this order, whatever their names
        _tensor(config.input, options.tokenizer_inputs.get(text, text), "TYPE_STRING", [1])
    if task.name == "qa":
        config.input[0].optional = True  # without a question, the context is tokenized alone
    for tensor in inputs:
        _tensor(config.output, tensor, "TYPE_INT64", [-1])
    if task.name == "qa":
        _tensor(config.output, "offsets", "TYPE_INT64", [-1, 2])
    _parameters(config, max_length=folder.max_length, pad_id=folder.pad_id, pair="true" if task.name == "qa" else "")
    return config


def _model(name: str, folder: ModelFolder, task: Task, inputs: list[str], options: Options) -> ModelConfig:
    platform = "onnxruntime_onnx" if options.fmt == "onnx" else "pytorch_libtorch"
    config = _base(name, options, platform=platform)
    for tensor in inputs:
        _tensor(config.input, tensor, "TYPE_INT64", [-1])
    hidden, labels = folder.hidden_size, len(folder.labels)
    dims = {"last_hidden_state": [-1, hidden], "logits": [labels], "start_logits": [-1], "end_logits": [-1]}
    for output in task.outputs:
        _tensor(config.output, output, "TYPE_FP32", dims[output])
    if options.fmt == "onnx":
        # onnxruntime's idle threads spin between operators, taking the CPU the tokenizer, the post-processing
        # and the server need (benchmarks/README.md, "Figures behind the code").
        _parameters(config, **{"session.intra_op.allow_spinning": "0"})
        if options.model_instances:
            # One-thread sessions side by side skip the thread pool's wake-ups within each batch
            # (benchmarks/README.md, embedding_onnx against the ONNX model called directly).
            config.instance_group.add(count=options.model_instances, kind=model_config_pb2.ModelInstanceGroup.KIND_CPU)
            _parameters(config, intra_op_thread_count=1)
    if options.fmt == "torchscript":
        # TorchScript's profiling executor re-specializes for each new sequence length, which makes requests of
        # varying lengths slower (benchmarks/README.md, "Figures behind the code").
        _parameters(config, DISABLE_OPTIMIZED_EXECUTION="true")
    if options.bucketed:
        bounds = [b for b in BUCKET_BOUNDARIES if b < folder.max_length] + [folder.max_length]
        _parameters(config, batching_strategy="bucketed", bucket_input="input_ids",
                    bucket_boundaries=",".join(str(b) for b in bounds))
    return config


def _postprocess(name: str, folder: ModelFolder, task: Task, options: Options) -> ModelConfig | None:
    if task.name == "encode":
        return None
    config = _base(name, options, backend="python")
    if task.name == "embedding":
        _tensor(config.input, "last_hidden_state", "TYPE_FP32", [-1, folder.hidden_size])
        _tensor(config.input, "attention_mask", "TYPE_INT64", [-1])
        _tensor(config.output, "embedding", "TYPE_FP32", [folder.hidden_size])
        _parameters(config, pooling=folder.pooling, normalize="true" if folder.normalize else "false")
    elif task.name == "seqcls":
        labels = folder.labels
        _tensor(config.input, "logits", "TYPE_FP32", [len(labels)])
        _tensor(config.output, "label", "TYPE_STRING", [1])
        _tensor(config.output, "score", "TYPE_FP32", [1])
        _tensor(config.output, "probabilities", "TYPE_FP32", [len(labels)])
        config.output[-1].label_filename = LABEL_FILE
        _parameters(config, labels=json.dumps(labels))
    else:
        for logits in ("start_logits", "end_logits"):
            _tensor(config.input, logits, "TYPE_FP32", [-1])
        _tensor(config.input, "offsets", "TYPE_INT64", [-1, 2])
        _tensor(config.input, "context", "TYPE_STRING", [1])
        _tensor(config.output, "answer", "TYPE_STRING", [1])
        _tensor(config.output, "score", "TYPE_FP32", [1])
        _tensor(config.output, "start", "TYPE_INT64", [1])
        _tensor(config.output, "end", "TYPE_INT64", [1])
        _parameters(config, max_answer_length=30)
    return config


def _ensemble(
    name: str, tokenizer: ModelConfig, model: ModelConfig, postprocess: ModelConfig | None, task: Task,
    options: Options, max_length: int,
) -> ModelConfig:
    """Tensors are named as the models name them, but for the text inputs, and then as `options.renamed` says."""
    config = ModelConfig(name=name, platform="ensemble", max_batch_size=options.max_batch_size)
    defaults = {"QUESTION": "question", "CONTEXT": "context"} if task.name == "qa" else {"TEXT": "input_text"}
    texts = {options.tokenizer_inputs.get(text, text): tensor for text, tensor in defaults.items()}
    steps = config.ensemble_scheduling.step
    _step(steps.add(), tokenizer, texts)
    _step(steps.add(), model, {})
    if postprocess is not None:
        _step(steps.add(), postprocess, {})
    new = options.renamed
    for text in texts.values():
        _tensor(config.input, new.get(text, text), "TYPE_STRING", [1])
    if task.name == "qa":
        config.input[0].optional = True  # a client may send the context alone (the tokenizer says how)
    if task.name == "embedding":  # what the OpenAI layer serves as /v1/embeddings
        _parameters(config, openai_api="embeddings", openai_text_input=new.get("input_text", "input_text"),
                    openai_embedding_output=new.get("embedding", "embedding"), openai_context_length=max_length)
    produced = {t.name: t for t in [*tokenizer.output, *model.output, *(postprocess.output if postprocess else [])]}
    for output in OUTPUTS[task.name]:
        tensor = config.output.add()
        tensor.CopyFrom(produced[output])
        tensor.name = new.get(output, output)
    for step in steps:
        for key, tensor in [*step.input_map.items()]:
            step.input_map[key] = new.get(tensor, tensor)
        for key, tensor in [*step.output_map.items()]:
            step.output_map[key] = new.get(tensor, tensor)
    return config


def _step(step: model_config_pb2.ModelEnsembling.Step, model: ModelConfig, texts: dict[str, str]) -> None:
    step.model_name = model.name
    step.model_version = -1
    for tensor in model.input:
        step.input_map[tensor.name] = texts.get(tensor.name, tensor.name)
    for tensor in model.output:
        step.output_map[tensor.name] = tensor.name


def _base(name: str, options: Options, backend: str = "", platform: str = "") -> ModelConfig:
    config = ModelConfig(name=name, backend=backend, platform=platform, max_batch_size=options.max_batch_size)
    if options.dynamic_batching or options.bucketed:
        config.dynamic_batching.SetInParent()
    if backend == "python":
        config.instance_group.add(count=1, kind=model_config_pb2.ModelInstanceGroup.KIND_CPU)
    return config


def _tensor(tensors: Any, name: str, data_type: str, dims: list[int]) -> None:
    tensors.add(name=name, data_type=model_config_pb2.DataType.Value(data_type), dims=dims)


def _parameters(config: ModelConfig, **values: object) -> None:
    for key, value in values.items():
        if value != "":
            config.parameters[key].string_value = str(value)


def _write_config(repository: Path, config: ModelConfig) -> None:
    (repository / config.name / "1").mkdir(parents=True)
    text = text_format.MessageToString(config, use_short_repeated_primitives=True)
    (repository / config.name / "config.pbtxt").write_text(text)


def _write_python(repository: Path, config: ModelConfig, template: str, extra: dict[str, Path] | None = None) -> None:
    _write_config(repository, config)
    version = repository / config.name / "1"
    (version / "model.py").write_text(resources.files("transerve.export.models").joinpath(template).read_text())
    for target, source in (extra or {}).items():
        shutil.copyfile(source, version / target)
