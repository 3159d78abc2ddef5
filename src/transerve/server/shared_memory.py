"""Triton's system shared memory extension: a client on the same host creates a POSIX shared memory object
(`tritonclient.utils.shared_memory`), registers it under a region name, and then passes inputs in, and has outputs
written into, that region instead of the request and response bodies.

Regions are never mapped into the server. A client owns its objects and may shrink one at any time (`ftruncate`),
and a read of a mapped page past the new end kills the whole process with SIGBUS, in whatever thread touches it
(a backend's included), which no check before the read can rule out. So an input is read with `preadv` into a
buffer of the server's own (the one copy a backend would otherwise make), and an output written with `pwrite`:
past an object's end these read short or extend it, and never fault. Before each, the object's size is checked
(`fstat`), and a region whose object is now smaller than registered is refused with a 400 naming it.

One descriptor is held per object (the same file, however many regions are registered on it, closed with its last
region), and the regions are capped per server and per object (`--max-shared-memory-regions`,
`--max-shared-memory-regions-per-object`): what a client can make the server hold is bounded.

A region an inference still uses cannot be unregistered, as in Triton: the refusal comes at once and the region
stays registered. An input region is in use while the buffer read from it is alive; an output region while a
request that will write into it is in flight (`pin_outputs`, released as the request settles).

Errors keep Triton's wording, but what Triton answers with a 500 (a key that does not open, a region smaller than
registered, an output region too small, an unregister of a region in use) is a 400 here: the client's mistake,
not the server's. Over gRPC a key that
does not open stays Triton's INTERNAL, which tritonclient's own tests check. Unlike Triton, an `offset` needs no page
alignment.

CUDA shared memory is not served: registering a CUDA region fails as on a Triton without a GPU.

As in Triton, a client may register any shared memory object the server's user can open: serve this port only
to clients trusted with the host's /dev/shm.
"""

from __future__ import annotations

import itertools
import os
import re
import stat
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from transerve.core.errors import ErrorCode, ServerError, invalid_arg, not_found
from transerve.core.tensors import wire_view
from transerve.core.types import InferRequest, InferResponse

#: Where Linux keeps POSIX shared memory objects (what shm_open opens).
SHM_DIR = Path("/dev/shm")

#: The per-tensor parameters that place a tensor in a region.
REGION = "shared_memory_region"
BYTE_SIZE = "shared_memory_byte_size"
OFFSET = "shared_memory_offset"

#: `--max-shared-memory-regions` and `--max-shared-memory-regions-per-object`: room for every client's regions
#: (Triton's tests use a handful) while keeping what a client can make the server hold small.
MAX_REGIONS = 1024
MAX_REGIONS_PER_OBJECT = 256

#: Tokens of the buffers read from regions (next() on a count is atomic).
_TOKENS = itertools.count()

#: A POSIX shared memory name: one optional leading slash, then no slash (so never a path elsewhere).
_KEY = re.compile(r"/?[^/\x00]+")


#: What Triton answers a CUDA registration on a machine without a GPU; the hint after it is transerve's.
CUDA_REGISTER_REFUSAL = ("failed to register shared memory region: invalid args (transerve serves system shared "
                         "memory only)")
#: The size of a CUDA IPC handle (cudaIpcMemHandle_t), which Triton checks a registration's `raw_handle` against.
CUDA_IPC_HANDLE_BYTES = 64


class UnopenedRegion(ServerError):
    """A key that opens no shared memory object: INVALID_ARG here, INTERNAL in Triton (and over gRPC)."""

    def __init__(self, key: str, why: str) -> None:
        super().__init__(ErrorCode.INVALID_ARG, f"Unable to open shared memory region: '{key}': {why}")


@dataclass(slots=True, eq=False)
class SharedObject:
    """An open shared memory object: one descriptor for every region registered on it."""

    #: (st_dev, st_ino): the same file, whichever key opened it (a name unlinked and made again is another one).
    identity: tuple[int, int]
    descriptor: int
    regions: int = 0


