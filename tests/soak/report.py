"""The soak's counts, what fails a run, and the JSON summary it prints."""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from soak.cluster import SETTLE_S
from soak.procstats import RSS_GROWTH

RETRY_S = 0.5  # a client that got an error waits this long before its next request, as a real one would
CUT_OFF = ("veth_down", "route_removed", "rate_cut")  # faults during which every request to the decode host may fail


@dataclass
class Counts:
    requests: int = 0
    concurrency: int = 4
    recovered: int = 0
    failed_cleanly: int = 0
    dropped: int = 0
    mismatched: int = 0
    hung: int = 0
    leaked: int = 0
    # fault kind -> times injected: corrupt_chunk, decode_sigkill, prefill_stall, client_drop; two hosts: veth_down,
    # rate_cut, route_removed, decode_restart (instead of corrupt_chunk and decode_sigkill)
    injected: collections.Counter[str] = field(default_factory=collections.Counter)
    # corrupted chunks: checksum failures their decode worker counted, and prompts it computed itself meanwhile
    corrupt_detected: int = 0
    corrupt_recomputed: int = 0
    faults: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    leaks: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    # where the decode workers' prompt KV came from, counted from the first request through the router
    transferred_tokens: int = 0
    recomputed_tokens: int = 0
    fallbacks_after_fault: collections.Counter[str] = field(default_factory=collections.Counter)  # by reason
    fallbacks_without_fault: collections.Counter[str] = field(default_factory=collections.Counter)  # must stay empty
    failed_without_fault: int = 0  # requests that failed cleanly while no fault was in effect: must be 0
    windows: list[list[Any]] = field(
        default_factory=list
    )  # [fault kind, start, end] in monotonic s; end inf while in effect
    # two hosts: per fault kind, how many ended, in how many the router marked a decode worker down, and the longest
    # it took after the fault to have every decode worker up again
    router_marks: dict[str, dict[str, float]] = field(
        default_factory=lambda: collections.defaultdict(lambda: {"faults": 0, "marked_down": 0, "max_up_again_s": 0.0})
    )
    failures: collections.Counter[str] = field(
        default_factory=collections.Counter
    )  # failed cleanly, by what the client saw
    restart_s: float = 0.0  # two hosts: the longest a decode worker took from its SIGKILL to ready again
    longest_wait_s: float = 0.0  # the longest any request took, answered or not
    proc_leaks: dict[str, float] = field(default_factory=dict)  # fds/threads above their post-warm-up count, from /proc
    rss_growth_pct: dict[str, float] = field(default_factory=dict)  # end RSS vs post-warm-up, per long-lived process
    http_pool: dict[str, str] = field(default_factory=dict)  # router <-> worker keep-alive connections, grown threads
    timeline: list[tuple[float, float, str]] = field(default_factory=list)  # (start, end, outcome) per request, from t0
    t0: float = 0.0  # monotonic time the traffic started: the timeline's and the windows' origin in the plot

    @property
    def failed_cleanly_bound(self) -> int:
        """The requests that may fail: those in flight when a decode worker dies or the prefill worker stalls, and,
        for a fault that cuts the decode host off, those every client sends while it is in effect (a client backs
        off ``RETRY_S`` after a failure) and the ones in flight when it began."""
        cut = [end - start + SETTLE_S for kind, start, end in self.windows if kind in CUT_OFF]
        per_client = sum(1 + int(seconds / RETRY_S) for seconds in cut)
        return self.concurrency * (
            self.injected["decode_sigkill"]
            + self.injected["decode_restart"]
            + self.injected["prefill_stall"]
            + per_client
        )

    def during_fault(self, start: float, end: float) -> bool:
        """Whether [start, end] overlaps a fault's window, stretched by ``SETTLE_S``, and a cut-off's by its own
        length again: TCP's retransmissions back off exponentially while a link is dead, so the first one after
        it is back may come up to about as long as the outage lasted."""
        return any(
            start <= w_end + SETTLE_S + (w_end - w_start if kind in CUT_OFF else 0.0) and end >= w_start
            for kind, w_start, w_end in self.windows
        )

    @contextlib.contextmanager
    def fault_window(self, kind: str) -> Iterator[None]:
        """Marks the time a fault is in effect (open-ended until the block exits)."""
        window = [kind, time.monotonic(), float("inf")]
        self.windows.append(window)
        try:
            yield
        finally:
            window[2] = time.monotonic()


