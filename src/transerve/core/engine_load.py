"""What an engine that schedules its own sequences says of its load: the sequences it decodes, those waiting in
its own queue, and how full its key/value budget is. The generation instance takes every request at once (its
engine batches them), so the server's scheduler queue stays empty and only the engine knows who waits; vLLM's
`num_requests_running`, `num_requests_waiting` and `kv_cache_usage_perc` are read from here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineLoad:
    running: int
    waiting: int
    #: The share of the key/value budget the running sequences hold (0 to 1); None: the engine does not know.
    kv_cache_usage: float | None = None

    @staticmethod
    def total(loads: list[EngineLoad]) -> EngineLoad:
        """Several instances' loads as one model's: sequences add up, the budget's use is their mean."""
        usages = [load.kv_cache_usage for load in loads if load.kv_cache_usage is not None]
        return EngineLoad(sum(load.running for load in loads), sum(load.waiting for load in loads),
                          sum(usages) / len(usages) if usages else None)
