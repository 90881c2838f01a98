"""``--plot FILE.png``: one small drawing helper every benchmark shares.

Each benchmark turns its own JSON report into one of two pictures, the
measured thing beside its same-run baseline: ``lines`` (a value against a
size, e.g. GB/s against transfer size) or ``bars`` (one value per case).
matplotlib is an optional extra (``pip install 'pdkv[plot]'``); ``check`` runs
before a benchmark starts, so a missing extra or an unwritable path fails in
a second, not after minutes of measuring.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pdkv.errors import ConfigError

EXTRA = "plot"


def pyplot() -> Any:
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise ConfigError(f"--plot needs matplotlib: pip install 'pdkv[{EXTRA}]'") from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def check(path: str | None) -> None:
    """Fail now (not after the benchmark) if ``path`` cannot be drawn to."""
    if path is None:
        return
    pyplot()
    target = Path(path)
    if target.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise ConfigError(f"--plot {path}: expected a file name ending in .png, .svg or .pdf")
    if not target.resolve().parent.is_dir():
        raise ConfigError(f"--plot {path}: the directory {target.resolve().parent} does not exist")


def lines(
    path: str,
    title: str,
    xlabel: str,
    ylabel: str,
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    note: str = "",
) -> None:
    """One line per series (label -> (xs, ys)) against a size in bytes: x is logarithmic, ticks read "4 KiB"."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ticks = sorted({x for xs, _ in series.values() for x in xs})
    ax.set_xticks(ticks, [size_label(int(x)) for x in ticks], rotation=30 if len(ticks) > 6 else 0)
    ax.minorticks_off()
    _finish(plt, fig, ax, path, title, xlabel, ylabel, note)


def bars(
    path: str, title: str, ylabel: str, categories: Sequence[str], series: Mapping[str, Sequence[float]], note: str = ""
) -> None:
    """Grouped bars: one group per category, one bar per series (label -> one value per category)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(min(14.0, max(6.0, 0.45 * len(categories) * max(1, len(series)) + 2)), 4.6))
    width = 0.8 / max(1, len(series))
    for i, (label, values) in enumerate(series.items()):
        xs = [c + (i - (len(series) - 1) / 2) * width for c in range(len(categories))]
        ax.bar(xs, values, width, label=label)
    ax.set_xticks(
        range(len(categories)), categories, rotation=20 if max(map(len, categories), default=0) > 10 else 0, ha="right"
    )
    _finish(plt, fig, ax, path, title, "", ylabel, note)


def _finish(plt: Any, fig: Any, ax: Any, path: str, title: str, xlabel: str, ylabel: str, note: str) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    if note:
        fig.text(0.01, 0.01, note, fontsize=7, alpha=0.8)
    fig.tight_layout(rect=(0, 0.04 if note else 0, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def size_label(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.3g} {unit}"
    return f"{n} B"
