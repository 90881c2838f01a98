"""The shared tier: a real Redis or Valkey server, or a Redis Cluster / Valkey cluster, through redis-py.

Every worker that points at the same server shares one cache: a prefix one
prefill worker computed is a hit on every other, on any machine. Values are
the chunk header plus its bytes (``pdkv.tier.base``), stored under
``<namespace><key hex>``; each batch is one pipelined round trip per server
(``pdkv.tier.redis_backend``: one server, or each cluster primary that owns
some of the batch's keys). Writes use ``SET NX`` (a chunk already there is
the same bytes) with an optional TTL; bounding memory is the server's job
(``maxmemory`` with an ``allkeys-lru`` policy), and it counts its own
evictions (``INFO stats``). The prompt tree that ``tier.memory_policy:
prefix`` keeps cannot reach it: ``SET`` has no parent, and the server's
policies sample a few keys on a one-second clock (on the Mooncake trace
``allkeys-lru`` still beat ``allkeys-lfu``:
benchmarks/history/2026-11-23-eviction-mooncake-trace.md, "Eviction on the
Mooncake trace"). A memory or disk level with the prefix policy in front is
where eviction knows prefixes.

Every value read is checked before it becomes KV (``pdkv.tier.base.read_value``):
its header (key, layout, size), its xxh3 checksum and, with ``secret``
(``tier.redis_secret``), its seal, an HMAC bound to the chunk key, so a value
written by someone without the secret, a valid value copied under another
key, a truncated one or one of another format version is a miss. It is
counted (``stats().rejected`` by reason: ``pdkv_tier_rejected_total``),
logged once per key, and deleted so that the next store puts a good one
there (``SET NX`` would keep a bad one forever). Workers sharing a server
must share its secret (and a namespace), or each deletes the others' values.

The cache must never fail a request: a server (or a cluster node) that is
down, slower than ``timeout_s`` to answer a whole pipeline
(``pdkv.tier.bounds``: a deadline per request, not per socket read, that
closes the connection),
declaring a value longer than a chunk's, or answering errors or malformed
replies makes its keys misses (reads) or no-ops (writes) with one logged
warning, and for ``retry_s`` afterwards it is skipped instead of each call
paying a connect timeout. On a cluster that is only the failed node's keys; the rest are
served as usual, and a replica that takes over serves its keys again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pdkv.layout import KVLayout
from pdkv.tier import bounds
from pdkv.tier.redis_backend import FAILED, Build, connect
from pdkv.tier.store import SharedStoreTier


class RedisTier(SharedStoreTier):
    def __init__(
        self,
        layout: KVLayout,
        url: str,
        *,
        namespace: str = "pdkv:kv:",
        ttl_s: float = 0.0,
        timeout_s: float = 2.0,
        connect_timeout_s: float = 1.0,
        retry_s: float = 10.0,
        secret: str = "",
        name: str = "redis",
    ) -> None:
        """``secret``: seal every value written and take only values sealed with it (see the module docstring)."""
        super().__init__(layout, name, secret)
        self._backend = connect(url, timeout_s, connect_timeout_s, retry_s)
        self.url = url
        self._namespace = namespace.encode()
        self._ttl_ms = int(ttl_s * 1000) or None

    def ping(self) -> bool:
        """Whether the server (a cluster: its slot map) answers now; a failure is logged and starts the retry window."""
        ok = self._backend.ping()
        if not ok:
            self._count(errors=1)
        return ok

    def has(self, keys: Sequence[bytes]) -> list[bool]:
        names = self._names(keys)
        found = self._batch("exists", names, lambda pipe, i: pipe.exists(names[i]))
        return [r is not FAILED and bool(r) for r in found]

    def _get(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor]) -> int:
        names = self._names(keys)
        got = self._batch("get", names, lambda pipe, i: pipe.get(names[i]), bounds.value_limit(outs))
        return self.accept_run(keys, outs, got)

    def _put(self, keys: Sequence[bytes], chunks: Sequence[torch.Tensor], parents: Sequence[bytes | None]) -> None:
        """``parents`` are not used: the server evicts by its own ``maxmemory-policy`` (see the module docstring)."""
        names = self._names(keys)
        values = self.encode(keys, chunks)
        done = self._batch("set", names, lambda pipe, i: pipe.set(names[i], values[i], nx=True, px=self._ttl_ms))
        self._count(
            written_bytes=sum(len(v) for v, stored in zip(values, done, strict=True) if stored and stored is not FAILED)
        )
        self._changed(
            stored=[k for k, stored in zip(keys, done, strict=True) if stored is not FAILED]
        )  # stored now, or already there (NX)

    def remove(self, keys: Sequence[bytes]) -> int:
        names = self._names(keys)
        removed = self._batch("delete", names, lambda pipe, i: pipe.delete(names[i]))
        return sum(int(r) for r in removed if r is not FAILED)

    def close(self) -> None:
        self._backend.close()

    def where(self, key: bytes) -> str:
        return self._name(key).decode()

    def _name(self, key: bytes) -> bytes:
        return self._namespace + key.hex().encode()

    def _names(self, keys: Sequence[bytes]) -> list[bytes]:
        return [self._name(key) for key in keys]

    def _batch(self, what: str, names: list[bytes], build: Build, limit: int = bounds.ANSWER_BYTES) -> list[Any]:
        if not names:
            return []
        results, failed = self._backend.batch(what, names, build, limit)
        if failed:
            self._count(errors=1)
        return results
