"""Prefix-aware eviction and the offline optimum it is measured against (issue 22), on small hand-checked traces.

The Mooncake-trace numbers are `pdkv bench ttft` part 2's job; these tests
check the policy's invariants, that the optimum is exact (against brute
force), hand-computed hit rates of every policy on a six-request trace, that
the policy plugs into the memory and disk levels with parents given (by
``TieredCache``, its promotions and ``KVCacheEngine``), and that part 2's
report holds together on a small synthetic trace.
"""

from __future__ import annotations

import functools
import itertools
import random
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from pdkv.bench.eviction import infinite_hit_rate, optimum, policy_replay, reuse_oracle_lru, serve
from pdkv.bench.ttft import TraceRequest, simulated_hit_rate, trace_hit_rates, trace_keys
from pdkv.cache_engine import KVCacheEngine
from pdkv.config import convert_config
from pdkv.errors import ConfigError, LayoutError
from pdkv.keys import chunk_keys
from pdkv.layout import KVLayout
from pdkv.tier import DiskTier, MemoryTier, TieredCache, build_tier
from pdkv.tier.base import HEADER_BYTES
from pdkv.tier.policy import POLICIES, PrefixAware, make_policy

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, block_size=4, dtype="float32")
TOKENS = 4
CHUNK_BYTES = LAYOUT.chunk_bytes(TOKENS)


def chain(n: int, salt: int = 0) -> list[bytes]:
    """``n`` prefix-chained keys of one prompt."""
    return chunk_keys([salt * 100_000 + i for i in range(n * TOKENS)], "test-model", TOKENS)


def parents(ks: Sequence[bytes], first: bytes | None = None) -> list[bytes | None]:
    return [first, *ks[:-1]]


def chunk(seed: int) -> torch.Tensor:
    return torch.randn(LAYOUT.chunk_shape(TOKENS), generator=torch.Generator().manual_seed(seed))


def bufs(n: int) -> list[torch.Tensor]:
    return [torch.empty(LAYOUT.chunk_shape(TOKENS)) for _ in range(n)]


def trace(*paths: Sequence[int]) -> list[list[bytes]]:
    """Chained keys of requests given as lists of block ids (same ids, same prefix: the Mooncake trace's convention)."""
    return trace_keys([TraceRequest(0, list(p), 1) for p in paths], "hand", 2)


# -- the policy's invariants ---------------------------------------------------------------
def test_prefix_policy_never_keeps_a_child_without_its_parent_and_respects_bytes() -> None:
    """Random prompts sharing prefixes, random sizes and reads: the cache stays closed under parents and within its
    bound."""
    rng = random.Random(5)
    p = PrefixAware(2000)
    parent_of: dict[bytes, bytes | None] = {}
    held: dict[bytes, int] = {}
    prompts = [chain(rng.randint(1, 12), salt=s) for s in range(40)]
    for step in range(4000):
        ks = rng.choice(prompts)[: rng.randint(1, 12)]
        got = _run_request(p, ks, held, parent_of, rng)
        assert got <= len(ks)
        assert p.used == sum(held.values()) <= 2000, step
        assert len(p) == len(held) and all(k in p for k in held)
        orphans = [k for k in held if parent_of[k] is not None and parent_of[k] not in held]
        assert not orphans, f"step {step}: a child is cached without its parent"
    assert p.admit(b"x" * 16, 2001) is None and b"x" * 16 not in p
    # nothing kept for keys that left: the per-key state is exactly the cached keys'
    assert (
        set(p._uses) == set(p._last) == set(p._priority) == set(held)
        and set(p._parent) <= set(held)
        and set(p._children) <= set(held)
    )


def _run_request(
    p: PrefixAware,
    ks: Sequence[bytes],
    held: dict[bytes, int],
    parent_of: dict[bytes, bytes | None],
    rng: random.Random,
) -> int:
    got = 0
    while got < len(ks) and ks[got] in p:
        p.touch(ks[got])
        got += 1
    for i in range(got, len(ks)):
        if ks[i] in p:  # cached past the first miss (stored as a root earlier): left as it is, as MemoryTier does
            continue
        size = rng.randint(1, 300)
        victims = p.admit(ks[i], size, ks[i - 1] if i else None)
        assert victims is not None and ks[i] not in victims
        for v in victims:
            del held[v]
        if i and ks[i - 1] not in held:  # its parent left to make room for it: it is stored as a root
            parent_of[ks[i]] = None
        else:
            parent_of[ks[i]] = ks[i - 1] if i else None
        held[ks[i]] = size
    return got


