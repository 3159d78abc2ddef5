"""Decoding-step self-attention in groups of rows, each over its own part of the left-padded window.

The running batch keeps every row's keys/values left-padded to the longest history (`decoder_batch`), and one
attention call reads the whole window for every row, padding included. Under the mixed load of
`benchmarks/generation.py` rows hold about half the window (75 real steps of 141 on average, GPT-2 small, 32 rows),
so half of what a CPU step's attention reads is padding, and attention reads the cache from memory: it is about a
third of a float32 step. Rows sit in the batch in the order they joined (they join at the end; leaving keeps the
order), so neighbouring rows have similar histories, and a group of consecutive rows needs only the last `w`
steps of the window, `w` its longest row: a view, no copy. `plan` picks the groups (fewest rows x window, each
extra call costing `GROUP_COST_KEYS`); `grouped_sdpa`, registered with transformers as an attention
implementation, runs torch's SDPA once per group during a step that has a plan and exactly as transformers' own
"sdpa" otherwise (prefill, encoders, cross-attention, other threads).

Only on the CPU: there a call costs tens of microseconds, while on a GPU every extra call is more kernel
launches for a step that is launch-bound already (benchmarks/README.md, "GPU check").
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

#: The attention implementation's name in transformers' registry.
GROUPED_SDPA = "transerve_row_groups"
#: What one more attention call per layer costs, in rows x window steps read. Measured on the 2-core development
#: machine (GPT-2 small, 32 rows of in-flight-like histories, one step timed with and without groups, interleaved):
#: 4-5% off a step at any cost from 128 to 1024 (2-5 groups), none at 64 (about 10 groups): the calls' fixed
#: costs (transformers' wrapper, the views, the concatenation) eat the saving.
GROUP_COST_KEYS = 256
#: Boundaries considered: at most this many blocks of consecutive rows, so planning stays quadratic in a constant.
MAX_BLOCKS = 32


@dataclass(frozen=True, slots=True)
class Group:
    """Rows `start` to `stop` of the batch attend to the last `window` steps of the keys/values."""

    start: int
    stop: int
    window: int


def plan(lengths: list[int], group_cost: int = GROUP_COST_KEYS) -> list[Group]:
    """Groups of consecutive rows that read the fewest row-steps, counting `group_cost` for each group past the
    first; `lengths[i]` is row i's real steps (its keys at the right end of the window), each at least 1.
    Dynamic programming over blocks of rows (one row each up to `MAX_BLOCKS` rows)."""
    rows = len(lengths)
    if rows == 0:
        return []
    size = -(-rows // MAX_BLOCKS)
    bounds = list(range(0, rows, size)) + [rows]
    longest = [max(lengths[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    blocks = len(longest)
    best = [0] + [-1] * blocks  # best[j]: cheapest cost of the first j blocks
    cut = [0] * (blocks + 1)
    for j in range(1, blocks + 1):
        window = 0
        for i in range(j, 0, -1):  # the last group is blocks i-1 .. j-1
            window = max(window, longest[i - 1])
            cost = best[i - 1] + (bounds[j] - bounds[i - 1]) * window + (group_cost if i > 1 else 0)
            if best[j] < 0 or cost < best[j]:
                best[j], cut[j] = cost, i - 1
    groups: list[Group] = []
    j = blocks
    while j > 0:
        i = cut[j]
        groups.append(Group(bounds[i], bounds[j], max(longest[i:j])))
        j = i
    return groups[::-1]


@dataclass(frozen=True, slots=True)
class _Step:
    groups: list[Group]
    #: The self-attention's key length this step (the window): a call with other keys is not self-attention.
    keys: int
    #: The modules that attend to something else with one query (cross-attention): id()s.
    skip: frozenset[int]


_local = threading.local()


@contextlib.contextmanager
def grouped(groups: list[Group], keys: int, skip: frozenset[int]) -> Iterator[None]:
    """During the block, on this thread, single-query self-attention over `keys` steps runs in `groups`."""
    _local.step = _Step(groups, keys, skip)
    try:
        yield
    finally:
        _local.step = None


def grouped_sdpa(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
    """transformers' sdpa attention, once per group of the current step's plan (see the module's docstring)."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    step: _Step | None = getattr(_local, "step", None)
    if step is None or query.shape[2] != 1 or key.shape[2] != step.keys or id(module) in step.skip:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    rows, outputs = query.shape[0], []
    bias = kwargs.pop("position_bias", None)
    for group in step.groups:
        part = {"position_bias": _part(bias, group, rows, step.keys)} if bias is not None else {}
        output, _ = sdpa_attention_forward(
            module, query[group.start:group.stop], key[group.start:group.stop, :, -group.window:],
            value[group.start:group.stop, :, -group.window:], _part(attention_mask, group, rows, step.keys),
            **kwargs, **part,
        )
        outputs.append(output)
    return torch.cat(outputs), None


def _part(tensor: Any, group: Group, rows: int, keys: int) -> Any:
    """A mask's or bias's piece for `group`: its rows (unless broadcast over rows) and the group's window."""
    if tensor is None:
        return None
    if tensor.shape[-1] == keys:
        tensor = tensor[..., -group.window:]
    return tensor[group.start:group.stop] if tensor.shape[0] == rows else tensor


def use_row_groups(model: Any) -> bool:
    """Make a CPU model's attention `grouped_sdpa` where it runs transformers' "sdpa"; whether it does now."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if model.device.type != "cpu" or getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(GROUPED_SDPA, grouped_sdpa)
    AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)
    model.set_attn_implementation(GROUPED_SDPA)
    return model.config._attn_implementation == GROUPED_SDPA
