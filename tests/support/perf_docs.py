"""docs/perf.md's commands and files, read from the page so that its tests run exactly what it shows."""

from __future__ import annotations

import re
import shlex

from .servers import REPO_ROOT

PAGE = REPO_ROOT / "docs" / "perf.md"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", PAGE.read_text(), re.DOTALL)


def perf_commands(llm: bool) -> list[list[str]]:
    """The page's `transerve perf` command lines (with or without --llm), as argv after `transerve`."""
    lines = [line for block in blocks("bash") for line in block.splitlines() if line.startswith("transerve perf")]
    return [shlex.split(line)[1:] for line in lines if ("--llm" in line) == llm]


def aimed(argv: list[str], http_url: str, grpc_url: str) -> list[str]:
    """`argv` aimed at a test's server: the page's localhost ports swapped for the server's."""
    url = grpc_url if "grpc" in argv else http_url
    if "-u" in argv:
        argv = list(argv)
        argv[argv.index("-u") + 1] = url
        return argv
    return [*argv, "-u", url]
