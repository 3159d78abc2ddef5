"""Triton's logging extension: the server's log settings (tritonserver's `--log-*` flags), read and changed while
it runs over HTTP (`/v2/logging`) and gRPC (`LogSettings`).

They govern this process's Python logging (a filter per level, the verbose level, the time format) and the
python-backend workers' `pb_utils.Logger`: the workers map one shared page, written here at every change, so a
change reaches workers already running. As in Triton, the log file cannot be changed over the network, and
unknown settings are ignored; a mistyped value is a 400 here (Triton: 500).
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import time
from dataclasses import asdict, dataclass
from typing import Any

from transerve.core.errors import invalid_arg, unsupported

#: The time formats of `log_format`.
FORMATS = ("default", "ISO8601")
#: The page the workers read: verbose level, then the info/warning/error switches as bits 0-2.
PAGE = struct.Struct("<II")
_LINE = "%(asctime)s %(levelname).1s %(name)s: %(message)s"


@dataclass(slots=True)
class LogSettings:
    log_file: str = ""
    log_info: bool = True
    log_warning: bool = True
    log_error: bool = True
    log_verbose_level: int = 0
    log_format: str = "default"


class ServerLog:
    """The current settings, applied to the root logger's handlers and to the workers' shared page."""

    def __init__(self, settings: LogSettings | None = None) -> None:
        self.settings = settings or LogSettings()
        descriptor = os.memfd_create("transerve-log-settings", os.MFD_CLOEXEC)
        os.ftruncate(descriptor, mmap.PAGESIZE)
        self._page = mmap.mmap(descriptor, mmap.PAGESIZE)
        #: What workers map (`--log-settings-fd`); they read it at every log call.
        self.page_fd = descriptor
        self._filter = _LevelSwitch(self.settings)
        #: The handlers that follow the settings (`install`); none until then.
        self._handlers: list[logging.Handler] = []
        self._write_page()

    def as_dict(self) -> dict[str, Any]:
        return asdict(self.settings)

    def update(self, changes: dict[str, Any]) -> dict[str, Any]:
        """Apply the settings named in `changes` (checked first: none applies if one is wrong)."""
        checked = {}
        for key, value in changes.items():
            if key == "log_file":
                raise unsupported("log file location can not be updated through network protocol")
            if key in ("log_info", "log_warning", "log_error"):
                if not isinstance(value, bool):
                    raise invalid_arg(f"log setting '{key}' must be true or false")
            elif key == "log_verbose_level":
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    raise invalid_arg(f"log setting '{key}' must be a non-negative integer")
            elif key == "log_format":
                if value not in FORMATS:
                    raise invalid_arg(f"invalid argument for --log_format, got: {value}")
            else:
                continue
            checked[key] = value
        for key, value in checked.items():
            setattr(self.settings, key, value)
        self._follow()
        return self.as_dict()

    def install(self, handlers: list[logging.Handler] | None = None) -> None:
        """Make `handlers` (default: the root logger's) follow the settings from now on; `transerve serve` calls
        it once, after configuring logging."""
        self._handlers = list(logging.getLogger().handlers if handlers is None else handlers)
        for handler in self._handlers:
            handler.addFilter(self._filter)
        self._follow()

    def _follow(self) -> None:
        if self._handlers:
            logging.getLogger().setLevel(logging.DEBUG if self.settings.log_verbose_level > 0 else logging.INFO)
            for handler in self._handlers:
                handler.setFormatter(_formatter(self.settings.log_format))
        self._write_page()

    def _write_page(self) -> None:
        settings = self.settings
        switches = settings.log_info | settings.log_warning << 1 | settings.log_error << 2
        self._page[:PAGE.size] = PAGE.pack(settings.log_verbose_level, switches)


class _LevelSwitch(logging.Filter):
    """Drops records of the levels whose switch is off (verbose records are DEBUG, governed by the level)."""

    def __init__(self, settings: LogSettings) -> None:
        super().__init__()
        self._settings = settings

    def filter(self, record: logging.LogRecord) -> bool:
        settings = self._settings
        if record.levelno >= logging.ERROR:
            return settings.log_error
        if record.levelno >= logging.WARNING:
            return settings.log_warning
        if record.levelno >= logging.INFO:
            return settings.log_info
        return settings.log_verbose_level > 0


def _formatter(kind: str) -> logging.Formatter:
    if kind == "ISO8601":
        formatter = logging.Formatter(_LINE, datefmt="%Y-%m-%dT%H:%M:%SZ")
        formatter.converter = time.gmtime
        return formatter
    return logging.Formatter(_LINE)


def read_page(page: mmap.mmap) -> tuple[int, bool, bool, bool]:
    """A worker's view of the page: (verbose level, info, warning, error)."""
    verbose, switches = PAGE.unpack_from(page)
    return verbose, bool(switches & 1), bool(switches & 2), bool(switches & 4)
