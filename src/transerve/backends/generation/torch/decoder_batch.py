"""The torch engine's running batch (`DecoderBatch`): rows at different decoding steps in one KV cache.

Rows join the batch at any step, so their histories differ in length. The self-attention keys/values of all rows
are kept left-padded to the longest history, with a mask that hides the padding; each row carries its own next
position. Encoder-decoder rows also carry their encoder output and its mask, and their cross-attention keys/values,
right-padded to the longest source. Rows leave by index selection, after which padding no remaining row needs is
trimmed away. The cache tensors are our own: views of buffers with spare rows and time steps (`cache_buffers`), so
that joining rows are written into spare rows and leaving rows are replaced by moving only the rows that change
places. A part of its own because it is data with its own bookkeeping: `model_runner` computes on it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from transerve.backends.generation.torch.cache_buffers import join_rows, keep_rows, select_rows

if TYPE_CHECKING:
    import torch


KV = list[tuple["torch.Tensor", "torch.Tensor"]]


@dataclass(slots=True)
class DecoderBatch:
    #: Per decoder layer, self-attention keys and values [rows, heads, time, dim], left-padded.
    self_kv: KV
    #: [rows, time]: 1 where `self_kv` holds a real token.
    mask: torch.Tensor
    #: [rows]: the position of each row's next token.
    positions: torch.Tensor
    #: Encoder-decoder only: per layer, cross-attention keys and values [rows, heads, source, dim], right-padded.
    cross_kv: KV | None = None
    #: Encoder-decoder only: encoder output [rows, source, d_model] and its mask [rows, source].
    encoder_hidden: torch.Tensor | None = None
    encoder_mask: torch.Tensor | None = None
    #: How many rows the caches' buffers should hold when (re)allocated: the most that will run together.
    capacity: int = 0
    #: The engine's `kv_cache_tokens`: a (re)allocated buffer holds no more rows than this many tokens at its length.
    token_budget: int = 0
    #: The host's copy of each row's real self-attention steps (`mask`'s ones, at its right end) and, encoder-decoder
    #: only, of its source's length (`encoder_mask`'s ones, at its left end): trimming padding after rows leave
    #: reads these instead of the masks, which on a GPU would wait for the device.
    lengths: list[int] = field(default_factory=list)
    sources: list[int] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return self.positions.shape[0]

    def tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor the batch holds (what `join_stream` marks as used by the decoding stream)."""
        for k, v in (self.self_kv or []) + (self.cross_kv or []):
            yield k
            yield v
        yield self.mask
        yield self.positions
        if self.encoder_hidden is not None:
            yield self.encoder_hidden
            yield self.encoder_mask

    def next_mask(self) -> torch.Tensor:
        """`mask` with the step being fed: one more real step for every row."""
        import torch

        return torch.cat((self.mask, torch.ones_like(self.positions)[:, None]), dim=1)

    def grew(self, self_kv: KV, mask: torch.Tensor) -> None:
        """After a step: the caches `self_kv` it grew, its `mask` (`next_mask`), and each row a position and a
        step further."""
        self.self_kv, self.mask = self_kv, mask
        self.positions = self.positions + 1
        self.lengths = [length + 1 for length in self.lengths]

    def select(self, index: torch.Tensor, decoder_only: bool = False, order: list[int] | None = None) -> None:
        """Keep the rows `index` (in that order; a row may repeat, as beams do), then trim unneeded padding; the
        caches change in place where they can (`cache_buffers.keep_rows`). `decoder_only`: rows only move among
        rows with the same encoder states (one sequence's beams), which therefore stay as they are. `order`:
        `index` as a list, where the caller has one."""
        order = index.tolist() if order is None else order
        rows = select_rows(index, order)
        self.lengths = [self.lengths[row] for row in order]
        self.self_kv = [(keep_rows(k, rows), keep_rows(v, rows)) for k, v in self.self_kv]
        self.mask = self.mask.index_select(0, index)
        self.positions = self.positions.index_select(0, index)
        if self.cross_kv is not None and not decoder_only:
            self.cross_kv = [(keep_rows(k, rows), keep_rows(v, rows)) for k, v in self.cross_kv]
            self.encoder_hidden = self.encoder_hidden.index_select(0, index)
            self.encoder_mask = self.encoder_mask.index_select(0, index)
            self.sources = [self.sources[row] for row in order]
        self._trim()

    def rows_range(self, start: int, stop: int, own: bool = False) -> DecoderBatch:
        """A new batch of rows `start` to `stop`, trimmed of the padding its rows do not need: what one call
        prepared for several sequences is split this way. Views of our tensors, unless `own`: copies, which
        later in-place writes to this batch's caches (into what they take for spare rows) cannot reach."""

        def rows(tensor: torch.Tensor) -> torch.Tensor:
            return tensor[start:stop].clone() if own else tensor[start:stop]

        def part(kv: KV) -> KV:
            return [(rows(k), rows(v)) for k, v in kv]

        encoder = self.encoder_hidden is not None
        batch = DecoderBatch(
            part(self.self_kv), rows(self.mask), rows(self.positions),
            part(self.cross_kv) if self.cross_kv is not None else None,
            rows(self.encoder_hidden) if encoder else None,
            rows(self.encoder_mask) if encoder else None,
            self.capacity, self.token_budget, self.lengths[start:stop], self.sources[start:stop],
        )
        batch._trim()
        return batch

    def _trim(self) -> None:
        """Drop the padding steps no row needs: those before the longest history, those after the longest source."""
        start = self.mask.shape[1] - max(self.lengths, default=0)
        if start > 0:
            self.self_kv = [(k[:, :, start:], v[:, :, start:]) for k, v in self.self_kv]
            self.mask = self.mask[:, start:]
        if self.cross_kv is not None:
            end = max(self.sources, default=0)
            if end < self.encoder_mask.shape[1]:
                self.cross_kv = [(k[:, :, :end], v[:, :, :end]) for k, v in self.cross_kv]
                self.encoder_hidden = self.encoder_hidden[:, :end]
                self.encoder_mask = self.encoder_mask[:, :end]

    def extend(self, other: DecoderBatch) -> None:
        """Append `other`'s rows after ours, padding both to common lengths; written into our caches' spare rows
        where they have room (`cache_buffers.join_rows`)."""
        import torch
        from torch.nn.functional import pad

        time = max(self.mask.shape[1], other.mask.shape[1])
        rows = (self.rows, other.rows)
        capacity, budget = max(self.capacity, other.capacity), max(self.token_budget, other.token_budget)
        if self.self_kv or other.self_kv:  # rows that have consumed no token yet have no keys/values: all padding
            layers = len(self.self_kv or other.self_kv)
            mine = self.self_kv or [(None, None)] * layers
            theirs = other.self_kv or [(None, None)] * layers
            self.self_kv = [
                (join_rows(a[0], b[0], rows, time, True, capacity, budget),
                 join_rows(a[1], b[1], rows, time, True, capacity, budget))
                for a, b in zip(mine, theirs, strict=True)
            ]
        self.mask = torch.cat([pad(batch.mask, (time - batch.mask.shape[1], 0)) for batch in (self, other)])
        self.positions = torch.cat((self.positions, other.positions))
        self.capacity, self.token_budget = capacity, budget
        self.lengths = self.lengths + other.lengths
        self.sources = self.sources + other.sources
        if self.cross_kv is None:
            return
        source = max(self.encoder_mask.shape[1], other.encoder_mask.shape[1])
        self.cross_kv = [
            (join_rows(a[0], b[0], rows, source, False, capacity, budget),
             join_rows(a[1], b[1], rows, source, False, capacity, budget))
            for a, b in zip(self.cross_kv, other.cross_kv, strict=True)
        ]

        def right(batch: DecoderBatch) -> tuple[torch.Tensor, torch.Tensor]:
            missing = source - batch.encoder_mask.shape[1]
            return pad(batch.encoder_hidden, (0, 0, 0, missing)), pad(batch.encoder_mask, (0, missing))

        (my_hidden, my_mask), (their_hidden, their_mask) = right(self), right(other)
        self.encoder_hidden = torch.cat((my_hidden, their_hidden))
        self.encoder_mask = torch.cat((my_mask, their_mask))
