"""The budget on a python worker's output (`output.WorkerOutput`) and on its restarts (`restarts.RestartBudget`)."""

from __future__ import annotations

import asyncio
import logging
import os

import pytest

from transerve.backends.python import output
from transerve.backends.python.output import WorkerOutput
from transerve.backends.python.restarts import MAX_RESTARTS, WINDOW_S, RestartBudget


def logged(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(record.levelno, record.getMessage()) for record in caplog.records
            if record.name == "transerve.backends.python.worker_output"]


async def read_all(chunks: list[bytes]) -> None:
    """Write `chunks` into a pipe a WorkerOutput reads, then end it."""
    read_end, write_end = os.pipe()
    reader = WorkerOutput(read_end, "m_0", asyncio.get_running_loop())
    for chunk in chunks:
        os.write(write_end, chunk)
        await asyncio.sleep(0.01)
    os.close(write_end)
    for _ in range(100):
        await asyncio.sleep(0.01)
        if reader._fd < 0:
            return
    reader.close()


def test_lines_keep_their_level_and_a_long_one_is_cut(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    long = b"x" * (output.LINE_MAX_BYTES + 5000)
    asyncio.run(read_all([b"plain print\nW1204 12:00:00.1 7 model.py:3] careful\n", b"par", b"tial\n",
                          long[:3000], long[3000:] + b"\nafter\n", b"no newline at the end"]))
    lines = logged(caplog)
    assert lines[:3] == [(logging.INFO, "model instance 'm_0': plain print"),
                         (logging.WARNING, "model instance 'm_0': W1204 12:00:00.1 7 model.py:3] careful"),
                         (logging.INFO, "model instance 'm_0': partial")]
    assert lines[3][1] == f"model instance 'm_0': {'x' * output.LINE_MAX_BYTES} [line cut at 4096 bytes]"
    assert lines[4:] == [(logging.INFO, "model instance 'm_0': after"),
                         (logging.INFO, "model instance 'm_0': no newline at the end")]


def test_a_flood_past_the_budget_is_counted_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    flood = b"line\n" * (output.BURST_LINES + 5000)
    asyncio.run(read_all([flood[index:index + 65536] for index in range(0, len(flood), 65536)]))
    lines = logged(caplog)
    kept = [message for _, message in lines if message.endswith(": line")]
    notes = [message for _, message in lines if "suppressed" in message]
    assert output.BURST_LINES <= len(kept) < output.BURST_LINES + 100  # a burst, then 100 lines/s
    assert len(notes) >= 1
    suppressed = sum(int(note.split("suppressed ")[1].split()[0]) for note in notes)
    assert len(kept) + suppressed == output.BURST_LINES + 5000


def test_restarts_are_spaced_then_refused_within_the_window() -> None:
    now = [0.0]
    budget = RestartBudget(lambda: now[0])
    delays = []
    for index in range(MAX_RESTARTS):
        now[0] = 10.0 * index
        delays.append(budget.next_delay())
    assert delays == [0.0, 0.5, 1.0, 2.0, 4.0]
    now[0] = 50.0
    assert budget.next_delay() is None
    now[0] = WINDOW_S + 0.1  # the first restart leaves the window, four are still in it
    assert budget.next_delay() == 4.0
    now[0] = 200.0  # a worker that ran long starts afresh
    assert budget.next_delay() == 0.0
    assert "restarted 5 times within 60s" in RestartBudget.refusal()
