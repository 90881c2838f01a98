"""A worker's use of the cache tier: load a prompt's cached prefix, offer what it computes.

Before a prompt reaches the engine, ``load`` asks the tier for the longest
run of its chunks it holds, scatters them into the request's blocks and
declares them computed, so the engine computes only the rest. It runs off
the engine thread (the request is not on the engine yet, so nothing else
touches its blocks), and a slow disk or network delays only this request.

The chunk holding the last prompt token is always computed, never loaded:
the engine needs that token's logits for the first output token, and
computing the same chunk over the same bytes as a cold run keeps the KV and
the tokens bit-identical with the tier on or off.

As the engine finishes each prefill chunk, the hook from ``offer`` stores
its full chunks (memory at once, the lower levels written behind). Both
directions are ``pdkv.KVCacheEngine`` calls, keyed at the worker's
``transfer.chunk_size`` under the request's ``cache_salt``: workers with
another chunk size never share, and neither do requests of two salts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pdkv.cache_engine import KVCacheEngine, suffix_mask
from pdkv.config import TierConfig
from pdkv.engine.base import EngineAdapter, Request
from pdkv.keys import PromptKeys
from pdkv.tier import CacheTier, TieredCache, build_tier
from pdkv.worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)

ChunkHook = Callable[[Request, int, int], None]


@dataclasses.dataclass
class CachedPrefix:
    """What ``load`` found for one request: the prompt keyed (None with the tier off) and how many tokens came from
    the tier."""

    keys: PromptKeys | None
    tokens: int = 0


class Tiering:
    """The tier as one worker uses it, through a ``KVCacheEngine``; with the tier disabled every call is a no-op."""

    def __init__(
        self,
        tier: CacheTier | None,
        engine: EngineAdapter,
        chunk_size: int,
        metrics: WorkerMetrics,
        load_batch_chunks: int = 4,
    ) -> None:
        self.engine = engine
        self.chunk_size = chunk_size
        self.metrics = metrics
        self.cache = (
            None
            if tier is None
            else KVCacheEngine(
                engine.layout, tier, chunk_size, fingerprint=engine.fingerprint, load_batch_chunks=load_batch_chunks
            )
        )
        self.tier = None if self.cache is None else self.cache.tier
        # Told each prompt's chunk keys, token ids and cache salt before its chunks are loaded or stored
        # (pdkv.worker.kv_events).
        self.on_prompt: Callable[[Sequence[bytes], Sequence[int], str], None] | None = None
        if self.tier is not None:
            metrics.registry.register(TierCollector(self.tier, metrics.role))

    @classmethod
    def from_config(cls, config: TierConfig, engine: EngineAdapter, chunk_size: int, metrics: WorkerMetrics) -> Tiering:
        """The tier ``config`` asks for, used by a worker around ``engine``."""
        return cls(build_tier(config, engine.layout), engine, chunk_size, metrics, config.load_batch_chunks)

    async def load(self, request: Request) -> CachedPrefix:
        """Load the cached prefix of a new request (not yet submitted); see the module docstring.

        If the caller is cancelled meanwhile, the request is freed once the
        load finishes: it never reached the engine, so nothing else would.
        """
        if self.cache is None:
            return CachedPrefix(None)
        loading = asyncio.ensure_future(asyncio.to_thread(self.load_sync, request))
        try:
            return await asyncio.shield(loading)
        except asyncio.CancelledError:
            loading.add_done_callback(lambda _f: self.engine.free(request))
            raise

    def load_sync(self, request: Request) -> CachedPrefix:
        """``load`` on the calling thread. A failing tier costs a full recompute, never the request."""
        if self.cache is None:
            return CachedPrefix(None)
        keys = self.cache.keys(request.prompt_token_ids, request.cache_salt)
        if self.on_prompt is not None:
            self.on_prompt(keys.keys, request.prompt_token_ids, request.cache_salt)
        prefix = CachedPrefix(keys)
        loadable = keys.prefix(
            (request.num_prompt_tokens - 1) // self.chunk_size * self.chunk_size
        )  # full chunks before the last token's
        try:
            loaded = int(self.cache.retrieve(loadable, self.engine.kv_buffer, request.block_table).sum())
        except Exception:  # nothing is marked computed yet: the engine overwrites whatever was scattered
            log.exception(
                "request %s: loading from the cache tier failed; computing the whole prompt", request.request_id
            )
            return prefix
        prefix.tokens = loaded
        if loaded:
            self.engine.mark_computed(request, loaded)
            self.metrics.prompt_tokens.labels(self.metrics.role, "tier").inc(loaded)
        return prefix

    def offer(self, prefix: CachedPrefix, then: ChunkHook | None) -> ChunkHook | None:
        """An engine ``on_chunk`` hook: run ``then`` (pushes to the decode worker come first), then store the
        full chunks computed."""
        cache, keys = self.cache, prefix.keys
        if cache is None or keys is None:
            return then
        cs, buffer = self.chunk_size, self.engine.kv_buffer

        def on_chunk(request: Request, start: int, end: int) -> None:
            if then is not None:
                then(request, start, end)
            first, stop = -(-start // cs) * cs, end // cs * cs  # the full chunks this step completed
            if first >= stop:
                return
            try:
                cache.store(keys.prefix(stop), buffer, request.block_table, suffix_mask(stop, first))
            except Exception:  # the cache is best effort: its failure must not fail the request
                log.exception("request %s: chunks not offered to the cache tier", request.request_id)

        return on_chunk

    def close(self) -> None:
        """Finish the tier's queued writes (bounded by ``tier.flush_timeout_s``) and close its levels."""
        if self.cache is not None:
            self.cache.close()


