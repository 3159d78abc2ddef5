"""A generation model's config `parameters`, read and checked once at load, and the engine they pick."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tritonclient.grpc import model_config_pb2

from transerve.backends.generation.torch.prefix_cache import DEFAULT_TOKENS as DEFAULT_PREFIX_CACHE_TOKENS
from transerve.core.errors import invalid_arg, unavailable
from transerve.repository.paths import inside

ENGINES = ("ctranslate2", "torch")
COMPUTE_TYPES = {
    "ctranslate2": ("float32", "int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16",
                    "bfloat16", "auto", "default"),
    "torch": ("float32", "float16", "bfloat16"),
}
DEFAULT_MODEL_DIR = "model"
#: The CTranslate2 engine's `max_batch_rows` when the config does not set it.
DEFAULT_BATCH_ROWS = 16


@dataclass(frozen=True, slots=True)
class GenerationSettings:
    engine: str
    #: The CTranslate2 model or Hugging Face folder.
    model_dir: Path
    compute_type: str
    intra_op_threads: int
    #: None when the config does not say: the engine picks (`batch_rows`; CTranslate2: `DEFAULT_BATCH_ROWS`).
    max_batch_rows: int | None
    #: CTranslate2 engine: calls (and model replicas) that run at once.
    max_concurrent_calls: int
    kv_cache_tokens: int
    #: The default when a request says nothing.
    max_new_tokens: int
    #: The torch engine's scheduling by name, None when not set (in-flight): the others are kept to compare against
    #: (`static_scheduling`).
    scheduling: str | None
    #: Torch engine: threads of the joining work while at most `latency_rows` rows run (0: the CPUs it may use).
    latency_threads: int = 0
    latency_rows: int = 1
    #: Torch engine on CPU, float32: linear layers on oneDNN's GEMM (see `onednn_linear`).
    onednn_linear: bool = True
    #: Torch engine, in-flight scheduling: sequences one joining call (encoder call or prefill) computes at most.
    join_group: int = 4
    #: Torch engine on a GPU: decoding steps recorded as CUDA graphs (`step_graphs`).
    cuda_graphs: bool = True
    #: Torch engine: tokens of prompt prefixes (encoder-decoder: sources) whose caches are kept for later requests
    #: (`prefix_cache`; 0: none).
    prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS


def read_settings(config: model_config_pb2.ModelConfig, version_path: Path,
                  model_dir: Path | None = None) -> GenerationSettings:
    """The settings, or INVALID_ARG for a bad value or a model folder outside the model's (`version_path` is
    `<model>/<version>`) and UNAVAILABLE for a missing one. A caller that made the model folder itself (the
    FasterTransformer backend's converted checkpoint) passes it as `model_dir`."""
    parameters = {key: value.string_value for key, value in config.parameters.items()}
    if model_dir is None:
        setting = "parameter model_dir" if parameters.get("model_dir") else "default_model_filename"
        name = parameters.get("model_dir") or config.default_model_filename or DEFAULT_MODEL_DIR
        model_dir = inside(version_path.parent, version_path, name, setting)
    if not model_dir.is_dir():
        raise unavailable(f"model directory '{model_dir}' not found (config parameter 'model_dir', relative to the "
                          "version folder)")
    engine = parameters.get("engine") or ("ctranslate2" if (model_dir / "model.bin").is_file() else "torch")
    if engine not in ENGINES:
        raise invalid_arg(f"parameter 'engine' is '{engine}'; it must be one of {', '.join(ENGINES)}")
    compute_type = parameters.get("compute_type") or "float32"
    if compute_type not in COMPUTE_TYPES[engine]:
        raise invalid_arg(f"parameter 'compute_type' is '{compute_type}'; the {engine} engine takes "
                          f"{', '.join(COMPUTE_TYPES[engine])}")
    return GenerationSettings(
        engine=engine,
        model_dir=model_dir,
        compute_type=compute_type,
        intra_op_threads=_integer(parameters, "intra_op_threads", 0, minimum=0),
        max_batch_rows=_integer(parameters, "max_batch_rows", None, minimum=1),
        max_concurrent_calls=_integer(parameters, "max_concurrent_calls", 2, minimum=1),
        kv_cache_tokens=_integer(parameters, "kv_cache_tokens", 65536, minimum=1),
        max_new_tokens=_integer(parameters, "max_new_tokens", 64, minimum=1),
        scheduling=parameters.get("scheduling") or None,
        latency_threads=_integer(parameters, "latency_threads", 0, minimum=0),
        latency_rows=_integer(parameters, "latency_rows", 1, minimum=0),
        onednn_linear=_boolean(parameters, "onednn_linear", True),
        join_group=_integer(parameters, "join_group", 4, minimum=1),
        cuda_graphs=_boolean(parameters, "cuda_graphs", True),
        prefix_cache_tokens=_integer(parameters, "prefix_cache_tokens", DEFAULT_PREFIX_CACHE_TOKENS, minimum=0),
    )


def _boolean(parameters: dict[str, str], key: str, default: bool) -> bool:
    text = parameters.get(key, "").strip().lower()
    if not text:
        return default
    if text not in ("true", "false"):
        raise invalid_arg(f"parameter '{key}' must be true or false, got '{text}'")
    return text == "true"


def _integer(parameters: dict[str, str], key: str, default: int | None, minimum: int) -> int | None:
    text = parameters.get(key, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise invalid_arg(f"parameter '{key}' must be an integer, got '{text}'") from None
    if value < minimum:
        raise invalid_arg(f"parameter '{key}' must be at least {minimum}, got {value}")
    return value
