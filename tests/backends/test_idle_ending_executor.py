"""IdleEndingExecutor: one thread at a time, calls in order, the thread ending when idle and a new one (set up
again) starting with the next call."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from transerve.backends.idle_ending_executor import IdleEndingExecutor


def wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_calls_run_in_order_on_one_thread_that_ends_when_idle_and_a_new_one_is_set_up_for_the_next():
    setups: list[threading.Thread] = []
    executor = IdleEndingExecutor("worker", idle_seconds=0.2, setup=lambda: setups.append(threading.current_thread()))
    try:
        order: list[int] = []
        futures = [executor.submit(lambda i=i: order.append(i) or threading.current_thread()) for i in range(5)]
        threads = {future.result(timeout=10) for future in futures}
        assert order == [0, 1, 2, 3, 4]
        assert len(threads) == 1 and setups == list(threads)  # set up once, before its first call
        first = threads.pop()
        assert first.name.startswith("worker")
        assert wait_for(lambda: executor.thread is None) and wait_for(lambda: not first.is_alive())
        second = executor.submit(threading.current_thread).result(timeout=10)
        assert second is not first and setups == [first, second]
        assert executor.threads_started == 2
    finally:
        executor.shutdown()


def test_errors_reach_the_caller_and_the_thread_keeps_serving():
    executor = IdleEndingExecutor("worker", idle_seconds=5.0)
    try:
        with pytest.raises(ZeroDivisionError):
            executor.submit(lambda: 1 / 0).result(timeout=10)
        assert executor.submit(lambda x, y=0: x + y, 2, y=3).result(timeout=10) == 5
        assert executor.threads_started == 1
    finally:
        executor.shutdown()


def test_a_failing_setup_is_logged_and_the_calls_still_run(caplog):
    def setup() -> None:
        raise RuntimeError("no threads for you")

    executor = IdleEndingExecutor("worker", idle_seconds=5.0, setup=setup)
    try:
        assert executor.submit(lambda: 7).result(timeout=10) == 7
        assert "thread setup failed" in caplog.text
    finally:
        executor.shutdown()


def test_shutdown_ends_the_thread_cancels_what_waits_if_asked_and_refuses_new_calls():
    executor = IdleEndingExecutor("worker", idle_seconds=60.0)
    started, release = threading.Event(), threading.Event()
    running = executor.submit(lambda: started.set() or release.wait(10))
    waiting = executor.submit(lambda: "never")
    assert started.wait(10)
    thread = executor.thread
    executor.shutdown(wait=False, cancel_futures=True)
    assert waiting.cancelled() and not running.done()
    release.set()
    thread.join(10)
    assert running.result(timeout=1) is True  # the call that ran is finished, then the thread ends
    assert not thread.is_alive() and executor.thread is None
    with pytest.raises(RuntimeError, match="shut down"):
        executor.submit(lambda: None)


def test_the_event_loop_runs_calls_on_it():
    executor = IdleEndingExecutor("worker", idle_seconds=5.0)

    async def main() -> str:
        return await asyncio.get_running_loop().run_in_executor(executor, lambda: threading.current_thread().name)

    try:
        assert asyncio.run(main()).startswith("worker")
    finally:
        executor.shutdown()
