"""Header blocks: HPACK (python-hyper's `hpack`) both ways, a request's head checked as RFC 9113 section 8 and the
gRPC-over-HTTP/2 spec want it, and the few response blocks a gRPC server sends.

Decoding a block in pure Python costs about what the rest of a small call costs (benchmarks/README.md, "Figures
behind the code"), and a client sends the same block for every call of a method: a block that leaves the dynamic
table unchanged decodes the same way for as long as the table stays unchanged, so its checked head is reused until
the table changes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hpack import Decoder, Encoder, HPACKError, NeverIndexedHeaderTuple
from hpack.table import HeaderTable

from transerve.frontends.access import is_custom_metadata
from transerve.frontends.grpc.http2.frames import COMPRESSION_ERROR, PROTOCOL_ERROR, H2ConnectionError, H2StreamError

#: gRPC status codes this transport sets itself.
OK, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, UNIMPLEMENTED, INTERNAL, UNAVAILABLE = 0, 4, 8, 12, 13, 14

_PSEUDO = {b":method", b":scheme", b":path", b":authority"}
_CONNECTION_SPECIFIC = {b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"}
_TIMEOUT = re.compile(rb"([0-9]{1,8})([HMSmun])")
_TIMEOUT_UNIT = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
#: Reused heads per connection; a client has one block per method it calls (and per timeout, for grpcio's).
_CACHED_HEADS = 64


@dataclass(frozen=True, slots=True)
class RequestHead:
    """What a call needs from its request headers; `refusal` is the HTTP status or gRPC status that ends it at once."""

    path: bytes
    timeout: float | None = None
    http_status: int = 200
    refusal: tuple[int, str] | None = None
    #: The call's custom metadata, as Triton's server sees it (restrictions and header forwarding read it).
    metadata: tuple[tuple[str, str], ...] = ()


class _CountingTable(HeaderTable):
    """hpack's dynamic table, counting its changes so that decoded blocks can be reused while it stays the same."""

    def __init__(self) -> None:
        super().__init__()
        self.changes = 0

    def add(self, name: bytes, value: bytes) -> None:
        self.changes += 1
        super().add(name, value)

    @property
    def maxsize(self) -> int:
        return HeaderTable.maxsize.fget(self)  # type: ignore[attr-defined]

    @maxsize.setter
    def maxsize(self, value: int) -> None:
        self.changes += 1
        HeaderTable.maxsize.fset(self, value)  # type: ignore[attr-defined]


class HeaderDecoder:
    """One connection's HPACK decoder. Every block must go through it, even one whose stream is refused, or the
    dynamic table the peer's encoder assumes would drift from ours."""

    def __init__(self, max_header_list_size: int) -> None:
        self._decoder = Decoder(max_header_list_size)
        self._table = self._decoder.header_table = _CountingTable()
        self._heads: dict[bytes, RequestHead] = {}

    def request_head(self, block: bytes) -> RequestHead:
        """The checked head of a request; H2StreamError when the request is malformed (section 8.1.1)."""
        head = self._heads.get(block)
        if head is not None:
            return head
        changes = self._table.changes
        headers = self.decode(block)
        cacheable = self._table.changes == changes
        if not cacheable:
            self._heads.clear()  # blocks that read the table may decode differently now
        head = _request_head(headers)
        if cacheable and len(self._heads) < _CACHED_HEADS:
            self._heads[block] = head
        return head

    def decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        try:
            return self._decoder.decode(block, raw=True)  # type: ignore[return-value]
        except HPACKError as exc:
            raise H2ConnectionError(COMPRESSION_ERROR, f"bad header block: {exc}") from None


def _request_head(headers: list[tuple[bytes, bytes]]) -> RequestHead:
    pseudo: dict[bytes, bytes] = {}
    content_type = timeout = encoding = None
    regular = False
    metadata = []
    for name, value in headers:
        if name[:1] == b":":
            if regular or name not in _PSEUDO or name in pseudo:
                raise H2StreamError(PROTOCOL_ERROR, f"malformed request: pseudo-header {name!r}")
            pseudo[name] = value
            continue
        regular = True
        if not name or name != name.lower() or name in _CONNECTION_SPECIFIC:
            raise H2StreamError(PROTOCOL_ERROR, f"malformed request: header {name!r}")
        if name == b"te" and value != b"trailers":
            raise H2StreamError(PROTOCOL_ERROR, "malformed request: te other than trailers")
        if name == b"content-type":
            content_type = value
        elif name == b"grpc-timeout":
            timeout = value
        elif name == b"grpc-encoding":
            encoding = value
        elif is_custom_metadata(text := name.decode("latin-1")):
            metadata.append((text, value.decode("latin-1")))
    path = pseudo.get(b":path")
    if not path or b":method" not in pseudo or b":scheme" not in pseudo:
        raise H2StreamError(PROTOCOL_ERROR, "malformed request: :method, :scheme or :path missing")
    if pseudo[b":method"] != b"POST":
        return RequestHead(path, http_status=405)
    if content_type is None or not content_type.startswith(b"application/grpc"):
        return RequestHead(path, http_status=415)
    if encoding not in (None, b"identity"):
        return RequestHead(path, refusal=(UNIMPLEMENTED, f"grpc-encoding {encoding.decode('latin-1')!r} is not "
                                                         "supported, send identity (uncompressed) messages"))
    if timeout is None:
        return RequestHead(path, metadata=tuple(metadata))
    match = _TIMEOUT.fullmatch(timeout)
    if match is None:
        return RequestHead(path, refusal=(INTERNAL, f"malformed grpc-timeout {timeout.decode('latin-1')!r}"))
    return RequestHead(path, timeout=int(match[1]) * _TIMEOUT_UNIT[match[2]], metadata=tuple(metadata))


# ---- response blocks: never indexed, so they touch neither side's dynamic table and can be built once -----------

_ENCODER = Encoder()


def encode(headers: list[tuple[str, str]]) -> bytes:
    return _ENCODER.encode([NeverIndexedHeaderTuple(name, value) for name, value in headers], huffman=True)


_GRPC_HEADERS = [(":status", "200"), ("content-type", "application/grpc")]
RESPONSE_HEADERS = encode(_GRPC_HEADERS)
OK_TRAILERS = encode([("grpc-status", "0")])
#: Sent before the first block after the peer changed SETTINGS_HEADER_TABLE_SIZE: our table is always empty.
TABLE_SIZE_ZERO = b"\x20"


def trailers(status: int, message: str, trailers_only: bool = False) -> bytes:
    """grpc-status and grpc-message (percent-encoded UTF-8), with the response head too for a Trailers-Only answer."""
    fields = [("grpc-status", str(status))]
    if message:
        fields.append(("grpc-message", percent_encode(message)))
    if trailers_only:
        fields = _GRPC_HEADERS + fields
        if status == UNIMPLEMENTED:
            fields.append(("grpc-accept-encoding", "identity"))
    return encode(fields)


def http_status(status: int) -> bytes:
    """A plain HTTP answer for a request that is not gRPC (405 not POST, 415 not application/grpc)."""
    return encode([(":status", str(status))])


def percent_encode(message: str) -> str:
    """grpc-message's encoding: UTF-8, with '%' and bytes outside printable ASCII as %XX."""
    return "".join(chr(byte) if 0x20 <= byte <= 0x7E and byte != 0x25 else f"%{byte:02X}"
                   for byte in message.encode("utf-8"))
