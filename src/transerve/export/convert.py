"""The transformers model as a file an engine serves: ONNX through `torch.onnx.export` (the TorchScript-based
exporter, arguments by name), or TorchScript through `torch.jit.trace`; then checked against transformers.

Both formats get the same tensor names: the tokenizer's outputs in, the task's outputs (`last_hidden_state`,
`logits`, `start_logits`/`end_logits`) out, with the batch and sequence axes dynamic.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from transerve.core.extras import MissingExtra, import_optional
from transerve.export.hf import ExportError, ModelFolder

#: Text that exercises padding (lengths differ) when tracing, and other lengths when checking.
TRACE_TEXTS = ["a short sentence", "a somewhat longer sentence, with punctuation, to pad the other one"]
CHECK_TEXTS = ["one", "a third length of text again", "and a fourth, the longest of these three texts by far, "
               "so that the check runs at a length the trace never saw"]
QUESTION = "what is checked?"
#: How far the exported model may stray from transformers: float32 reassociation, far below what matters.
TOLERANCE = 1e-3


@dataclass(frozen=True, slots=True)
class Task:
    name: str
    #: The transformers Auto class that loads the model for this task.
    auto_class: str
    #: What the exported model returns, in order.
    outputs: tuple[str, ...]
    #: What a checkpoint must be fine-tuned for to have the task's head.
    description: str


TASKS = {
    "encode": Task("encode", "AutoModel", ("last_hidden_state",), "feature extraction"),
    "embedding": Task("embedding", "AutoModel", ("last_hidden_state",), "sentence embeddings"),
    "seqcls": Task("seqcls", "AutoModelForSequenceClassification", ("logits",), "sequence classification"),
    "qa": Task("qa", "AutoModelForQuestionAnswering", ("start_logits", "end_logits"), "question answering"),
}


def import_libraries(fmt: str) -> None:
    """Import what the export needs (seconds, for torch), or say in one line what to install."""
    for module in ("torch", "transformers", "tokenizers") + (("onnxruntime",) if fmt == "onnx" else ()):
        try:
            import_optional(module, "export")
        except MissingExtra as exc:
            raise ExportError(str(exc)) from None


def load_model(folder: ModelFolder, task: Task, allow_random_head: bool = False) -> tuple[Any, list[str]]:
    """The transformers model in eval mode, wrapped to take the tokenizer's tensors by name and return the
    task's outputs as a tuple, and the names of the inputs it takes. A checkpoint without weights for the
    task's head (a base BERT exported as seqcls) is refused unless `allow_random_head`: transformers would fill
    the head with random numbers, and the export would serve noise."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import inspect

    import torch
    import transformers

    transformers.logging.set_verbosity_error()  # the progress shown is ours
    transformers.logging.disable_progress_bar()
    auto = getattr(transformers, task.auto_class)
    try:
        model, report = auto.from_pretrained(str(folder.path), local_files_only=True, output_loading_info=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ExportError(f"transformers cannot load '{folder.path}' as {task.auto_class}: "
                          f"{' '.join(str(exc).split())[:300]}") from None
    random = random_weights(task, report)
    if random and not allow_random_head:
        shown = ", ".join(random[:4]) + (f" and {len(random) - 4} more" if len(random) > 4 else "")
        raise ExportError(f"'{folder.path}' has no weights for the {task.name} head ({shown} would be random): "
                          f"export a checkpoint fine-tuned for {task.description}, or pass --allow-random-head")
    model = model.eval().float()
    takes_types = "token_type_ids" in inspect.signature(model.forward).parameters

    class Outputs(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def pick(self, result: Any) -> tuple[Any, ...]:
            return tuple(getattr(result, name) for name in task.outputs)

    class WithTypes(Outputs):
        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> tuple[Any, ...]:
            return self.pick(self.model(input_ids=input_ids, attention_mask=attention_mask,
                                        token_type_ids=token_type_ids, return_dict=True))

    class WithoutTypes(Outputs):
        def forward(self, input_ids: Any, attention_mask: Any) -> tuple[Any, ...]:
            return self.pick(self.model(input_ids=input_ids, attention_mask=attention_mask, return_dict=True))

    names = ["input_ids", "attention_mask"] + (["token_type_ids"] if takes_types else [])
    return (WithTypes() if takes_types else WithoutTypes()).eval(), names


def random_weights(task: Task, report: dict[str, Any]) -> list[str]:
    """The weights transformers' load report says it initialized at random (missing from the checkpoint, or of
    another shape) that the task's outputs depend on; the pooler is not used for token states."""
    keys = sorted({*report.get("missing_keys", ()), *(str(key[0] if isinstance(key, tuple) else key)
                                                      for key in report.get("mismatched_keys", ()))})
    if task.auto_class == "AutoModel":
        keys = [key for key in keys if "pooler" not in key.split(".")]
    return keys


def tokenize(folder: ModelFolder, task: Task, texts: list[str], names: list[str]) -> dict[str, np.ndarray]:
    """The tokenizer model's outputs for `texts` (QA: each text as the context of one question)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder.tokenizer_file))
    tokenizer.no_padding()
    tokenizer.enable_truncation(folder.max_length, strategy="only_second" if task.name == "qa" else "longest_first")
    encodings = tokenizer.encode_batch([(QUESTION, text) for text in texts] if task.name == "qa" else texts)
    length = max(len(encoding.ids) for encoding in encodings)
    arrays = {name: np.zeros((len(encodings), length), dtype=np.int64) for name in names}
    arrays["input_ids"][:] = folder.pad_id
    for row, encoding in enumerate(encodings):
        size = len(encoding.ids)
        arrays["input_ids"][row, :size] = encoding.ids
        arrays["attention_mask"][row, :size] = encoding.attention_mask
        if "token_type_ids" in arrays:
            arrays["token_type_ids"][row, :size] = encoding.type_ids
    return arrays


def export(module: Any, names: list[str], task: Task, example: dict[str, np.ndarray], fmt: str, path: Path) -> None:
    """Write `module` as `path` (model.onnx or model.pt)."""
    import torch

    args = tuple(torch.from_numpy(example[name]) for name in names)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # tracer warnings about Python control flow the graph freezes
        if fmt == "onnx":
            axes = {name: {0: "batch", 1: "sequence"} for name in [*names, *task.outputs]}
            if task.name == "seqcls":
                axes["logits"] = {0: "batch"}
            torch.onnx.export(module, args, str(path), input_names=names, output_names=list(task.outputs),
                              dynamic_axes=axes, opset_version=17, dynamo=False)
        else:
            torch.jit.trace(module, args, check_trace=False).save(str(path))


def check(module: Any, names: list[str], inputs: dict[str, np.ndarray], fmt: str, path: Path) -> float:
    """The largest difference between the exported file's outputs and transformers' on `inputs`, relative to
    the outputs' scale; ExportError beyond TOLERANCE."""
    import torch

    with torch.no_grad():
        expected = [t.numpy() for t in module(*(torch.from_numpy(inputs[name]) for name in names))]
    if fmt == "onnx":
        import onnxruntime

        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        got = session.run(None, {name: inputs[name] for name in names})
    else:
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            loaded = torch.jit.load(str(path))
            got = [t.numpy() for t in loaded(*(torch.from_numpy(inputs[name]) for name in names))]
    worst = 0.0
    for want, have in zip(expected, got, strict=True):
        if want.shape != have.shape:
            raise ExportError(f"the exported model gives shape {list(have.shape)} where transformers gives "
                              f"{list(want.shape)}")
        worst = max(worst, float(np.abs(want - have).max() / max(1.0, float(np.abs(want).max()))))
    if worst > TOLERANCE:
        raise ExportError(f"the exported model differs from transformers by {worst:.2e} (more than {TOLERANCE})")
    return worst
