"""What the tests, the benchmarks and ``pdkv demo`` share to drive pdkv from outside.

Nothing on the serving path imports this package: it starts workers as
processes (``procs``), talks HTTP to them (``http``), writes tiny random
models (``model``), starts private Redis servers and clusters (``redis``,
``redis_cluster``) and S3 servers (``s3``), and checks a cache level against
the backend contract (``tier_conformance``, for anyone writing one), stores
that misbehave on purpose included (``hostile``). Each
module imports only what it needs, so the HTTP helpers load without torch.
"""
