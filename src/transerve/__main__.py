"""`python -m transerve` is the `transerve` command, and the console script calls `main` here too: the command's
modules are imported inside it with Ctrl-C held (a library's import can turn a KeyboardInterrupt into an
ImportError, as core/interrupts.py explains), so one that comes while they load is one line and status 130 too."""

import signal
import sys


def main() -> int:
    caught: list[int] = []
    held = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if held:
        signal.signal(signal.SIGINT, lambda signum, _: caught.append(signum))
    try:
        from transerve.cli import main as run
    finally:
        if held:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    if caught:
        print("transerve: interrupted", file=sys.stderr)
        return 130
    return run()


if __name__ == "__main__":
    sys.exit(main())
