"""Model names: the rule Triton applies, and the narrower one for the names transerve's tools write.

Triton's rule (core's model repository manager, `ValidateModelName`, applied when a model is loaded by name) is
short: a name may not be empty or only blanks, may not be `..` and may not hold `/`. A repository's folders are
taken by their names as they are, so Triton serves a folder `bad name` (clients ask for `/v2/models/bad%20name`).

The names `transerve export` and `convert` write are more than that: folder names, one segment of every URL a
client calls (`/v2/models/{name}/...`, never needing percent-escapes), a string in config.pbtxt, and a word on
command lines (`perf_analyzer -m NAME`, the seeds' `--model-name=NAME`, shell scripts). So they take what all of
those take unquoted: letters, digits, `_`, `-` and `.`, beginning with a letter, a digit or `_` (a leading `.`
hides the folder and allows `..`; a leading `-` reads as a flag), and at most `MAX_LENGTH` characters, which
leaves room within a file name's 255 bytes for the suffixes the tools add (`_detokenizer`, `_postprocess`).
"""

from __future__ import annotations

import re

MAX_LENGTH = 200
_CHARACTER = re.compile(r"[A-Za-z0-9_.\-]")


class ModelNameError(ValueError):
    """A name a tool would write that a client could not call plainly; the message says why in one line."""


def triton_problem(name: str) -> str | None:
    """Why Triton refuses to load a model of this name, or None when it takes it."""
    if not name.strip():
        return "a model name cannot be empty"
    if name.strip() == ".." or "/" in name:
        return "a model name must not contain path traversal characters ('..', '/')"
    return None


def check_tool_name(name: str, option: str) -> None:
    """ModelNameError naming `option` (`--name`, ...) unless `name` is one the tools may write as a model."""
    problem = triton_problem(name)
    if problem is None and len(name) > MAX_LENGTH:
        problem = f"it has {len(name)} characters, more than {MAX_LENGTH}"
    if problem is None:
        bad = [char for char in name if not _CHARACTER.fullmatch(char)]
        if bad:
            problem = f"{'a space' if bad[0] == ' ' else repr(bad[0])} is not allowed"
        elif name[0] in ".-":
            problem = f"it may not begin with {name[0]!r}"
    if problem is not None:
        raise ModelNameError(f"{option} {name!r} is not a model name: {problem}; use letters, digits, '_', '-' and "
                             "'.', beginning with a letter, a digit or '_'")

