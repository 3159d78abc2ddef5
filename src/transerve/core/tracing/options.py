"""tritonserver 2.51's trace flags, parsed as it parses them: `--trace-config [<mode>,]<setting>=<value>` (repeatable)
and the deprecated `--trace-file/--trace-level/--trace-rate/--trace-count/--trace-log-frequency`.

Numbers are read as C++'s `std::stoi`/`std::stoul` read them (leading blanks, a sign, digits; whatever follows is
ignored), so a value tritonserver accepts is accepted here with the same meaning, and a bad one is refused at start
with tritonserver's message.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field

log = logging.getLogger("transerve")

#: Trace levels, as bits: OFF is 0.
OFF, TIMESTAMPS, TENSORS = 0, 1, 2
TRITON, OPENTELEMETRY = "triton", "opentelemetry"
MODES = (TRITON, OPENTELEMETRY)

#: The batch span processor's settings, in the order tritonserver lists the defaulted ones, with the environment
#: variable that overrides each default (as the OpenTelemetry SDKs read them).
BSP_DEFAULTS = (
    ("bsp_max_export_batch_size", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "512"),
    ("bsp_schedule_delay", "OTEL_BSP_SCHEDULE_DELAY", "5000"),
    ("bsp_max_queue_size", "OTEL_BSP_MAX_QUEUE_SIZE", "2048"),
)

_INTEGER = re.compile(r"[ \t\n\v\f\r]*([+-]?)([0-9]+)")
_INT32 = (-(2**31), 2**31 - 1)
_ULONG_MAX = 2**64 - 1


class TraceConfigError(ValueError):
    """A trace flag tritonserver would refuse; the message is tritonserver's."""


class Unparsable(ValueError):
    """No number at the start of the text (C++'s std::invalid_argument)."""


class OutOfRange(ValueError):
    """A number too large for its type (C++'s std::out_of_range)."""


def stoi(text: str) -> int:
    """C++'s `std::stoi`: a 32-bit int from the start of `text`."""
    match = _INTEGER.match(text)
    if match is None:
        raise Unparsable(text)
    digits = match[2].lstrip("0") or "0"
    if len(digits) > 11:  # never in range; also keeps int() away from huge digit strings
        raise OutOfRange(text)
    value = int(match[1] + digits)
    if not _INT32[0] <= value <= _INT32[1]:
        raise OutOfRange(text)
    return value


def stoul32(text: str) -> int:
    """C++'s `std::stoul` stored in a uint32_t: a negative number wraps, the result is truncated to 32 bits."""
    match = _INTEGER.match(text)
    if match is None:
        raise Unparsable(text)
    digits = match[2].lstrip("0") or "0"
    if len(digits) > 20 or int(digits) > _ULONG_MAX:
        raise OutOfRange(text)
    value = -int(digits) % 2**64 if match[1] == "-" else int(digits)
    return value & 0xFFFFFFFF


def _parse_number(text: str, unsigned: bool = False) -> int:
    """tritonserver's ParseOption<int> / <uint32_t>, with its messages."""
    try:
        return stoul32(text) if unsigned else stoi(text)
    except Unparsable:
        raise TraceConfigError(f"Invalid option value. Got {text}") from None
    except OutOfRange:
        raise TraceConfigError(f"Provided option value is out of bound. Got {text}") from None


def parse_level(text: str) -> int:
    """A `level` value: OFF (also false/off), TIMESTAMPS (also true/on/min/max) or TENSORS, in any case."""
    lowered = text.lower()
    if lowered in ("false", "off"):
        return OFF
    if lowered in ("true", "on", "min", "max", "timestamps"):
        return TIMESTAMPS
    if lowered == "tensors":
        return TENSORS
    raise TraceConfigError(f"invalid value for trace level option: {lowered}")


def parse_mode(text: str) -> str:
    lowered = text.lower()
    if lowered in MODES:
        return lowered
    raise TraceConfigError(f'invalid value for trace mode option: {lowered}. Available options are "triton" and '
                           '"opentelemetry"')


@dataclass(slots=True)
class TraceOptions:
    """The trace settings at start; the trace extension can change all but the file and the mode."""

    level: int = OFF
    #: Every `rate`-th request is traced.
    rate: int = 1000
    #: Traces left to take; -1 is no limit.
    count: int = -1
    #: Write the traces to `<file>.<n>` every `log_frequency` traces; 0 writes them to `file` at exit.
    log_frequency: int = 0
    file: str = ""
    mode: str = TRITON
    #: Each mode's `--trace-config <mode>,<setting>=<value>` entries in the order given, with the values as the
    #: trace extension shows them (for OpenTelemetry: the batch span processor's, defaults included).
    config: dict[str, list[tuple[str, str]]] = field(default_factory=dict)

    def mode_config(self) -> list[tuple[str, str]]:
        return self.config.get(self.mode, [])


def _bad(flag: str, error: TraceConfigError) -> TraceConfigError:
    return TraceConfigError(f'Bad option: "{flag}".\n{error}')


