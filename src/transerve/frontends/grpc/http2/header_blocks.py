"""A request's header blocks as they arrive: a HEADERS frame, less its padding and priority, and the CONTINUATION
frames after it, joined into one block, bounded in size (MAX_HEADER_LIST) and in frames (MAX_CONTINUATIONS, against
the CONTINUATION floods of CVE-2024-28182). The connection decodes the whole block (`headers.py`)."""

from __future__ import annotations

from collections.abc import Callable

from transerve.frontends.grpc.http2 import frames as h2
from transerve.frontends.grpc.http2.frames import H2ConnectionError
from transerve.frontends.grpc.limits import MAX_CONTINUATIONS, MAX_HEADER_LIST


class HeaderBlocks:
    """Joins one header block at a time; `empty` is told of a frame that carries nothing (it has a budget)."""

    __slots__ = ("pending", "_continuations", "_empty")

    def __init__(self, empty: Callable[[str], None]) -> None:
        self.pending: tuple[int, int, bytearray] | None = None  # stream, END_STREAM flag, block so far
        self._continuations = 0  # CONTINUATION frames of the block in `pending`
        self._empty = empty

    def headers(self, flags: int, stream_id: int, payload: memoryview) -> tuple[int, bytes, bool] | None:
        """A HEADERS frame: (END_STREAM flag, block, whether the stream depends on itself) if its block ends there,
        else None (CONTINUATIONs follow)."""
        if stream_id == 0:
            raise H2ConnectionError(h2.PROTOCOL_ERROR, "HEADERS on stream 0")
        start, stop = 0, len(payload)
        if flags & h2.PADDED:
            if not stop:
                raise H2ConnectionError(h2.PROTOCOL_ERROR, "PADDED HEADERS without a pad length")
            start, stop = 1, stop - payload[0]
        depends_on_itself = False
        if flags & h2.PRIORITY_FLAG:
            if stop - start < 5:
                raise H2ConnectionError(h2.FRAME_SIZE_ERROR, "HEADERS too short for its priority")
            depends_on_itself = h2.u31(payload, start) == stream_id
            start += 5
        if stop < start:
            raise H2ConnectionError(h2.PROTOCOL_ERROR, "padding exceeds the HEADERS frame")
        fragment = payload[start:stop]
        if len(fragment) > MAX_HEADER_LIST:
            raise H2ConnectionError(h2.ENHANCE_YOUR_CALM, "header block too large")
        if flags & h2.END_HEADERS:
            return flags & h2.END_STREAM, bytes(fragment), depends_on_itself
        if not fragment:
            self._empty("empty HEADERS frames")
        self.pending = (stream_id, flags & h2.END_STREAM, bytearray(fragment))
        self._continuations = 0
        return None

    def continuation(self, flags: int, stream_id: int, payload: memoryview) -> tuple[int, bytes] | None:
        """A CONTINUATION frame: (END_STREAM flag, block) if the block ends with it, else None."""
        pending = self.pending
        if pending is None or pending[0] != stream_id:
            raise H2ConnectionError(h2.PROTOCOL_ERROR, "CONTINUATION without a header block to continue")
        self._continuations += 1
        if self._continuations > MAX_CONTINUATIONS:
            raise H2ConnectionError(h2.ENHANCE_YOUR_CALM, f"a header block of more than {MAX_CONTINUATIONS} "
                                                          "CONTINUATION frames")
        if not payload and not flags & h2.END_HEADERS:
            self._empty("empty CONTINUATION frames")
        block = pending[2]
        block += payload
        if len(block) > MAX_HEADER_LIST:
            raise H2ConnectionError(h2.ENHANCE_YOUR_CALM, "header block too large")
        if not flags & h2.END_HEADERS:
            return None
        self.pending = None
        return pending[1], bytes(block)
