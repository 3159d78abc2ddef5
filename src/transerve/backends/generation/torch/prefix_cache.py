"""The torch engine's prefix cache (`PrefixCache`): key/value caches of prompt prefixes that later requests reuse.

Decoder-only prompts are cut into blocks of `BLOCK_TOKENS` tokens; a block is found by its parent block's id and
its own tokens, so a chain of blocks stands for one prefix and prompts that share a start share its blocks. Each
block holds, per layer, the self-attention keys and values of its positions: copies, detached from any batch, which
a later prefill starts from (`ModelRunner.prefill`) so that only the rest of its prompt goes through the model. A
key/value at a position depends on the tokens up to it only (causal attention, the position's own id), so a block
computed behind one prompt serves every prompt that starts with the same blocks. Encoder-decoder sources are kept
whole: the encoder's output and the cross-attention keys/values derived from it, for a source seen before.

The cache is bounded in tokens (`prefix_cache_tokens`; a block counts as its tokens, a source as its length) and
forgets the least recently used entry first. A use touches a chain from its deepest block to its first, so a
block is always used more recently than the blocks that follow it: what is forgotten first is the end of a chain,
never a block whose followers would stay unreachable. An entry handed out is copied first (`torch.cat`, `clone`),
so forgetting it, or a batch writing into its own tensors, never touches what another request holds. Entries are
added from the engine thread and the joining thread; a lock keeps the bookkeeping whole.

On a GPU the two threads queue work on different streams: an entry is published only once the stream that made
it has finished it, and a lookup waits for its copies before returning, so no stream reads an entry still being
written or one freed for reuse.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from transerve.core.engine_load import PrefixCacheCounts

if TYPE_CHECKING:
    import torch

    from transerve.backends.generation.torch.decoder_batch import KV

#: Tokens per block of a decoder-only prompt: a hit covers whole blocks.
BLOCK_TOKENS = 32
#: `prefix_cache_tokens` when the config does not set it.
DEFAULT_TOKENS = 2048


@dataclass(slots=True)
class _Entry:
    #: Per layer, keys and values: [heads, BLOCK_TOKENS, dim] for a block; [1, heads, source, dim] for a source.
    kv: KV
    tokens: int
    #: A source's encoder output [1, source, d_model]; None for a block.
    hidden: torch.Tensor | None = None
    #: Blocks that follow this one (a block is forgotten only after them).
    children: int = 0
    #: The block this one follows (None: the first of its prompt, or a source).
    parent: _Entry | None = None
    #: The id the blocks that follow this one are found by (0 stands for the prompt's start).
    ident: int = 0


@dataclass(slots=True)
class Source:
    """A cached encoder-decoder source: its encoder output [1, source, d_model] and per decoder layer its
    cross-attention keys/values [1, heads, source, dim], copies the caller owns."""

    hidden: torch.Tensor
    cross_kv: KV


@dataclass(slots=True)
class Prefix:
    """A decoder-only prompt's cached start: its length in tokens and per layer its keys/values
    [1, heads, length, dim], copies the caller owns; length 0 and no layers on a miss."""

    length: int = 0
    kv: KV = field(default_factory=list)


class PrefixCache:
    """Prompt prefixes' key/value caches on one device, at most `tokens` tokens of them (see the module docstring)."""

    def __init__(self, tokens: int, device: torch.device, block: int = BLOCK_TOKENS) -> None:
        self.capacity = tokens
        self.block = block
        self.device = device
        #: Counters since load (replaced whole under the lock, so a reader always sees one consistent set).
        self.stats = PrefixCacheCounts()
        self._entries: OrderedDict[object, _Entry] = OrderedDict()
        self._used = 0
        self._next_id = 1
        self._lock = threading.Lock()

    @property
    def used_tokens(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._entries)

    # -- decoder-only prompts ------------------------------------------------------------------------------------

    def _chain(self, ids: list[int]) -> list[tuple[object, _Entry]]:
        """The cached blocks `ids` starts with, leaving its last token out (its logits must be computed); under
        the lock."""
        found, parent = [], 0
        for start in range(0, (len(ids) - 1) // self.block * self.block, self.block):
            key = (parent, tuple(ids[start:start + self.block]))
            entry = self._entries.get(key)
            if entry is None:
                break
            found.append((key, entry))
            parent = entry.ident
        return found

    def probe(self, ids: list[int]) -> int:
        """How many of `ids`' first tokens a lookup would find now (nothing counted, nothing touched)."""
        with self._lock:
            return len(self._chain(ids)) * self.block

    def lookup(self, ids: list[int]) -> Prefix:
        """The cached start of prompt `ids` (counted in `stats`); a miss has length 0."""
        import torch

        with self._lock:
            chain = self._chain(ids)
            self._touch([key for key, _ in chain])
            self._count(len(ids), len(chain) * self.block)
            entries = [entry for _, entry in chain]
        if not entries:
            return Prefix()
        layers = len(entries[0].kv)
        kv = [
            tuple(torch.cat([entry.kv[layer][part] for entry in entries], dim=1)[None] for part in (0, 1))
            for layer in range(layers)
        ]
        self._finished()
        return Prefix(len(entries) * self.block, kv)

    def missed(self, prompts: list[list[int]]) -> None:
        """Count lookups that found nothing (prompts prefilled without one: `fused_joins`)."""
        with self._lock:
            for ids in prompts:
                self._count(len(ids), 0)

    def store(self, ids: list[int], kv: KV, start: int = 0) -> None:
        """Keep the whole blocks of prompt `ids` from its keys/values `kv` (per layer [heads, len(ids), dim], the
        prompt's positions only), skipping the first `start` tokens (whole blocks: those found cached)."""
        blocks = min(len(ids) // self.block, self.capacity // self.block)
        if blocks * self.block <= start:
            return
        with self._lock:
            parent, keys = 0, []
            for first in range(0, blocks * self.block, self.block):
                key = (parent, tuple(ids[first:first + self.block]))
                entry = self._entries.get(key)
                keys.append(key)
                if entry is None:
                    break
                parent = entry.ident
            else:
                self._touch(keys)
                return
            known = len(keys) - 1
        # Copies made outside the lock; the chain is checked again when they are added.
        copies = [
            [(k[:, first:first + self.block].clone(), v[:, first:first + self.block].clone()) for k, v in kv]
            for first in range(known * self.block, blocks * self.block, self.block)
        ]
        self._finished()
        with self._lock:
            parent_entry, parent, chain = None, 0, []
            for index in range(blocks):
                first = index * self.block
                key = (parent, tuple(ids[first:first + self.block]))
                entry = self._entries.get(key)
                if entry is None:
                    if index < known or not self._make_room(self.block, keep=parent_entry):
                        break  # a block before it was forgotten meanwhile, or there is no room
                    entry = _Entry(copies[index - known], self.block, parent=parent_entry, ident=self._next_id)
                    self._next_id += 1
                    if parent_entry is not None:
                        parent_entry.children += 1
                    self._entries[key] = entry
                    self._used += self.block
                chain.append(key)
                parent_entry, parent = entry, entry.ident
            self._touch(chain)

    # -- encoder-decoder sources ---------------------------------------------------------------------------------

    def source(self, ids: list[int]) -> Source | None:
        """The cached encoder output of source `ids` and its cross-attention keys/values (counted in `stats`)."""
        key = ("source", tuple(ids))
        with self._lock:
            entry = self._entries.get(key)
            self._count(len(ids), len(ids) if entry is not None else 0)
            if entry is None:
                return None
            self._entries.move_to_end(key)
        found = Source(entry.hidden.clone(), [(k.clone(), v.clone()) for k, v in entry.kv])
        self._finished()
        return found

    def store_source(self, ids: list[int], hidden: torch.Tensor, cross_kv: KV) -> None:
        """Keep source `ids`' encoder output [1, source, d_model] and cross-attention keys/values (per layer
        [1, heads, source, dim]): copied here."""
        key = ("source", tuple(ids))
        if len(ids) > self.capacity or len(ids) == 0:
            return
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return
        entry = _Entry([(k.clone(), v.clone()) for k, v in cross_kv], len(ids), hidden.clone())
        self._finished()
        with self._lock:
            if key in self._entries or not self._make_room(len(ids)):
                return
            self._entries[key] = entry
            self._used += len(ids)

    # -- bookkeeping (under the lock) ----------------------------------------------------------------------------

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._used = 0

    def _count(self, queried: int, hit: int) -> None:
        self.stats += PrefixCacheCounts(queried, hit, 1 if hit else 0, 0 if hit else 1)

    def _touch(self, keys: list[object]) -> None:
        """Mark a chain (first block first) as just used: its first block the most recently."""
        for key in reversed(keys):
            self._entries.move_to_end(key)

    def _make_room(self, tokens: int, keep: _Entry | None = None) -> bool:
        """Forget least recently used entries until `tokens` more fit; False when they cannot (`keep`, the block a
        new one follows, and blocks with followers are not forgotten)."""
        while self._used + tokens > self.capacity:
            victim = next((key for key, entry in self._entries.items() if entry.children == 0 and entry is not keep),
                          None)
            if victim is None:
                return False
            entry = self._entries.pop(victim)
            self._used -= entry.tokens
            if entry.parent is not None:
                entry.parent.children -= 1
        return True

    def _finished(self) -> None:
        """On a GPU: wait until this thread's stream has run the copies just queued (see the module docstring)."""
        if self.device.type == "cuda":
            import torch

            torch.cuda.current_stream(self.device).synchronize()
