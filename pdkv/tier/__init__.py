"""The shared prefix-keyed KV cache: memory (L1), local disk (L2), Redis/Valkey and S3 (remote), and any other.

``CacheTier`` (``base``) is the one interface; ``MemoryTier``, ``DiskTier``,
``RedisTier`` and ``S3Tier`` (``s3``, named in ``tier.levels``) are the levels; ``TieredCache`` composes them (reads go
down and promote up, writes go behind). ``build_tier`` makes what a
``TierConfig`` asks for, ``open_level`` one ``tier.levels`` entry (any class that
keeps the contract of README.md, "Your own backend").
"""

from __future__ import annotations

from pdkv.config import LevelSpec, TierConfig
from pdkv.errors import ConfigError
from pdkv.layout import KVLayout
from pdkv.tier.base import CacheTier, LeafTier, TierStats
from pdkv.tier.disk import DiskTier
from pdkv.tier.memory import MemoryTier
from pdkv.tier.remote import RedisTier
from pdkv.tier.tiered import TieredCache

__all__ = [
    "CacheTier",
    "DiskTier",
    "LeafTier",
    "MemoryTier",
    "RedisTier",
    "TierStats",
    "TieredCache",
    "build_tier",
    "open_level",
]


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
            levels.append(
                RedisTier(
                    layout,
                    config.redis_url,
                    namespace=config.redis_namespace,
                    ttl_s=config.redis_ttl_s,
                    timeout_s=config.redis_timeout_s,
                    connect_timeout_s=config.redis_connect_timeout_s,
                    retry_s=config.redis_retry_s,
                    secret=config.redis_secret,
                )
            )
        for spec in config.level_specs():
            levels.append(open_level(spec, layout))
        for level in levels:
            level.ping()  # an unreachable server is logged at start, then served as misses
    except BaseException:
        for level in levels:  # a disk level holds its directory's lock
            level.close()
        raise
    if not levels:
        return None
    return TieredCache(levels, config.write_behind_bytes, config.flush_timeout_s)


def open_level(spec: LevelSpec, layout: KVLayout) -> CacheTier:
    """The level a ``tier.levels`` entry names, opened for chunks of ``layout``: ``cls(layout, options, name)``."""
    if not issubclass(spec.cls, CacheTier):
        raise ConfigError(
            f"field '{spec.field}.backend' = {spec.backend!r}: {spec.cls.__qualname__} is not a pdkv.tier.CacheTier "
            "(subclass pdkv.tier.LeafTier, or pdkv.tier.store.SharedStoreTier for a shared server)"
        )
    return spec.cls(layout, spec.options, name=spec.name)
