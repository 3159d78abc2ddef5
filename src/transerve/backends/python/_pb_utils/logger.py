"""pb_utils.Logger: a model's log lines on the worker's stderr, filtered by the server's log settings."""

from __future__ import annotations

import datetime
import enum
import mmap
import os
import sys

from transerve.backends.python._pb_utils.errors import _require
from transerve.core.log_settings import read_page


class Logger:
    """Writes a model's log lines to the worker's stderr, which the server shares."""

    class LogLevel(enum.IntEnum):
        INFO = 0
        WARNING = 1
        ERROR = 2
        VERBOSE = 3

    INFO = LogLevel.INFO
    WARNING = LogLevel.WARNING
    ERROR = LogLevel.ERROR
    VERBOSE = LogLevel.VERBOSE

    #: The server's log settings page (set by the worker), read at every call so that changes made while the
    #: server runs (`/v2/logging`) apply; without one, everything but verbose lines is written.
    settings_page: mmap.mmap | None = None

    @staticmethod
    def log(message: str, level: LogLevel = LogLevel.INFO) -> None:
        _require(message, str, "Logger.log", "message")
        if not isinstance(level, Logger.LogLevel):  # Triton's binding takes the enum only, not a number
            raise TypeError(f"Logger.log(): level must be a pb_utils.Logger.LogLevel, not {type(level).__name__}")
        verbose, *switches = read_page(Logger.settings_page) if Logger.settings_page is not None else (
            0, True, True, True)
        if not (verbose > 0 if level == Logger.LogLevel.VERBOSE else switches[level]):
            return
        caller = sys._getframe(1)
        if caller.f_code.co_filename == __file__:
            caller = caller.f_back or caller
        stamp = datetime.datetime.now().strftime("%m%d %H:%M:%S.%f")
        where = f"{os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}"
        sys.stderr.write(f"{'IWEV'[level]}{stamp} {os.getpid()} {where}] {message}\n")
        sys.stderr.flush()

    @staticmethod
    def log_info(message: str) -> None:
        Logger.log(message, Logger.LogLevel.INFO)

    @staticmethod
    def log_warn(message: str) -> None:
        Logger.log(message, Logger.LogLevel.WARNING)

    @staticmethod
    def log_error(message: str) -> None:
        Logger.log(message, Logger.LogLevel.ERROR)

    @staticmethod
    def log_verbose(message: str) -> None:
        Logger.log(message, Logger.LogLevel.VERBOSE)


LogLevel = Logger.LogLevel
