"""How often an instance's worker may be restarted: at once the first time, then after a growing delay, and not at
all past a cap, so a model whose worker dies right after each start (or whose restart fails) costs a bounded number
of `initialize` calls instead of a restart loop; the instance is then given up (its model UNAVAILABLE, the reason
in the log and the repository index) until the model is loaded again."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

#: The most restarts within `WINDOW_S`; the one after is refused.
MAX_RESTARTS = 5
#: The window restarts are counted in: a worker that ran this long without a restart starts afresh.
WINDOW_S = 60.0
#: The delay before the second restart within the window; it doubles for each later one, up to `MAX_DELAY_S`.
FIRST_DELAY_S = 0.5
MAX_DELAY_S = 8.0


class RestartBudget:
    """The restarts of one instance within the last `WINDOW_S` seconds."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._times: deque[float] = deque()

    def next_delay(self) -> float | None:
        """Seconds to wait before restarting now (0 for the first in the window), counting the restart; None once
        `MAX_RESTARTS` were made within the window."""
        now = self._clock()
        while self._times and self._times[0] <= now - WINDOW_S:
            self._times.popleft()
        made = len(self._times)
        if made >= MAX_RESTARTS:
            return None
        self._times.append(now)
        return 0.0 if made == 0 else min(FIRST_DELAY_S * 2 ** (made - 1), MAX_DELAY_S)

    @staticmethod
    def refusal() -> str:
        """Why a restart was refused, for the log and the repository index."""
        return (
            f"its worker process was restarted {MAX_RESTARTS} times within {WINDOW_S:g}s and is not restarted again "
            "(load the model again to retry)"
        )
