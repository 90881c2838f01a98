"""What the tests, the benchmarks and ``pdkv demo`` share to drive pdkv from outside.

Nothing on the serving path imports this package: it starts workers as
processes (``procs``), talks HTTP to them (``http``), writes tiny random
models (``model``) and starts private Redis servers and clusters (``redis``,
``redis_cluster``). Each module imports only what it needs, so the HTTP
helpers load without torch.
"""
