"""Tensors in shared memory between the server and a python-backend worker (`ipc.py` carries the messages).

Each direction has an arena (a memfd mapped by both processes); a message only names where its tensors lie.

Ownership follows the bytes: the producer allocates in its own arena, the consumer reads and then
tells the producer, in its next message, which blocks it has finished with. The allocator is a
first-fit free list, so blocks may be released in any order. On arrival:

* tiny tensors (up to INLINE_TENSOR_LIMIT bytes) travel in the datagram itself: for them, a block's
  bookkeeping (allocate, copy in, copy out, release) costs more than the bytes;
* small tensors (up to COPY_LIMIT bytes) and all BYTES tensors are copied out (BYTES are
  deserialized from Triton's length-prefixed form, which copies anyway), and their block is
  released at once, so a model or a response may keep such an array as long as it likes;
* larger tensors become zero-copy numpy views into the arena, and their block is released only
  when the last array using that memory is garbage-collected (a weakref finalizer), so keeping
  a reference after `execute` returns is safe too; it just holds that block.

When the arena has no room (or a tensor is bigger than the arena), the producer writes the rest of
the message into a one-off memfd and passes its descriptor with the datagram (SCM_RIGHTS); the
consumer maps it, and it disappears when the last view of it does. A control message too big for
one datagram is spilled into shared memory the same way.
"""

from __future__ import annotations

import bisect
import mmap
import os
import weakref
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from transerve.core.datatypes import NUMPY_DTYPES, deserialize_bytes, serialize_bytes

#: Tensors up to this size are copied on arrival; larger ones are zero-copy views.
COPY_LIMIT = 64 * 1024
#: Tensors up to this size travel inside the message instead of the arena.
INLINE_TENSOR_LIMIT = 1024
#: Arena size per direction unless `--backend-config=python,shm-default-byte-size=N` says otherwise. Its pages
#: are only backed once used; a tensor that does not fit goes through a fresh memfd, whose page faults cost a
#: 16 MiB tensor about half of its round trip (benchmarks/README.md, "Large tensors").
DEFAULT_ARENA_BYTES = 64 * 1024 * 1024
_ALIGNMENT = 64

#: `region` of a descriptor that lies in the peer's arena (others index the datagram's descriptors).
ARENA = -1
#: `region` of a descriptor whose bytes are in the message (its `offset` is a bytearray of them).
INLINE = -2

#: A tensor in transit: (name, datatype, array).
Entry = tuple[str, str, np.ndarray]
#: Where a tensor lies: (name, datatype, shape, region, offset (the bytes, for INLINE), nbytes, is_view).
Descriptor = tuple[str, str, tuple[int, ...], int, "int | bytearray", int, bool]
#: Tensors written for one message: (descriptors per group, blocks to free after reading, one-off fds).
Placed = tuple[list[list[Descriptor]], list[int], list[int]]
_NOTHING_PLACED: Placed = ([], [], [])


