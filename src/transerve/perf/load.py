"""The load: a closed loop (N workers, each sending its next request when its last one is answered, as
perf_analyzer's --concurrency-range) or an open loop (requests sent on a schedule, constant or Poisson, whatever
the answers do, as its --request-rate-range). Workers are threads with a connection each; what they measure
goes to a `Recorder` that the measurement takes from window by window."""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from transerve.perf.options import PerfError
from transerve.perf.transport import Connection, Timing


class Recorder:
    """Timings answered since the last `take`, shared by the workers."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._timings: list[Timing] = []
        self.error: PerfError | None = None

    def add(self, timing: Timing) -> None:
        with self._lock:
            self._timings.append(timing)
            self._lock.notify_all()

    def fail(self, error: PerfError) -> None:
        with self._lock:
            if self.error is None:
                self.error = error
            self._lock.notify_all()

    def take(self) -> list[Timing]:
        with self._lock:
            taken, self._timings = self._timings, []
        return taken

    def wait_for(self, count: int, timeout: float) -> bool:
        """Until `count` timings are held (or an error); False when `timeout` passes first."""
        with self._lock:
            return self._lock.wait_for(lambda: len(self._timings) >= count or self.error is not None, timeout)


class Load:
    """A running load; `stop` ends it and waits for the requests in flight."""

    def __init__(self, connect: Callable[[], Connection], requests: list[Any], recorder: Recorder) -> None:
        self.connect = connect
        self.requests = requests
        self.recorder = recorder
        self.stopping = threading.Event()
        self.threads: list[threading.Thread] = []
        self.delayed = 0  # open loop: requests sent more than DELAY_S after their time

    def _thread(self, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=self._guarded, args=(target, *args), daemon=True)
        self.threads.append(thread)
        thread.start()

    def _guarded(self, target: Callable[..., None], *args: Any) -> None:
        try:
            target(*args)
        except PerfError as exc:
            self.recorder.fail(exc)
            self.stopping.set()

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join()


class ClosedLoop(Load):
    def start(self, concurrency: int) -> ClosedLoop:
        for index in range(concurrency):
            self._thread(self._worker, index)
        return self

    def _worker(self, index: int) -> None:
        connection = self.connect()
        try:
            step = index
            while not self.stopping.is_set():
                self.recorder.add(connection.infer(self.requests[step % len(self.requests)]))
                step += 1
        finally:
            connection.close()


#: An open-loop request sent later than this after its scheduled time counts as delayed (perf_analyzer warns of
#: them too: the client, not the server, then limits the rate).
DELAY_S = 0.005


class OpenLoop(Load):
    def start(self, rate: float, distribution: str, threads: int, seed: int = 0) -> OpenLoop:
        self.due: queue.SimpleQueue[tuple[float, int] | None] = queue.SimpleQueue()
        for _ in range(threads):
            self._thread(self._worker)
        self._thread(self._schedule, rate, distribution, threads, random.Random(seed))
        return self

    def _schedule(self, rate: float, distribution: str, threads: int, generator: random.Random) -> None:
        moment = time.perf_counter()
        step = 0
        try:
            while not self.stopping.is_set():
                moment += generator.expovariate(rate) if distribution == "poisson" else 1.0 / rate
                pause = moment - time.perf_counter()
                if pause > 0 and self.stopping.wait(pause):
                    break
                self.due.put((moment, step))
                step += 1
        finally:
            for _ in range(threads):
                self.due.put(None)

    def _worker(self) -> None:
        connection = self.connect()
        try:
            while (item := self.due.get()) is not None:
                moment, step = item
                if time.perf_counter() - moment > DELAY_S:
                    self.delayed += 1
                self.recorder.add(connection.infer(self.requests[step % len(self.requests)]))
        finally:
            connection.close()
