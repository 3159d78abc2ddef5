"""Command-line pieces every benchmark shares: `--json PATH` output and comma-separated lists.

The JSON document names what produced it (benchmark, date, commit, machine, arguments) next to the numbers, so a
saved result can be compared with a later one without guessing where it came from.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]


def comma_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def int_list(text: str) -> list[int]:
    return [int(item) for item in comma_list(text)]


def add_json_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, metavar="PATH",
                        help="also write the results as JSON here (with the date, commit, machine and arguments)")


def commit() -> str:
    """The checkout's commit, with `+dirty` when it has uncommitted changes; "" outside git."""
    try:
        head = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""
    return head + ("+dirty" if dirty else "")


def write_json(path: Path | None, benchmark: str, results: Any, args: argparse.Namespace | None = None) -> None:
    """Write `results` (anything `json` can take; dataclasses and paths as text) under a header naming the run."""
    if path is None:
        return
    document = {
        "benchmark": benchmark,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit(),
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                    "python": platform.python_version()},
        "arguments": {key: value for key, value in vars(args).items() if key != "json"} if args else None,
        "results": results,
    }
    Path(path).write_text(json.dumps(document, indent=1, default=_plain) + "\n")
    print(f"results written to {path}", file=sys.stderr)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return str(value)
