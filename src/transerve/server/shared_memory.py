"""Triton's system shared memory extension: a client on the same host creates a POSIX shared memory object
(`tritonclient.utils.shared_memory`), registers it under a region name, and then passes inputs in, and has outputs
written into, that region instead of the request and response bodies.

Regions are mapped once, at registration. An input is a read-only numpy view of its region (no copy: a backend
that needs the bytes elsewhere copies them once, as from any request body), so, as in Triton, a client must not
overwrite a region while a request that reads it runs. An unregistered region is unmapped once the last view of it
is gone. Outputs are written into their region, in one copy, when the response is ready.

A region an inference still uses cannot be unregistered, as in Triton: the refusal comes at once and the region
stays registered. An input region is in use while a view of it is alive (the mapping refuses to close); an output
region while a request that will write into it is in flight (`pin_outputs`, released as the request settles).

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

import mmap
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transerve.core.errors import ErrorCode, ServerError, invalid_arg, not_found
from transerve.core.tensors import wire_view
from transerve.core.types import InferRequest, InferResponse

#: Where Linux keeps POSIX shared memory objects (what shm_open opens).
SHM_DIR = Path("/dev/shm")

#: The per-tensor parameters that place a tensor in a region.
REGION = "shared_memory_region"
BYTE_SIZE = "shared_memory_byte_size"
OFFSET = "shared_memory_offset"

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


@dataclass(slots=True)
class Region:
    """A registered region: `byte_size` bytes from `offset` of the shared memory object `key`."""

    name: str
    key: str
    offset: int
    byte_size: int
    mapping: mmap.mmap
    #: Requests in flight that will write an output into the region.
    writers: int = 0

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}


class SharedMemoryRegistry:
    """The server's registered regions, by name; used on the event loop only."""

    def __init__(self) -> None:
        self._regions: dict[str, Region] = {}

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        if name in self._regions:
            raise ServerError(ErrorCode.ALREADY_EXISTS, f"shared memory region '{name}' already in manager")
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
            mapping = mmap.mmap(descriptor, size)
        finally:
            os.close(descriptor)
        self._regions[name] = Region(name, key, offset, byte_size, mapping)

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
        """Unmap and forget a region no request uses; False (and nothing changed) for one in use."""
        if region.writers:
            return False
        try:
            region.mapping.close()
        except BufferError:  # an input still reads it
            return False
        del self._regions[region.name]
        return True

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
        """The `byte_size` bytes from `offset` of region `name`, read-only, in place."""
        region, start = self._locate(name, offset, byte_size)
        return memoryview(region.mapping)[start:start + byte_size].toreadonly()

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
            with memoryview(region.mapping) as target:
                target[start:start + data.nbytes] = data
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