def test_prefix_policy_evicts_a_cold_chain_tail_first_and_a_hot_root_last() -> None:
    p = PrefixAware(6)
    ks = chain(4)
    for k, up in zip(ks, parents(ks), strict=True):
        p.admit(k, 1, up)
    p.touch(ks[0])  # the root is now the most recent: LRU would evict ks[1] next, orphaning ks[2:]
    other = chain(4, salt=1)
    victims = []
    for k, up in zip(other, parents(other), strict=True):
        victims += p.admit(k, 1, up) or []
    assert victims == [ks[3], ks[2]]  # leaves first, deepest first
    assert [k in p for k in ks] == [True, True, False, False]


def test_prefix_policy_keeps_the_heap_bounded_and_each_eviction_local() -> None:
    """Touches push heap entries; stale ones are dropped so the heap stays O(cached keys). An eviction
    promotes only the evicted leaf's parent: a 500-deep chain leaves in 500 evictions, one key each, tail first."""
    ks = chain(500)
    hot = PrefixAware(600)
    for k, up in zip(ks, parents(ks), strict=True):
        hot.admit(k, 1, up)
    for _ in range(5000):
        hot.touch(ks[-1])  # the only leaf: each touch pushes an entry
        assert len(hot._leaves) <= 2 * len(hot) + 64
    cold = PrefixAware(500)
    for k, up in zip(ks, parents(ks), strict=True):
        cold.admit(k, 1, up)
    evicted = []
    for i in range(500):
        victims = cold.admit(i.to_bytes(16, "little"), 1)
        assert victims is not None and len(victims) == 1
        evicted += victims
    assert evicted == ks[::-1]


def test_prefix_policy_forced_removal_detaches_and_the_stored_again_parent_takes_its_children_back() -> None:
    p = PrefixAware(4)
    ks = chain(3)
    for k, up in zip(ks, parents(ks), strict=True):
        p.admit(k, 1, up)
    p.discard(ks[1])  # the tier removed it (remove(), or a damaged disk file): the one forced way
    assert ks[1] not in p and p.used == 2 and [k in p for k in (ks[0], ks[2])] == [True, True]
    p.admit(ks[1], 1)  # stored again (its parent unsaid): it is still ks[0]'s child and ks[2]'s parent
    p.touch(ks[2])  # ks[2] is now more recent than ks[1]: only the tree keeps ks[1] from going first
    filler = chain(8, salt=1)
    evicted = []
    for k, up in zip(filler, parents(filler), strict=True):
        evicted += p.admit(k, 1, up) or []
    assert evicted[:3] == [ks[2], ks[1], ks[0]]  # still a chain: tail first
    p.discard(b"?" * 16)  # not there: nothing happens
    assert p.used == len(p) == 4

    orphaned = PrefixAware(3)
    for k, up in zip(ks, parents(ks), strict=True):
        orphaned.admit(k, 1, up)
    orphaned.discard(ks[1])
    orphaned.discard(ks[2])  # the detached ks[1] loses its last child: forgotten, ks[0] is a leaf again
    orphaned.touch(ks[0])
    assert (
        orphaned.admit(b"a" * 16, 1) == []
        and orphaned.admit(b"b" * 16, 1) == []
        and orphaned.admit(b"c" * 16, 1) == [ks[0]]
    )
    assert not orphaned._detached and set(orphaned._uses) == {
        b"a" * 16,
        b"b" * 16,
        b"c" * 16,
    }  # the detached key was forgotten


