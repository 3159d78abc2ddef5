"""The server's log settings (core.log_settings) applied to its own Python logging, and the page workers read."""

from __future__ import annotations

import io
import logging
import mmap
from collections.abc import Iterator

import pytest

from transerve.core.log_settings import LogSettings, ServerLog, read_page


@pytest.fixture
def captured() -> Iterator[tuple[io.StringIO, logging.Handler]]:
    """A handler on the root logger writing to a string, as `transerve serve` configures one, removed afterwards
    (with the level it changes): pytest's own handlers stay as they are."""
    root = logging.getLogger()
    level = root.level
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    root.addHandler(handler)
    yield stream, handler
    root.removeHandler(handler)
    root.setLevel(level)


def emit_all(mark: str) -> None:
    log = logging.getLogger("transerve.test")
    log.debug(f"debug-{mark}")
    log.info(f"info-{mark}")
    log.warning(f"warning-{mark}")
    log.error(f"error-{mark}")


def test_the_switches_govern_the_servers_own_log(captured: tuple[io.StringIO, logging.Handler]) -> None:
    server_log = ServerLog()
    server_log.install([captured[1]])
    emit_all("a")
    server_log.update({"log_info": False, "log_error": False, "log_verbose_level": 1})
    emit_all("b")
    text = captured[0].getvalue()
    assert [mark in text for mark in ("debug-a", "info-a", "warning-a", "error-a")] == [False, True, True, True]
    assert [mark in text for mark in ("debug-b", "info-b", "warning-b", "error-b")] == [True, False, True, False]


def test_iso8601_times_are_utc(captured: tuple[io.StringIO, logging.Handler]) -> None:
    server_log = ServerLog(LogSettings(log_format="ISO8601"))
    server_log.install([captured[1]])
    logging.getLogger("transerve.test").warning("stamped")
    stamp = captured[0].getvalue().split(" ", 1)[0]
    assert stamp.endswith("Z") and "T" in stamp


def test_workers_read_every_change_from_the_page() -> None:
    server_log = ServerLog()  # not installed: no handler of this process changes
    page = mmap.mmap(server_log.page_fd, mmap.PAGESIZE, access=mmap.ACCESS_READ)
    assert read_page(page) == (0, True, True, True)
    server_log.update({"log_verbose_level": 3, "log_warning": False})
    assert read_page(page) == (3, True, False, True)
