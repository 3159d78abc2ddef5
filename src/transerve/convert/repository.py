"""The model repository `transerve convert` writes, configs built as Triton's ModelConfig.

For a name N:

- `N` (backend "generation"): the generator, speaking FasterTransformer's tensors (`input_ids`, `sequence_length`,
  the optional decoding tensors -> `output_ids`, `sequence_length`, log-probabilities, `prefix_length`, the top
  log-probabilities `output_top_ids` and `output_top_log_probs`, and for decoder-only models the prompt's scores
  `prompt_log_probs`, `prompt_top_ids`, `prompt_top_log_probs` and `prompt_ranks`), or, named
  `fastertransformer`, the first FasterTransformer names the seed client calls (`INPUT_ID`, `REQUEST_INPUT_LEN`,
  `REQUEST_OUTPUT_LEN` -> `OUTPUT0`, `OUTPUT1`). Its version folder holds the model in `model/`;
- `N_tokenizer` and `N_detokenizer` (python): text to token ids and back, from the model's tokenizer.json; with
  `--max-input-tokens`, the tokenizer's `max_input_tokens` parameter has it truncate longer inputs;
- `N_text` (ensemble), or the name `--text-name` gives it (seed 001's client calls `transformer`): `text_input`
  in, `text_output` out (what /generate serves). Decoding options travel as
  request parameters, which the ensemble hands to the generator: /generate turns a body's other keys
  (`"max_tokens": 32`, `"beam_width": 4`, ...) into parameters, tritonclient sends `parameters={...}`. They are not
  optional ensemble inputs because transerve's ensembles do not yet run a step whose optional input was left out.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from tritonclient.grpc import model_config_pb2

from transerve.export.repository import _parameters, _tensor, _write_config

ModelConfig = model_config_pb2.ModelConfig

#: The name that selects FasterTransformer's first tensor names (the seed's generator model is named so).
FASTERTRANSFORMER_NAME = "fastertransformer"
MODEL_DIR = "model"

#: The later FasterTransformer names' optional decoding inputs: name, type, dims.
DECODING_INPUTS = (
    ("max_output_len", "TYPE_UINT32", [1]),
    ("beam_width", "TYPE_UINT32", [1]),
    ("runtime_top_k", "TYPE_UINT32", [1]),
    ("runtime_top_p", "TYPE_FP32", [1]),
    ("temperature", "TYPE_FP32", [1]),
    ("len_penalty", "TYPE_FP32", [1]),
    ("repetition_penalty", "TYPE_FP32", [1]),
    ("random_seed", "TYPE_UINT64", [1]),
    ("min_length", "TYPE_UINT32", [1]),
    ("end_id", "TYPE_UINT32", [1]),
    ("bad_words_list", "TYPE_INT32", [2, -1]),
    ("stop_words_list", "TYPE_INT32", [2, -1]),
    ("return_log_probs", "TYPE_BOOL", [1]),
    ("stream", "TYPE_BOOL", [1]),
)
@dataclass(frozen=True, slots=True)
class Options:
    name: str
    engine: str
    #: The config's compute_type parameter.
    compute_type: str
    max_batch_size: int
    decoupled: bool
    #: Decoder-only models' output ids start with the prompt.
    decoder_only: bool
    #: The tokenizer truncates longer inputs to this many tokens (None: it never truncates).
    max_input_tokens: int | None = None
    #: The text ensemble's name (None: `N_text`).
    text_name: str | None = None

    @property
    def first_names(self) -> bool:
        return self.name == FASTERTRANSFORMER_NAME


def model_names(name: str, text_name: str | None = None) -> list[str]:
    """The folders a conversion writes, the text ensemble last."""
    return [name, f"{name}_tokenizer", f"{name}_detokenizer", text_name or f"{name}_text"]


def write(repository: Path, tokenizer_file: Path, options: Options) -> Path:
    """Write every config and the python models; return the folder the caller puts the model in."""
    generator = generator_config(options)
    _write_config(repository, generator)
    tokenizer = _tokenizer(options)
    detokenizer = _detokenizer(options)
    for config, source in ((tokenizer, "tokenizer.py"), (detokenizer, "detokenizer.py")):
        _write_config(repository, config)
        version = repository / config.name / "1"
        (version / "model.py").write_text(resources.files("transerve.convert.models").joinpath(source).read_text())
        shutil.copyfile(tokenizer_file, version / "tokenizer.json")
    _write_config(repository, _text_ensemble(options, generator, tokenizer, detokenizer))
    return repository / options.name / "1" / MODEL_DIR


def generator_config(options: Options) -> ModelConfig:
    config = ModelConfig(name=options.name, backend="generation", max_batch_size=options.max_batch_size)
    if options.decoupled:
        config.model_transaction_policy.decoupled = True
    if options.first_names:
        _tensor(config.input, "INPUT_ID", "TYPE_UINT32", [-1])
        _tensor(config.input, "REQUEST_INPUT_LEN", "TYPE_UINT32", [1])
        _optional(config, "REQUEST_OUTPUT_LEN", "TYPE_UINT32", [1])
        _tensor(config.output, "OUTPUT0", "TYPE_UINT32", [-1, -1])
        _tensor(config.output, "OUTPUT1", "TYPE_UINT32", [-1])
    else:
        _tensor(config.input, "input_ids", "TYPE_UINT32", [-1])
        _tensor(config.input, "sequence_length", "TYPE_UINT32", [1])
        for name, data_type, dims in DECODING_INPUTS:
            _optional(config, name, data_type, dims)
        _tensor(config.output, "output_ids", "TYPE_UINT32", [-1, -1])
        _tensor(config.output, "sequence_length", "TYPE_UINT32", [-1])
        _tensor(config.output, "cum_log_probs", "TYPE_FP32", [-1])
        _tensor(config.output, "output_log_probs", "TYPE_FP32", [-1, -1])
        _tensor(config.output, "prefix_length", "TYPE_UINT32", [-1])
        _tensor(config.output, "output_top_ids", "TYPE_UINT32", [-1, -1, -1])
        _tensor(config.output, "output_top_log_probs", "TYPE_FP32", [-1, -1, -1])
        if options.decoder_only:  # an encoder-decoder model does not score its (encoder's) input
            _tensor(config.output, "prompt_log_probs", "TYPE_FP32", [-1])
            _tensor(config.output, "prompt_top_ids", "TYPE_UINT32", [-1, -1])
            _tensor(config.output, "prompt_top_log_probs", "TYPE_FP32", [-1, -1])
            _tensor(config.output, "prompt_ranks", "TYPE_UINT32", [-1])
    parameters = {"engine": options.engine, "model_dir": MODEL_DIR, "compute_type": options.compute_type,
                  "intra_op_threads": 0, "max_new_tokens": 64}
    if options.engine == "torch":  # no max_batch_rows: the engine sizes it on a GPU (32 on the CPU)
        parameters["kv_cache_tokens"] = 65536
    else:
        parameters["max_batch_rows"] = 16
    _parameters(config, **parameters)
    return config


def _optional(config: ModelConfig, name: str, data_type: str, dims: list[int]) -> None:
    _tensor(config.input, name, data_type, dims)
    config.input[-1].optional = True


def _python(name: str, options: Options) -> ModelConfig:
    config = ModelConfig(name=name, backend="python", max_batch_size=options.max_batch_size)
    config.dynamic_batching.SetInParent()
    config.instance_group.add(count=1, kind=model_config_pb2.ModelInstanceGroup.KIND_CPU)
    return config


def _tokenizer(options: Options) -> ModelConfig:
    config = _python(f"{options.name}_tokenizer", options)
    if options.max_input_tokens is not None:
        _parameters(config, max_input_tokens=options.max_input_tokens)
    _tensor(config.input, "text_input", "TYPE_STRING", [1])
    _tensor(config.output, "input_ids", "TYPE_UINT32", [-1])
    _tensor(config.output, "sequence_length", "TYPE_UINT32", [1])
    return config


def _detokenizer(options: Options) -> ModelConfig:
    config = _python(f"{options.name}_detokenizer", options)
    _tensor(config.input, "output_ids", "TYPE_UINT32", [-1, -1])
    _tensor(config.input, "sequence_length", "TYPE_UINT32", [-1])
    _optional(config, "prefix_length", "TYPE_UINT32", [-1])
    _tensor(config.output, "text_output", "TYPE_STRING", [1])
    return config


def _text_ensemble(
    options: Options, generator: ModelConfig, tokenizer: ModelConfig, detokenizer: ModelConfig
) -> ModelConfig:
    """Ensemble tensors are named apart (the tokenizer's and the generator's `sequence_length` differ)."""
    config = ModelConfig(name=options.text_name or f"{options.name}_text", platform="ensemble",
                         max_batch_size=options.max_batch_size)
    _tensor(config.input, "text_input", "TYPE_STRING", [1])
    _tensor(config.output, "text_output", "TYPE_STRING", [1])
    if options.first_names:
        names = {"ids": "INPUT_ID", "lengths": "REQUEST_INPUT_LEN", "output_ids": "OUTPUT0",
                 "output_lengths": "OUTPUT1"}
    else:
        names = {"ids": "input_ids", "lengths": "sequence_length", "output_ids": "output_ids",
                 "output_lengths": "sequence_length"}
    steps = config.ensemble_scheduling.step
    step = steps.add(model_name=tokenizer.name, model_version=-1)
    step.input_map["text_input"] = "text_input"
    step.output_map["input_ids"] = "input_ids"
    step.output_map["sequence_length"] = "input_length"
    step = steps.add(model_name=generator.name, model_version=-1)
    step.input_map[names["ids"]] = "input_ids"
    step.input_map[names["lengths"]] = "input_length"
    step.output_map[names["output_ids"]] = "output_ids"
    step.output_map[names["output_lengths"]] = "output_length"
    if not options.first_names:
        step.output_map["prefix_length"] = "prefix_length"
    step = steps.add(model_name=detokenizer.name, model_version=-1)
    step.input_map["output_ids"] = "output_ids"
    step.input_map["sequence_length"] = "output_length"
    if not options.first_names:
        step.input_map["prefix_length"] = "prefix_length"
    elif options.decoder_only:  # the first names have no prefix_length: the prompt's length says it
        step.input_map["prefix_length"] = "input_length"
    step.output_map["text_output"] = "text_output"
    return config
