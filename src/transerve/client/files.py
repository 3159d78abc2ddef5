"""The input file read line by line in bounded memory, and the output file as the run's checkpoint.

Output line k answers input line k. Every answer is written as one whole line ending in a newline, so the output's
complete lines are exactly the input lines done; a last line without its newline (a run killed mid-write) is cut
off when a run resumes, and redone.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from transerve.client.errors import RunStopped

_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class Line:
    number: int  # 1-based, as editors and the error report count
    text: str | None  # None when the line could not be read as text
    problem: str = ""  # why text is None


def count_lines(path: Path) -> int:
    """Lines in `path`, a last line without a newline included."""
    count, last = 0, b"\n"
    with path.open("rb") as file:
        while chunk := file.read(_CHUNK):
            count += chunk.count(b"\n")
            last = chunk[-1:]
    return count + (last != b"\n")


def read_lines(path: Path, skip: int, max_bytes: int) -> Iterator[Line]:
    """The lines after the first `skip`, without their line ending (`\\n` or `\\r\\n`). A line longer than
    `max_bytes` or not UTF-8 comes as a problem; its bytes are never held whole."""
    with path.open("rb") as file:
        number = 0
        while True:
            data, complete_bytes = _next_line(file, max_bytes)
            if data is None:
                return
            number += 1
            if number <= skip:
                continue
            if complete_bytes > max_bytes:
                yield Line(number, None, f"the line has {complete_bytes} bytes, more than --max-line-bytes "
                                         f"{max_bytes}")
                continue
            try:
                yield Line(number, data.decode("utf-8"))
            except UnicodeDecodeError as exc:
                yield Line(number, None, f"the line is not UTF-8 (byte {exc.start + 1}: {exc.reason})")


def _next_line(file: BinaryIO, max_bytes: int) -> tuple[bytes | None, int]:
    """(the line's bytes, its length); the bytes are cut short past `max_bytes` (the rest is read and dropped);
    (None, 0) at the end of the file."""
    data = file.readline(max_bytes + 2)
    if not data:
        return None, 0
    length = len(data)
    while not data.endswith(b"\n"):
        more = file.readline(_CHUNK)
        if not more:
            break
        length += len(more)
        data = more if len(data) > max_bytes else data + more
    if data.endswith(b"\n"):
        length -= 1 + data.endswith(b"\r\n")
        data = data[: -2 if data.endswith(b"\r\n") else -1]
    return data, length


class Output:
    """The output file, opened to continue after its complete lines."""

    def __init__(self, path: Path, input_lines: int) -> None:
        self.path = path
        #: Input lines already answered: the output's complete lines.
        self.done = _complete_lines(path)
        if self.done > input_lines:
            raise RunStopped(f"{path} has {self.done} lines, more than the input's {input_lines}: it is not this "
                             "input's output (remove it to start again)")
        self._file = path.open("ab")

    def write(self, answers: list[str]) -> None:
        """Append whole lines: a line break inside an answer becomes a space, so lines stay aligned."""
        self._file.write(b"".join((one_line(answer) + "\n").encode("utf-8") for answer in answers))
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _complete_lines(path: Path) -> int:
    """The number of complete lines of `path` (0 when it does not exist), after cutting off a partial last one."""
    if not path.exists():
        return 0
    size = path.stat().st_size
    with path.open("r+b") as file:
        end = size
        while end > 0:  # find the last newline, reading backwards in chunks
            start = max(0, end - _CHUNK)
            file.seek(start)
            index = file.read(end - start).rfind(b"\n")
            if index >= 0:
                end = start + index + 1
                break
            end = start
        if end != size:
            file.truncate(end)
    return count_lines(path) if end else 0


def one_line(text: str) -> str:
    """The answer on one line: each line break a space."""
    return text.replace("\r\n", " ").replace("\r", " ").replace("\n", " ")
