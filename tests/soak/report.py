"""The soak's counts, what fails a run, and the JSON summary it prints."""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from soak.cluster import SETTLE_S


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
    # fault kind -> times injected: corrupt_chunk, decode_sigkill, prefill_stall, client_drop
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

    @property
    def failed_cleanly_bound(self) -> int:
        """The requests that may fail: those in flight when a decode worker dies or the prefill worker stalls."""
        return self.concurrency * (self.injected["decode_sigkill"] + self.injected["prefill_stall"])

    def during_fault(self, start: float, end: float) -> bool:
        """Whether [start, end] overlaps a fault's window, stretched by ``SETTLE_S``."""
        return any(start <= w_end + SETTLE_S and end >= w_start for _, w_start, w_end in self.windows)

    @contextlib.contextmanager
    def fault_window(self, kind: str) -> Iterator[None]:
        """Marks the time a fault is in effect (open-ended until the block exits)."""
        window = [kind, time.monotonic(), float("inf")]
        self.windows.append(window)
        try:
            yield
        finally:
            window[2] = time.monotonic()


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
        "dropped_by_client": counts.dropped,
        "mismatched": counts.mismatched,
        "hung": counts.hung,
        "leaked": counts.leaked,
        "seconds": counts.seconds,
        "faults": [f"{f} x{counts.faults.count(f)}" if counts.faults.count(f) > 1 else f for f in faults],
        "leaks": counts.leaks,
        "errors": counts.errors,
        "problems": problems(counts),
    }
