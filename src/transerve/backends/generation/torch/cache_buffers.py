"""The torch engine's KV cache tensors: views of buffers with spare rows and time steps, written in place.

A layer's keys (or values) for the running batch are a view [rows, heads, time, dim] of a contiguous buffer
[capacity rows, heads, capacity time, dim]: the batch's rows are the buffer's first rows, and its time window a
slice of the buffer's time axis. So a decoding step writes the new token's keys/values after the window instead of
concatenating (copying) the whole history, rows that join are written into the spare rows, and rows that leave are
replaced by moving only the rows that change places; without this every join and leave copied every layer's cache
twice (once to rebuild it, once more at the next step to make room), a large share of the engine's time under
in-flight batching (benchmarks/README.md, "Figures behind the code"). A buffer is reallocated, with `HEADROOM` steps
to spare, only when a window outgrows it. Spare rows and the time outside a window hold stale (finite) values that
the attention mask hides; padding written inside a window is zeroed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from transerve.backends.generation.torch.host_copies import to_device

if TYPE_CHECKING:
    import torch

#: Time steps of spare capacity a buffer gets when it has to be (re)allocated.
HEADROOM = 32


def window(cache: torch.Tensor) -> tuple[int, int] | None:
    """Where `cache` [rows, heads, time, dim] lies in its buffer, as (first time step, buffer's time capacity),
    when it is a time slice of the first rows of a contiguous buffer (the layout this module makes); None for any
    other layout (for instance a slice of a fused projection's output, which must never be written in place)."""
    rows, heads, time, dim = cache.shape
    step = cache.stride(1)
    if cache.stride(3) != 1 or cache.stride(2) != dim or cache.stride(0) != heads * step or step % dim:
        return None
    if cache.storage_offset() >= step:  # not the buffer's first rows
        return None
    return cache.storage_offset() // dim, step // dim


def room(cache: torch.Tensor) -> int:
    """How many time steps `cache` may span from its first one without leaving its buffer (0: not ours)."""
    where = window(cache)
    return 0 if where is None else where[1] - where[0]


def row_capacity(cache: torch.Tensor) -> int:
    """How many rows `cache`'s buffer has (0: not ours)."""
    if window(cache) is None:
        return 0
    return cache.untyped_storage().nbytes() // cache.element_size() // cache.stride(0)


def buffer_rows(rows: int, rows_wanted: int, time: int, token_budget: int) -> int:
    """The rows a new buffer of `time` steps gets for a batch of `rows`: `rows_wanted` (the most that run together),
    but no more than `token_budget` tokens' worth at that length (0: no budget), so that a long sequence running
    alone does not reserve its length for every row the batch could ever have; never fewer than `rows`."""
    if token_budget:
        rows_wanted = min(rows_wanted, token_budget // max(1, time))
    return max(rows, rows_wanted)


def hold(layer: Any, keys: torch.Tensor, values: torch.Tensor) -> Any:
    """`layer` (a transformers cache layer) holding `keys`/`values`, set as its `lazy_initialization` would but
    without the empty tensors that makes first (a tensor made from host data has no place in a CUDA graph)."""
    layer.dtype, layer.device = keys.dtype, keys.device
    layer.keys, layer.values = keys, values
    layer.is_initialized = True
    return layer


def cache_layer(keys: torch.Tensor, values: torch.Tensor, kind: type | None = None) -> Any:
    """A transformers cache layer (`kind`, else `DynamicLayer`) holding `keys`/`values`."""
    from transformers.cache_utils import DynamicLayer

    return hold((kind or DynamicLayer)(), keys, values)


def allocate(like: torch.Tensor, rows: int, time: int) -> torch.Tensor:
    """A zeroed buffer [rows, heads, time, dim] of `like`'s heads, dim, dtype and device."""
    return like.new_zeros((rows, like.shape[1], time, like.shape[3]))


def span(cache: torch.Tensor, rows: int, start: int, time: int) -> torch.Tensor:
    """The view of `cache`'s buffer of its first `rows` rows and `time` steps from step `start`."""
    _, heads, _, dim = cache.shape
    return cache.as_strided((rows, heads, time, dim), cache.stride(), start * dim)


def append(cache: torch.Tensor, new: torch.Tensor, rows_wanted: int, token_budget: int = 0) -> torch.Tensor:
    """`cache` followed by `new` [rows, heads, steps, dim] along time: in place when its buffer has room, else in a
    new buffer of `buffer_rows` rows with `HEADROOM` steps to spare."""
    rows, _, time, _ = cache.shape
    grown_time = time + new.shape[2]
    if room(cache) >= grown_time:
        grown = span(cache, rows, window(cache)[0], grown_time)
    else:
        steps = grown_time + HEADROOM
        buffer = allocate(cache, buffer_rows(rows, rows_wanted, steps, token_budget), steps)
        buffer[:rows, :, :time] = cache
        grown = buffer[:rows, :, :grown_time]
    grown[:, :, time:] = new
    return grown


@dataclass(frozen=True, slots=True)
class RowSelection:
    """Rows to keep, in order (`index`), and the moves that keep them in place: the rows whose source differs from
    their position (`destinations`, None when none does) and those sources. Made once per selection by
    `select_rows`, then applied to every layer's keys and values by `keep_rows`."""

    index: torch.Tensor
    count: int
    destinations: torch.Tensor | None
    sources: torch.Tensor | None


def select_rows(index: torch.Tensor, order: list[int] | None = None) -> RowSelection:
    """The selection of the rows `index` [count] (in that order; rows may repeat); `order`: the same rows as a
    list, where the caller has them (reading `index` back from a GPU waits for the device)."""
    moved = [row for row, source in enumerate(index.tolist() if order is None else order) if source != row]
    if not moved:
        return RowSelection(index, len(index), None, None)
    destinations = to_device(moved, index.device, index.dtype)
    return RowSelection(index, len(index), destinations, index.index_select(0, destinations))


def keep_rows(cache: torch.Tensor, selection: RowSelection) -> torch.Tensor:
    """`cache`'s rows of `selection`. When there are no more of them than rows now and the cache is ours, in place:
    only the rows whose source differs from their position are copied (gathered first, so sources and destinations
    may overlap); else gathered into a new tensor."""
    if selection.count > cache.shape[0] or window(cache) is None:
        return cache.index_select(0, selection.index)
    if selection.destinations is not None:
        cache.index_copy_(0, selection.destinations, cache.index_select(0, selection.sources))
    return cache[:selection.count]


def join_rows(
    mine: torch.Tensor | None, theirs: torch.Tensor | None, rows: tuple[int, int], time: int, left_padded: bool,
    rows_wanted: int, token_budget: int = 0,
) -> torch.Tensor:
    """`mine`'s rows then `theirs`', each padded with zeros to `time` steps: on the left (`left_padded`, the
    self-attention cache, whose real steps end together) or on the right (cross-attention, whose sources start
    together). `rows` counts each side's rows: a side given as None has them but no steps yet (all padding).
    Written into `mine`'s buffer when it has the rows and the steps, else into a new buffer of `buffer_rows`
    rows."""
    mine_rows, their_rows = rows
    total = mine_rows + their_rows
    like = mine if mine is not None else theirs
    mine_time = 0 if mine is None else mine.shape[2]
    target = _in_place_target(mine, total, time, left_padded) if mine is not None else None
    if target is None:
        steps = time + HEADROOM
        buffer = allocate(like, buffer_rows(total, rows_wanted, steps, token_budget), steps)
        target = buffer[:total, :, :time]
        if mine is not None:
            _place(target[:mine_rows], mine, left_padded)
    elif time > mine_time:  # the window widened over our rows: its new steps are padding for them
        _pad_zero(target[:mine_rows], mine_time, left_padded)
    theirs_part = target[mine_rows:]
    if theirs is None:
        theirs_part.zero_()
    else:
        _pad_zero(theirs_part, theirs.shape[2], left_padded)
        _place(theirs_part, theirs, left_padded)
    return target


def _in_place_target(mine: torch.Tensor, rows: int, time: int, left_padded: bool) -> torch.Tensor | None:
    """The view of `mine`'s buffer that holds `rows` rows and a window of `time` steps placed as `mine`'s is (same
    last step when `left_padded`, same first step otherwise), or None when the buffer is not ours or too small."""
    where = window(mine)
    if where is None or row_capacity(mine) < rows:
        return None
    first, capacity = where
    start = first + mine.shape[2] - time if left_padded else first
    if start < 0 or start + time > capacity:
        return None
    return span(mine, rows, start, time)


def _place(target: torch.Tensor, source: torch.Tensor, left_padded: bool) -> None:
    """Copy `source` into `target`'s last steps (`left_padded`) or first ones."""
    steps = source.shape[2]
    if steps:
        (target[:, :, target.shape[2] - steps:] if left_padded else target[:, :, :steps]).copy_(source)


def _pad_zero(target: torch.Tensor, steps: int, left_padded: bool) -> None:
    """Zero all but `target`'s last `steps` steps (`left_padded`) or all but its first ones."""
    padding = target.shape[2] - steps
    if padding > 0:
        (target[:, :, :padding] if left_padded else target[:, :, steps:]).zero_()


def fewest_moves(starts: list[int], sizes: list[int]) -> list[int]:
    """An order for groups of rows that stay in a batch after others left (group i: `sizes[i]` rows now at rows
    `starts[i]` onward, in batch order) that moves as few rows as possible: a group that lies inside the smaller
    batch keeps its place, and the others fill the gaps, first fit; the batch order when they do not fit. Rows are
    only ever moved, never reordered, within a group."""
    total = sum(sizes)
    placed: dict[int, int] = {}
    movers = []
    for group, (start, size) in enumerate(zip(starts, sizes, strict=True)):
        if start + size <= total:
            placed[start] = group
        else:
            movers.append(group)
    if not movers:
        return list(range(len(starts)))
    gaps, row = [], 0
    for start in sorted(placed):
        if start > row:
            gaps.append([row, start - row])
        row = start + sizes[placed[start]]
    if row < total:
        gaps.append([row, total - row])
    for group in movers:
        gap = next((gap for gap in gaps if gap[1] >= sizes[group]), None)
        if gap is None:
            return list(range(len(starts)))
        placed[gap[0]] = group
        gap[0] += sizes[group]
        gap[1] -= sizes[group]
    return [placed[start] for start in sorted(placed)]
