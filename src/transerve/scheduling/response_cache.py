"""Triton's response cache: a model whose config says `response_cache { enable: true }` answers a request whose
inputs it has answered before from memory, without running, when the server runs with `--cache-config
local,size=BYTES`.

As in Triton 2.51 (tests/e2e/test_response_cache.py compares the two), a request's key is its model, version and
inputs (names, datatypes, shapes, bytes): not its id, parameters or requested outputs; requests are looked up
before they are batched, and only successful responses are kept. Unlike Triton, a hit answers only the outputs the
request asks for (Triton's answers every cached output). The least recently used responses make room for new ones;
a response larger than the whole cache is not kept.

`CachingScheduler` wraps a model's scheduler, so hits never queue; `ResponseCache` holds the responses of every
model of the server, each as its own copy of the model's arrays, read-only (a backend's outputs may be views of
memory it reuses).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from transerve.backends.base import BackendInstance
from transerve.core.datatypes import serialize_bytes
from transerve.core.errors import invalid_arg
from transerve.core.stats import ModelStats
from transerve.core.types import InferRequest, InferResponse, Tensor
from transerve.scheduling import OnDone, OnIdle, Scheduler


def parse_cache_config(values: list[str]) -> int | None:
    """The local cache's size in bytes from tritonserver's `--cache-config` values (`local,size=N`), or None."""
    size = None
    for value in values:
        kind, _, setting = value.partition(",")
        key, _, number = setting.partition("=")
        if kind != "local":
            raise invalid_arg(f"--cache-config {value}: only the 'local' cache is available (local,size=BYTES)")
        if key != "size" or not number.isdigit():
            raise invalid_arg(f"--cache-config {value}: expected local,size=BYTES")
        size = int(number)
    return size


@dataclass(slots=True)
class CacheStats:
    """The server-wide counters Triton exports as nv_cache_* metrics."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    lookup_ns: int = 0
    insertion_ns: int = 0


class ResponseCache:
    """Responses by key, least recently used first, within `size` bytes of tensor data."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.used = 0
        self.stats = CacheStats()
        self._entries: OrderedDict[bytes, tuple[list[Tensor], int]] = OrderedDict()

    @property
    def entries(self) -> int:
        return len(self._entries)

    def lookup(self, key: bytes) -> list[Tensor] | None:
        entry = self._entries.get(key)
        if entry is None:
            self.stats.misses += 1
            return None
        self._entries.move_to_end(key)
        self.stats.hits += 1
        return entry[0]

    def insert(self, key: bytes, outputs: list[Tensor]) -> None:
        nbytes = sum(_nbytes(tensor.data) for tensor in outputs)
        if nbytes > self.size or key in self._entries:
            return
        kept = [Tensor(t.name, t.datatype, _frozen_copy(t.data), dict(t.parameters)) for t in outputs]
        while self.used + nbytes > self.size:
            _, (_, evicted) = self._entries.popitem(last=False)
            self.used -= evicted
            self.stats.evictions += 1
        self._entries[key] = (kept, nbytes)
        self.used += nbytes


def request_key(model_name: str, version: str, request: InferRequest) -> bytes:
    """A digest of what identifies a response: the model, its version and the inputs, in name order."""
    digest = hashlib.blake2b(digest_size=32)
    for part in (model_name, version):
        digest.update(part.encode())
        digest.update(b"\0")
    for tensor in sorted(request.inputs, key=lambda t: t.name):
        digest.update(f"{tensor.name}\0{tensor.datatype}\0{tensor.data.shape}\0".encode())
        if tensor.datatype == "BYTES":
            digest.update(serialize_bytes(tensor.data))
        else:
            digest.update(np.ascontiguousarray(tensor.data).reshape(-1).view(np.uint8))
    return digest.digest()


class CachingScheduler:
    """A model's scheduler behind its response cache: hits are answered at once, misses scheduled and kept."""

    def __init__(self, inner: Scheduler, cache: ResponseCache, model_name: str, version: str, stats: ModelStats):
        self._inner = inner
        self._cache = cache
        self._model = (model_name, version)
        self._stats = stats

    @property
    def pending_count(self) -> int:
        return self._inner.pending_count

    async def drain(self) -> None:
        await self._inner.drain()

    def add_instances(self, instances: list[BackendInstance]) -> None:
        self._inner.add_instances(instances)

    def retire(self, instances: list[BackendInstance], on_idle: OnIdle) -> list[BackendInstance]:
        return self._inner.retire(instances, on_idle)

    def submit(self, request: InferRequest, on_done: OnDone | None = None) -> asyncio.Future[InferResponse]:
        started = time.monotonic_ns()
        key = request_key(*self._model, request)
        outputs = self._cache.lookup(key)
        looked_up = time.monotonic_ns() - started
        self._cache.stats.lookup_ns += looked_up
        if outputs is not None:
            self._stats.cache_hit.add(looked_up)
            future = asyncio.get_running_loop().create_future()
            future.set_result(InferResponse(*self._model, [
                Tensor(t.name, t.datatype, t.data, dict(t.parameters)) for t in outputs]))
            if on_done is not None:
                future.get_loop().call_soon(on_done, future)  # never from inside submit
            return future

        def keep(future: asyncio.Future[InferResponse]) -> None:
            inserted = 0
            if not future.cancelled() and future.exception() is None:
                inserting = time.monotonic_ns()
                self._cache.insert(key, future.result().outputs)
                inserted = time.monotonic_ns() - inserting
                self._cache.stats.insertion_ns += inserted
            self._stats.cache_miss.add(looked_up + inserted)
            if on_done is not None:
                on_done(future)

        return self._inner.submit(request, keep)


def _frozen_copy(data: np.ndarray) -> np.ndarray:
    copy = np.array(data, copy=True)
    copy.flags.writeable = False
    return copy


def _nbytes(data: np.ndarray) -> int:
    if data.dtype == np.object_:
        return sum(len(item) for item in data.reshape(-1)) + 8 * data.size
    return data.nbytes
