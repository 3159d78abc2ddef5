"""What an engine that schedules its own sequences says of its load: the sequences it decodes, those waiting in
its own queue, and how full its key/value budget is. The generation instance takes every request at once (its
engine batches them), so the server's scheduler queue stays empty and only the engine knows who waits; vLLM's
`num_requests_running`, `num_requests_waiting`, `kv_cache_usage_perc` and the prefix cache's counters are read from
here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PrefixCacheCounts:
    """An engine's prefix cache since load: prompt tokens looked up and found (vLLM's `prefix_cache_queries` and
    `_hits`), and lookups that found something or nothing."""

    queried_tokens: int = 0
    hit_tokens: int = 0
    hits: int = 0
    misses: int = 0

    def __add__(self, other: PrefixCacheCounts) -> PrefixCacheCounts:
        return PrefixCacheCounts(self.queried_tokens + other.queried_tokens, self.hit_tokens + other.hit_tokens,
                                 self.hits + other.hits, self.misses + other.misses)


@dataclass(frozen=True, slots=True)
class EngineLoad:
    running: int
    waiting: int
    #: The share of the key/value budget the running sequences hold (0 to 1); None: the engine does not know.
    kv_cache_usage: float | None = None
    #: None: the engine keeps no prefix cache (or it is off).
    prefix_cache: PrefixCacheCounts | None = None

    @staticmethod
    def total(loads: list[EngineLoad]) -> EngineLoad:
        """Several instances' loads as one model's: sequences and counts add up, the budget's use is their mean."""
        usages = [load.kv_cache_usage for load in loads if load.kv_cache_usage is not None]
        caches = [load.prefix_cache for load in loads if load.prefix_cache is not None]
        return EngineLoad(sum(load.running for load in loads), sum(load.waiting for load in loads),
                          sum(usages) / len(usages) if usages else None,
                          sum(caches, PrefixCacheCounts()) if caches else None)