@dataclass(slots=True, eq=False)
class Region:
    """A registered region: `byte_size` bytes from `offset` of the shared memory object `key`."""

    name: str
    key: str
    offset: int
    byte_size: int
    source: SharedObject
    #: Requests in flight that will write an output into the region.
    writers: int = 0
    #: A token for each buffer read from it that is still alive (discarded as the buffer is freed, in any thread:
    #: set.add and set.discard are atomic, a counter's `-= 1` is not).
    readers: set[int] = field(default_factory=set)

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}

    def check_size(self) -> None:
        """Refuse a region whose object is now smaller than it was registered."""
        end = self.offset + self.byte_size
        size = os.fstat(self.source.descriptor).st_size
        if size < end:
            raise _shrunk(self, size)


def _shrunk(region: Region, size: int) -> ServerError:
    return invalid_arg(f"shared memory region '{region.name}' is no longer usable: its object '{region.key}' is now "
                       f"{size} bytes, smaller than the {region.offset + region.byte_size} bytes registered")


class SharedMemoryRegistry:
    """The server's registered regions, by name; used on the event loop only."""

    def __init__(self, max_regions: int = MAX_REGIONS, max_regions_per_object: int = MAX_REGIONS_PER_OBJECT) -> None:
        self._regions: dict[str, Region] = {}
        self._objects: dict[tuple[int, int], SharedObject] = {}
        self.max_regions = max_regions
        self.max_regions_per_object = max_regions_per_object

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        if name in self._regions:
            raise ServerError(ErrorCode.ALREADY_EXISTS, f"shared memory region '{name}' already in manager")
        if len(self._regions) >= self.max_regions:
            raise invalid_arg(f"failed to register shared memory region '{name}': the server has {self.max_regions} "
                              "regions registered, its limit (--max-shared-memory-regions)")
        if not _KEY.fullmatch(key) or key.lstrip("/") in (".", ".."):
            raise UnopenedRegion(key, "not a shared memory object name")
        try:  # never through a symbolic link: a region is a shared memory object, not a file elsewhere
            descriptor = os.open(SHM_DIR / key.lstrip("/"), os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:
            raise UnopenedRegion(key, exc.strerror or "cannot open") from None
        try:
            found = os.fstat(descriptor)
            if not stat.S_ISREG(found.st_mode):
                raise UnopenedRegion(key, "not a shared memory object")
            size = found.st_size
            if size == 0 or offset + byte_size > size:
                raise invalid_arg(f"failed to register shared memory region '{name}': invalid args: registering "
                                  f"{byte_size} bytes from offset {offset} of '{key}', an object of {size} bytes")
            source = self._objects.get((found.st_dev, found.st_ino))
            if source is not None and source.regions >= self.max_regions_per_object:
                raise invalid_arg(f"failed to register shared memory region '{name}': '{key}' has "
                                  f"{self.max_regions_per_object} regions registered, the limit per object "
                                  "(--max-shared-memory-regions-per-object)")
        except BaseException:
            os.close(descriptor)
            raise
        if source is None:
            source = self._objects[(found.st_dev, found.st_ino)] = SharedObject((found.st_dev, found.st_ino),
                                                                                descriptor)
        else:
            os.close(descriptor)
        source.regions += 1
        self._regions[name] = Region(name, key, offset, byte_size, source)

    def unregister(self, name: str | None = None) -> None:
        """Forget region `name` (every region when None); an unknown name is no error, as in Triton. A region in
        use stays registered, and the call fails with Triton's words (every region not in use is forgotten)."""
        if name is not None:
            region = self._regions.get(name)
            if region is not None and not self._release(region):
                raise invalid_arg(f"Cannot unregister shared memory region '{name}', it is currently in use.")
            return
        refused = [n for n, region in sorted(self._regions.items()) if not self._release(region)]
        if refused:
            raise invalid_arg("Failed to unregister the following system shared memory regions: "
                              + "".join(f"{n} ," for n in refused))

    def _release(self, region: Region) -> bool:
        """Forget a region no request uses (closing its object with its last region); False, and nothing changed,
        for one in use."""
        if region.writers or region.readers:
            return False
        del self._regions[region.name]
        source = region.source
        source.regions -= 1
        if not source.regions:
            del self._objects[source.identity]
            os.close(source.descriptor)
        return True

    @property
    def descriptors(self) -> int:
        """How many descriptors the registry holds: one per object."""
        return len(self._objects)

    def pin_outputs(self, request: InferRequest) -> list[Region] | None:
        """The regions `request`'s outputs will be written into, counted as in use until `unpin`; None when it
        names none. Only called while some region is registered."""
        pinned = None
        for output in request.outputs or ():
            parameters = output.parameters
            region = self._regions.get(parameters[REGION]) if parameters and REGION in parameters else None
            if region is not None:
                region.writers += 1
                pinned = [region] if pinned is None else [*pinned, region]
        return pinned

    @staticmethod
    def unpin(pinned: list[Region]) -> None:
        for region in pinned:
            region.writers -= 1

    @property
    def registered(self) -> bool:
        """Whether any region is registered (a request can use shared memory only then)."""
        return bool(self._regions)

    def status(self, name: str | None = None) -> list[dict[str, Any]]:
        if name is None:
            return [region.status() for region in self._regions.values()]
        region = self._regions.get(name)
        if region is None:
            raise not_found(f"Unable to find system shared memory region: '{name}'")
        return [region.status()]

    def read(self, name: str, offset: int, byte_size: int) -> memoryview:
        """The `byte_size` bytes from `offset` of region `name`, read-only, copied out of the object (a region
        whose object shrank is refused, never faulted on)."""
        region, start = self._locate(name, offset, byte_size)
        region.check_size()
        buffer = np.empty(byte_size, np.uint8)
        if byte_size and os.preadv(region.source.descriptor, [buffer], start) < byte_size:
            raise _shrunk(region, os.fstat(region.source.descriptor).st_size)  # shrunk since the check
        token = next(_TOKENS)
        region.readers.add(token)
        weakref.finalize(buffer, region.readers.discard, token)
        return memoryview(buffer).toreadonly()

    def write_outputs(self, request: InferRequest, response: InferResponse) -> None:
        """Write the outputs `request` placed in regions into them (marking them `in_shared_memory`)."""
        places = {o.name: o.parameters for o in request.outputs or () if REGION in o.parameters}
        for tensor in response.outputs:
            parameters = places.get(tensor.name)
            if parameters is None:
                continue
            data = wire_view(tensor)
            byte_size = parameters.get(BYTE_SIZE, 0)
            if data.nbytes > byte_size:
                raise invalid_arg(
                    f"shared memory size specified with the request for output '{tensor.name}' ({byte_size} "
                    f"bytes) should be at least {data.nbytes} bytes to hold the results"
                )
            region, start = self._locate(parameters[REGION], parameters.get(OFFSET, 0), byte_size)
            region.check_size()
            _write_all(region.source.descriptor, data, start)
            tensor.in_shared_memory = True

    def _locate(self, name: str, offset: int, byte_size: int) -> tuple[Region, int]:
        region = self._regions.get(name)
        if region is None:
            raise not_found(f"Unable to find shared memory region: '{name}'")
        if offset >= region.byte_size:
            raise invalid_arg(f"Invalid offset for shared memory region: '{name}'")
        if offset + byte_size > region.byte_size:
            raise invalid_arg(f"Invalid offset + byte size for shared memory region: '{name}'")
        return region, region.offset + offset


def _write_all(descriptor: int, data: memoryview, position: int) -> None:
    """pwrite until every byte is written (one call writes at most about 2 GiB)."""
    while data.nbytes:
        written = os.pwrite(descriptor, data, position)
        data, position = data[written:], position + written


def placement(name: str, parameters: dict[str, Any], kind: str) -> tuple[str, int, int] | None:
    """The (region, offset, byte size) an input's or output's parameters name, checked; None if they name none.
    `kind` is "input" or "output", for messages."""
    region = parameters.get(REGION)
    if region is None:
        return None
    if not isinstance(region, str):
        raise invalid_arg(f"{kind} '{name}': '{REGION}' must be a string")
    values = []
    for key in (OFFSET, BYTE_SIZE):
        value = parameters.get(key, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise invalid_arg(f"{kind} '{name}': '{key}' must be a non-negative integer")
        values.append(value)
    return region, values[0], values[1]
