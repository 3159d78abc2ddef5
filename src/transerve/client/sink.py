"""Where answered batches go: the output file, the error report (stderr and `--errors-file`) and the progress bar.

Until a first line is answered, batches are held back: when the first `GIVE_UP_AFTER` lines sent all fail, the
fault is the run's (a misspelt `--param`, a model that refuses every text), so the run stops with nothing written,
rather than writing empty lines that a rerun would skip.
"""

from __future__ import annotations

from typing import TextIO

from transerve.client.errors import RunStopped
from transerve.client.files import Line, Output
from transerve.client.progress import ProgressBar
from transerve.client.runner import Outcome

GIVE_UP_AFTER = 10


class Sink:
    def __init__(self, output: Output, errors: TextIO | None, progress: ProgressBar) -> None:
        self._output = output
        self._errors = errors
        self._progress = progress
        self._held: list[tuple[list[Line], Outcome]] = []
        self._answered_one = False
        self.failed = 0

    def take(self, batch: list[Line], outcome: Outcome) -> None:
        if self._answered_one or not (outcome.failures or self._held):
            self._write(batch, outcome)
            return
        self._held.append((batch, outcome))
        failed = {number for number, _ in outcome.failures}
        if any(line.text and not line.text.isspace() and line.number not in failed for line in batch):
            self._answered_one = True
            self.flush()
            return
        failures = [failure for _, held in self._held for failure in held.failures]
        if len(failures) >= GIVE_UP_AFTER:
            raise RunStopped(f"the first {len(failures)} lines sent all failed, the last with: line "
                             f"{failures[-1][0]}: {failures[-1][1]}; nothing was written")

    def flush(self) -> None:
        """Write what is held (at the end of a short file whose lines all failed)."""
        held, self._held = self._held, []
        for batch, outcome in held:
            self._write(batch, outcome)

    def _write(self, batch: list[Line], outcome: Outcome) -> None:
        self._output.write(outcome.answers)
        for number, why in outcome.failures:
            self._progress.interrupt(f"transerve client: line {number}: {why}")
            if self._errors is not None:
                self._errors.write(f"{number}\t{why}\n")
        if self._errors is not None:
            self._errors.flush()
        self.failed += len(outcome.failures)
        self._progress.advance(len(batch), len(outcome.failures))
