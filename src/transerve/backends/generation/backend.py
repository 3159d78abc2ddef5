"""The `generation` backend: text generation (T5, BART, Marian, GPT-2, ...) behind FasterTransformer's tensors.

Each instance owns one engine on its device: CTranslate2 (the default when the model folder holds a converted
`model.bin`) or PyTorch + transformers. Engines are optional extras, imported when a model needs one; a model
whose engine, folder or weights are missing is UNAVAILABLE with the reason, and the rest of the repository
serves. See docs/generation.md.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

from transerve.backends.base import Backend, BackendModel, ModelContext, Placement, instance_placements
from transerve.backends.generation.engine import GenerationEngine
from transerve.backends.generation.instance import GenerationInstance
from transerve.backends.generation.interface import TensorInterface
from transerve.backends.generation.load_probe import probe
from transerve.backends.generation.options import Limits
from transerve.backends.generation.settings import DEFAULT_BATCH_ROWS, GenerationSettings, read_settings
from transerve.core.errors import ServerError, invalid_arg, unavailable

log = logging.getLogger(__name__)

#: transformers' `from_pretrained` patches torch process-wide while it loads (weights created on the meta device):
#: two loads in two threads at once break each other (seen: meta-tensor errors, and weights silently left random).
#: Models load concurrently, so torch engines are opened one at a time.
_TORCH_LOADING = threading.Lock()


class GenerationBackend(Backend):
    name = "generation"

    async def load(self, context: ModelContext) -> BackendModel:
        try:
            interface = TensorInterface(context.config)
            settings = read_settings(context.config, context.version_path)
        except ServerError as exc:
            raise ServerError(exc.code, f"{failed_to_load(context)}: {exc.message}") from None
        return await serve(context, interface, lambda placement: settings)


def failed_to_load(context: ModelContext) -> str:
    return f"failed to load '{context.name}' version {context.version}"


async def serve(context: ModelContext, interface: TensorInterface,
                settings_for: Callable[[Placement], GenerationSettings]) -> BackendModel:
    """The model's instances, one engine each on its placement with `settings_for` it; a failure is the load's
    ServerError with the reason (the engines already opened are closed)."""
    where = failed_to_load(context)
    config = context.config
    loop = asyncio.get_running_loop()
    placements = instance_placements(config)
    every = [settings_for(placement) for placement in placements]
    settings = every[0]
    try:
        _own_scheduling(config, context.name)
        # Loading takes seconds: every instance's engine loads at once, off the event loop.
        engines = await asyncio.gather(
            *(loop.run_in_executor(None, open_engine, own, placement)
              for own, placement in zip(every, placements, strict=True)),
            return_exceptions=True,
        )
    except ServerError as exc:
        raise ServerError(exc.code, f"{where}: {exc.message}") from None
    failures = [engine for engine in engines if isinstance(engine, BaseException)]
    if failures:
        for engine in engines:
            if not isinstance(engine, BaseException):
                engine.close()
        failure = failures[0]
        if isinstance(failure, ServerError):
            raise ServerError(failure.code, f"{where}: {failure.message}") from None
        raise unavailable(f"{where}: the {settings.engine} engine cannot load {settings.model_dir}: "
                          f"{_one_line(failure)}") from None
    limits = Limits(
        max_new_tokens=settings.max_new_tokens,
        # the engines' own count where the config does not set it (sized from each GPU's memory): the smallest
        max_batch_rows=min(engine.max_batch_rows for engine in engines),
        decoupled=config.model_transaction_policy.decoupled,
        vocab_size=min(engine.vocab_size for engine in engines),
    )
    instances = [
        GenerationInstance(context.name, context.version, placement.name, engine, interface, limits, loop)
        for placement, engine in zip(placements, engines, strict=True)
    ]
    return BackendModel(config, instances)


def _own_scheduling(config: Any, name: str) -> None:
    """The engine batches by itself and must see every request at once: a batcher in front of it would hold
    requests back until an execution ends. `dynamic_batching` (FasterTransformer configs carry it) is dropped."""
    if config.HasField("sequence_batching"):
        raise invalid_arg("the generation backend does not serve sequence_batching (stateful) models")
    if config.HasField("dynamic_batching"):
        log.warning("model '%s': dynamic_batching is ignored; the generation engine batches requests itself", name)
        config.ClearField("dynamic_batching")


def open_engine(settings: GenerationSettings, placement: Placement) -> GenerationEngine:
    """The instance's engine on its device, loaded in the calling thread and proven by a warm-up decode
    (`load_probe`): an engine that cannot decode there is closed and its load fails UNAVAILABLE with the reason."""
    engine = _load_engine(settings, placement)
    try:
        probe(engine, f"cuda:{placement.device_id}" if placement.kind == "GPU" else "cpu")
    except BaseException:
        engine.close()
        raise
    return engine


def _load_engine(settings: GenerationSettings, placement: Placement) -> GenerationEngine:
    """The instance's engine on its device (KIND_GPU: its GPU; otherwise the CPU)."""
    on_gpu = placement.kind == "GPU"
    if settings.engine == "ctranslate2":
        from transerve.backends.generation.ctranslate2.engine import CTranslate2Engine

        return CTranslate2Engine(
            settings.model_dir, device="cuda" if on_gpu else "cpu", device_index=placement.device_id if on_gpu else 0,
            compute_type=settings.compute_type, intra_op_threads=settings.intra_op_threads,
            max_batch_rows=settings.max_batch_rows or DEFAULT_BATCH_ROWS,
            max_concurrent_calls=settings.max_concurrent_calls,
        )
    from transerve.backends.generation.torch.engine import TorchEngine
    from transerve.backends.generation.torch.static_scheduling import scheduling_named

    # A config may name a scheduling to compare against (docs/generation.md); in-flight otherwise.
    scheduling = scheduling_named(settings.scheduling) if settings.scheduling else None
    with _TORCH_LOADING:
        return TorchEngine(
            settings.model_dir, device=f"cuda:{placement.device_id}" if on_gpu else "cpu",
            compute_type=settings.compute_type, intra_op_threads=settings.intra_op_threads,
            max_batch_rows=settings.max_batch_rows, kv_cache_tokens=settings.kv_cache_tokens,
            latency_threads=settings.latency_threads, latency_rows=settings.latency_rows,
            onednn_linear=settings.onednn_linear, join_group=settings.join_group, scheduling=scheduling,
            static_steps=None if settings.cuda_graphs else False, prefix_cache_tokens=settings.prefix_cache_tokens,
        )


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:300]}"
