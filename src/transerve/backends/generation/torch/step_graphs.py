"""The torch engine's decoding steps at fixed shapes over fixed buffers: replayed as CUDA graphs on a GPU.

An eager step launches every kernel of the model's forward from Python, hundreds of them for the t5-small and GPT-2
small shapes, and on a GPU the step then waits on the launches rather than on the device (the GPU mostly idle:
benchmarks/README.md, "Figures behind the code"). A CUDA graph records a step's kernels once and replays them with
one launch, but only at the shapes and tensor addresses it recorded. So a step here runs at bucketed shapes over
tensors that do not move:

- Every layer's self-attention keys/values (and cross-attention ones) live in buffers allocated once, of the
  engine's `max_batch_rows` rows and the longest history (source) a row may have, in `cache_buffers`' layout, so
  that the batch's own in-place joins, leaves and trims keep working in them. A batch whose caches lie elsewhere
  (new, or moved by a reallocation), or whose window reaches the buffer's end or has drifted far from its start,
  is copied in first (`_adopt`): rarely, not per step.
- A step runs R rows (the batch's rows rounded up to a power of two, spare rows computing nothing anyone reads)
  over the buffer's first T time steps (the window's end rounded up to `TIME_BUCKET`) and, encoder-decoder, its
  first S source steps; a prepared 4-D mask shows each row its own history. The new token's keys/values are
  written at the window's end, an index held in a device tensor (`write_at`), which is also the query's position
  for T5's relative position bias (T5 reads it as the cache's length, `PinnedLayer.get_seq_length`).
- One graph per (R, T, S), recorded at its first use; the graphs share one memory pool, and at most `MAX_GRAPHS`
  are kept. A step copies its inputs into its graph's tensors, replays it and copies the logits out.

On the CPU the same steps run eagerly (`capture=False`, for tests): the layout, masks and positions are checked
there against the engine's ordinary steps. A model whose forward cannot be recorded (it reads a value back, for
one) runs eager steps from then on, logged once.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from transerve.backends.generation.torch.cache_buffers import cache_layer, hold, span, window
from transerve.backends.generation.torch.fused_joins import FUSED_ATTENTION, full_attention_only

if TYPE_CHECKING:
    import torch

    from transerve.backends.generation.torch.decoder_batch import DecoderBatch
    from transerve.backends.generation.torch.model_loading import ModelFacts
    from transerve.backends.generation.torch.model_runner import ModelRunner

logger = logging.getLogger(__name__)

#: Time steps (and source steps) the attended span is rounded up to.
TIME_BUCKET = 64
#: The fewest rows a step runs (then powers of two up to the buffers' rows).
FEWEST_ROWS = 8
#: Steps left free before a window copied in, so that rows joining with longer histories fit in place.
LEFT_ROOM = 64
#: Recorded graphs kept; the least recently used goes beyond this.
MAX_GRAPHS = 64
#: Attention implementations whose masks are boolean (True: attend), as the prepared masks here are.
BOOLEAN_MASKS = ("sdpa", FUSED_ATTENTION)
#: Held while any engine of the process records a graph: starting a recording empties torch's cache of free device
#: memory, which fails while another recording is underway (several engines, or instances, on one GPU).
_RECORDING = threading.Lock()


@dataclass(slots=True)
class _Graph:
    """One shape's step: its input tensors (written before each run), its output, and its recording."""

    tokens: torch.Tensor
    positions: torch.Tensor
    write_at: torch.Tensor
    mask: torch.Tensor
    encoder_mask: torch.Tensor | None
    logits: torch.Tensor | None = None
    recording: Any = None