class Region:
    """A memfd mapped into this process; `view` is a writable memoryview over all of it."""

    __slots__ = ("fd", "size", "mmap", "view")

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size
        self.mmap = mmap.mmap(fd, size)
        self.view = memoryview(self.mmap)

    @classmethod
    def create(cls, size: int, name: str) -> Region:
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            return cls(fd, size)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, fd: int) -> Region:
        """Map a region another process created; the descriptor is closed, the mapping stays."""
        try:
            return cls(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)

    def close_fd(self) -> None:
        """Close the descriptor once a child has inherited it; the mapping stays."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class FreeList:
    """First-fit allocator over [0, size) that tolerates out-of-order release.

    Free extents are kept sorted as two parallel lists; releasing merges a block with its free
    neighbours, so steady traffic keeps reusing the front of the arena.
    """

    __slots__ = ("_starts", "_ends", "_live")

    def __init__(self, size: int) -> None:
        self._starts = [0]
        self._ends = [size]
        self._live: dict[int, int] = {}

    def allocate(self, nbytes: int) -> int | None:
        """The offset of a block of at least `nbytes`, or None when no free extent is big enough."""
        nbytes = (nbytes + _ALIGNMENT - 1) & -_ALIGNMENT
        starts, ends = self._starts, self._ends
        for index, start in enumerate(starts):
            end = ends[index]
            if end - start >= nbytes:
                if end - start == nbytes:
                    del starts[index], ends[index]
                else:
                    starts[index] = start + nbytes
                self._live[start] = nbytes
                return start
        return None

    def release(self, offset: int) -> None:
        end = offset + self._live.pop(offset)
        starts, ends = self._starts, self._ends
        index = bisect.bisect_left(starts, offset)
        joins_previous = index > 0 and ends[index - 1] == offset
        joins_next = index < len(starts) and starts[index] == end
        if joins_previous and joins_next:
            ends[index - 1] = ends[index]
            del starts[index], ends[index]
        elif joins_previous:
            ends[index - 1] = end
        elif joins_next:
            starts[index] = offset
        else:
            starts.insert(index, offset)
            ends.insert(index, end)

    @property
    def live_blocks(self) -> int:
        return len(self._live)


def _raw_bytes(data: np.ndarray) -> Any:
    """The bytes of a numeric array in C order: a copy for small arrays (cheaper than a buffer
    export), a flat view of large C-contiguous ones so they are copied only into the arena."""
    if data.nbytes <= COPY_LIMIT or not data.flags.c_contiguous:
        return data.tobytes()
    try:
        return memoryview(data).cast("B")
    except (TypeError, ValueError):  # dtypes the buffer protocol cannot name, e.g. bfloat16
        return memoryview(data.reshape(-1).view(np.uint8))


class ShmWriter:
    """The producer's side of one direction: lays a message's tensors out in its arena."""

    __slots__ = ("_region", "_free")

    def __init__(self, region: Region) -> None:
        self._region = region
        self._free = FreeList(region.size)

    def release(self, offsets: Sequence[int]) -> None:
        for offset in offsets:
            self._free.release(offset)

    @property
    def live_blocks(self) -> int:
        return self._free.live_blocks

    def write(self, groups: Sequence[Sequence[Entry]], first_fd: int = 0) -> Placed:
        """Place every tensor; returns descriptors per group (in the order given), the arena blocks
        the consumer must release after reading, and one-off descriptors to send with the message.

        Tiny tensors go in the message, copied tensors share one block (8-byte aligned inside it), each
        viewed tensor gets its own, and whatever finds no room goes to a single one-off region (`first_fd`
        is its index).
        """
        plans: list[list[tuple[Any, ...]]] = []
        copied_bytes = 0
        for group in groups:
            plan: list[tuple[Any, ...]] = []
            for name, datatype, data in group:
                if datatype == "BYTES":
                    payload: Any = serialize_bytes(data)
                    nbytes = len(payload)
                    is_view = False
                else:
                    nbytes = data.nbytes
                    if nbytes <= INLINE_TENSOR_LIMIT:
                        plan.append((name, datatype, data.shape, bytearray(data.tobytes()), nbytes, None))
                        continue
                    payload = _raw_bytes(data)
                    is_view = nbytes > COPY_LIMIT
                if nbytes <= INLINE_TENSOR_LIMIT:
                    plan.append((name, datatype, data.shape, bytearray(payload), nbytes, None))
                    continue
                if not is_view:
                    copied_bytes += (nbytes + 7) & -8
                plan.append((name, datatype, data.shape, payload, nbytes, is_view))
            plans.append(plan)
        view = self._region.view
        allocate = self._free.allocate
        cursor = allocate(copied_bytes) if copied_bytes else 0
        frees = [cursor] if copied_bytes and cursor is not None else []
        descriptors: list[list[Any]] = []
        overflow: list[tuple[list[Any], int, tuple[Any, ...]]] = []
        for plan in plans:
            placed: list[Any] = []
            for item in plan:
                name, datatype, shape, payload, nbytes, is_view = item
                if is_view is None:
                    placed.append((name, datatype, shape, INLINE, payload, nbytes, False))
                    continue
                if is_view:
                    offset = allocate(nbytes)
                elif cursor is not None:
                    offset = cursor
                    cursor += (nbytes + 7) & -8
                else:
                    offset = None
                if offset is None:
                    overflow.append((placed, len(placed), item))
                    placed.append(None)
                    continue
                if nbytes:
                    view[offset : offset + nbytes] = payload
                placed.append((name, datatype, shape, ARENA, offset, nbytes, is_view))
            descriptors.append(placed)
        fds = self._write_overflow(overflow, first_fd) if overflow else []
        return descriptors, frees, fds

    @staticmethod
    def _write_overflow(overflow: list[tuple[list[Any], int, tuple[Any, ...]]], region_index: int) -> list[int]:
        """Write what found no room in the arena into one fresh memfd, sent with the datagram."""
        total = sum((item[4] + _ALIGNMENT - 1) & -_ALIGNMENT for _, _, item in overflow) or _ALIGNMENT
        region = Region.create(total, "transerve-overflow")
        offset = 0
        for placed, position, (name, datatype, shape, payload, nbytes, is_view) in overflow:
            if nbytes:
                region.view[offset : offset + nbytes] = payload
            placed[position] = (name, datatype, shape, region_index, offset, nbytes, is_view)
            offset += (nbytes + _ALIGNMENT - 1) & -_ALIGNMENT
        region.view.release()
        region.mmap.close()
        return [region.fd]


class ShmReader:
    """The consumer's side of one direction: turns descriptors into numpy arrays and collects the
    producer's blocks it has finished with (`take_releases`), to send back in the next message."""

    __slots__ = ("_view", "_pending")

    def __init__(self, region: Region) -> None:
        self._view = region.view
        #: A deque because finalizers may append from any thread while the owner drains it.
        self._pending: deque[int] = deque()

    def take_releases(self) -> list[int]:
        pending = self._pending
        released = []
        while pending:
            released.append(pending.popleft())
        return released

    def read(
        self, groups: Sequence[Sequence[Descriptor]], frees: Sequence[int], regions: Sequence[Region]
    ) -> list[list[Entry]]:
        tensor = self._tensor
        entries = [[tensor(descriptor, regions) for descriptor in group] for group in groups]
        self._pending.extend(frees)
        return entries

    def _tensor(self, descriptor: Descriptor, regions: Sequence[Region]) -> Entry:
        name, datatype, shape, region, offset, nbytes, is_view = descriptor
        if region == INLINE:  # `offset` holds the bytes: a bytearray, so the array is writable
            if datatype == "BYTES":
                return name, datatype, deserialize_bytes(offset, _count(shape)).reshape(shape)
            return name, datatype, np.ndarray(shape, NUMPY_DTYPES[datatype], offset)
        view = self._view if region == ARENA else regions[region].view
        if datatype == "BYTES":
            return name, datatype, deserialize_bytes(view[offset : offset + nbytes], _count(shape)).reshape(shape)
        dtype = NUMPY_DTYPES[datatype]
        if not is_view:
            return name, datatype, np.ndarray(shape, dtype, view, offset).copy()
        flat = np.frombuffer(view, dtype, nbytes // dtype.itemsize, offset)
        if region == ARENA:
            # `flat.base` is the memoryview numpy made; every array derived from `flat` keeps it
            # alive, so it dies exactly when the block's memory is no longer referenced.
            weakref.finalize(flat.base, self._pending.append, offset).atexit = False
        return name, datatype, flat.reshape(shape)


def _count(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count
