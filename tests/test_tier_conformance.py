"""Every built-in level keeps the backend contract: the conformance kit (pdkv.testing.tier_conformance) on memory,
disk, Redis and the levels composed; Redis Cluster, S3 and a backend written outside pdkv run it in their own modules
(test_tier_cluster, test_tier_s3, test_tier_plugins), beside the server each starts.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pdkv.layout import KVLayout
from pdkv.netaddr import free_port
from pdkv.testing.redis import LocalRedis
from pdkv.testing.tier_conformance import (
    HOSTILE_RULES,
    RULES,
    ConformanceError,
    Harness,
    Raw,
    check,
    run_conformance,
)
from pdkv.tier import DiskTier, MemoryTier, RedisTier, TieredCache
from pdkv.tier.base import CacheTier
from pdkv.tier.disk import SUFFIX

LOCAL_ONLY = {"sealed", "shared_between_handles", "dead_store_is_a_miss"} | HOSTILE_RULES


def passed(report: dict[str, str]) -> set[str]:
    return {rule for rule, result in report.items() if result == "passed"}


def test_memory_keeps_the_contract() -> None:
    report = run_conformance(Harness(open=lambda layout, _secret: MemoryTier(layout, 1 << 20)))
    assert passed(report) == set(RULES) - LOCAL_ONLY - {"damaged_values_are_misses"}
    assert report["damaged_values_are_misses"].startswith("n/a: values never leave the process")


def disk_raw(root: Path) -> Raw:
    def path(key: bytes) -> Path:
        return root / key.hex()[:2] / (key.hex() + SUFFIX)

    def write(key: bytes, value: bytes) -> None:
        path(key).parent.mkdir(exist_ok=True)
        path(key).write_bytes(value)

    return Raw(read=lambda key: path(key).read_bytes() if path(key).exists() else None, write=write)


def test_disk_keeps_the_contract(tmp_path: Path) -> None:
    report = run_conformance(
        Harness(open=lambda layout, _secret: DiskTier(layout, tmp_path, 1 << 20), raw=disk_raw(tmp_path))
    )
    assert passed(report) == set(RULES) - LOCAL_ONLY


def redis_harness(url: str, namespace: str) -> Harness:
    import redis

    client = redis.Redis.from_url(url)
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nobody listens on it

    def open_tier(layout: KVLayout, secret: str) -> CacheTier:
        return RedisTier(layout, url, namespace=namespace, secret=secret)

    return Harness(
        open=open_tier,
        raw=Raw(
            read=lambda key: client.get(namespace + key.hex()),
            write=lambda key, value: client.set(namespace + key.hex(), value),
        ),
        dead=lambda layout: RedisTier(layout, dead, timeout_s=0.5, connect_timeout_s=0.5),
        shared=True,
        seals=True,
    )


def test_redis_keeps_the_contract(redis_server: LocalRedis) -> None:
    # the rules on a hostile store run in tests/test_tier_hostile.py, against stores that misbehave on purpose
    assert passed(run_conformance(redis_harness(redis_server.url, "conformance:"))) == set(RULES) - HOSTILE_RULES


STACK_RULES = (
    "prefix_shaped",
    "empty_batches",
    "first_write_stays",
    "remove",
    "arguments_are_checked",
    "sealed",
    "shared_between_handles",
    "concurrent_writers",
)


@pytest.mark.parametrize("rule", STACK_RULES)
def test_memory_disk_and_redis_composed_keep_the_rules_of_one_level(
    rule: str, tmp_path: Path, redis_server: LocalRedis
) -> None:
    """A worker's cache (memory, disk, Redis behind the write-behind queue) keeps the rules that hold for the stack as
    a whole; counters are per level, and a damaged Redis value under a copy memory holds is (rightly) not read.
    ``arguments_are_checked`` caught the composed cache raising IndexError, not LayoutError, on a short batch."""
    dirs = iter(range(1000))

    def open_stack(layout: KVLayout, secret: str) -> CacheTier:
        return TieredCache(
            [
                MemoryTier(layout, 1 << 20),
                DiskTier(layout, tmp_path / str(next(dirs)), 1 << 20),
                RedisTier(layout, redis_server.url, namespace="stack:", secret=secret),
            ]
        )

    harness = redis_harness(redis_server.url, "stack:")
    harness.open = open_stack
    assert check(rule, harness) == "passed"


def test_a_broken_rule_is_named() -> None:
    """The kit fails a level that breaks the contract, naming the rule: a memory level that lets a second put
    replace the first value."""

    class Replacing(MemoryTier):
        def _put(self, keys, chunks, parents) -> None:  # noqa: ANN001 - MemoryTier's signature
            self.remove(keys)
            super()._put(keys, chunks, parents)

    harness = Harness(open=lambda layout, _secret: Replacing(layout, 1 << 20))
    with pytest.raises(ConformanceError, match="first_write_stays: a second put replaced the first value"):
        check("first_write_stays", harness)
    assert check("round_trip", harness) == "passed"
