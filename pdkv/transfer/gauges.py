"""Which entries of ``KVSender.stats`` and ``KVReceiver.stats`` are levels rather than counts.

Every other entry only grows, and workers export it as ``pdkv_transfer_events_total{event=...}`` (the reference
workers, pdkv/worker/server.py, and the vLLM connector, pdkv/integration/vllm/stats.py); these go out as gauges of
their own or not at all.
"""

from __future__ import annotations

GAUGES = frozenset(
    {
        "free_blocks",
        "free_staging_slots",
        "reservations",
        "reserved_blocks",
        "pooled_blocks",
        "pooled_slots",
        "inflight_bytes",
        "open_transfers",
    }
)
