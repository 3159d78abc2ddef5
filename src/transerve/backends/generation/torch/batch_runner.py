"""The torch engine's batch runner (`BatchRunner`): the running batch, stepped through the model runner
(`model_runner`: the forward pass and the KV cache), and the thread counts each kind of call runs with
(`ThreadPolicy`). A part of its own because everything here touches the device and torch's threads; the scheduler
and token selection never do.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from transerve.backends.generation.torch.host_copies import to_device

if TYPE_CHECKING:
    import torch

    from transerve.backends.generation.torch.decoder_batch import DecoderBatch
    from transerve.backends.generation.torch.model_runner import ModelRunner

class ThreadPolicy:
    """How many threads each kind of work computes with. Joining work (the encoder call or prompt prefill:
    compute-bound) while at most `latency_rows` rows run (a lone request: idle cores, and its time to first token
    waits on it) runs on `latency_threads`; the rest on `load_threads` (intra_op_threads), which leaves other cores
    to the server and its clients: a step of a few rows reads every weight for little arithmetic and gains nothing
    from more threads. OpenMP's thread count (and MKL's) belongs to the calling thread, so each thread of the
    engine sets its own."""

    def __init__(self, device: torch.device, intra_op_threads: int, latency_threads: int, latency_rows: int) -> None:
        import torch

        self.device = device
        self.load_threads = intra_op_threads or torch.get_num_threads()
        self.latency_threads = latency_threads or cpu_count()
        self.latency_rows = latency_rows
        #: What the engine thread last set (0: nothing yet).
        self.current = 0
        #: Threads the joining thread computes with: it prepares waiting sequences' rows while the engine thread
        #: decodes, on the cores decoding leaves idle (on a GPU: the device's work, `load_threads` for the CPU
        #: side); there is no such thread when decoding uses every core (0).
        self.joining_threads = (
            self.load_threads if device.type != "cpu" else min(self.load_threads, cpu_count() - self.load_threads)
        )

    def start_thread(self, joining: bool) -> None:
        """At the start of an engine thread (`joining`: the joining thread, which keeps `joining_threads`). torch's
        lazy per-thread setup runs first, so that it cannot undo a count set later; and the thread's current CUDA
        device, which torch also keeps per thread (cuda:0 until set), becomes the engine's, so that the streams and
        graph recordings that name no device are on it."""
        import torch

        torch.get_num_threads()
        if self.device.type == "cuda" and self.device.index is not None:  # bare "cuda" is the current one
            torch.cuda.set_device(self.device)
        if joining:
            torch.set_num_threads(self.joining_threads)
        else:
            self.current = 0  # a new thread: nothing set yet

    def set(self, joining: bool, used_rows: int) -> None:
        """On the engine thread: the count for joining work (`joining`) or a step, with `used_rows` rows running."""
        import torch

        wanted = self.latency_threads if joining and used_rows <= self.latency_rows else self.load_threads
        if wanted != self.current:
            torch.set_num_threads(wanted)
            self.current = wanted


@dataclass(slots=True)
class StepPlan:
    """What the engine thread hands the batch runner for one step: the rows that join now (`new`: their batch, and
    their first decoder inputs or first logits) and, decoder-only with rows running, the prompts prefilled in the
    step's own forward (`prompts`: their inputs and rows per sequence, `ModelRunner.step_with_prompts`)."""

    new: tuple[DecoderBatch, torch.Tensor] | None = None
    prompts: tuple[list[list[int]], list[int]] | None = None


@dataclass(slots=True)
class StepResult:
    """What one step gives token selection: every row's logits [rows, vocab] (float32), in batch order."""

    logits: torch.Tensor


class BatchRunner:
    """The running batch on the device: its rows' caches (`DecoderBatch`), their next input tokens, and the model
    calls (`forward`) that step it. Used by the engine thread only."""

    def __init__(self, forward: ModelRunner, threads: ThreadPolicy) -> None:
        self.forward = forward
        self.threads = threads
        self.device = forward.device
        self.batch: DecoderBatch | None = None
        self.next_tokens: torch.Tensor | None = None

    def step(self, plan: StepPlan) -> StepResult | None:
        """One step: the running rows and the plan's new ones merged, then those of its prompts; None when no row
        runs."""
        import torch

        new, prompts = plan.new, plan.prompts

        if self.forward.encoder_decoder:  # new rows' first decoder inputs go through this step with the others'
            if new is not None:
                self._merge(new[0])
                self.next_tokens = new[1] if self.next_tokens is None else torch.cat((self.next_tokens, new[1]))
            if self.batch is None:
                return None
            self.threads.set(joining=False, used_rows=0)
            return StepResult(self.forward.step(self.batch, self.next_tokens).float())
        logits, fresh = None, None
        if self.batch is not None:
            self.threads.set(joining=False, used_rows=0)
            if prompts:
                logits, *fresh = self.forward.step_with_prompts(self.batch, self.next_tokens, *prompts)
            else:
                logits = self.forward.step(self.batch, self.next_tokens)
        for rows in (new, fresh):  # their prompts are in the cache already, and `rows[1]` holds their first logits
            if rows:
                self._merge(rows[0])
                logits = rows[1] if logits is None else torch.cat((logits, rows[1]))
        return None if logits is None else StepResult(logits.float())

    def feed(self, keep: list[int], next_tokens: list[int], same_sequences: bool) -> None:
        """After a step: keep the batch rows `keep`, in that order, with their next input tokens. `same_sequences`
        says that rows only moved among their own sequence's rows (beams), whose encoder states are all alike."""
        import torch

        self.next_tokens = None
        self.select(keep, same_sequences)
        if self.batch is not None:
            self.next_tokens = to_device(next_tokens, self.device, torch.long)

    def select(self, keep: list[int], same_sequences: bool = False) -> None:
        """Keep the batch rows `keep`, in that order (no-op when nothing changes)."""
        import torch

        if self.batch is None:
            return
        if not keep:
            self.clear()
            return
        if keep != list(range(self.batch.rows)):
            index = to_device(keep, self.device, torch.long)
            self.batch.select(index, decoder_only=same_sequences, order=keep)
            if self.next_tokens is not None:
                self.next_tokens = self.next_tokens.index_select(0, index)

    def clear(self) -> None:
        self.batch, self.next_tokens = None, None

    def _merge(self, batch: DecoderBatch) -> None:
        if self.batch is None:
            self.batch = batch
        else:
            self.batch.extend(batch)


def cpu_count() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
