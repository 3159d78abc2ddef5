"""The torch engine's model calls (`ModelRunner`): prefill and decoding steps on a `DecoderBatch` (`decoder_batch`).

Rows join the batch at any step, so their histories differ in length. The self-attention keys/values of all rows
are kept left-padded to the longest history, with a mask that hides the padding; each row carries its own next
position, passed to the model as `position_ids` (decoder-only models) or through `RowPositions` (encoder-decoder
decoders with absolute position embeddings, which take no position ids: BART, Marian). Relative positions (T5) are
unaffected by left padding: T5's bias depends on key position minus query position only, both counted in the padded
layout, so a row with a shorter history (even an empty one) sees the same distances to its real keys.
Encoder-decoder rows also carry their encoder output and its mask, and their cross-attention keys/values,
right-padded to the longest source. New encoder-decoder rows join with an empty history (all padding) and consume
the decoder start token in the next step together with every other row, so joining runs no decoder step of its
own; new decoder-only rows join with their whole prompt in the cache and the logits after it (one forward pass
for all of them, or, on the CPU while rows run, the running rows' step itself: `fused_joins`). Rows leave by
index selection, after which padding no remaining row needs is trimmed away.

The cache tensors are our own: views of buffers with spare rows and time steps (`cache_buffers`), so that joining
rows are written into spare rows, leaving rows are replaced by moving only the rows that change places, and each
step writes one time step. Each forward wraps them in a transformers `DynamicCache` (`EncoderDecoderCache`) whose
layers the model extends by one step (`GrowingLayer`), and the grown tensors are read back.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import TYPE_CHECKING, Any

from transerve.backends.generation.torch.cache_buffers import append, cache_layer
from transerve.backends.generation.torch.decoder_batch import KV, DecoderBatch
from transerve.backends.generation.torch.fused_joins import Fused, fused, fused_layer_class, use_fused_joins
from transerve.backends.generation.torch.prefix_cache import Prefix, Source

if TYPE_CHECKING:
    import torch

    from transerve.backends.generation.torch.prefix_cache import PrefixCache
    from transerve.backends.generation.torch.step_graphs import StepGraphs

logger = logging.getLogger(__name__)


def _row_positions_class():
    import torch

    class RowPositions(torch.nn.Module):
        """Stands in for a decoder's absolute position embedding table, looking up each row's own position."""

        def __init__(self, table: torch.nn.Embedding) -> None:
            super().__init__()
            self.table = table
            self.offset = getattr(table, "offset", 0)
            self.position_ids: torch.Tensor | None = None

        def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            return torch.nn.functional.embedding(self.position_ids + self.offset, self.table.weight)

    return RowPositions


class ModelRunner:
    """Prefill and decoding steps of one transformers model on `DecoderBatch`es."""

    def __init__(
        self, model: Any, decoder_start_id: int | None, pad_id: int, capacity: int = 0, token_budget: int = 0,
    ) -> None:
        import torch

        self.model = model
        #: The most rows the caller runs together: the rows the caches' buffers get.
        self.capacity = capacity
        #: The engine's `kv_cache_tokens`, which bounds the rows of the caches' buffers at long histories.
        self.token_budget = token_budget
        self.device = model.device
        self.encoder_decoder = bool(model.config.is_encoder_decoder)
        self.decoder_start_id = decoder_start_id
        self.pad_id = pad_id
        self.positions = None
        #: Whether rows may sit at different steps: each row's positions reach the model (position ids, or a
        #: decoder position table looked up per row, or relative positions). A decoder whose position module is
        #: something else (e.g. M2M100's, computed from the cache length) only supports rows in lockstep.
        self.per_row_positions = "position_ids" in inspect.signature(model.forward).parameters
        if self.encoder_decoder:
            decoder = model.get_decoder()
            table = getattr(decoder, "embed_positions", None)
            if isinstance(table, torch.nn.Embedding):
                self.positions = _row_positions_class()(table)
                decoder.embed_positions = self.positions
            self.per_row_positions = table is None or self.positions is not None
        #: Whether the model computes the logits of the last positions only when asked (transformers' causal LMs).
        self.logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        #: The decoder's cross-attention modules in layer order, where their names are known (T5, BART family).
        self.cross_attention = _cross_attention_modules(model) if self.encoder_decoder else []
        self.mutable_forward = _mutable_forward(model.config.get_text_config(decoder=True))
        #: The keyword each call below passes its cache by (`cache` in current transformers; `past_key_values`,
        #: which they deprecate with a FutureWarning per call, in older ones).
        self.cache_keyword = _cache_keyword(model.forward)
        self.decoder_cache_keyword = _cache_keyword(model.get_decoder().forward) if self.encoder_decoder else ""
        self.cross_cache_keyword = _cache_keyword(self.cross_attention[0].forward) if self.cross_attention else ""
        #: Whether joining prompts are prefilled in the running rows' step (`fused_joins`): decoder-only models on
        #: the CPU, where a step is bound by reading the weights, whose positions reach the model per token.
        self.fuses_joins = (
            not self.encoder_decoder and self.device.type == "cpu" and self.per_row_positions
            and self.logits_to_keep and not self.mutable_forward and use_fused_joins(model)
        )
        #: Steps at bucketed shapes over fixed buffers, recorded as CUDA graphs on a GPU (`step_graphs`), where the
        #: engine set them up; None: every step runs eagerly.
        self.graphs: StepGraphs | None = None
        #: Prompt prefixes' (encoder-decoder: sources') caches kept for later requests (`prefix_cache`), where the
        #: engine set one up and the model allows it (`caches_prefixes`).
        self.prefixes: PrefixCache | None = None

    @property
    def caches_prefixes(self) -> bool:
        """Whether a prompt's start may come from another prompt's cache: always for an encoder's output; for a
        decoder-only model, where positions reach the model per token and its forward does not rescale RoPE by
        the sequence's length."""
        return self.encoder_decoder or (self.per_row_positions and not self.mutable_forward)

    def _tensor(self, values: Any) -> torch.Tensor:
        import torch

        return torch.tensor(values, dtype=torch.long, device=self.device)

    @property
    def concurrent_joins(self) -> bool:
        """Whether new rows may be computed in another thread while `step` runs: not when their cross-attention
        keys/values come from a decoder run, which shares `positions` with the step, nor when the model's forward
        changes the model (dynamic or longrope RoPE rescale their frequencies in place)."""
        return not self.mutable_forward and (not self.encoder_decoder or bool(self.cross_attention))

    def new_rows(self, inputs: list[list[int]], repeats: list[int]) -> tuple[DecoderBatch, torch.Tensor]:
        """`encode` (encoder-decoder) or `prefill` (decoder-only)."""
        return self.encode(inputs, repeats) if self.encoder_decoder else self.prefill(inputs, repeats)

    def encode(self, sources: list[list[int]], repeats: list[int]) -> tuple[DecoderBatch, torch.Tensor]:
        """New encoder-decoder sequences' rows, ready to join the running batch; sequence i gets `repeats[i]`
        identical rows (its beams). Returns their batch and each row's first decoder input ([rows]: the start
        token), which the next `step` consumes together with every other row's token: joining costs one encoder
        call for all new sequences and no decoder step of its own (their self-attention cache starts empty)."""
        batch = self._encode(sources)
        rows = self._repeat(repeats)
        if len(rows) != len(sources):
            batch.select(self._tensor(rows), order=rows)
        return batch, self._tensor([self.decoder_start_id] * len(rows))

    def prefill(self, prompts: list[list[int]], repeats: list[int]) -> tuple[DecoderBatch, torch.Tensor]:
        """New decoder-only sequences' rows (sequence i gets `repeats[i]` identical rows) with their whole prompts
        in the cache, left-padded, and the next-token logits after each prompt ([rows, vocab]): one forward pass
        for all new sequences, the LM head on the last position only. Their first tokens are chosen with the
        running rows' next ones, so a sequence that starts alone reads the weights once before its first token.
        Where a prompt starts with a cached prefix (`prefixes`), or two start with the same whole block, each
        prompt gets a forward of its own, over what follows its cached prefix, looked up once the prompts before it
        have kept their blocks: a load whose prompts share a system prompt computes it once."""

        batch = None
        if self._shared_starts(prompts):
            try:
                parts = [self._prefill([ids], self._prefixes([ids])[0]) for ids in prompts]
            except Exception:  # the cache must never fail a request: prefill them in full
                logger.exception("prefilling after cached prefixes failed; prefilling in full")
            else:
                batch, logits = self._stacked(parts) if len(parts) > 1 else parts[0]
        elif self.prefixes is not None:
            self.prefixes.missed(prompts)
        if batch is None:
            batch, logits = self._prefill(prompts)
        rows = self._repeat(repeats)
        if len(rows) != len(prompts):
            index = self._tensor(rows)
            batch.select(index, order=rows)
            logits = logits.index_select(0, index)
        return batch, logits

    def _stacked(self, parts: list[tuple[DecoderBatch, torch.Tensor]]) -> tuple[DecoderBatch, torch.Tensor]:
        """One-row batches (prompts prefilled one at a time) as one batch, left-padded to the longest, and their
        logits: one allocation per layer's keys or values, where joining them one by one (`DecoderBatch.extend`)
        would give the first a buffer of `capacity` rows and grow it as longer prompts come."""
        import torch

        lengths = [batch.lengths[0] for batch, _ in parts]
        longest = max(lengths)

        def stacked(tensors: list[torch.Tensor]) -> torch.Tensor:  # each [1, heads, length, dim]
            first = tensors[0]
            out = first.new_zeros((len(tensors), first.shape[1], longest, first.shape[3]))
            for row, (tensor, length) in enumerate(zip(tensors, lengths, strict=True)):
                out[row, :, longest - length:] = tensor[0, :, tensor.shape[2] - length:]
            return out

        kv = [(stacked([batch.self_kv[layer][0] for batch, _ in parts]),
               stacked([batch.self_kv[layer][1] for batch, _ in parts]))
              for layer in range(len(parts[0][0].self_kv))]
        mask = self._tensor([[0] * (longest - length) + [1] * length for length in lengths])
        batch = DecoderBatch(kv, mask, mask.sum(-1), capacity=self.capacity, token_budget=self.token_budget,
                             lengths=lengths)
        return batch, torch.cat([logits for _, logits in parts])

    def _shared_starts(self, prompts: list[list[int]]) -> bool:
        """Whether a prompt starts with a cached prefix, or two with the same whole block (`prefill`)."""
        if self.prefixes is None:
            return False
        try:
            if any(self.prefixes.probe(ids) for ids in prompts):
                return True
        except Exception:
            logger.exception("looking up prompt prefixes failed; prefilling in full")
            return False
        block = self.prefixes.block
        starts = [tuple(ids[:block]) for ids in prompts if len(ids) > block]
        return len(set(starts)) < len(starts)

    def _prefixes(self, prompts: list[list[int]]) -> list[Prefix]:
        """Each prompt's cached prefix (length 0 without one); none at all where there is no cache or it fails."""
        if self.prefixes is None:
            return [Prefix() for _ in prompts]
        try:
            return [self.prefixes.lookup(ids) for ids in prompts]
        except Exception:  # the cache is an optimisation: a cold prefill serves the request
            logger.exception("looking up prompt prefixes failed; prefilling in full")
            return [Prefix() for _ in prompts]

    def _prefill(self, prompts: list[list[int]], prefix: Prefix | None = None) -> tuple[DecoderBatch, torch.Tensor]:
        """One forward over `prompts` (left-padded), or over one prompt past its cached `prefix`, whose
        keys/values start the cache; the prompts' new whole blocks are kept (`prefixes`)."""
        import torch
        from transformers import DynamicCache

        cache = DynamicCache()
        done = prefix.length if prefix is not None else 0
        if done:
            (ids_,) = prompts
            cache.layers = [cache_layer(k, v) for k, v in prefix.kv]
            mask = self._tensor([[1] * len(ids_)])
            ids = self._tensor([ids_[done:]])
            positions = torch.arange(done, len(ids_), device=self.device)[None]
        else:
            longest = max(len(ids) for ids in prompts)
            mask = self._tensor([[0] * (longest - len(x)) + [1] * len(x) for x in prompts])
            ids = self._tensor([[self.pad_id] * (longest - len(x)) + list(x) for x in prompts])
            positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        keep = {"logits_to_keep": 1} if self.logits_to_keep else {}
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **{self.cache_keyword: cache},
            **keep,
        )
        kv = [(layer.keys, layer.values) for layer in cache.layers]
        self._remember(prompts, kv, [done] * len(prompts))
        batch = DecoderBatch(kv, mask, mask.sum(-1), capacity=self.capacity, token_budget=self.token_budget,
                             lengths=[len(ids) for ids in prompts])
        return batch, out.logits[:, -1, :]

    def _remember(self, prompts: list[list[int]], kv: KV, done: list[int]) -> None:
        """Keep the whole blocks of `prompts`, whose keys/values `kv` holds left-padded, past the first `done[i]`
        tokens of each (those found cached, `prefixes`); a failure only leaves them out."""
        if self.prefixes is None:
            return
        try:
            longest = kv[0][0].shape[2]
            for row, (ids, cached) in enumerate(zip(prompts, done, strict=True)):
                start = longest - len(ids)
                self.prefixes.store(ids, [(k[row, :, start:], v[row, :, start:]) for k, v in kv], cached)
        except Exception:  # e.g. out of device memory: the cache is emptied, the request goes on
            logger.exception("keeping prompt prefixes failed; the prefix cache is emptied")
            self.prefixes.clear()

    @staticmethod
    def _repeat(repeats: list[int]) -> list[int]:
        """The batch rows of sequences that get `repeats[i]` rows each."""
        return [i for i, count in enumerate(repeats) for _ in range(count)]

    def _encode(self, sources: list[list[int]]) -> DecoderBatch:
        """The rows of `sources`, their encoder output and cross-attention keys/values cached (`prefixes`) or
        computed in one encoder call (`_encode_all`); those computed are kept for later requests."""
        found = self._sources(sources)
        missing = [ids for ids, source in zip(sources, found, strict=True) if source is None]
        computed = self._encode_all(missing) if missing else None
        if computed is not None and self.prefixes is not None:
            self._remember_sources(missing, computed)
        if computed is not None and len(missing) == len(sources):
            return computed
        parts, row = [], 0
        for ids, source in zip(sources, found, strict=True):
            if source is None:
                parts.append(computed.rows_range(row, row + 1, own=True))
                row += 1
            else:
                parts.append(self._source_rows(ids, source))
        batch = parts[0]
        for other in parts[1:]:
            batch.extend(other)
        return batch

    def _sources(self, sources: list[list[int]]) -> list[Source | None]:
        """Each source's cached encoder output (None where there is none, or no cache, or it fails)."""
        if self.prefixes is None:
            return [None] * len(sources)
        try:
            return [self.prefixes.source(ids) for ids in sources]
        except Exception:  # the cache is an optimisation: the encoder serves the request
            logger.exception("looking up cached sources failed; encoding them")
            return [None] * len(sources)

    def _source_rows(self, ids: list[int], source: Source) -> DecoderBatch:
        """The row of a source found cached, as `_encode_all` would have made it."""
        import torch

        empty = self._tensor([[]])
        positions = torch.zeros(1, dtype=torch.long, device=self.device)
        batch = DecoderBatch([], empty, positions, None, source.hidden, self._tensor([[1] * len(ids)]),
                             self.capacity, self.token_budget, [0], [len(ids)])
        batch.cross_kv = source.cross_kv
        return batch

    def _remember_sources(self, sources: list[list[int]], batch: DecoderBatch) -> None:
        """Keep each source's encoder output and cross-attention keys/values, right-padded in `batch`."""
        try:
            for row, ids in enumerate(sources):
                length = len(ids)
                self.prefixes.store_source(
                    ids, batch.encoder_hidden[row:row + 1, :length],
                    [(k[row:row + 1, :, :length], v[row:row + 1, :, :length]) for k, v in batch.cross_kv],
                )
        except Exception:  # e.g. out of device memory: the cache is emptied, the request goes on
            logger.exception("keeping encoder outputs failed; the prefix cache is emptied")
            self.prefixes.clear()

    def _encode_all(self, sources: list[list[int]]) -> DecoderBatch:
        """One encoder call for all `sources` (right-padded, masked), and their cross-attention keys/values; the
        decoder's self-attention cache starts empty (position 0)."""
        import torch

        longest = max(len(ids) for ids in sources)
        ids = self._tensor([list(x) + [self.pad_id] * (longest - len(x)) for x in sources])
        mask = self._tensor([[1] * len(x) + [0] * (longest - len(x)) for x in sources])
        hidden = self.model.get_encoder()(input_ids=ids, attention_mask=mask).last_hidden_state
        rows = len(sources)
        empty = self._tensor([[]] * rows)
        positions = torch.zeros(rows, dtype=torch.long, device=self.device)
        batch = DecoderBatch([], empty, positions, None, hidden, mask, self.capacity, self.token_budget, [0] * rows,
                             [len(ids) for ids in sources])
        batch.cross_kv = self._cross_kv(batch)
        return batch

    def _cross_kv(self, batch: DecoderBatch) -> KV:
        """Each decoder layer's cross-attention keys/values of `batch`'s encoder output, computed by the layers'
        own cross-attention modules (so their projections and head layout are the model's); a decoder whose
        modules are not known by name runs once on the start token instead, its output discarded."""
        import torch
        from transformers import DynamicCache, EncoderDecoderCache

        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        hidden = batch.encoder_hidden
        if self.cross_attention:
            query = hidden[:, :1]
            for module in self.cross_attention:
                module(hidden_states=query, key_value_states=hidden, **{self.cross_cache_keyword: cache})
        else:
            start = torch.full((batch.rows, 1), self.decoder_start_id, dtype=torch.long, device=self.device)
            if self.positions is not None:
                self.positions.position_ids = batch.positions[:, None]
            self.model.get_decoder()(
                input_ids=start, encoder_hidden_states=hidden, encoder_attention_mask=batch.encoder_mask,
                use_cache=True, **{self.decoder_cache_keyword: cache},
            )
        return [(layer.keys, layer.values) for layer in cache.cross_attention_cache.layers]

    def step(self, batch: DecoderBatch, tokens: torch.Tensor) -> torch.Tensor:
        """Feed each row's next token ([rows]); grow `batch` by one step; return next-token logits [rows, vocab]."""
        from transformers import DynamicCache, EncoderDecoderCache

        if self.graphs is not None:
            logits = self.graphs.step(batch, tokens)
            if logits is not None:
                return logits

        cache = DynamicCache()
        cache.layers = [cache_layer(k, v, _growing_layer_class()) for k, v in batch.self_kv]
        for layer in cache.layers:
            layer.capacity, layer.token_budget = batch.capacity, batch.token_budget
        if not self.encoder_decoder:
            return self._decode(batch, tokens, cache)
        cross = DynamicCache()
        cross.layers = [cache_layer(k, v) for k, v in batch.cross_kv]
        return self._decode(batch, tokens, EncoderDecoderCache(cache, cross))

    def step_with_prompts(
        self, batch: DecoderBatch, tokens: torch.Tensor, prompts: list[list[int]], repeats: list[int],
    ) -> tuple[torch.Tensor, DecoderBatch, torch.Tensor]:
        """`step` and `prefill` in one forward pass (`fused_joins`, where `fuses_joins`): feeds each running row its
        next token and grows `batch` by one step, and computes the new sequences' rows (sequence i gets
        `repeats[i]` rows); a prompt whose start is cached (`prefixes`) feeds only the tokens after it. Returns the
        running rows' next-token logits, the new rows' batch and their logits."""
        import torch
        from transformers import DynamicCache

        rows = batch.rows
        found = self._prefixes(prompts)
        fed = [ids[prefix.length:] for ids, prefix in zip(prompts, found, strict=True)]
        spans, start = [], rows
        for ids in fed:
            spans.append((start, start + len(ids)))
            start += len(ids)
        ids = torch.cat((tokens, self._tensor([token for prompt in fed for token in prompt])))[None]
        positions = torch.cat([batch.positions] + [torch.arange(prefix.length, len(ids_), device=self.device)
                                                   for ids_, prefix in zip(prompts, found, strict=True)])
        mask = batch.next_mask()
        plan = Fused(rows, spans, mask.bool()[:, None, None, :],
                     prefixes=[prefix.kv or None for prefix in found] if any(p.length for p in found) else [])
        layer_class = fused_layer_class()
        cache = DynamicCache()
        cache.layers = [layer_class(plan, index, k, v, batch.capacity, batch.token_budget)
                        for index, (k, v) in enumerate(batch.self_kv)]
        keep = self._tensor(list(range(rows)) + [stop - 1 for _, stop in spans])
        with fused(plan):
            # A prepared (4-D) mask ends transformers' mask building at once; the fused attention ignores it.
            out = self.model(
                input_ids=ids, attention_mask=plan.mask[:1, :, :, :1], position_ids=positions[None], use_cache=True,
                logits_to_keep=keep, **{self.cache_keyword: cache},
            )
        if len(plan.attended) != len(cache.layers):  # the caches grew, but what attention computed is not ours
            raise RuntimeError(f"{len(cache.layers) - len(plan.attended)} of the model's attention layers did not "
                               "run the fused attention: joining prompts cannot be prefilled in the step")
        batch.grew([(layer.keys, layer.values) for layer in cache.layers], mask)
        logits = out.logits[0]
        new = self._prompt_rows(prompts, found, cache.layers)
        self._remember(prompts, new.self_kv, [prefix.length for prefix in found])
        new_logits = logits[rows:]
        repeated = self._repeat(repeats)
        if len(repeated) != len(prompts):
            index = self._tensor(repeated)
            new.select(index, order=repeated)
            new_logits = new_logits.index_select(0, index)
        return logits[:rows], new, new_logits

    def _prompt_rows(self, prompts: list[list[int]], found: list[Prefix], layers: list[Any]) -> DecoderBatch:
        """The rows of `prompts` from a fused forward's cache `layers`: each prompt's keys/values (its cached start's,
        `found`, then those computed) left-padded to the longest, as `prefill` leaves them."""
        longest = max(len(ids) for ids in prompts)
        mask = self._tensor([[0] * (longest - len(x)) + [1] * len(x) for x in prompts])

        def left_padded(computed: torch.Tensor, layer: int, part: int) -> torch.Tensor:  # [1, heads, fed, dim]
            padded = computed.new_zeros((len(prompts), computed.shape[1], longest, computed.shape[3]))
            start = 0
            for row, (ids, prefix) in enumerate(zip(prompts, found, strict=True)):
                first, fed = longest - len(ids), len(ids) - prefix.length
                if prefix.length:
                    padded[row, :, first:first + prefix.length] = prefix.kv[layer][part][0]
                padded[row, :, longest - fed:] = computed[0, :, start:start + fed]
                start += fed
            return padded

        kv = [(left_padded(layer.prompt_keys, index, 0), left_padded(layer.prompt_values, index, 1))
              for index, layer in enumerate(layers)]
        return DecoderBatch(kv, mask, mask.sum(-1), capacity=self.capacity, token_budget=self.token_budget,
                            lengths=[len(ids) for ids in prompts])

    def _decode(self, batch: DecoderBatch, tokens: torch.Tensor, cache: Any) -> torch.Tensor:
        mask = batch.next_mask()
        logits = self.decoder_logits(tokens, mask, batch.positions[:, None], cache, batch.encoder_hidden,
                                     batch.encoder_mask)
        self_cache = cache.self_attention_cache if self.encoder_decoder else cache
        batch.grew([(layer.keys, layer.values) for layer in self_cache.layers], mask)
        return logits

    def decoder_logits(self, tokens: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any,
                       encoder_hidden: torch.Tensor | None = None, encoder_mask: torch.Tensor | None = None,
                       ) -> torch.Tensor:
        """The model's forward on one token per row (`tokens` [rows]) at `positions` ([rows, 1]) with `cache` (an
        `EncoderDecoderCache` for encoder-decoder models, which take the encoder's output and mask too) and the
        decoder's `mask` (2-D, or prepared 4-D); the next-token logits [rows, vocab]."""
        from transformers.modeling_outputs import BaseModelOutput

        if self.encoder_decoder:
            if self.positions is not None:
                self.positions.position_ids = positions
            out = self.model(
                encoder_outputs=BaseModelOutput(last_hidden_state=encoder_hidden), attention_mask=encoder_mask,
                decoder_input_ids=tokens[:, None], decoder_attention_mask=mask, use_cache=True,
                **{self.cache_keyword: cache},
            )
        else:
            out = self.model(
                input_ids=tokens[:, None], attention_mask=mask, position_ids=positions, use_cache=True,
                **{self.cache_keyword: cache},
            )
        return out.logits[:, -1, :]


