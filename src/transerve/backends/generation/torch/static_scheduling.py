"""Schedulings kept to compare in-flight batching against, outside the engine's production path: the benchmarks
(benchmarks/inflight_vs_request.py) pass one to `TorchEngine`, and a model config's `scheduling` parameter picks
one by name (docs/generation.md).

`Static` is request-level batching as FasterTransformer's backend and transformers' `generate` run it: a finished
sequence's result is sent, but its rows decode on (their tokens discarded) until the last sequence of the batch
ends. Its rows are taken by stand-ins, greedy sequences that never end and answer no one; they may outgrow
`kv_cache_tokens`, and run past a model's last position (clamped there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from transerve.backends.generation.engine import DecodingOptions, GenerationRequest
from transerve.backends.generation.torch.sampling import TokenRules
from transerve.backends.generation.torch.scheduler import RequestLevel, Scheduling
from transerve.backends.generation.torch.sequence import Sequence
from transerve.core.errors import invalid_arg

if TYPE_CHECKING:
    from transerve.backends.generation.torch.decoder_batch import DecoderBatch
    from transerve.backends.generation.torch.selection import Choices, Stay

#: A stand-in decodes until its batch ends, so its length limit is never reached.
_ENDLESS = DecodingOptions(max_new_tokens=1 << 62, end_ids=[])


class _StandIn(Sequence):
    """One row of a finished sequence, decoding on with the greedy choice and no rules; its tokens go nowhere."""


def _stand_in(token: int) -> _StandIn:
    rules = TokenRules(end_ids=[], repetition_penalty=1.0, min_new_tokens=0, banned=[], banned_after={})
    return _StandIn(GenerationRequest([token], _ENDLESS), None, lambda outcome: None, rules, 1, 0, [token], [token])


class Static(RequestLevel):
    """Request-level batching whose finished rows decode on until the batch's last sequence ends."""

    name = "static"

    def decode_on(self, choices: Choices) -> list[Stay]:
        stays = list(choices.stays)
        for sequence, _, row in choices.finished:
            stays.extend(
                (_stand_in(token), first, [first], [token])
                for first, token in enumerate(choices.tokens[row:row + sequence.rows], start=row)
            )
        if all(isinstance(stay[0], _StandIn) for stay in stays):  # the batch ends with its last sequence
            return []
        return stays

    def stepped(self, batch: DecoderBatch, max_positions: int | None) -> None:
        if max_positions is not None:  # stand-ins may run past the model's last position
            batch.positions.clamp_(max=max_positions - 1)


SCHEDULINGS: dict[str, type[Scheduling]] = {"inflight": Scheduling, "request": RequestLevel, "static": Static}


def scheduling_named(name: str) -> Scheduling:
    """The scheduling a model config's `scheduling` parameter names."""
    if name not in SCHEDULINGS:
        raise invalid_arg(f"scheduling {name!r} is not one of {', '.join(SCHEDULINGS)}")
    return SCHEDULINGS[name]()
