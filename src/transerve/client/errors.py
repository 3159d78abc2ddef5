"""The two ways a line can go wrong: the line's own fault, or the run's."""

from __future__ import annotations


class LineFailed(Exception):
    """This line was refused (invalid input, the server's INVALID_ARG): reported with its number, the run goes on."""


class RunStopped(Exception):
    """The run cannot go on (server unreachable or failing, unknown model, bad options): what is written so far
    stays as the checkpoint a rerun resumes from."""
