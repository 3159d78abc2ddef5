"""A decoder-only model's decoding step and the prefill of joining prompts in one forward pass.

On the CPU a float32 step is bound by memory: a 32-row GPT-2 small step reads every weight once, and a joining
sequence's prefill, run as a forward of its own, reads them all again. Under a mixed in-flight load a sequence
joins about every other step, so that second read is a large part of the work, and one forward over the step's
tokens and the prompt's costs about the prefill alone plus the step's attention (benchmarks/README.md, "The lever
left"). This module lets one forward do both: the step's tokens (one per running
row) and the prompts' tokens go through the model as one sequence of tokens, each with its own position; the
linear layers see them as rows and read the weights once. Only attention needs to know which token belongs to
what: the step's tokens attend to their rows' caches (grown by one step, as a step grows them), each prompt's
tokens to themselves, causally (a prompt whose start was cached, `prefix_cache`, feeds only the tokens after it,
which attend to that start's keys/values too). `Fused`, active on the calling thread during that forward, says
so; the attention implementation registered here (`FUSED_ATTENTION`, transformers' "sdpa" whenever no fused
forward runs) and the cache layers (`FusedLayer`) read it.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from transerve.backends.generation.torch.cache_buffers import append, hold

if TYPE_CHECKING:
    import torch

#: The attention implementation's name in transformers' registry.
FUSED_ATTENTION = "transerve_fused_joins"
#: The model types whose forward passes this is known to compute exactly as a step and a prefill (tested): their
#: attention layers all call transformers' attention interface and update the cache through its layers, and
#: positions reach them only as `position_ids` (no mask-derived positions or biases, as ALiBi models have).
FUSED_MODEL_TYPES = frozenset({"gpt2", "llama", "mistral", "qwen2"})


@dataclass(slots=True)
class Fused:
    """One fused forward: `rows` running rows' tokens first, then the prompts' tokens at `spans` (start, stop) of
    the token axis (the rows' tokens included); `mask` [rows, 1, 1, time + 1] says which of the grown caches'
    steps are real."""

    rows: int
    spans: list[tuple[int, int]]
    mask: torch.Tensor
    #: Per layer, the layer's cache (`FusedLayer`), registered as the forward reaches it.
    layers: dict[int, Any] = field(default_factory=dict)
    #: The layers whose attention ran fused: all of them, or the forward was not the fused one.
    attended: set[int] = field(default_factory=set)
    #: Per span, the keys/values of its prompt's cached start (`prefix_cache`: per layer [1, heads, start, dim],
    #: the span holding the tokens after it), or None; empty: none has one.
    prefixes: list[Any] = field(default_factory=list)


_local = threading.local()


@contextlib.contextmanager
def fused(plan: Fused) -> Iterator[None]:
    """During the block, on this thread, the model's forward is the fused one `plan` describes."""
    _local.plan = plan
    try:
        yield
    finally:
        _local.plan = None


def _active() -> Fused | None:
    return getattr(_local, "plan", None)


def fused_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
    """transformers' "sdpa" attention; in a fused forward, the running rows' queries against their caches and
    each prompt's queries against its own keys, causally. `query`/`key`/`value` are [1, heads, tokens, dim] there;
    the output is [1, tokens, heads, dim], as "sdpa" gives."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plan = _active()
    if plan is None or query.shape[0] != 1 or module.layer_idx not in plan.layers:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    layer, rows = plan.layers[module.layer_idx], plan.rows
    parts = []
    if rows:
        step_query = query[0, :, :rows].transpose(0, 1).unsqueeze(2)  # [rows, heads, 1, dim]
        output, _ = sdpa_attention_forward(module, step_query, layer.keys, layer.values, plan.mask, **kwargs)
        parts.append(output.reshape(1, rows, *output.shape[2:]))
    kwargs.pop("is_causal", None)
    for index, (start, stop) in enumerate(plan.spans):
        prefix = plan.prefixes[index] if plan.prefixes else None
        span_query, span_key, span_value = query[:, :, start:stop], key[:, :, start:stop], value[:, :, start:stop]
        if prefix is None:
            output, _ = sdpa_attention_forward(module, span_query, span_key, span_value, None, is_causal=True,
                                               **kwargs)
        else:  # after its cached start: each token sees all of it, and its own prompt's tokens causally
            prefix_key, prefix_value = prefix[module.layer_idx]
            done, tokens = prefix_key.shape[2], stop - start
            seen = torch.ones(tokens, done + tokens, dtype=torch.bool, device=query.device).tril(done)[None, None]
            output, _ = sdpa_attention_forward(
                module, span_query, torch.cat((prefix_key, span_key), dim=2),
                torch.cat((prefix_value, span_value), dim=2), seen, is_causal=False, **kwargs,
            )
        parts.append(output)
    plan.attended.add(module.layer_idx)
    return torch.cat(parts, dim=1), None


def use_fused_joins(model: Any) -> bool:
    """Make `model`'s attention `fused_attention` where it runs transformers' "sdpa"; whether it does now."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    config = model.config
    if config.model_type not in FUSED_MODEL_TYPES or config._attn_implementation != "sdpa":
        return False
    if not full_attention_only(config):  # the fused attention has no window: every key is seen
        return False
    AttentionInterface.register(FUSED_ATTENTION, fused_attention)
    AttentionMaskInterface.register(FUSED_ATTENTION, sdpa_mask)  # fused forwards pass a prepared mask instead
    try:
        model.set_attn_implementation(FUSED_ATTENTION)
    except ValueError:  # transformers refuses a custom implementation for this model
        return False
    return model.config._attn_implementation == FUSED_ATTENTION


def full_attention_only(config: Any) -> bool:
    """Whether every layer attends to the whole history: no sliding window that a sequence could outgrow."""
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or []):
        return False
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return True
    positions = getattr(config, "max_position_embeddings", None)
    return isinstance(positions, int) and window >= positions


@functools.cache
def fused_layer_class() -> type:
    """`FusedLayer`, made on first use (transformers is imported lazily)."""
    from transformers.cache_utils import DynamicLayer

    class FusedLayer(DynamicLayer):
        """A layer's cache in a fused forward: the running rows' keys/values (views of our buffers), grown by their
        step's tokens in place; the prompts' keys/values kept as computed, for their rows' caches."""

        def __init__(self, plan: Fused, index: int, keys: torch.Tensor, values: torch.Tensor, capacity: int,
                     token_budget: int) -> None:
            super().__init__()
            hold(self, keys, values)
            self.plan, self.index, self.capacity, self.token_budget = plan, index, capacity, token_budget
            self.prompt_keys: torch.Tensor | None = None
            self.prompt_values: torch.Tensor | None = None

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            rows = self.plan.rows
            if rows:
                step_keys = key_states[0, :, :rows].transpose(0, 1).unsqueeze(2)  # [rows, heads, 1, dim]
                step_values = value_states[0, :, :rows].transpose(0, 1).unsqueeze(2)
                self.keys = append(self.keys, step_keys, self.capacity, self.token_budget)
                self.values = append(self.values, step_values, self.capacity, self.token_budget)
            self.prompt_keys, self.prompt_values = key_states[:, :, rows:], value_states[:, :, rows:]
            self.plan.layers[self.index] = self
            return key_states, value_states

    return FusedLayer
