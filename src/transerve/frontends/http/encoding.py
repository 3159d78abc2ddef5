"""Content codings of HTTP bodies: gzip and deflate, both ways, bounded by --http-max-input-size.

A request body is inflated in steps of bounded input and output, so a compression bomb stops at the limit
and never holds the event loop for long: the first steps run on the loop (most bodies are done there), the
rest in a thread (zlib releases the GIL while it inflates). Every member of a multi-member gzip body is
inflated, as `gzip.decompress` does.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gzip
import re
import zlib
from collections.abc import Callable, Iterator
from typing import Any

#: The body encodings understood both ways, as Triton names them in its `Accept-Encoding` answer.
ENCODINGS = "gzip, deflate"

#: Steps of inflating done on the event loop before the rest of a body moves to a thread. A step there feeds zlib
#: at most 16 KiB and takes at most 16 KiB out, or starts a gzip member. Below about that much inflating, a thread
#: hop would cost more than it spares the loop (benchmarks/README.md, "Figures behind the code").
INLINE_STEPS = 4
_INLINE_STEP = 16 * 1024

#: A step in the thread: large, because the loop may wait for the GIL each time the thread takes it back from
#: zlib; the pieces are joined in the thread too, since a large copy on the loop holds it as long (the loop's
#: lateness either way: benchmarks/README.md, "Figures behind the code").
_THREAD_STEP = 4 * 1024 * 1024

#: gzip members allowed per byte of the limit: each member costs a start however little it holds, so a body of
#: empty members would cost seconds; BGZF files (members of up to 64 KiB) stay well within this.
_BYTES_PER_MEMBER = 16 * 1024
_MIN_MEMBERS = 1024

_GZIP_MAGIC = b"\x1f\x8b"
_NOT_ZERO = re.compile(rb"[^\0]")


class UnsupportedEncoding(ValueError):
    """A `Content-Encoding` other than gzip, deflate or identity."""


def response_encoding(accept_encoding: str) -> str | None:
    """The encoding to compress a response with, chosen from `Accept-Encoding` as Triton chooses: the highest
    `q` among identity, gzip and deflate (the first of equals), none when identity wins or nothing is named.

    Entries that name anything else, or whose weight does not parse, are skipped; a weight of 0 never wins.
    """
    chosen, weight = "identity", 0.0
    for entry in accept_encoding.split(","):
        name, _, parameter = entry.strip().partition(";")
        name = name.strip()
        entry_weight = 1.0
        if parameter:
            key, _, value = parameter.strip().partition("=")
            if key.strip() != "q":
                continue
            try:
                entry_weight = float(value)
            except ValueError:
                continue
        if name in ("identity", "gzip", "deflate") and entry_weight > weight:
            chosen, weight = name, entry_weight
    return None if chosen == "identity" else chosen


def compress_body(body: bytes, encoding: str) -> bytes:
    """`gzip` or `deflate` (zlib format, which clients inflate with zlib), at the fastest level: a response
    is compressed for the wire once, and speed matters more than the last bytes."""
    return gzip.compress(body, compresslevel=1) if encoding == "gzip" else zlib.compress(body, 1)


def decompress_body(body: bytes, encoding: str, limit: int) -> bytes:
    """Undo `Content-Encoding: gzip|deflate`, refusing output past `limit` (ValueError; a bomb stops early)."""
    stream = _Stream.open(body, encoding, limit, _THREAD_STEP)
    return body if stream is None else b"".join(stream.pieces)


async def decompress_body_async(body: bytes, encoding: str, limit: int) -> bytes:
    """`decompress_body`, its first INLINE_STEPS steps on the event loop and the rest in a thread."""
    stream = _Stream.open(body, encoding, limit, _INLINE_STEP)
    if stream is None:
        return body
    pieces: list[bytes] = []
    for count, piece in enumerate(stream.pieces, 1):
        pieces.append(piece)
        if count == INLINE_STEPS:  # the rest, and the copy that joins the pieces, in a thread
            stream.step = _THREAD_STEP
            return await asyncio.get_running_loop().run_in_executor(None, _join, pieces, stream.pieces)
    return b"".join(pieces)


def _join(first: list[bytes], rest: Iterator[bytes]) -> bytes:
    """The pieces joined, and then freed and handed back to the system: a thread's pieces come from its own malloc
    arena, which glibc keeps at its largest (each executor thread would hold a body's worth after it)."""
    try:
        first.extend(rest)
        return b"".join(first)
    finally:  # a body past the limit too: its pieces were as large
        first.clear()
        _trim_malloc()


def _malloc_trim() -> Callable[[], None]:
    """glibc's `malloc_trim(0)` (returns the free memory of every arena), or nothing where the C library has none."""
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    return lambda: trim(0) and None


_trim_malloc = _malloc_trim()


def _inflate_gzip(stream: _Stream) -> Iterator[bytes]:
    """Each member in turn; zero bytes between or after members are padding, as `gzip.decompress` takes them.
    A truncated last member gives what it holds, as Triton (zlib without an end check) does."""
    body, limit = stream.body, stream.limit
    members = max(_MIN_MEMBERS, limit // _BYTES_PER_MEMBER)
    while True:
        members -= 1
        if members < 0:
            raise ValueError("cannot decompress the gzip request body: too many gzip members")
        try:
            yield from stream.inflate(zlib.decompressobj(16 + zlib.MAX_WBITS))
        except zlib.error:
            raise ValueError("cannot decompress the gzip request body") from None
        if not stream.ended:
            return
        following = _NOT_ZERO.search(body, stream.offset)
        if following is None:
            return
        if body[following.start():following.start() + 2] != _GZIP_MAGIC:
            raise ValueError("cannot decompress the gzip request body: data after its last member")
        stream.offset = following.start()
        yield b""  # a step of its own: starting a member costs however little it holds


def _inflate_deflate(stream: _Stream) -> Iterator[bytes]:
    """The zlib format, or raw deflate without its header as some clients send it; what follows the stream
    is ignored."""
    try:
        yield from stream.inflate(zlib.decompressobj(zlib.MAX_WBITS))
        if stream.ended or stream.produced:
            return
        raise zlib.error("incomplete deflate stream")
    except zlib.error:
        if stream.produced:
            raise ValueError("cannot decompress the deflate request body") from None
    stream.offset = 0
    try:
        yield from stream.inflate(zlib.decompressobj(-zlib.MAX_WBITS))
    except zlib.error as exc:
        raise ValueError(f"cannot decompress the deflate request body: {exc}") from None


class _Stream:
    """A compressed body being inflated: its pieces, where the next zlib stream starts, how much output there was,
    and the size of a step (which may change between pieces)."""

    __slots__ = ("body", "limit", "step", "offset", "produced", "ended", "pieces")

    @classmethod
    def open(cls, body: bytes, encoding: str, limit: int, step: int) -> _Stream | None:
        """None for identity; UnsupportedEncoding for codings other than gzip and deflate."""
        encoding = encoding.strip().lower()
        if encoding in ("", "identity"):
            return None
        if encoding not in ("gzip", "deflate"):
            raise UnsupportedEncoding(f"Unsupported compression type '{encoding}' (use {ENCODINGS})")
        return cls(body, limit, step, _inflate_gzip if encoding == "gzip" else _inflate_deflate)

    def __init__(self, body: bytes, limit: int, step: int,
                 inflate: Callable[[_Stream], Iterator[bytes]]) -> None:
        self.body = body
        self.limit = limit
        self.step = step
        self.offset = 0
        self.produced = 0
        self.ended = False
        self.pieces = inflate(self)

    def inflate(self, decompressor: Any) -> Iterator[bytes]:
        """One zlib stream from `offset`, in pieces of at most `step` bytes from at most `step` bytes of input
        each; ValueError past the limit. Leaves `offset` just after the stream and `ended` telling whether it
        ended."""
        body, fed = memoryview(self.body), self.offset
        while not decompressor.eof:
            data = decompressor.unconsumed_tail
            if not data:
                if fed >= len(body):
                    break
                data, fed = body[fed:fed + self.step], fed + self.step
            allowed = self.limit - self.produced
            piece = decompressor.decompress(data, min(self.step, allowed + 1))
            if len(piece) > allowed:
                raise ValueError(f"decompressed request body exceeds the limit of {self.limit} bytes")
            self.produced += len(piece)
            yield piece
        self.ended = decompressor.eof
        self.offset = min(fed, len(body)) - len(decompressor.unused_data)