class TierCollector(Collector):
    """``pdkv_tier_*`` series, read from the tier at scrape time so /metrics is what the tier counted."""

    COUNTERS = (
        ("hits", "pdkv_tier_hits", "Chunks served by this cache level"),
        ("misses", "pdkv_tier_misses", "Chunk lookups this cache level could not serve"),
        ("hit_tokens", "pdkv_tier_hit_tokens", "Prompt tokens whose KV this cache level served"),
        ("read_bytes", "pdkv_tier_read_bytes", "KV bytes served by this cache level"),
        ("written_bytes", "pdkv_tier_written_bytes", "KV bytes stored in this cache level"),
        ("evictions", "pdkv_tier_evictions", "Chunks this cache level evicted to stay in its bound"),
        (
            "errors",
            "pdkv_tier_errors",
            "Corrupt or mismatched chunks dropped, and failed reads/writes (served as misses)",
        ),
    )
    GAUGES = (
        ("bytes", "pdkv_tier_bytes", "KV bytes this cache level holds"),
        ("entries", "pdkv_tier_entries", "Chunks this cache level holds"),
        ("capacity_bytes", "pdkv_tier_capacity_bytes", "Byte bound of this cache level"),
    )

    def __init__(self, tier: CacheTier, role: str) -> None:
        self.tier = tier
        self.role = role

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        stats = self.tier.stats()
        for attr, name, doc in self.COUNTERS:
            counter = CounterMetricFamily(name, doc, labels=["role", "tier"])
            for level, s in stats.items():
                counter.add_metric([self.role, level], getattr(s, attr))
            yield counter
        for attr, name, doc in self.GAUGES:
            gauge = GaugeMetricFamily(name, doc, labels=["role", "tier"])
            for level, s in stats.items():
                if getattr(s, attr) is not None:
                    gauge.add_metric([self.role, level], getattr(s, attr))
            yield gauge
        rejected = CounterMetricFamily(
            "pdkv_tier_rejected",
            "Values read from this cache level and refused (served as misses), by reason: format, key, shape, size, "
            "mac, checksum",
            labels=["role", "tier", "reason"],
        )
        for level, s in stats.items():
            for reason, count in sorted(s.rejected.items()):
                rejected.add_metric([self.role, level, reason], count)
        yield rejected
        if isinstance(self.tier, TieredCache):
            pending = GaugeMetricFamily(
                "pdkv_tier_write_behind_bytes", "Bytes queued for the lower cache levels", labels=["role"]
            )
            pending.add_metric([self.role], self.tier.pending_bytes)
            dropped = CounterMetricFamily(
                "pdkv_tier_write_behind_dropped",
                "Chunks not written to the lower cache levels because the queue was full",
                labels=["role"],
            )
            dropped.add_metric([self.role], self.tier.dropped_chunks)
            yield pending
            yield dropped
