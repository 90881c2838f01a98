"""Host time per chunk and per request, on either side: what the Python around the channel costs.

NIXL reports ``agent_xfer_post_time`` (the host's time to post a transfer) and ``agent_xfer_time``; this is
ours, so ``pdkv bench transfer`` can say how many host microseconds a chunk and a request cost on P and on D
beside the wire's time (issue 37, item 6). Each side records ``time.perf_counter_ns`` spans into one
``HostTimes`` (shared through ``parts``): on P, ``chunk`` is the posting of one chunk (``send_chunk`` without
its credit wait) and ``request`` the fixed cost of a transfer (``open``, and its last ``Landed`` to settled);
on D, ``chunk`` is a chunk's landing (notice read, verified, ``Landed`` sent) and ``request`` its reservation
(``Reserve`` answered, or a pooled chunk's admission) and its free.

Cheap by design: one append to a bounded deque per span, no logging; the oldest samples fall off past
``KEEP`` so a long-running worker holds a fixed amount.
"""

from __future__ import annotations

import collections
import threading
import time

KINDS = ("chunk", "request")
KEEP = 65536  # samples kept per kind: a bench scenario's worth, and a fixed bound in a long-running worker


class HostTimes:
    """Spans of host time in ns, per kind (``KINDS``), recorded from any thread and taken by a reader."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: dict[str, collections.deque[int]] = {k: collections.deque(maxlen=KEEP) for k in KINDS}

    def add(self, kind: str, ns: int) -> None:
        """One span of ``ns`` nanoseconds of ``kind``'s host work."""
        self._spans[kind].append(ns)  # deque.append is atomic: no lock on the hot path

    def since(self, kind: str, start_ns: int) -> None:
        """One span of ``kind`` from ``start_ns`` (``time.perf_counter_ns``) to now."""
        self._spans[kind].append(time.perf_counter_ns() - start_ns)

    def take(self) -> dict[str, list[int]]:
        """Every span recorded since the last ``take``, per kind, and forget them."""
        out: dict[str, list[int]] = {k: [] for k in KINDS}
        with self._lock:  # popleft, not a copy then clear: a span added meanwhile is kept for the next take
            for kind, spans in self._spans.items():
                while spans:
                    out[kind].append(spans.popleft())
        return out


def summary(spans: list[int]) -> dict[str, float | None]:
    """``p50`` and ``mean`` of spans in ns, as microseconds (None when there were none)."""
    if not spans:
        return {"p50": None, "mean": None, "n": 0}
    ordered = sorted(spans)
    return {"p50": ordered[len(ordered) // 2] / 1e3, "mean": sum(ordered) / len(ordered) / 1e3, "n": len(ordered)}
