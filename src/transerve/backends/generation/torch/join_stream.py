"""Where the joining thread's device work runs, and how the rows it prepares pass to the engine thread.

A GPU runs the kernels queued on one stream in order, so an encoder call or prompt prefill that the joining thread
queues on the decoding stream delays the next decoding step by its whole length, though its host work overlapped.
On a CUDA stream of its own it runs beside the steps. Two things then keep the handover right: the decoding stream
waits for an event recorded after the joining work, so a step never reads rows before they are complete; and every
tensor handed over is marked as used on the decoding stream (`record_stream`), because torch's caching allocator
would otherwise give a freed tensor's memory back to the joining stream at once, while decoding kernels queued
before the free may still read it. On the CPU kernels run as they are called, the lock that hands rows over already
orders them, and this does nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from transerve.backends.generation.torch.decoder_batch import DecoderBatch


@dataclass(slots=True)
class Prepared:
    """A sequence's rows computed before it joins: their batch, their first decoder inputs (encoder-decoder) or
    first logits (decoder-only), and, when computed on the joining stream, the event that marks them complete."""

    batch: DecoderBatch
    first: torch.Tensor
    ready: Any = None


class JoinStream:
    """The joining thread's stream on a GPU (None elsewhere), and the handover of what it computes."""

    def __init__(self, device: torch.device) -> None:
        import torch

        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def joining(self) -> Iterator[None]:
        """Queue the device work of the block on the joining stream."""
        if self.stream is None:
            yield
            return
        import torch

        with torch.cuda.stream(self.stream):
            yield

    def prepared(self, batch: DecoderBatch, first: torch.Tensor) -> Prepared:
        """`batch` and `first`, just computed inside `joining`, with the event that completes them."""
        if self.stream is None:
            return Prepared(batch, first)
        import torch

        ready = torch.cuda.Event()
        ready.record(self.stream)
        return Prepared(batch, first, ready)

    @staticmethod
    def receive(prepared: Prepared) -> tuple[DecoderBatch, torch.Tensor]:
        """On the engine thread, before its stream reads `prepared`: wait for its event there and mark its
        tensors as used there."""
        if prepared.ready is None:
            return prepared.batch, prepared.first
        import torch

        decoding = torch.cuda.current_stream(prepared.first.device)
        decoding.wait_event(prepared.ready)
        for tensor in (prepared.first, *prepared.batch.tensors()):
            tensor.record_stream(decoding)
        return prepared.batch, prepared.first