def test_prefix_policy_learns_a_stretch_that_keeps_reused_prefixes_through_a_scan() -> None:
    """A prefix read every few requests survives a stream of one-off prompts larger than the cache; LRU loses it."""
    shared = chain(16, salt=999)
    kept = {}
    for name in ("lru", "prefix"):
        rng = random.Random(1)
        p = make_policy(name, 100)
        hits = 0
        for i in range(3000):
            if i % 20 == 0:
                full = serve(p, shared) == len(shared)
                hits += full and i >= 1500  # the stretch is learned from the first 1024 reuse gaps: count after that
            serve(p, chain(rng.randint(3, 8), salt=i + 1))
        kept[name] = hits
    assert isinstance(p, PrefixAware) and p.stretch > 0
    assert kept["lru"] == 0 and kept["prefix"] >= 70, (
        kept
    )  # 75 reads of the shared prefix counted, each after ~126 one-off chunks


# -- the optimum -----------------------------------------------------------------------------
def test_hand_checked_trace_optimum_and_each_policy() -> None:
    """Capacity 3 blocks, six requests (16 blocks); every figure below is worked out by hand in the comments.

    r1 A B C | r2 A B D | r3 A E | r4 A B D | r5 A F | r6 A B G   (letters: blocks; same letter, same prefix)

    Optimum (keep the soonest-needed, drop what never returns): r1 0, r2 A B = 2, r3 A = 1 (E never again:
    not kept), r4 A B D = 3, r5 A = 1, r6 A B = 2: 9 of 16.
    LRU: r1 0; r2 2, stores D evicting C; r3 1 (A), stores E evicting B, the *parent* of D (order D A E);
    r4 A hit then B missing: 1 (D is cached but unreachable), stores B and D evicting D and E (order A B
    D); r5 1 (A), stores F evicting B again (D unreachable again); r6 A then B missing: 1. Total 6.
    prefix (leaves first; no stretch learned on six requests): r1 0; r2 2, D evicts the leaf C; r3 1, E
    evicts the leaf D; r4 2 (A B), D evicts the leaf E; r5 1, F evicts the leaf D; r6 2 (A B). Total 8.
    S3-FIFO (small FIFO is 10% of 3: any newcomer in it goes first): r1 0; r2 2, A B move to main, C
    evicted; r3 1, D evicted from small; r4 2, E evicted, D comes back from the ghost into main; r5 1,
    main reinserts A and B, evicts D; r6 2. Total 8.
    """
    requests = trace([1, 2, 3], [1, 2, 4], [1, 5], [1, 2, 4], [1, 6], [1, 2, 7])
    best = optimum(requests, 3)
    assert best.hit_rate == best.relaxed_hit_rate == best.min_parents_first == 9 / 16
    expected = {"lru": 6 / 16, "prefix": 8 / 16, "s3fifo": 8 / 16}
    for policy, rate in expected.items():
        assert simulated_hit_rate(requests, 3, policy) == rate, policy  # through a real MemoryTier
        assert policy_replay(requests, 3, policy).hit_rate == rate, policy
    assert policy_replay(requests, 3, "lru").unreachable_share > 0  # D cached under an evicted B
    assert policy_replay(requests, 3, "prefix").unreachable_share == 0
    assert infinite_hit_rate(requests) == optimum(requests, 100).hit_rate == 9 / 16
    assert reuse_oracle_lru(requests, 3) == 9 / 16  # told what never returns, LRU keeps the rest: here that is enough


def test_optimum_breaks_ties_children_first_where_a_block_level_min_loses_the_run() -> None:
    """One block of room, two requests A B | A B: A and B are both next needed by r2. Keeping B (parents
    first) is as good for a per-block count but leaves B unreachable; keeping A is credited one hit."""
    requests = trace([1, 2], [1, 2])
    best = optimum(requests, 1)
    assert (best.hit_rate, best.relaxed_hit_rate, best.min_parents_first) == (1 / 4, 1 / 4, 0.0)


def _brute_force(requests: Sequence[Sequence[bytes]], capacity: int) -> int:
    """The best leading-run credit over every schedule (any kept subset of cache + request, at most ``capacity``)."""

    @functools.cache
    def best(t: int, cache: frozenset[bytes]) -> int:
        if t == len(requests):
            return 0
        keys = requests[t]
        run = next((i for i, k in enumerate(keys) if k not in cache), len(keys))
        pool = sorted(cache | set(keys))
        choices = (frozenset(c) for r in range(min(capacity, len(pool)) + 1) for c in itertools.combinations(pool, r))
        return run + max(best(t + 1, c) for c in choices)

    return best(0, frozenset())


