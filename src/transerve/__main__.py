"""`python -m transerve` is the `transerve` command, and the console script calls `main` here too: the command's
modules are imported inside it with Ctrl-C held (a library's import can turn a KeyboardInterrupt into an
ImportError, as core/interrupts.py explains), so one that comes while they load is one line and status 130 too."""

import sys

from transerve.core.interrupts import interrupts_held


def main() -> int:
    try:
        with interrupts_held():
            from transerve.cli import main as run
    except KeyboardInterrupt:
        print("transerve: interrupted", file=sys.stderr)
        return 130
    return run()


if __name__ == "__main__":
    sys.exit(main())
