"""Histogram bucket boundaries that the router's and the workers' metrics share.

``pdkv_ttft_seconds`` means the same on every role, so its buckets must be the
same for one dashboard query to aggregate router and workers. They live here,
apart from both, because the router never imports the worker (or the engine
behind it, and so torch).
"""

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
GBPS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32)
