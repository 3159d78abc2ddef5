"""Per-row grammar state and the step's token masks: before a token is chosen, every constrained row of the
running batch gets its bitmask (one llguidance call fills them all, in parallel), which is applied to that row's
logits (disallowed tokens to -inf); rows without a grammar are left as they are. After the choice each constrained
row consumes its token, and ends when its grammar has no more tokens to take. An end token is allowed only where
the grammar accepts, so a constrained output ends complete or at its token budget."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class GrammarError(RuntimeError):
    """A row's matcher went into an error state: its sequence fails, the batch goes on."""


class BatchMasks:
    """The bitmask buffer of one engine's batch ([rows, ceil(vocab / 32)] int32 on the host: pinned on a GPU
    host, so that its copy to the device does not block) and the executor that fills it. The next step refills it
    only after this step's choice was copied back to the host, which waits for the device: the copy is done by
    then."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        import llguidance
        import torch

        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.device = device
        self.executor = llguidance.LLExecutor()
        self._pinned = device.type == "cuda"
        self._buffer = torch.zeros((0, self.words), dtype=torch.int32)
        self.shifts = torch.arange(32, dtype=torch.int32, device=device)

    def buffer(self, rows: int) -> torch.Tensor:
        """A host buffer of at least `rows` masks (grown by doubling; never shrunk)."""
        import torch

        if self._buffer.shape[0] < rows:
            size = max(rows, 2 * self._buffer.shape[0], 8)
            self._buffer = torch.zeros((size, self.words), dtype=torch.int32, pin_memory=self._pinned)
        return self._buffer[:rows]


class RowGrammar:
    """One row's matcher and the end tokens that may close it (the sequence's end ids)."""

    __slots__ = ("matcher", "end_ids", "masks")

    def __init__(self, matcher: Any, end_ids: list[int], masks: BatchMasks) -> None:
        self.matcher = matcher
        self.end_ids = [token for token in end_ids if 0 <= token < masks.vocab_size]
        self.masks = masks

    def copy(self) -> RowGrammar:
        """The same state, to go on apart (a beam that branches)."""
        return RowGrammar(self.matcher.deep_copy(), self.end_ids, self.masks)

    def ends_with(self, token: int) -> bool:
        """Whether `token` would end the row (`consume`'s answer), this state left as it is; False for a token the
        grammar does not allow (a beam candidate with no likelihood left)."""
        if token in self.end_ids:
            return True
        trial = self.matcher.deep_copy()
        return trial.consume_token(token) and trial.is_stopped()

    def consume(self, token: int) -> bool:
        """Advance past the chosen `token`; True when the row is to end now (an end token, or the grammar takes
        no more tokens). GrammarError if the token was not one the grammar allowed."""
        if token in self.end_ids:
            return True
        if not self.matcher.consume_token(token):
            raise GrammarError(f"the output left its grammar: {self.matcher.get_error()}")
        return self.matcher.is_stopped()


def apply_masks(rows: list[tuple[int, RowGrammar]], logits: torch.Tensor) -> None:
    """Mask `logits` ([batch rows, vocab], in place) for each (row, grammar) of `rows` (one engine's: they share
    its `BatchMasks`). The host fills the masks; they are added to the logits as 0 / -inf (`_bias`)."""
    import torch

    if not rows:
        return
    masks = rows[0][1].masks
    count = len(rows)
    buffer = masks.buffer(count)
    for _, grammar in rows:
        if grammar.matcher.is_error():
            raise GrammarError(f"a grammar is in an error state: {grammar.matcher.get_error()}")
    masks.executor.unsafe_compute_mask_ptr([(grammar.matcher, index) for index, (_, grammar) in enumerate(rows)],
                                           buffer.data_ptr(), masks.words * 4, count)
    _end_tokens(rows, buffer)
    bias = _bias(buffer, masks, logits.shape[1])
    places = [row for row, _ in rows]
    if places == list(range(places[0], places[0] + count)):
        logits[places[0]:places[0] + count].add_(bias)
    else:
        index = torch.tensor(places, dtype=torch.long).to(logits.device, non_blocking=True)
        logits.index_add_(0, index, bias.to(logits.dtype))  # float16 logits on a GPU: index_add_ takes one dtype


#: The bits of float32 -inf (0xFF800000) as an int32: `(bit - 1) & NEG_INF_BITS` is 0.0 for an allowed token and
#: -inf for a banned one, read as float32. Added to the logits, a mask costs integer work and one addition, where
#: a boolean `masked_fill_` over the vocabulary was several times slower on the CPU.
NEG_INF_BITS = -8388608


def _bias(buffer: torch.Tensor, masks: BatchMasks, vocab: int) -> torch.Tensor:
    """The masks as additive 0 / -inf logits, [rows, vocab], on the logits' device. On the CPU NumPy unpacks the
    bits (one thread, no parallel region to wait on); elsewhere the packed masks go to the device in one copy,
    without waiting for it, and are unpacked there."""
    import numpy as np
    import torch

    if masks.device.type == "cpu":
        bits = np.unpackbits(buffer.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        return torch.from_numpy(((bits.astype(np.int32) - 1) & np.int32(NEG_INF_BITS)).view(np.float32))
    return device_bias(buffer.to(masks.device, non_blocking=True), masks.shifts, vocab)


def device_bias(packed: torch.Tensor, shifts: torch.Tensor, vocab: int) -> torch.Tensor:
    """`_bias` computed by torch where `packed` lies (`shifts`: 0..31 there), for a device other than the CPU."""
    import torch

    bits = ((packed[:, :, None] >> shifts) & 1).view(packed.shape[0], -1)[:, :vocab]
    return ((bits - 1) & NEG_INF_BITS).view(torch.float32)


def _end_tokens(rows: list[tuple[int, RowGrammar]], buffer: torch.Tensor) -> None:
    """Each row's end tokens allowed exactly where its grammar accepts (llguidance knows the model's end-of-sequence
    token only; a request may name others)."""
    host = buffer.numpy()
    for index, (_, grammar) in enumerate(rows):
        accepting = grammar.matcher.is_accepting()
        for token in grammar.end_ids:
            word, bit = token >> 5, token & 31
            value = int(host[index, word]) & 0xFFFFFFFF
            value = value | (1 << bit) if accepting else value & ~(1 << bit)
            host[index, word] = value - (1 << 32) if value >= 1 << 31 else value
