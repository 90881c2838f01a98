"""Prometheus metrics of a worker, under one ``pdkv_`` naming shared by every role.

Each worker gets its own registry, so several workers in one process (tests,
the demo) never collide. Gauges that mirror the transfer layer's state
(reserved blocks, in-flight bytes) are read from it at scrape time, so what
/metrics says is what the receiver holds, not a counter that can drift.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric

from pdkv.http.metric_buckets import GBPS_BUCKETS, LATENCY_BUCKETS


class WorkerMetrics:
    def __init__(self, role: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.role = role
        self.requests = Counter("pdkv_requests", "Generation requests by outcome", ["role", "outcome"], registry=r)
        self.ttft = Histogram(
            "pdkv_ttft_seconds",
            "Time from request arrival to the first token",
            ["role"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.transfer_seconds = Histogram(
            "pdkv_transfer_seconds",
            "KV transfer time per request, from its first chunk posted to its last verified (the prefill's computing "
            "of the chunks in between included)",
            ["role"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.transfer_tail = Histogram(
            "pdkv_transfer_tail_seconds",
            "The transfer time a request is exposed to: from its last chunk's post (that KV computed) to its verdict",
            ["role"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.chunk_seconds = Histogram(
            "pdkv_chunk_seconds",
            "A chunk's time from its post to its verdict: what the wire and the receiver's check took",
            ["role"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.transfer_wait = Histogram(
            "pdkv_transfer_wait_seconds",
            "Time a decode request waited for its transferred KV to land (after P's answer: the transfer's tail)",
            ["role"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.transfer_gbps = Histogram(
            "pdkv_transfer_gbps",
            "KV throughput of each chunk, from its post to its verdict (GB/s)",
            ["role"],
            buckets=GBPS_BUCKETS,
            registry=r,
        )
        # by series name: what ``Completions.wire_times`` measures goes to these
        self.wire_series = {
            "pdkv_transfer_seconds": self.transfer_seconds,
            "pdkv_transfer_tail_seconds": self.transfer_tail,
            "pdkv_chunk_seconds": self.chunk_seconds,
            "pdkv_transfer_gbps": self.transfer_gbps,
        }
        self.transfer_bytes = Counter("pdkv_transfer_bytes", "KV bytes moved", ["role"], registry=r)
        self.transfers = Counter("pdkv_transfers", "KV transfers by outcome", ["role", "outcome"], registry=r)
        self.fallbacks = Counter(
            "pdkv_fallbacks",
            "Requests whose KV was recomputed locally instead of transferred",
            ["role", "reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "pdkv_prompt_tokens", "Prompt tokens by where their KV came from", ["role", "source"], registry=r
        )
        self.generated_tokens = Counter("pdkv_generated_tokens", "Generated tokens", ["role"], registry=r)

    def gauge(self, name: str, doc: str, fn: Callable[[], float]) -> None:
        """A gauge read from ``fn`` at scrape time."""
        Gauge(name, doc, ["role"], registry=self.registry).labels(self.role).set_function(fn)

    def events(self, stats: Callable[[], Mapping[str, int]], gauges: frozenset[str]) -> None:
        """Export the transfer layer's event counters (checksum and auth failures, expired leases, ...)
        as ``pdkv_transfer_events_total{event=...}``, read at scrape time; ``gauges`` are left out."""
        self.registry.register(_EventCollector(self.role, stats, gauges))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EventCollector:
    def __init__(self, role: str, stats: Callable[[], Mapping[str, int]], gauges: frozenset[str]) -> None:
        self.role, self.stats, self.gauges = role, stats, gauges

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "pdkv_transfer_events",
            "Sender/receiver events: chunks, refusals, checksum and auth failures, expired leases, ...",
            labels=["role", "event"],
        )
        for event, value in sorted(self.stats().items()):
            if event not in self.gauges:
                family.add_metric([self.role, event], value)
        yield family