class StepGraphs:
    """Decoding steps of `runner`'s model at bucketed shapes (see the module docstring), for batches of at most
    `rows` rows, `time` self-attention steps and `source` source steps. `capture`: record CUDA graphs (a GPU);
    else run the same steps eagerly."""

    def __init__(self, runner: ModelRunner, rows: int, time: int, source: int, capture: bool) -> None:
        import torch

        self.runner = runner
        self.rows, self.time, self.source = rows, time, source
        self.capture = capture
        self.graphs: OrderedDict[tuple[int, int, int], _Graph] = OrderedDict()
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.cross_keys: list[torch.Tensor] = []
        self.cross_values: list[torch.Tensor] = []
        #: The encoder output's width (encoder-decoder models).
        self.width = 0
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        #: The stream graphs are warmed up and recorded on (each engine its own: torch's default one is shared).
        self.side_stream = torch.cuda.Stream(device=runner.device) if capture else None
        #: Why steps run eagerly from now on (None: they do not).
        self.off: str | None = None
        why = _unsuited(runner)
        if why:
            self._turn_off(why)

    def step(self, batch: DecoderBatch, tokens: torch.Tensor) -> torch.Tensor | None:
        """What `ModelRunner.step` does, at a bucketed shape: feeds each row its next token, grows `batch` by one
        step and returns the next-token logits [rows, vocab]; None when this batch does not fit the buffers (the
        caller steps it eagerly)."""
        import torch

        time = batch.mask.shape[1]
        source = batch.encoder_mask.shape[1] if batch.cross_kv is not None else 0
        if self.off or not batch.self_kv or batch.rows > self.rows or time >= self.time or source > self.source:
            return None
        if not self.keys and not self._allocate(batch):
            return None
        start = self._adopt(batch)
        end = start + time
        rows = batch.rows
        key = (_row_bucket(rows, self.rows), _bucket(end + 1, self.time), _bucket(source, self.source) if source else 0)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self._new_graph(key)
        self._fill(graph, batch, tokens, start, end)
        if graph.logits is None and not self._record(key, graph):
            return None
        self.graphs.move_to_end(key)
        if graph.recording is not None:
            graph.recording.replay()
        else:
            graph.logits = self._forward(key, graph)
        logits = graph.logits[:rows].to(torch.float32, copy=True)  # the next step overwrites the graph's output
        batch.grew([(span(k, rows, start, time + 1), span(v, rows, start, time + 1))
                    for k, v in zip(self.keys, self.values, strict=True)], batch.next_mask())
        return logits

    def _allocate(self, batch: DecoderBatch) -> bool:
        """The buffers, shaped after `batch`'s caches: whether they could be allocated."""
        import torch

        def buffer(like: torch.Tensor, time: int) -> torch.Tensor:
            return like.new_zeros((self.rows, like.shape[1], time, like.shape[3]))

        try:
            self.keys = [buffer(k, self.time) for k, _ in batch.self_kv]
            self.values = [buffer(v, self.time) for _, v in batch.self_kv]
            if batch.cross_kv is not None:
                self.cross_keys = [buffer(k, self.source) for k, _ in batch.cross_kv]
                self.cross_values = [buffer(v, self.source) for _, v in batch.cross_kv]
                self.width = batch.encoder_hidden.shape[2]
        except torch.OutOfMemoryError:
            self._turn_off(f"no memory for {self.rows} rows of {self.time} steps")
            return False
        size = sum(buffer.nbytes for buffer in (*self.keys, *self.values, *self.cross_keys, *self.cross_values))
        logger.info("decoding steps at fixed shapes%s: cache buffers of %d rows, %d steps%s: %.2f GiB",
                    " (CUDA graphs)" if self.capture else "", self.rows, self.time,
                    f", {self.source} source steps" if self.cross_keys else "", size / 2**30)
        return True

    def _adopt(self, batch: DecoderBatch) -> int:
        """Where `batch`'s window starts in the buffers, after copying its caches into them when they lie elsewhere,
        the window would reach the buffers' end, or more of the attended span would be stale steps before the
        window than steps in it."""
        time = batch.mask.shape[1]
        start = _start_in(batch.self_kv, self.keys, self.values)
        if start is None or start + time >= self.time or start > max(time, LEFT_ROOM):
            start = min(LEFT_ROOM, self.time - time - 1)
            batch.self_kv = [(_place(k, buffer_k, start), _place(v, buffer_v, start))
                             for (k, v), buffer_k, buffer_v in zip(batch.self_kv, self.keys, self.values, strict=True)]
        if batch.cross_kv is not None and _start_in(batch.cross_kv, self.cross_keys, self.cross_values) != 0:
            batch.cross_kv = [(_place(k, buffer_k, 0), _place(v, buffer_v, 0)) for (k, v), buffer_k, buffer_v
                              in zip(batch.cross_kv, self.cross_keys, self.cross_values, strict=True)]
        return start

    def _new_graph(self, key: tuple[int, int, int]) -> _Graph:
        import torch

        rows, time, source = key
        device = self.keys[0].device

        def longs() -> torch.Tensor:
            return torch.zeros(rows, dtype=torch.long, device=device)

        encoder_mask = torch.zeros((rows, 1, 1, source), dtype=torch.bool, device=device) if source else None
        return _Graph(longs(), longs(), torch.zeros(1, dtype=torch.long, device=device),
                      torch.zeros((rows, 1, 1, time), dtype=torch.bool, device=device), encoder_mask)

    def _fill(self, graph: _Graph, batch: DecoderBatch, tokens: torch.Tensor, start: int, end: int) -> None:
        """The step's inputs into `graph`'s tensors. Spare rows attend to their own new key (and first source
        step) only, so that everything they compute stays finite."""
        rows = batch.rows
        graph.tokens[:rows].copy_(tokens)
        graph.positions[:rows].copy_(batch.positions)
        graph.write_at.fill_(end)
        graph.mask.zero_()
        graph.mask[:rows, 0, 0, start:end].copy_(batch.mask)
        graph.mask[:, 0, 0, end] = True
        if graph.encoder_mask is not None:
            graph.encoder_mask.zero_()
            graph.encoder_mask[:rows, 0, 0, :batch.encoder_mask.shape[1]].copy_(batch.encoder_mask)
            graph.encoder_mask[rows:, 0, 0, 0] = True

    def _record(self, key: tuple[int, int, int], graph: _Graph) -> bool:
        """Make `graph` ready to run: record it (on a GPU; one eager run first, on a side stream, as recording
        needs); whether it could be. Beyond `MAX_GRAPHS`, the least recently used graph goes."""
        import torch

        if self.capture:
            device = self.keys[0].device
            try:
                with _RECORDING, torch.cuda.device(device):
                    decoding = torch.cuda.current_stream(device)
                    self.side_stream.wait_stream(decoding)
                    with torch.cuda.stream(self.side_stream):
                        self._forward(key, graph)
                    decoding.wait_stream(self.side_stream)
                    recording = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(recording, pool=self.pool, stream=self.side_stream,
                                          capture_error_mode="thread_local"):
                        graph.logits = self._forward(key, graph)
                    graph.recording = recording
            except Exception as error:  # noqa: BLE001 - any failure means eager steps, which still work
                self._turn_off(f"its forward could not be recorded as a CUDA graph ({error!r})")
                return False
        self.graphs[key] = graph
        while len(self.graphs) > MAX_GRAPHS:
            self.graphs.popitem(last=False)
        return True

    def _forward(self, key: tuple[int, int, int], graph: _Graph) -> torch.Tensor:
        """The model's forward over the buffers at `key`'s shape, from `graph`'s inputs: logits [rows, vocab]."""
        from transformers import DynamicCache, EncoderDecoderCache

        rows, time, source = key
        runner = self.runner
        pinned = _pinned_layer_class()
        cache = DynamicCache()
        cache.layers = [pinned(k[:rows, :, :time], v[:rows, :, :time], graph.write_at)
                        for k, v in zip(self.keys, self.values, strict=True)]
        if not runner.encoder_decoder:
            return runner.decoder_logits(graph.tokens, graph.mask, graph.positions[:, None], cache)
        cross = DynamicCache()
        cross.layers = [cache_layer(k[:rows, :, :source], v[:rows, :, :source])
                        for k, v in zip(self.cross_keys, self.cross_values, strict=True)]
        # Only the shape of the encoder's output is read: every cross-attention layer takes its keys from `cross`.
        hidden = self.keys[0].new_zeros(()).expand(rows, source, self.width)
        return runner.decoder_logits(graph.tokens, graph.mask, graph.positions[:, None],
                                     EncoderDecoderCache(cache, cross), hidden, graph.encoder_mask)

    def _turn_off(self, why: str) -> None:
        """Eager steps from now on. The buffers go with the graphs: a batch living in them keeps them only until it
        moves out (its next reallocation) or ends."""
        self.off = why
        self.graphs.clear()
        self.keys, self.values, self.cross_keys, self.cross_values = [], [], [], []
        logger.warning("decoding steps run eagerly, not as recorded graphs: %s", why)


