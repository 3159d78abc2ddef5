"""An executor of one thread at a time that ends when idle: the next call starts a new one.

torch's OpenMP runtime (libgomp) keeps a pool of worker threads for every thread that has computed in parallel,
for as long as that thread lives; once a process holds more such threads than cores, every pool's workers stop
spinning between parallel regions and sleep, and waking them costs each region time. So a model that sits idle
must not keep a thread that has computed: it would slow every busy model of the server (docs/generation.md
measured this for the generation engine). A thread of this executor ends after `idle_seconds` without work, and
its pool with it; `setup` runs first on every new thread, for what is set per thread (torch's thread count).
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

logger = logging.getLogger(__name__)

_Call = tuple[Future, Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class IdleEndingExecutor(Executor):
    """Runs submitted calls one at a time, in order, on a thread of its own that ends after `idle_seconds`
    without work."""

    def __init__(self, name: str, idle_seconds: float, setup: Callable[[], None] | None = None) -> None:
        self.name = name
        self.idle_seconds = idle_seconds
        self._setup = setup
        self._cond = threading.Condition()
        self._calls: collections.deque[_Call] = collections.deque()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._numbers = itertools.count()
        #: Threads started so far (a new one after each idle end).
        self.threads_started = 0

    @property
    def thread(self) -> threading.Thread | None:
        """The thread that runs calls now, None while idle."""
        return self._thread

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError(f"executor {self.name} is shut down")
            self._calls.append((future, fn, args, kwargs))
            if self._thread is None:
                # Not a daemon: at exit the interpreter waits for it (idle_seconds at most after the last call), as
                # it waits for ThreadPoolExecutor's threads; a process that exited with such a thread as a daemon,
                # after it had run torch, aborted ("terminate called without an active exception").
                self._thread = threading.Thread(target=self._work, name=f"{self.name}_{next(self._numbers)}")
                self.threads_started += 1
                self._thread.start()
            self._cond.notify()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._cond:
            self._closed = True
            thread = self._thread
            if cancel_futures:
                while self._calls:
                    self._calls.popleft()[0].cancel()
            self._cond.notify_all()
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join()

    def _work(self) -> None:
        if self._setup is not None:
            try:
                self._setup()
            except Exception:
                logger.exception("%s: thread setup failed", self.name)
        while (call := self._next()) is not None:
            self._run(call)
            del call  # nothing of a finished call lives on while the thread waits for the next

    @staticmethod
    def _run(call: _Call) -> None:
        future, fn, args, kwargs = call
        if not future.set_running_or_notify_cancel():
            return
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:  # the caller's to handle, as ThreadPoolExecutor does
            future.set_exception(exc)
        else:
            future.set_result(result)

    def _next(self) -> _Call | None:
        """The next call; None when the thread is to end (shut down with nothing queued, or idle too long)."""
        with self._cond:
            deadline = time.monotonic() + self.idle_seconds
            while not self._calls:
                left = deadline - time.monotonic()
                if self._closed or left <= 0:
                    self._thread = None
                    return None
                self._cond.wait(left)
            return self._calls.popleft()
