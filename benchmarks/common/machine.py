"""The machine's other work: wait until it is quiet before a run, and measure what it took during one.

On a small shared machine other processes move throughput by a fifth between runs; a table that says how much CPU
they used lets a reader tell a slow server from a busy machine.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def machine_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of the whole machine so far, from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    total = sum(fields)
    return total - fields[3] - fields[4], total  # minus idle and iowait


def busy_cores(seconds: float = 1.0) -> float:
    """Cores' worth of CPU the machine spent over `seconds`: between runs, that is other work."""
    busy0, total0 = machine_ticks()
    time.sleep(seconds)
    busy1, total1 = machine_ticks()
    return (os.cpu_count() or 1) * (busy1 - busy0) / max(total1 - total0, 1)


def wait_for_quiet(limit: float, patience_s: float) -> float:
    """Wait (up to `patience_s`) until other work uses at most `limit` cores; returns what it used."""
    deadline = time.monotonic() + patience_s
    while (busy := busy_cores()) > limit and time.monotonic() < deadline:
        pass
    return busy


class OtherWork:
    """Cores' worth of CPU that processes other than the benchmark's (client, servers and their workers) used
    during a run: the machine's busy time minus ours."""

    def __init__(self, server_pids: list[int]) -> None:
        import psutil

        self._roots = [psutil.Process()] + [psutil.Process(pid) for pid in server_pids]

    def _ours(self) -> float:
        import psutil

        seconds = 0.0
        for root in self._roots:
            for process in [root, *root.children(recursive=True)]:
                try:
                    times = process.cpu_times()
                except psutil.Error:
                    continue
                seconds += times.user + times.system + times.children_user + times.children_system
        return seconds

    def __enter__(self) -> OtherWork:
        self._machine, self._ours0, self._wall = machine_ticks(), self._ours(), time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        busy1, total1 = machine_ticks()
        wall = time.monotonic() - self._wall
        cores = os.cpu_count() or 1
        machine_seconds = cores * wall * (busy1 - self._machine[0]) / max(total1 - self._machine[1], 1)
        self.cores = max(0.0, machine_seconds - (self._ours() - self._ours0)) / wall


def rss_bytes(pid: int) -> int:
    """A process's resident memory now (0 if /proc does not say)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0
