"""``--plot``: the soak over time, answered and failed requests per interval, each fault's time in effect shaded."""

from __future__ import annotations

import math

from pdkv.bench.plot import pyplot

from soak.report import Counts

COLORS = {
    "veth_down": "tab:red",
    "rate_cut": "tab:orange",
    "route_removed": "tab:purple",
    "decode_restart": "tab:brown",
    "decode_sigkill": "tab:brown",
    "prefill_stall": "tab:gray",
    "corrupt_chunk": "tab:pink",
}


def plot(counts: Counts, path: str, title: str) -> None:
    """Requests finished per second (answered, failed cleanly) against time since the traffic started, the fault
    windows as shaded bands, one colour per kind: a fault's effect is the dip, or the failures, under its band."""
    plt = pyplot()
    end = max((e for _, e, _ in counts.timeline), default=1.0)
    width = max(1.0, end / 200)  # about 200 bins, at least a second each
    bins = math.ceil(end / width) + 1
    xs = [i * width for i in range(bins)]
    series = {"answered": [0.0] * bins, "failed cleanly": [0.0] * bins}
    for _, finished, outcome in counts.timeline:
        key = (
            "failed cleanly"
            if outcome == "failed_cleanly"
            else "answered"
            if outcome in ("recovered", "dropped")
            else None
        )
        if key is not None:
            series[key][int(finished / width)] += 1 / width
    fig, ax = plt.subplots(figsize=(12, 4.5))
    ax.plot(xs, series["answered"], color="tab:blue", linewidth=0.8, label="answered (req/s)")
    ax.plot(xs, series["failed cleanly"], color="black", linewidth=0.8, label="failed cleanly (req/s)")
    seen: set[str] = set()
    for kind, start, stop in counts.windows:
        if kind not in COLORS or math.isinf(stop):
            continue
        ax.axvspan(
            start - counts.t0,
            stop - counts.t0,
            color=COLORS[kind],
            alpha=0.25,
            linewidth=0,
            label=None if kind in seen else kind,
        )
        seen.add(kind)
    ax.set_xlabel("seconds since the traffic started")
    ax.set_ylabel("requests per second")
    ax.set_title(title)
    ax.set_xlim(0, end)
    ax.legend(loc="upper right", fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