def step_graphs_for(runner: ModelRunner, facts: ModelFacts, rows: int, kv_cache_tokens: int) -> StepGraphs:
    """The steps of an engine of `rows` rows: buffers for the longest decoder history a row may have (a
    decoder-only model's positions, an encoder-decoder model's as many decoder steps as its positions or, unbounded,
    its longest source allow; at most `kv_cache_tokens`) and the longest source, each plus the step being written,
    rounded up to `TIME_BUCKET`; recorded as CUDA graphs on a GPU."""
    history = min(facts.max_positions or facts.max_input_length, kv_cache_tokens)
    source = _round_up(facts.max_input_length) if facts.is_encoder_decoder else 0
    return StepGraphs(runner, rows, _round_up(history + 1), source, capture=runner.device.type == "cuda")


def _unsuited(runner: ModelRunner) -> str | None:
    """Why `runner`'s model cannot step here, None when it can. The prepared masks are boolean and attend to the
    whole history; the query's position is the write position in the buffers, which only relative positions and
    positions given per row leave right; and a recording keeps what the forward computed of the model itself."""
    config = runner.model.config
    if config._attn_implementation not in BOOLEAN_MASKS:
        return f"its attention ({config._attn_implementation!r}) takes masks of another kind"
    if not full_attention_only(config.get_text_config(decoder=True)):
        return "a sliding window could be outgrown"
    if not runner.per_row_positions:
        return "its decoder's positions cannot be set per row"
    if runner.mutable_forward:
        return "its forward changes the model (dynamic RoPE)"
    return None


