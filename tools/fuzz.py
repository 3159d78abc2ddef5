"""Run the property-based fuzz tests (tests/fuzz) far longer than CI does, before a release.

    python tools/fuzz.py --minutes 5 --target all        # http1 | http2 | hpack | codecs | all

Each target's minutes are shared among its properties; each property runs in rounds of random examples (the
`release` profile, not derandomized, so every round explores new inputs) until its share is spent. A failure
prints hypothesis' shrunk example and a `@reproduce_failure` line; the table at the end says what ran. Exits 1 if
any property failed.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import sys
import time
import traceback
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path[0] = str(TESTS)  # not tools/: this script would shadow tests/fuzz

from hypothesis import settings  # noqa: E402
from support.fuzzing import Loop  # noqa: E402

TARGETS = {"http1": "fuzz.test_fuzz_http1", "http2": "fuzz.test_fuzz_http2", "hpack": "fuzz.test_fuzz_hpack",
           "codecs": "fuzz.test_fuzz_codecs"}
ROUND = 200  # examples per round: a failure is reported within a round


def properties(module_name: str) -> list:
    module = importlib.import_module(module_name)
    return [value for name, value in vars(module).items()
            if name.startswith("test_") and getattr(value, "is_hypothesis_test", False)]


def run(test, seconds: float) -> tuple[int, float, str]:
    """Rounds of `test` for `seconds`: examples run, time taken, and "ok" or the failure."""
    count = 0
    inner = test.hypothesis.inner_test

    @functools.wraps(inner)  # so that a failure prints the property's name and arguments
    def counted(*args, **kwargs):
        nonlocal count
        count += 1
        return inner(*args, **kwargs)

    test.hypothesis.inner_test = counted
    runner = settings(settings.get_profile("release"), max_examples=ROUND, database=None)(test)
    start = time.monotonic()
    outcome = "ok"
    try:
        with Loop() as loop:
            while time.monotonic() - start < seconds:
                kwargs = {"loop": loop} if "loop" in inspect.signature(test).parameters else {}
                try:
                    runner(**kwargs)
                except Exception as exc:  # every failure is reported, then the next property runs
                    traceback.print_exc()
                    outcome = f"FAILED: {type(exc).__name__}"
                    break
    finally:
        test.hypothesis.inner_test = inner
    return count, time.monotonic() - start, outcome


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=5.0, help="per target (default 5)")
    parser.add_argument("--target", choices=[*TARGETS, "all"], default="all")
    args = parser.parse_args()
    targets = list(TARGETS) if args.target == "all" else [args.target]
    rows = []
    for target in targets:
        tests = properties(TARGETS[target])
        for test in tests:
            print(f"{target}: {test.__name__} ...", flush=True)
            examples, seconds, outcome = run(test, args.minutes * 60 / len(tests))
            rows.append((target, test.__name__, examples, seconds, outcome))
    width = max(len(row[1]) for row in rows)
    print(f"\n{'target':<7} {'property':<{width}} {'examples':>9} {'seconds':>8} {'per s':>7}  result")
    for target, name, examples, seconds, outcome in rows:
        print(f"{target:<7} {name:<{width}} {examples:>9} {seconds:>8.1f} {examples / seconds:>7.0f}  {outcome}")
    return 0 if all(row[4] == "ok" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
