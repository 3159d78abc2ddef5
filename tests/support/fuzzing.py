"""What the property-based (hypothesis) tests share: their profiles, a transport that records what a protocol
writes, and an event loop to drive protocols on in process.

Profiles: `ci` (the default: few examples, derandomized so that a run is the same on every machine, no deadline
because shared CI machines stall) and `release` (many examples, random, for `tools/fuzz.py` before a release).
`HYPOTHESIS_PROFILE` or pytest's `--hypothesis-profile` picks one.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import struct
from collections.abc import Iterable

from hypothesis import HealthCheck, settings

_SLOW_GENERATION = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]

settings.register_profile(
    "ci", max_examples=200, deadline=None, derandomize=True, database=None, print_blob=True,
    suppress_health_check=_SLOW_GENERATION,
)
settings.register_profile(
    "release", max_examples=5000, deadline=None, derandomize=False, print_blob=True,
    suppress_health_check=_SLOW_GENERATION,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


class FakeTransport(asyncio.Transport):
    """Records what is written; `closed` once the protocol closes it. Reading can be paused as a socket's can."""

    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closed = False
        self.reading = True

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self.closed:
            self.out += data

    def writelines(self, parts: Iterable[bytes | bytearray | memoryview]) -> None:
        for part in parts:
            self.write(part)

    def close(self) -> None:
        self.closed = True

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:  # a half-close: nothing more goes out, which is all a test sees of closing
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def abort(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def is_reading(self) -> bool:
        return self.reading

    def get_write_buffer_size(self) -> int:
        return 0

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def get_extra_info(self, name: str, default: object = None) -> object:
        return ("127.0.0.1", 40000) if name == "peername" else default


class Loop:
    """One event loop for many examples (a loop per example costs more than most examples), which records every
    error that escapes a protocol: an exception from a callback or a task, or a message logged at ERROR."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.errors: list[str] = []
        self.loop.set_exception_handler(lambda _, context: self.errors.append(str(context.get("exception")
                                                                                   or context["message"])))
        self._handler = _Collect(self.errors)

    def __enter__(self) -> Loop:
        logging.getLogger("transerve").addHandler(self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("transerve").removeHandler(self._handler)
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()

    def run(self, coroutine: object) -> object:
        return self.loop.run_until_complete(coroutine)  # type: ignore[arg-type]

    def check(self) -> None:
        """Fail on what escaped since the last check."""
        errors, self.errors[:] = list(self.errors), []
        assert not errors, errors


async def settle(turns: int = 20) -> None:
    """Let the tasks a protocol started run until they wait on nothing in process."""
    for _ in range(turns):
        await asyncio.sleep(0)


def cut(data: bytes, points: Iterable[int]) -> list[bytes]:
    """`data` split at `points` (any integers: taken modulo its length, sorted, repeats dropped)."""
    if not data:
        return [data]
    edges = sorted({point % len(data) for point in points} | {0, len(data)})
    return [data[a:b] for a, b in zip(edges, edges[1:], strict=False)]


def h2_connection(handler: object, max_message: int = 1 << 20) -> object:
    """A native gRPC connection (built on the running loop) whose calls go to `handler`, with default limits."""
    from transerve.frontends.grpc.http2.connection import Http2Connection

    if "limits" not in inspect.signature(Http2Connection).parameters:  # before the h2 branch's Http2Limits
        return Http2Connection(handler, max_message, lambda _: None)  # type: ignore[arg-type]
    from transerve.frontends.grpc.limits import Http2Limits  # type: ignore[import-not-found]

    return Http2Connection(handler, Http2Limits(max_message=max_message), lambda _: None)  # type: ignore[arg-type]


def h2_frames(out: bytes) -> list[tuple[int, int, int, bytes]]:
    """The HTTP/2 frames (type, flags, stream, payload) a server wrote; it must only ever write whole ones."""
    frames, offset = [], 0
    while offset < len(out):
        assert len(out) - offset >= 9, "a truncated frame head"
        head, flags, stream_id = struct.unpack_from(">IBI", out, offset)
        end = offset + 9 + (head >> 8)
        assert end <= len(out), "a truncated frame"
        frames.append((head & 0xFF, flags, stream_id, out[offset + 9:end]))
        offset = end
    return frames


class _Collect(logging.Handler):
    def __init__(self, errors: list[str]) -> None:
        super().__init__(logging.ERROR)
        self._errors = errors

    def emit(self, record: logging.LogRecord) -> None:
        self._errors.append(record.getMessage())