CLEAN_FAILURES = ("HTTP 503", "error event")
"""How a request may fail while a fault is in effect: the router found no worker that could serve it (503 with
Retry-After), or the answer had begun and ends with an error event (``one_request`` names each so)."""


def failures_by_status(counts: Counts) -> dict[str, int]:
    """Failed requests by HTTP status (``"503"``), or ``"error event"`` for a stream that ended with one."""
    out: collections.Counter[str] = collections.Counter()
    for what, n in counts.failures.items():
        out[what.removeprefix("HTTP ")] += n
    return dict(out.most_common())


def problems(counts: Counts) -> list[str]:
    """What makes a soak fail; empty when it passed."""
    out = [
        f"{what}: {n}"
        for what, n in (("hung", counts.hung), ("leaked", counts.leaked), ("mismatched", counts.mismatched))
        if n
    ]
    out += [e for e in counts.errors if e.startswith("fault")]
    if counts.fallbacks_without_fault:
        out.append(f"prompts recomputed while no fault was in effect: {dict(counts.fallbacks_without_fault)}")
    if counts.failed_without_fault:
        out.append(f"requests failed while no fault was in effect: {counts.failed_without_fault}")
    if counts.failed_cleanly > counts.failed_cleanly_bound:
        out.append(
            f"failed cleanly: {counts.failed_cleanly}, more than the {counts.failed_cleanly_bound} in flight at the "
            "faults that can fail one"
        )
    if not counts.transferred_tokens:
        out.append("no prompt's KV was transferred")
    out += [
        f"{n} requests failed with {what}: a client can act only on a 503 (retry after Retry-After) or, once tokens "
        "were sent, an error event"
        for what, n in counts.failures.items()
        if what not in CLEAN_FAILURES
    ]
    if counts.proc_leaks:
        out.append(f"left behind (/proc): {counts.proc_leaks}")
    out += [
        f"RSS of {name} grew {pct}% after the warm-up (more than {100 * RSS_GROWTH:g}%)"
        for name, pct in counts.rss_growth_pct.items()
        if pct > 100 * RSS_GROWTH
    ]
    return out


def summary(counts: Counts) -> dict[str, Any]:
    faults = sorted(set(counts.faults), key=counts.faults.index)
    return {
        "requests": counts.requests,
        "faults_injected": sum(counts.injected.values()),
        "faults_by_kind": dict(sorted(counts.injected.items())),
        "corrupt_chunks": {
            "injected": counts.injected["corrupt_chunk"],
            "detected": counts.corrupt_detected,
            "recomputed": counts.corrupt_recomputed,
        },
        "recovered": counts.recovered,
        "failed_cleanly": counts.failed_cleanly,
        "failed_cleanly_bound": counts.failed_cleanly_bound,
        "failed_without_fault": counts.failed_without_fault,
        "kv": {
            "transferred_prompt_tokens": counts.transferred_tokens,
            "recomputed_prompt_tokens": counts.recomputed_tokens,
            "fallbacks_after_fault": dict(sorted(counts.fallbacks_after_fault.items())),
            "fallbacks_without_fault": dict(sorted(counts.fallbacks_without_fault.items())),
        },
        "failures_by_status": failures_by_status(counts),
        "longest_wait_s": counts.longest_wait_s,
        "longest_decode_restart_s": counts.restart_s,
        "router_marks": {kind: dict(marks) for kind, marks in sorted(counts.router_marks.items())},
        "dropped_by_client": counts.dropped,
        "mismatched": counts.mismatched,
        "hung": counts.hung,
        "leaked": counts.leaked,
        "seconds": counts.seconds,
        "faults": [f"{f} x{counts.faults.count(f)}" if counts.faults.count(f) > 1 else f for f in faults],
        "leaks": counts.leaks,
        "proc_leaks": counts.proc_leaks,
        "rss_growth_pct": counts.rss_growth_pct,
        "pools_grown": counts.http_pool,  # router <-> worker keep-alive connections; threads within POOL_THREADS
        "errors": counts.errors,
        "problems": problems(counts),
    }
