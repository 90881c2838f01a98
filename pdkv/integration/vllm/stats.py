"""The worker side's transfer counters as the reference workers' ``pdkv_*`` Prometheus series.

vLLM runs the connector's worker side in its worker process and serves ``/metrics`` from its API server, so the
counters travel the way vLLM's own connectors' stats do: each step the worker side hands over what its counters
gained since the last step (``delta``), vLLM's scheduler sums those (``merged``), and its metrics logger turns them
into series (``series``) on Prometheus counters of the connector's (connector.py). Plain pdkv, no vLLM: what a
counter means is decided here, tested without vLLM.

The role comes from the counter, not from the instance: a ``kv_both`` instance's pushes count as ``prefill``,
its loads as ``decode``, as on the reference workers (pdkv/worker/metrics.py), whose names and labels these are.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

# series name -> (documentation, its labels besides "role"); the names and meanings of pdkv/worker/metrics.py's
SERIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "pdkv_transfers": ("KV transfers by outcome", ("outcome",)),
    "pdkv_transfer_bytes": ("KV bytes moved", ()),
    "pdkv_transfer_tokens": ("Tokens whose KV a transfer moved (pushed by P, loaded by D)", ()),
    "pdkv_fallbacks": ("Requests whose KV was recomputed locally instead of transferred", ("reason",)),
    "pdkv_prompt_tokens": ("Prompt tokens by where their KV came from", ("source",)),
}

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


def delta(now: Mapping[str, int], last: Mapping[str, int]) -> dict[str, int]:
    """What the counters that become series gained since ``last`` (a snapshot of ``now`` taken then)."""
    return {k: now[k] - last.get(k, 0) for k in COUNTER_SERIES if now.get(k, 0) > last.get(k, 0)}


def merged(a: Mapping[str, int], b: Mapping[str, int]) -> dict[str, int]:
    """Two deltas (of two steps, or two workers) as one."""
    return {k: a.get(k, 0) + b.get(k, 0) for k in a.keys() | b.keys()}


def series(data: Mapping[str, int]) -> Iterator[tuple[str, dict[str, str], int]]:
    """(series name, labels, increment) for each series a delta adds to; counters not in the table are skipped:
    a newer worker may send more than this process knows of."""
    for counter, value in sorted(data.items()):
        for name, role, values in COUNTER_SERIES.get(counter, ()):
            yield name, {"role": role, **dict(zip(SERIES[name][1], values, strict=True))}, value
