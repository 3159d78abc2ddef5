"""The fenced code blocks of a docs page, so that tests run the commands a page shows as it shows them."""

from __future__ import annotations

import re
from pathlib import Path

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def code_blocks(page: Path, language: str) -> list[str]:
    """The page's blocks fenced as `language` (```bash, ```python), in order."""
    return [body for lang, body in _FENCE.findall(page.read_text(encoding="utf-8")) if lang == language]


def commands(block: str) -> list[str]:
    """A shell block's commands: comments and blank lines dropped, backslash continuations joined."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


_CAPTIONED = re.compile(r"^`([^`\s]+)`:\n\n```\w*\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def captioned_files(page: Path) -> dict[str, str]:
    """The files a page shows whole: a block right after a line that is only a path in backticks and a colon."""
    return dict(_CAPTIONED.findall(page.read_text(encoding="utf-8")))