def _cache_keyword(function: Any) -> str:
    """The name `function` takes its key/value cache by: `cache` where it has one, else `past_key_values`."""
    return "cache" if "cache" in inspect.signature(function).parameters else "past_key_values"


def _mutable_forward(config: Any) -> bool:
    """Whether the model's forward changes the model: RoPE of type dynamic or longrope recomputes its frequencies."""
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(parameters, dict):
        return False
    kinds = [parameters.get("rope_type")] + [v.get("rope_type") for v in parameters.values() if isinstance(v, dict)]
    return any(kind in ("dynamic", "longrope") for kind in kinds)


#: What encoder-decoder models of transformers name their decoder layers' cross-attention modules.
CROSS_ATTENTION_NAMES = ("EncDecAttention", "encoder_attn")


def _cross_attention_modules(model: Any) -> list[Any]:
    """One cross-attention module per decoder layer, in layer order; empty when the names are not known."""
    decoder = model.get_decoder()
    found = [
        module for name, module in decoder.named_modules()
        if name.rsplit(".", 1)[-1] in CROSS_ATTENTION_NAMES and isinstance(getattr(module, "layer_idx", None), int)
    ]
    layers = getattr(model.config, "decoder_layers", None) or getattr(model.config, "num_decoder_layers", None)
    if [module.layer_idx for module in found] != list(range(len(found))) or (layers and len(found) != layers):
        return []
    return found


@functools.cache
def _growing_layer_class() -> type:
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        """A self-attention cache layer whose keys/values are views of our buffers (`cache_buffers`): a step
        writes the new token's keys/values in place instead of concatenating (copying) the whole history, which
        `DynamicLayer` does at every step."""

        #: Rows a buffer this layer has to reallocate gets.
        capacity = 0
        #: Tokens such a buffer may hold at its length (0: no bound).
        token_budget = 0

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.keys = append(self.keys, key_states, self.capacity, self.token_budget)
            self.values = append(self.values, value_states, self.capacity, self.token_budget)
            return self.keys, self.values

    return GrowingLayer
