"""The exported ensemble's tensor names: its defaults per task, and `--input-name`/`--output-name OLD=NEW`, which
give a client the names it already calls (the seed tutorial's `TEXT`, `LOGITS`, `HIDDEN_STATE`, ...); the step
models' names (`--step-names`) and the tokenizer model's own inputs (`--tokenizer-input-name`), which give the
steps the names of the tutorial's repository (`tokenizer` taking `text`, `model`).

A new name must be one Triton takes for an ensemble tensor and that any client can spell: letters, digits, `_`,
`.` and `-` (no `:` or `,`, which perf_analyzer's `--shape NAME:dims` and tritonclient's lists split on), not
starting with a digit, and no name of another of the ensemble's tensors (Triton refuses an ensemble where two
tensors share a name).
"""

from __future__ import annotations

import re

from transerve.core.model_names import ModelNameError, check_tool_name
from transerve.export.hf import ExportError

#: The ensemble's inputs and outputs under their default names, per task.
INPUTS = {"seqcls": ("input_text",), "qa": ("question", "context"), "encode": ("input_text",),
          "embedding": ("input_text",)}
OUTPUTS = {
    "seqcls": ("label", "score", "probabilities", "logits"),
    "qa": ("answer", "score", "start", "end", "start_logits", "end_logits"),
    "encode": ("last_hidden_state", "attention_mask"),
    "embedding": ("embedding",),
}

#: The tensors between the ensemble's steps (a model without token_type_ids has one fewer: checking against all is
#: stricter, and possible before the model is loaded).
BETWEEN_STEPS = ("input_ids", "attention_mask", "token_type_ids", "offsets", "last_hidden_state", "logits",
                 "start_logits", "end_logits")

_VALID = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]{0,127}")

#: The tokenizer model's text inputs under their default names, per task.
TOKENIZER_INPUTS = {"seqcls": ("TEXT",), "qa": ("QUESTION", "CONTEXT"), "encode": ("TEXT",), "embedding": ("TEXT",)}
#: The steps of an export, in order (`encode` has no post-processing).
STEPS = ("tokenizer", "model", "postprocess")


def parse(task: str, inputs: list[str], outputs: list[str]) -> dict[str, str]:
    """Default name -> the name the ensemble uses instead, from `--input-name` and `--output-name` values."""
    renamed: dict[str, str] = {}
    for flag, specs, choices in (("--input-name", inputs, INPUTS[task]), ("--output-name", outputs, OUTPUTS[task])):
        for spec in specs:
            _rename(renamed, flag, spec, choices, f"{task} ensemble", flag[2:-5], choices[0].upper())
    _check_unique(renamed, {*INPUTS[task], *OUTPUTS[task], *BETWEEN_STEPS})
    return renamed


def _rename(renamed: dict[str, str], flag: str, spec: str, choices: tuple[str, ...], owner: str, kind: str,
            example: str) -> None:
    """One `OLD=NEW` of `flag` into `renamed`: OLD one of `choices` (the `owner`'s `kind`s), NEW a tensor name."""
    old, equals, new = spec.partition("=")
    if not equals:
        raise ExportError(f"{flag} '{spec}': expected OLD=NEW, e.g. {choices[0]}={example}")
    if old not in choices:
        raise ExportError(f"{flag} '{spec}': the {owner} has no {kind} '{old}' (its {kind}s: {', '.join(choices)})")
    if old in renamed:
        raise ExportError(f"{flag} '{spec}': '{old}' is renamed twice")
    if not _VALID.fullmatch(new):
        raise ExportError(f"{flag} '{spec}': '{new}' is not a tensor name: use 1-128 letters, digits, '_', '.' or "
                          "'-', not starting with a digit")
    renamed[old] = new


def _check_unique(renamed: dict[str, str], tensors: set[str]) -> None:
    """Refuse a new name that another of the ensemble's tensors (`tensors`, by default name) ends up with too."""
    owners: dict[str, str] = {}
    for tensor in sorted(tensors, key=lambda name: (name not in renamed, name)):  # renamed first: the culprits
        name = renamed.get(tensor, tensor)
        if name in owners:
            culprit, other = (tensor, owners[name]) if tensor in renamed else (owners[name], tensor)
            raise ExportError(f"'{culprit}={name}': the ensemble's tensor '{other}' is named '{name}' already "
                              "(Triton refuses an ensemble with two tensors of one name)")
        owners[name] = tensor


def parse_tokenizer_inputs(task: str, specs: list[str]) -> dict[str, str]:
    """`--tokenizer-input-name OLD=NEW` values: default tokenizer input name -> the tokenizer model's own name for
    it (the tutorial's tokenizer takes `text`: TEXT=text). Only the tokenizer model changes: the ensemble maps
    its own input onto it."""
    choices = TOKENIZER_INPUTS[task]
    renamed: dict[str, str] = {}
    for spec in specs:
        _rename(renamed, "--tokenizer-input-name", spec, choices, f"{task} tokenizer", "input", choices[0].lower())
    final = [renamed.get(name, name) for name in choices]
    if len(set(final)) < len(final):
        raise ExportError(f"--tokenizer-input-name: the tokenizer's inputs would share a name ({', '.join(final)})")
    return renamed


def step_names(name: str, task: str, spec: str | None) -> dict[str, str]:
    """Step -> model name: `NAME_tokenizer`, `NAME_model`, `NAME_postprocess` unless `--step-names
    TOKENIZER,MODEL[,POSTPROCESS]` names them (the tutorial's repository: tokenizer,model)."""
    steps = STEPS[:2] if task == "encode" else STEPS
    names = {step: f"{name}_{step}" for step in steps}
    if spec is None:
        return names
    given = spec.split(",")
    if not 2 <= len(given) <= len(steps):
        shown = "TOKENIZER,MODEL" + ("" if task == "encode" else "[,POSTPROCESS]")
        raise ExportError(f"--step-names '{spec}': expected {shown}, e.g. tokenizer,model")
    for step, model in zip(steps, given, strict=False):
        try:
            check_tool_name(model, "--step-names")
        except ModelNameError as exc:
            raise ExportError(str(exc)) from None
        names[step] = model
    everything = [*names.values(), name]
    if len(set(everything)) < len(everything):
        raise ExportError(f"--step-names '{spec}': the ensemble '{name}' and its steps need a name each "
                          f"({', '.join(everything)})")
    return names