def _split_config(text: str) -> tuple[str, str, str]:
    """One `--trace-config` value as (mode or "" for a global setting, setting, value)."""
    comma = text.find(",")
    mode = ""
    if comma > 0:
        mode = parse_mode(text[:comma])
    elif comma == 0:
        raise TraceConfigError("No trace mode specified. --trace-config option format is <trace mode>,<setting>="
                               f"<value> or <setting>=<value>. Got {text}")
    equals = text.find("=", comma + 1)
    setting, value = text[comma + 1:equals], text[equals + 1:]
    if equals < 0 or not setting or not value:
        raise TraceConfigError(f"--trace-config option format is '<trace mode>,<setting>=<value>'. Got {text}")
    return mode, setting, value


def parse_trace_options(
    config: list[str],
    file: str | None = None,
    levels: list[str] | None = None,
    rate: str | None = None,
    count: str | None = None,
    log_frequency: str | None = None,
) -> TraceOptions:
    """TraceOptions from the `--trace-config` values and the deprecated flags; raises TraceConfigError."""
    options = TraceOptions()
    disabled = False
    for flag, given in (("--trace-file", file), ("--trace-level", levels), ("--trace-rate", rate),
                        ("--trace-count", count), ("--trace-log-frequency", log_frequency)):
        if given is not None:
            log.warning("'%s' is deprecated: use --trace-config instead", flag)
    if file is not None:
        options.file = file
    for text in levels or ():
        try:
            level = parse_level(text)
        except TraceConfigError as exc:
            raise _bad("--trace-level", exc) from None
        disabled |= level == OFF
        options.level |= level
    for flag, name, given in (("--trace-rate", "rate", rate), ("--trace-count", "count", count),
                              ("--trace-log-frequency", "log_frequency", log_frequency)):
        if given is not None:
            try:
                setattr(options, name, _parse_number(given))
            except TraceConfigError as exc:
                raise _bad(flag, exc) from None
    entries: dict[str, list[tuple[str, str]]] = {"": [], TRITON: [], OPENTELEMETRY: []}
    for text in config:
        try:
            mode, setting, value = _split_config(text)
        except TraceConfigError as exc:
            raise _bad("--trace-config", exc) from None
        entries[mode].append((setting, value))
    for setting, value in entries[""]:
        try:
            if setting == "rate":
                options.rate = _parse_number(value)
            elif setting == "level":
                level = parse_level(value)
                disabled |= level == OFF
                options.level |= level
            elif setting == "mode":
                options.mode = parse_mode(value)
            elif setting == "count":
                options.count = _parse_number(value)
        except TraceConfigError as exc:
            raise _bad(f"--trace-config {setting}", exc) from None
    if options.mode == TRITON:
        for setting, value in entries[TRITON]:
            try:
                if setting == "file":
                    options.file = value
                elif setting == "log-frequency":
                    options.log_frequency = _parse_number(value)
            except TraceConfigError as exc:
                raise _bad(f"--trace-config triton,{setting}", exc) from None
    else:
        entries[OPENTELEMETRY] = _batch_span_processor(entries[OPENTELEMETRY])
    if disabled:
        options.level = OFF
    # Both are handed to the trace settings as uint32, as tritonserver does: -1 is 4294967295.
    options.rate &= 0xFFFFFFFF
    options.log_frequency &= 0xFFFFFFFF
    options.config = {TRITON: entries[TRITON], OPENTELEMETRY: entries[OPENTELEMETRY]}
    if options.mode == OPENTELEMETRY:
        _check_opentelemetry(options)
    return options


def _batch_span_processor(entries: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The OpenTelemetry entries with the batch span processor's numbers read as uint32, and the ones not given
    added from OTEL_BSP_* or the SDK defaults."""
    names = {name for name, _, _ in BSP_DEFAULTS}
    given = set()
    result = []
    for setting, value in entries:
        if setting in names:
            try:
                value = str(_parse_number(value, unsigned=True))
            except TraceConfigError as exc:
                raise _bad(f"--trace-config opentelemetry,{setting}", exc) from None
            given.add(setting)
        result.append((setting, value))
    for setting, variable, default in BSP_DEFAULTS:
        if setting not in given:
            try:
                result.append((setting, str(_parse_number(os.environ.get(variable, default), unsigned=True))))
            except TraceConfigError as exc:
                raise _bad(variable, exc) from None
    return result


def _check_opentelemetry(options: TraceOptions) -> None:
    """What the OpenTelemetry SDK would refuse later is refused now, naming the setting; and the SDK must be there."""
    values = {setting: int(value) for setting, value in options.mode_config() if setting.startswith("bsp_")}
    for setting in ("bsp_max_queue_size", "bsp_schedule_delay", "bsp_max_export_batch_size"):
        if values[setting] == 0:
            raise TraceConfigError(f"--trace-config opentelemetry,{setting} must be positive")
    if values["bsp_max_export_batch_size"] > values["bsp_max_queue_size"]:
        raise TraceConfigError("--trace-config opentelemetry,bsp_max_export_batch_size must not exceed "
                               "bsp_max_queue_size: larger batches could never be exported")
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError:
        raise TraceConfigError("--trace-config mode=opentelemetry needs the OpenTelemetry SDK and its OTLP/HTTP "
                               "exporter: pip install 'transerve[trace]'") from None
