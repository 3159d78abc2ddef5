"""An HTTP/2 connection's life as one `Phase`, with its legal moves in one table (`MOVES`); the connection changes
its phase in one method, `Http2Connection._move`."""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    """Where a connection is in its life."""

    PREFACE = "preface"  # the client's connection preface has not all arrived
    SETTINGS = "settings"  # its first frame, which must be SETTINGS, has not
    OPEN = "open"  # streams open and close
    DRAINING = "draining"  # GOAWAY sent: no new streams; the open ones are answered, then the connection closes
    CLOSED = "closed"  # closing or gone: nothing more is read, and nothing more is written past what is buffered


#: Each phase's legal next phases. A connection can drain or close from any phase before; one that has not yet read
#: its client's SETTINGS has no streams, so draining closes it at once.
MOVES: dict[Phase, frozenset[Phase]] = {
    Phase.PREFACE: frozenset({Phase.SETTINGS, Phase.DRAINING, Phase.CLOSED}),
    Phase.SETTINGS: frozenset({Phase.OPEN, Phase.DRAINING, Phase.CLOSED}),
    Phase.OPEN: frozenset({Phase.DRAINING, Phase.CLOSED}),
    Phase.DRAINING: frozenset({Phase.CLOSED}),
    Phase.CLOSED: frozenset(),
}