@pytest.mark.parametrize("seed", range(12))
def test_optimum_equals_brute_force_and_bounds_every_policy(seed: int) -> None:
    rng = random.Random(seed)
    paths = [[rng.randint(1, 3) for _ in range(rng.randint(1, 4))] for _ in range(7)]
    requests = trace(*paths)
    total = sum(map(len, requests))
    for capacity in (1, 2, 3):
        best = optimum(requests, capacity)
        assert best.hit_rate == best.relaxed_hit_rate == _brute_force(requests, capacity) / total
        assert best.min_parents_first <= best.hit_rate
        for policy in POLICIES:
            assert policy_replay(requests, capacity, policy).hit_rate <= best.hit_rate


# -- in the tier -------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["lru", "prefix"])
def test_parents_reach_memory_and_disk_through_the_tiered_cache(tmp_path: Path, policy: str) -> None:
    """Three levels' worth of one prompt, its root read again, then an unrelated chunk: LRU evicts the root's
    child (the rest of the prompt becomes unreachable), the prefix policy the prompt's tail."""
    memory = MemoryTier(LAYOUT, 3 * CHUNK_BYTES, policy)
    disk = DiskTier(LAYOUT, tmp_path, 3 * (HEADER_BYTES + CHUNK_BYTES), policy)
    cache = TieredCache([memory, disk])
    ks = chain(3)
    cache.put(ks, [chunk(i) for i in range(3)], parents(ks))
    assert cache.flush(10)
    assert memory.get(ks[:1], bufs(1)) == 1 and disk.get(ks[:1], bufs(1)) == 1
    other = chain(1, salt=7)
    cache.put(other, [chunk(9)])
    assert cache.flush(10)
    expected = 1 if policy == "lru" else 2
    assert memory.contains(ks) == disk.contains(ks) == expected
    assert memory.stats()["memory"].evictions == disk.stats()["disk"].evictions == 1
    cache.close()


def test_promoted_chunks_keep_their_parents_in_memory(tmp_path: Path) -> None:
    """Chunks read from disk are promoted into a prefix-policy memory level linked to the chunk before them."""
    memory = MemoryTier(LAYOUT, 4 * CHUNK_BYTES, "prefix")
    disk = DiskTier(LAYOUT, tmp_path, 1 << 20)
    ks = chain(3)
    disk.put(ks, [chunk(i) for i in range(3)], parents(ks))
    cache = TieredCache([memory, disk])
    assert cache.get(ks, bufs(3)) == 3
    assert memory.get(ks[:1], bufs(1)) == 1  # the root is the most recent in memory now
    cache.put(chain(2, salt=3), [chunk(5), chunk(6)], parents(chain(2, salt=3)))  # two newcomers: one eviction
    assert memory.contains(ks) == 2  # the tail went, not the root's child
    cache.close()


def test_disk_prefix_policy_survives_a_restart(tmp_path: Path) -> None:
    entry = HEADER_BYTES + CHUNK_BYTES
    ks = chain(3)
    tier = DiskTier(LAYOUT, tmp_path, 3 * entry, "prefix")
    tier.put(ks, [chunk(i) for i in range(3)], parents(ks))
    tier.close()
    again = DiskTier(LAYOUT, tmp_path, 2 * entry, "prefix")  # a smaller bound: trimmed at the scan
    assert len([k for k in ks if again.has([k])[0]]) == 2 and again.stats()["disk"].bytes == 2 * entry
    out = bufs(1)
    held = [k for k in ks if again.has([k])[0]]
    assert again.get(held[:1], out) == 1 and torch.equal(out[0], chunk(ks.index(held[0])))
    again.close()


