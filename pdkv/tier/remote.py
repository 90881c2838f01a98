"""The shared tier: a real Redis or Valkey server, through redis-py.

Every worker that points at the same server shares one cache: a prefix one
prefill worker computed is a hit on every other, on any machine. Values are
the chunk header plus its bytes (``pdkv.tier.base``), stored under
``<namespace><key hex>``; each batch is one pipelined round trip. Writes use
``SET NX`` (a chunk already there is the same bytes) with an optional TTL;
bounding memory is the server's job (``maxmemory`` with an ``allkeys-lru``
policy), and it counts its own evictions (``INFO stats``). The prompt tree
that ``tier.memory_policy: prefix`` keeps cannot reach it: ``SET`` has no
parent, and the server's policies sample a few keys on a one-second clock
(on the Mooncake trace ``allkeys-lru`` still beat ``allkeys-lfu``:
benchmarks/RESULTS.md, "Eviction on the Mooncake trace"). A memory or disk
level with the prefix policy in front is where eviction knows prefixes.

The cache must never fail a request: a server that is down, slow past the
socket timeout or answering errors makes every call a miss (reads) or a
no-op (writes) with one logged warning, and for ``retry_s`` afterwards calls
skip the server entirely instead of each paying a connect timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from pdkv.errors import ConfigError
from pdkv.layout import KVLayout
from pdkv.memory import byte_view
from pdkv.tier.base import ChunkHeader, LeafTier, read_value

log = logging.getLogger(__name__)

T = TypeVar("T")


class RedisTier(LeafTier):
    remote = True

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
        name: str = "redis",
    ) -> None:
        super().__init__(layout, name)
        try:
            import redis
        except ImportError:
            raise ConfigError("tier.redis_url is set but redis-py is not installed: pip install 'pdkv[redis]'") from None
        try:
            self._client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=connect_timeout_s)
        except ValueError as exc:
            raise ConfigError(f"tier.redis_url {url!r} is not a Redis URL ({exc}); expected redis://HOST:PORT/DB, rediss://... or unix:///PATH") from None
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self.url = url
        self._namespace = namespace.encode()
        self._ttl_ms = int(ttl_s * 1000) or None
        self._retry_s = retry_s
        self._down_until = 0.0
        self._state_lock = threading.Lock()

    def ping(self) -> bool:
        """Whether the server answers now (a failure is logged and starts the retry window)."""
        return self._call("ping", self._client.ping, False)

    def has(self, keys: Sequence[bytes]) -> list[bool]:
        def exists() -> list[bool]:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._name(key))
            return [bool(n) for n in pipe.execute()]

        return self._call("exists", exists, [False] * len(keys))

    def _get(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor]) -> int:
        def fetch() -> list[bytes | None]:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.get(self._name(key))
            return pipe.execute()

        values: list[bytes | None] = self._call("get", fetch, [])
        for i, (key, out, value) in enumerate(zip(keys, outs, values, strict=False)):
            if value is None:
                return i
            reason = read_value(self.layout, key, value, out)
            if reason is not None:
                log.warning("redis tier: chunk %s is unusable (%s); deleted, it will be recomputed", key.hex(), reason)
                self._count(errors=1)
                self.remove([key])
                return i
        return len(values)

    def _put(self, keys: Sequence[bytes], chunks: Sequence[torch.Tensor], parents: Sequence[bytes | None]) -> None:
        """``parents`` are not used: the server evicts by its own ``maxmemory-policy`` (see the module docstring)."""
        def store() -> int:
            values = [ChunkHeader.of(self.layout, key, chunk).encode() + byte_view(chunk) for key, chunk in zip(keys, chunks, strict=True)]
            pipe = self._client.pipeline(transaction=False)
            for key, value in zip(keys, values, strict=True):
                pipe.set(self._name(key), value, nx=True, px=self._ttl_ms)
            return sum(len(v) for v, stored in zip(values, pipe.execute(), strict=True) if stored)

        self._count(written_bytes=self._call("set", store, 0))

    def remove(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        return int(self._call("delete", lambda: self._client.delete(*(self._name(k) for k in keys)), 0))

    def close(self) -> None:
        self._client.close()

    def _name(self, key: bytes) -> bytes:
        return self._namespace + key.hex().encode()

    def _call(self, what: str, fn: Callable[[], T], default: T) -> T:
        """Run one round trip; on any server or network failure return ``default`` (a miss) and back off."""
        with self._state_lock:
            if time.monotonic() < self._down_until:
                return default
        try:
            return fn()
        except self._errors as exc:
            with self._state_lock:
                first = self._down_until == 0.0 or time.monotonic() >= self._down_until
                self._down_until = time.monotonic() + self._retry_s
            if first:
                log.warning("redis tier %s: %s failed (%s); serving misses and skipping the server for %.0fs", self.url, what, exc, self._retry_s)
            self._count(errors=1)
            return default
