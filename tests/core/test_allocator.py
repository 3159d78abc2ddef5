"""The server's malloc thresholds (core.allocator): applied on glibc, left alone when the environment sets them."""

from __future__ import annotations

import platform

import pytest

from transerve.core.allocator import keep_large_buffers


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_applied_on_glibc():
    assert keep_large_buffers() is True


def test_the_environment_wins(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert keep_large_buffers() is False