def _row_bucket(rows: int, most: int) -> int:
    """`rows` rounded up to a power of two (at least `FEWEST_ROWS`), at most `most`."""
    bucket = FEWEST_ROWS
    while bucket < rows:
        bucket *= 2
    return min(bucket, most)


def _bucket(steps: int, most: int) -> int:
    """`steps` rounded up to a multiple of `TIME_BUCKET`, at most `most`."""
    return min(_round_up(steps), most)


def _round_up(steps: int) -> int:
    return -(-steps // TIME_BUCKET) * TIME_BUCKET


def _start_in(kv: list[tuple[torch.Tensor, torch.Tensor]], keys: list[torch.Tensor],
              values: list[torch.Tensor]) -> int | None:
    """Where `kv`'s window starts in the buffers `keys`/`values`, None when its tensors are not theirs. Every
    layer's caches go through the same joins, leaves, trims and reallocations, so the first layer's keys and the
    last layer's values stand for all (checking every layer costs a step more than it is worth)."""
    start = None
    for tensor, buffer in ((kv[0][0], keys[0]), (kv[-1][1], values[-1])):
        where = window(tensor)
        if where is None or tensor.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr():
            return None
        if where[1] != buffer.shape[2] or start not in (None, where[0]):
            return None
        start = where[0]
    return start


def _place(tensor: torch.Tensor, buffer: torch.Tensor, start: int) -> torch.Tensor:
    """`tensor` [rows, heads, time, dim] copied into `buffer`'s first rows from time step `start`: the view."""
    rows, _, time, _ = tensor.shape
    target = buffer[:rows, :, start:start + time]
    if tensor.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr():
        tensor = tensor.clone()  # moved within the buffer: source and target may overlap
    target.copy_(tensor)
    return target


@functools.cache
def _pinned_layer_class() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any]:
    from transformers.cache_utils import DynamicLayer

    class PinnedLayer(DynamicLayer):
        """A self-attention cache layer over a fixed span of the buffers: a step writes the new token's
        keys/values at `write_at` (a device tensor, so a recorded step writes where each replay says), and its
        length, which T5 takes for the query's position, is that same tensor."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, write_at: torch.Tensor) -> None:
            super().__init__()
            hold(self, keys, values)
            self.write_at = write_at

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.keys.index_copy_(2, self.write_at, key_states)
            self.values.index_copy_(2, self.write_at, value_states)
            return self.keys, self.values

        def get_seq_length(self) -> Any:
            return self.write_at[0]

    return PinnedLayer
