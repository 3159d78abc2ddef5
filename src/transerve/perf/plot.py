"""`--plot FILE.png`: throughput and latency against the load level, one figure (matplotlib, optional)."""

from __future__ import annotations

from pathlib import Path

from transerve.perf.options import PerfError

LATENCY_COLORS = ("tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PerfError("--plot needs matplotlib: pip install 'transerve[perf]'") from None
    matplotlib.use("Agg")  # a file, never a window
    import matplotlib.pyplot as pyplot

    return pyplot


def check_available() -> None:
    """Fail before the run rather than after it."""
    _pyplot()


def plot(path: Path, level_name: str, levels: list[float], series: dict[str, list[float]], title: str) -> None:
    """`series`: throughput first (left axis), then latencies (right axis, milliseconds)."""
    pyplot = _pyplot()
    figure, left = pyplot.subplots(figsize=(7, 4.5))
    names = list(series)
    left.plot(levels, series[names[0]], "o-", color="tab:blue", label=names[0])
    left.set_xlabel(level_name)
    left.set_ylabel(names[0], color="tab:blue")
    right = left.twinx()
    for name, color in zip(names[1:], LATENCY_COLORS, strict=False):
        right.plot(levels, series[name], "s--", color=color, label=name)
    if len(levels) <= 16:
        left.set_xticks(levels)
    right.set_ylabel("latency (ms)")
    lines = left.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    left.legend(lines[0] + more[0], lines[1] + more[1], loc="upper left", fontsize="small")
    left.set_title(title)
    figure.tight_layout()
    try:
        figure.savefig(path, format="png")
    except OSError as exc:
        raise PerfError(f"--plot {path}: {exc.strerror or exc}") from None
    finally:
        pyplot.close(figure)
