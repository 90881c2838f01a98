"""The router's Prometheus metrics, named like the workers' (``pdkv_``, ``role="router"``).

Series that mean the same on every role share the workers' names
(``pdkv_requests_total``, ``pdkv_ttft_seconds``), so one dashboard query
covers router and workers. Router-only series are ``pdkv_router_*``.
Per-worker gauges (in flight, up) are read from the pool at scrape time, so
a deregistered worker's series disappear with it.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdkv.http.metric_buckets import LATENCY_BUCKETS
from pdkv.router.pool import ROLES, WorkerPool

ROLE = "router"


class _PoolCollector(Collector):
    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        requests = GaugeMetricFamily(
            "pdkv_router_inflight_requests",
            "Requests the router has in flight on each worker",
            labels=["role", "worker"],
        )
        tokens = GaugeMetricFamily(
            "pdkv_router_inflight_tokens",
            "Estimated prompt tokens the router has in flight on each prefill worker",
            labels=["role", "worker"],
        )
        up = GaugeMetricFamily(
            "pdkv_router_worker_up", "1 if the worker passed its last health check or hop", labels=["role", "worker"]
        )
        for role in ROLES:
            for w in self.pool.workers(role):
                requests.add_metric([role, w.url], w.inflight_requests)
                tokens.add_metric([role, w.url], w.inflight_tokens)
                up.add_metric([role, w.url], 1.0 if w.healthy else 0.0)
        yield from (requests, tokens, up)


class RouterMetrics:
    def __init__(self, pool: WorkerPool) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("pdkv_requests", "Generation requests by outcome", ["role", "outcome"], registry=r)
        self.ttft = Histogram(
            "pdkv_ttft_seconds",
            "Time from request arrival to the first token (streamed requests)",
            ["role"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pdkv_e2e_seconds",
            "Time from request arrival to the end of the answer",
            ["role"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.hop = Histogram(
            "pdkv_router_hop_seconds",
            "Time of one successful hop to a worker",
            ["hop"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.retries = Counter(
            "pdkv_router_retries",
            "Hops tried again on another worker, by the failure that caused it",
            ["hop", "reason"],
            registry=r,
        )
        self.fallbacks = Counter(
            "pdkv_router_fallbacks",
            "Requests whose decode worker computes the prompt itself, by why",
            ["reason"],
            registry=r,
        )
        self.disaggregation = Counter(
            "pdkv_router_disaggregation",
            "How each prompt was served (router.disaggregate): transfer, transfer_codec or local, and why",
            ["way", "reason"],
            registry=r,
        )
        self.decisions = Counter(
            "pdkv_router_decisions",
            "Worker choices by policy, role and reason",
            ["policy", "role", "reason"],
            registry=r,
        )
        self.cancels = Counter(
            "pdkv_router_transfer_cancels",
            "Abandoned transfers the router cancelled on a decode worker, by outcome (ok, refused, unanswered)",
            ["outcome"],
            registry=r,
        )
        self.errors = Counter(
            "pdkv_router_errors",
            "Requests the router failed (generation, /v1/models), by the status it answered (or ended a stream with, "
            "in-band) and the cause: no_worker, deadline, or the last failed hop's reason (connect, timeout, "
            "http_503, bad_answer, truncated, ...)",
            ["status", "cause"],
            registry=r,
        )
        self.handoffs = Counter(
            "pdkv_router_first_token_handoffs",
            "Streamed requests whose first token the client got from the prefill worker (router.stream_first_token), "
            "the decode worker streaming the rest",
            registry=r,
        )
        self.picks = Counter("pdkv_router_picks", "Hops sent to each worker", ["role", "worker"], registry=r)
        r.register(_PoolCollector(pool))

    def render(self) -> bytes:
        return generate_latest(self.registry)
