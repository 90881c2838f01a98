"""The shared prefix-keyed KV cache: memory (L1), local disk (L2), Redis/Valkey (remote).

``CacheTier`` (``base``) is the one interface; ``MemoryTier``, ``DiskTier``
and ``RedisTier`` are the levels; ``TieredCache`` composes them (reads go
down and promote up, writes go behind). ``build_tier`` makes what a
``TierConfig`` asks for.
"""

from __future__ import annotations

from pdkv.config import TierConfig
from pdkv.layout import KVLayout
from pdkv.tier.base import CacheTier, LeafTier, TierStats
from pdkv.tier.disk import DiskTier
from pdkv.tier.memory import MemoryTier
from pdkv.tier.remote import RedisTier
from pdkv.tier.tiered import TieredCache

__all__ = ["CacheTier", "DiskTier", "LeafTier", "MemoryTier", "RedisTier", "TierStats", "TieredCache", "build_tier"]


def build_tier(config: TierConfig, layout: KVLayout) -> TieredCache | None:
    """The levels ``config`` enables for chunks of ``layout``, composed; None when it enables none."""
    if not config.enabled:
        return None
    levels: list[CacheTier] = []
    try:
        if config.memory_bytes:
            levels.append(MemoryTier(layout, config.memory_bytes, config.memory_policy))
        if config.disk_path:
            levels.append(DiskTier(layout, config.disk_path, config.disk_bytes, config.disk_policy))
        if config.redis_url:
            remote = RedisTier(
                layout,
                config.redis_url,
                namespace=config.redis_namespace,
                ttl_s=config.redis_ttl_s,
                timeout_s=config.redis_timeout_s,
                connect_timeout_s=config.redis_connect_timeout_s,
                retry_s=config.redis_retry_s,
                secret=config.redis_secret,
            )
            remote.ping()  # an unreachable server is logged at start, then served as misses
            levels.append(remote)
    except BaseException:
        for level in levels:  # a disk level holds its directory's lock
            level.close()
        raise
    if not levels:
        return None
    return TieredCache(levels, config.write_behind_bytes, config.flush_timeout_s)
