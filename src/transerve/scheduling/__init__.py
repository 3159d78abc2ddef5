"""Per-model schedulers: which requests go to which instance, and when.

Every scheduler has the same face to the core: `submit(request, on_done)` returns a future of the
response (and calls `on_done(future)` once it is done), `pending_count` says how many wait, and
`drain()` waits until none is queued or running. An instance-group update in place (Triton's) goes
through `add_instances` and `retire`: the requests queued and running meanwhile are not disturbed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from tritonclient.grpc import model_config_pb2

from transerve.backends.base import BackendInstance
from transerve.core.stats import ModelStats
from transerve.core.types import InferRequest, InferResponse

#: Called with a request's future once it is done, never from inside `submit`. The direct scheduler calls it
#: as it settles the future, a loop turn sooner than a done callback, and not at all for a future someone
#: else cancelled (the canceller accounts for that one); the batchers make it a done callback.
OnDone = Callable[["asyncio.Future[InferResponse]"], None]
#: Called once with a retired instance when nothing runs on it any more and no sequence holds it: it may close.
OnIdle = Callable[[BackendInstance], None]


class Scheduler(Protocol):
    @property
    def pending_count(self) -> int: ...

    def submit(self, request: InferRequest, on_done: OnDone | None = None) -> asyncio.Future[InferResponse]: ...

    async def drain(self) -> None: ...

    def add_instances(self, instances: list[BackendInstance]) -> None:
        """Schedule onto these instances too, from now on."""

    def retire(self, instances: list[BackendInstance], on_idle: OnIdle) -> list[BackendInstance]:
        """Give these instances nothing new; `on_idle(instance)` once each has finished what it runs (at the
        latest when `drain` returns). Returns those a sequence still holds: they serve it to its end first."""


def create_scheduler(
    model_name: str, config: model_config_pb2.ModelConfig, instances: list[BackendInstance], stats: ModelStats
) -> Scheduler:
    """The scheduler the config asks for."""
    if config.HasField("sequence_batching"):
        from transerve.scheduling.sequence_batcher import SequenceBatcher

        return SequenceBatcher(model_name, config, instances, stats)
    if config.HasField("dynamic_batching"):
        from transerve.scheduling.dynamic_batcher import DynamicBatcher

        return DynamicBatcher(model_name, config, instances, stats)
    from transerve.scheduling.direct import DirectScheduler

    return DirectScheduler(model_name, instances, stats, config.max_batch_size)
