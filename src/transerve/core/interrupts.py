"""Ctrl-C held while modules load. A library's import can turn a KeyboardInterrupt raised inside it into an
ImportError (numpy's C extensions do: "Importing the numpy C-extensions failed"), which a command would then
report as a missing package; held, the interrupt is raised once the imports are done, as itself."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def interrupts_held() -> Iterator[None]:
    """Run the block with SIGINT recorded instead of raised; raise KeyboardInterrupt after it if one came. Where
    SIGINT is not Python's default (ignored, or another handler), or off the main thread, nothing changes."""
    if threading.current_thread() is not threading.main_thread() or (
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    caught: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, _: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if caught:
        raise KeyboardInterrupt