def test_tier_put_refuses_malformed_parents_and_config_takes_the_policy(tmp_path: Path) -> None:
    tier = MemoryTier(LAYOUT, 4 * CHUNK_BYTES, "prefix")
    ks = chain(2)
    with pytest.raises(LayoutError, match="parents"):
        tier.put(ks, [chunk(0), chunk(1)], [None])
    with pytest.raises(LayoutError, match="parents"):
        tier.put(ks, [chunk(0), chunk(1)], [None, b"short"])
    assert tier.contains(ks) == 0  # nothing stored by a refused call
    config = convert_config(
        {
            "tier": {
                "memory_policy": "prefix",
                "memory_bytes": 4 * CHUNK_BYTES,
                "disk_policy": "s3fifo",
                "disk_path": str(tmp_path),
            }
        }
    ).tier
    built = build_tier(config, LAYOUT)
    assert built is not None and [type(level._policy).__name__ for level in built.levels] == ["PrefixAware", "S3FIFO"]  # type: ignore[attr-defined]
    built.close()
    with pytest.raises(ConfigError, match="tier.disk_policy' = 'lfu'"):
        convert_config({"tier": {"disk_policy": "lfu"}})
    with pytest.raises(ConfigError, match="unknown eviction policy 'lfu'"):
        MemoryTier(LAYOUT, CHUNK_BYTES, "lfu")


def test_bench_part2_reports_every_policy_against_the_optimum() -> None:
    """`pdkv bench ttft --parts 2` on a small synthetic conversation trace: every row's ratio is to the optimum at
    its size."""
    rng = random.Random(3)
    conversations = [[0, *range(100 * c + 1, 100 * c + 1 + rng.randint(1, 6))] for c in range(60)]
    requests = []
    for _ in range(300):
        c = rng.randrange(60)
        conversations[c].append(conversations[c][-1] + 1)  # the next turn extends the previous prompt
        requests.append(TraceRequest(0, list(conversations[c]), 1))
    report = trace_hit_rates(requests, "synthetic")
    assert [o["l1_blocks"] for o in report["optimum"]] == [4096, 16384, 65536, report["unique_blocks"]]
    assert all(o["hit_rate"] == o["relaxed_min_hit_rate"] >= o["min_parents_first_hit_rate"] for o in report["optimum"])
    assert {(r["policy"], r["l1_blocks"]) for r in report["rows"]} == {
        (p, o["l1_blocks"]) for p in POLICIES for o in report["optimum"]
    }
    assert all(0 < r["ratio"] <= 1 and r["optimum_hit_rate"] >= r["hit_rate"] for r in report["rows"])
    assert [c["policy"] for c in report["policy_cost"]] == list(POLICIES) and report["policy_cost"][0]["ratio"] == 1.0
    assert isinstance(report["targets"]["prefix_beats_lru_and_s3fifo_at_every_size"], bool)
    redis_rows = report["redis"].get("rows", [])
    assert "skipped" in report["redis"] or [r["policy"] for r in redis_rows] == [
        "redis allkeys-lru",
        "redis allkeys-lfu",
        *(f"pdkv {p}" for p in POLICIES),
    ]


def test_cache_engine_links_stored_and_batch_promoted_chunks_under_their_parents(tmp_path: Path) -> None:
    """KVCacheEngine stores with parents, and a retrieve in batches of two promotes from disk into memory with
    each batch linked under the chunk before it. Then the prompt's root is read again and one unrelated chunk
    stored: the prefix policy evicts the prompt's tail (a leaf); had a batch boundary broken the chain, the chunk
    before it would have been a leaf too, older, and gone first."""
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, block_size=4, dtype="float32")
    cs = 4
    memory = MemoryTier(layout, 6 * layout.chunk_bytes(cs), "prefix")
    disk = DiskTier(layout, tmp_path, 1 << 20)
    cache = KVCacheEngine(layout, TieredCache([memory, disk]), cs, fingerprint="fp", load_batch_chunks=2)
    buffer = [t.normal_() for t in layout.allocate(16)]
    tokens = list(range(1, 6 * cs + 1))
    block_table = list(range(layout.blocks_for(len(tokens))))
    assert cache.store(tokens, buffer, block_table) == len(tokens) and cache.flush(10)
    ks = cache.keys(tokens).keys
    assert memory.remove(list(ks)) == 6  # memory lost them; disk has them
    assert bool(
        cache.retrieve(tokens, [t.clone().zero_() for t in buffer], block_table).all()
    )  # three batches, promoted
    assert memory.contains(ks) == 6
    assert memory.get(ks[:1], [torch.empty(layout.chunk_shape(cs))]) == 1
    memory.put([b"u" * 16], [torch.zeros(layout.chunk_shape(cs))])
    assert memory.contains(ks) == 5
    cache.close()
