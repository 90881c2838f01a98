"""The worker side's transfer counters as the reference workers' ``pdkv_*`` Prometheus series.

vLLM runs the connector's worker side in its worker process and serves ``/metrics`` from its API server, so the
counters travel the way vLLM's own connectors' stats do: each step the worker side hands over what its counters
gained since the last step (``delta``), vLLM's scheduler sums those (``merged``), and its metrics logger turns them
into series (``series``) on Prometheus counters of the connector's (connector.py). Each transfer's time, throughput
and wait travel the same way as observations (``observations``, ``histogram_series``) for the reference workers'
histograms. Plain pdkv, no vLLM: what a counter or an observation means is decided here, tested without vLLM.

The role comes from the counter, not from the instance: a ``kv_both`` instance's pushes count as ``prefill``,
its loads as ``decode``, as on the reference workers (pdkv/worker/metrics.py), whose names and labels these are.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from pdkv.http.metric_buckets import GBPS_BUCKETS, LATENCY_BUCKETS
from pdkv.transfer.gauges import GAUGES

# series name -> (documentation, its labels besides "role"); the names and meanings of pdkv/worker/metrics.py's
SERIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "pdkv_transfers": ("KV transfers by outcome", ("outcome",)),
    "pdkv_transfer_bytes": ("KV bytes moved", ()),
    "pdkv_transfer_tokens": ("Tokens whose KV a transfer moved (pushed by P, loaded by D)", ()),
    "pdkv_fallbacks": ("Requests whose KV was recomputed locally instead of transferred", ("reason",)),
    "pdkv_prompt_tokens": ("Prompt tokens by where their KV came from", ("source",)),
    "pdkv_transfer_events": (
        "Sender/receiver events: chunks, refusals, checksum and auth failures, expired leases, ...",
        ("event",),
    ),
}
EVENTS = "pdkv_transfer_events"
"""The series of the sender's and receiver's own counters (``KVSender.stats``, ``KVReceiver.stats`` and their
channel's), one ``event`` label each, as the reference workers export them; delta keys ``"events|role|event"``."""


# worker-side counter -> the series (name, role, extra label values) it adds to
COUNTER_SERIES: dict[str, tuple[tuple[str, str, tuple[str, ...]], ...]] = {
    "push_ok": (("pdkv_transfers", "prefill", ("ok",)),),
    "push_failed": (("pdkv_transfers", "prefill", ("failed",)),),
    "push_bytes": (("pdkv_transfer_bytes", "prefill", ()),),
    "push_tokens": (("pdkv_transfer_tokens", "prefill", ()),),
    "load_ok": (("pdkv_transfers", "decode", ("ok",)),),
    "load_failed": (("pdkv_transfers", "decode", ("failed",)), ("pdkv_fallbacks", "decode", ("transfer_failed",))),
    "load_bytes": (("pdkv_transfer_bytes", "decode", ()),),
    "pushed_tokens_loaded": (
        ("pdkv_transfer_tokens", "decode", ()),
        ("pdkv_prompt_tokens", "decode", ("transferred",)),
    ),
    "tier_load_failed": (("pdkv_fallbacks", "decode", ("tier_failed",)),),
    "tier_tokens_loaded": (("pdkv_prompt_tokens", "decode", ("tier",)),),
}


# histogram series -> (documentation, buckets); the reference workers' names, meanings and buckets
HISTOGRAMS: dict[str, tuple[str, tuple[float, ...]]] = {
    "pdkv_transfer_seconds": (
        "KV transfer time per request, first chunk posted to last verified (per rank at tensor parallel)",
        LATENCY_BUCKETS,
    ),
    "pdkv_transfer_tail_seconds": (
        "The transfer time a request is exposed to: from its last chunk's post to its verdict",
        LATENCY_BUCKETS,
    ),
    "pdkv_chunk_seconds": ("A chunk's time from its post to its verdict", LATENCY_BUCKETS),
    "pdkv_transfer_gbps": ("KV throughput of each chunk, from its post to its verdict (GB/s)", GBPS_BUCKETS),
    "pdkv_transfer_wait_seconds": (
        "Time a decode request waited for its transferred KV to land (from when vLLM handed it its blocks)",
        LATENCY_BUCKETS,
    ),
}
Observation = tuple[str, str, float]
"""(histogram series, role, value): one transfer's measurement, handed over with the next step's delta."""


def delta(now: Mapping[str, int], last: Mapping[str, int]) -> dict[str, int]:
    """What the counters that become series (``COUNTER_SERIES``, ``event_counts``) gained since ``last`` (a
    snapshot of ``now`` taken then)."""
    return {
        k: v - last.get(k, 0)
        for k, v in now.items()
        if (k in COUNTER_SERIES or k.startswith("events|")) and v > last.get(k, 0)
    }


def event_counts(role: str, *stats: Mapping[str, int]) -> dict[str, int]:
    """The counters of ``stats`` (a sender's or receiver's, its channel's) summed, as ``"events|role|event"`` keys
    for ``delta``; gauges left out."""
    out: dict[str, int] = {}
    for one in stats:
        for event, value in one.items():
            if event not in GAUGES:
                key = f"events|{role}|{event}"
                out[key] = out.get(key, 0) + int(value)
    return out


def observations(observed: Iterable[Observation]) -> dict[str, list[float]]:
    """Observations as a delta's entries, one list per series and role (``"series|role"``)."""
    out: dict[str, list[float]] = {}
    for name, role, value in observed:
        out.setdefault(f"{name}|{role}", []).append(value)
    return out


def merged(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """Two deltas (of two steps, or two workers) as one: counters add up, observations are joined."""
    out = dict(a)
    for k, v in b.items():
        out[k] = out[k] + v if k in out else v
    return out


def histogram_series(data: Mapping[str, Any]) -> Iterator[tuple[str, dict[str, str], list[float]]]:
    """(series name, labels, values) for each histogram a delta observed; unknown series are skipped."""
    for key, values in sorted(data.items()):
        name, sep, role = key.partition("|")
        if sep and name in HISTOGRAMS and isinstance(values, list):
            yield name, {"role": role}, values


def series(data: Mapping[str, Any]) -> Iterator[tuple[str, dict[str, str], int]]:
    """(series name, labels, increment) for each series a delta adds to; counters not in the table are skipped:
    a newer worker may send more than this process knows of."""
    for counter, value in sorted(data.items()):
        kind, _, rest = counter.partition("|")
        if kind == "events" and "|" in rest and isinstance(value, int):
            role, _, event = rest.partition("|")
            yield EVENTS, {"role": role, "event": event}, value
        for name, role, values in COUNTER_SERIES.get(counter, ()):
            yield name, {"role": role, **dict(zip(SERIES[name][1], values, strict=True))}, value
