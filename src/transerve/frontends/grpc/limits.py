"""What one HTTP/2 connection may cost the server: its timeouts, the per-message size limit, and the budgets for
frames that cost the server work but carry no call (resets, PINGs, SETTINGS, empty frames), past which the connection
ends with GOAWAY ENHANCE_YOUR_CALM. The numbers, and where they come from, are in docs/security.md."""

from __future__ import annotations

from dataclasses import dataclass

#: Triton's gRPC server takes messages up to INT32_MAX bytes; so does this one unless told otherwise.
MAX_MESSAGE_BYTES = 2**31 - 1
#: SETTINGS both transports announce. A stream's window bounds what a client can queue on it unread; the
#: connection's, what it can queue on all of them (a message larger than the windows still flows: see
#: http2/connection.py).
MAX_CONCURRENT_STREAMS = 4096
STREAM_WINDOW = 1 << 22
CONNECTION_WINDOW = 1 << 24
MAX_HEADER_LIST = 1 << 16


@dataclass(frozen=True)
class Http2Limits:
    """Per-connection limits; the defaults are `transerve serve`'s."""

    #: Largest request message a call may receive (`--grpc-max-input-size`).
    max_message: int = MAX_MESSAGE_BYTES
    #: Seconds a new connection has to send its preface and SETTINGS and to acknowledge ours.
    handshake_timeout: float = 10.0
    #: Seconds a connection with no open stream stays open (GOAWAY NO_ERROR then).
    idle_timeout: float = 300.0
    #: Seconds an answer may wait, without progress, for the client's flow-control window or for the socket to drain
    #: before its stream (or, for the socket, the connection) is given up.
    stall_timeout: float = 30.0
    #: grpc-core's ping policy, with Triton's defaults: a PING that comes sooner than `min_ping_interval` after the
    #: previous one, with no HEADERS or DATA sent in between, is a strike; past `max_ping_strikes` (0: no limit)
    #: the connection ends. With no call open the interval is two hours unless `pings_without_calls`.
    max_ping_strikes: int = 2
    min_ping_interval: float = 300.0
    pings_without_calls: bool = False


#: (burst, per second) of the token buckets. Resets follow nghttp2 (1000, then 33 a second); SETTINGS and empty
#: frames, which a gRPC client sends a handful of, get a tenth of that.
RESETS = (1000, 33.0)
SETTINGS_FRAMES = (100, 10.0)
EMPTY_FRAMES = (100, 10.0)
#: CONTINUATION frames one header block may take (nghttp2's limit, CVE-2024-28182), and entries one SETTINGS frame
#: may carry (nghttp2's).
MAX_CONTINUATIONS = 8
MAX_SETTINGS = 32
#: Seconds without a PING, with no call open, that grpc-core asks of a client not allowed to ping without calls.
IDLE_PING_INTERVAL = 7200.0


class TokenBucket:
    """`burst` events at once, refilled at `rate` a second; `take` says False once the bucket is empty."""

    __slots__ = ("_burst", "_rate", "_tokens", "_at")

    def __init__(self, budget: tuple[int, float], now: float) -> None:
        self._burst, self._rate = budget
        self._tokens = float(self._burst)
        self._at = now

    def take(self, now: float) -> bool:
        tokens = min(self._burst, self._tokens + (now - self._at) * self._rate)
        self._at = now
        if tokens < 1.0:
            self._tokens = tokens
            return False
        self._tokens = tokens - 1.0
        return True


class PingPolicy:
    """grpc-core's abuse policy for received PINGs (see `Http2Limits.max_ping_strikes`)."""

    __slots__ = ("_limits", "_last", "_strikes")

    def __init__(self, limits: Http2Limits) -> None:
        self._limits = limits
        self._last = float("-inf")
        self._strikes = 0

    def forgive(self) -> None:
        """The server sent HEADERS or DATA: the next PING is not early, whenever it comes."""
        self._last = float("-inf")
        self._strikes = 0

    def received(self, now: float, calls_open: bool) -> bool:
        """Count one PING; True when the client has used up its strikes."""
        limits = self._limits
        interval = limits.min_ping_interval if calls_open or limits.pings_without_calls else IDLE_PING_INTERVAL
        early = now < self._last + interval
        self._last = now
        if not early:
            return False
        self._strikes += 1
        return 0 < limits.max_ping_strikes < self._strikes
