"""``pdkv.KVCacheEngine``: the store / retrieve / lookup contract (pdkv/cache_engine.py), on small random KV.

Every check compares the KV a retrieve wrote into a buffer with the KV the
store read out of another (``gather`` of both: the canonical chunk, whatever
the layout), and checks the tokens around it were not touched. The levels
behind are the real ones: memory, a disk directory, a redis-server.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import pdkv
from pdkv.cache_engine import KVCacheEngine, suffix_mask
from pdkv.errors import CacheRequestError, ConfigError, LayoutError, PdkvError
from pdkv.keys import PromptKeys
from pdkv.layout import KVLayout, gather
from pdkv.testing.redis import LocalRedis
from pdkv.tier import MemoryTier

FP = "test-model"
CS = 16  # chunk size
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=8, dtype="float32")
LAYOUTS = {
    "per_layer NHD bs8 f32": LAYOUT,
    "per_layer HND bs16 f16": KVLayout(
        num_layers=2, num_kv_heads=2, head_dim=4, block_size=16, dtype="float16", order="HND"
    ),
    "cross_layer NHD bs32 bf16": KVLayout(
        num_layers=2, num_kv_heads=2, head_dim=4, block_size=32, dtype="bfloat16", kind="cross_layer"
    ),
    "cross_layer HND bs4 f32": KVLayout(
        num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float32", kind="cross_layer", order="HND"
    ),
    "per_layer HKND bs16 (vLLM CPU)": KVLayout(
        num_layers=2, num_kv_heads=2, head_dim=4, block_size=16, dtype="bfloat16", order="HKND"
    ),
    "per_layer NHKD bs16 (vLLM GPU)": KVLayout(
        num_layers=2, num_kv_heads=2, head_dim=4, block_size=16, dtype="bfloat16", order="NHKD"
    ),
    "split_kv HND bs8 f16 (K/V planes)": KVLayout(
        num_layers=2, num_kv_heads=2, head_dim=4, block_size=8, dtype="float16", kind="split_kv", order="HND"
    ),
    "per_layer MLA bs8": KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_size=8, dtype="float32", mla=True),
}
BLOCKS = 24


def random_buffer(layout: KVLayout, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(t.shape, generator=gen).to(t.dtype) for t in layout.allocate(BLOCKS)]


def nan_buffer(layout: KVLayout) -> list[torch.Tensor]:
    """A fresh buffer whose every slot reads NaN until written: an untouched token is visible."""
    return [t.fill_(float("nan")) for t in layout.allocate(BLOCKS)]


def table(layout: KVLayout, num_tokens: int, seed: int) -> list[int]:
    """A scattered block table for ``num_tokens`` tokens (blocks out of order, as an allocator hands them out)."""
    return torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(seed))[
        : layout.blocks_for(num_tokens)
    ].tolist()


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * 37 + salt * 1009) % 5000 + 1 for i in range(n)]


def kv(layout: KVLayout, buffer: list[torch.Tensor], block_table: list[int], start: int, end: int) -> torch.Tensor:
    return gather(layout, buffer, block_table, start, end - start)


def untouched(layout: KVLayout, buffer: list[torch.Tensor], block_table: list[int], start: int, end: int) -> bool:
    return bool(kv(layout, buffer, block_table, start, end).float().isnan().all())


def engine(layout: KVLayout = LAYOUT, **tier: Any) -> KVCacheEngine:
    return KVCacheEngine(layout, {"memory_bytes": 1 << 20, **tier}, CS, fingerprint=FP)


@pytest.fixture
def source() -> tuple[list[torch.Tensor], list[int]]:
    """A computed prompt's KV: a random buffer and a block table for 64 tokens."""
    return random_buffer(LAYOUT, 1), table(LAYOUT, 64, 2)


# -- round trips over every layout ------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_store_then_retrieve_into_a_fresh_buffer_is_bit_identical(layout: KVLayout) -> None:
    tokens = prompt(53)  # 3 full chunks and a partial one of 5 tokens
    src, src_table = random_buffer(layout, 3), table(layout, 53, 4)
    dst, dst_table = nan_buffer(layout), table(layout, 53, 5)
    with engine(layout) as cache:
        assert cache.store(tokens, src, src_table) == 53
        assert cache.lookup(tokens) == 53
        loaded = cache.retrieve(torch.tensor(tokens), dst, dst_table)  # token ids as a tensor work like a list
    assert loaded.dtype == torch.bool and loaded.device.type == "cpu" and loaded.all() and loaded.numel() == 53
    assert torch.equal(kv(layout, dst, dst_table, 0, 53), kv(layout, src, src_table, 0, 53))


def test_layouts_with_the_same_wire_fields_share_chunks_through_disk(tmp_path: Path) -> None:
    """Stored from per-layer NHD buffers of 8-token blocks, retrieved by another engine into a cross-layer HND
    buffer of 32-token blocks."""
    other = KVLayout(
        num_layers=2, num_kv_heads=2, head_dim=4, block_size=32, dtype="float32", kind="cross_layer", order="HND"
    )
    tokens = prompt(40)
    src, src_table = random_buffer(LAYOUT, 6), table(LAYOUT, 40, 7)
    with engine(memory_bytes=0, disk_path=str(tmp_path)) as writer:
        assert writer.store(tokens, src, src_table) == 40
    dst, dst_table = nan_buffer(other), table(other, 40, 8)
    with engine(other, memory_bytes=0, disk_path=str(tmp_path)) as reader:
        assert reader.retrieve(tokens, dst, dst_table).all()
        assert reader.stats()["disk"].hits == 3
    assert torch.equal(kv(other, dst, dst_table, 0, 40), kv(LAYOUT, src, src_table, 0, 40))


# -- masks ------------------------------------------------------------------------------------------
def test_store_only_the_suffix_then_retrieve_it_with_a_mask(source: tuple[list[torch.Tensor], list[int]]) -> None:
    src, src_table = source
    tokens = prompt(64)
    with engine() as cache:
        assert cache.store(tokens, src, src_table, mask=suffix_mask(64, 32)) == 32  # chunks 2 and 3 only
        assert cache.lookup(tokens) == 0  # lookup counts from token 0: chunk 0 is not held
        dst, dst_table = nan_buffer(LAYOUT), table(LAYOUT, 64, 9)
        assert not cache.retrieve(tokens, dst, dst_table).any()  # without a mask the run starts (and ends) at chunk 0
        loaded = cache.retrieve(tokens, dst, dst_table, mask=suffix_mask(64, 32))
        assert torch.equal(loaded, suffix_mask(64, 32))  # chained keys: chunks 2-3 need not have 0-1 held
        assert torch.equal(kv(LAYOUT, dst, dst_table, 32, 64), kv(LAYOUT, src, src_table, 32, 64))
        assert untouched(LAYOUT, dst, dst_table, 0, 32)
        # the prefix stored later: now the whole prompt is there, and chunks 2-3 are not stored twice
        assert cache.store(tokens, src, src_table) == 32
        assert cache.lookup(tokens) == 64


def test_retrieve_with_a_mask_inside_a_chunk_writes_only_the_true_tokens(
    source: tuple[list[torch.Tensor], list[int]],
) -> None:
    """pdkv accepts any False prefix on retrieve (LMCache wants whole chunks): the tokens the caller holds, e.g. an
    engine's shared prefix-cache blocks, are never written, even within the chunk that is read."""
    src, src_table = source
    tokens = prompt(64)
    with engine() as cache:
        cache.store(tokens, src, src_table)
        dst, dst_table = nan_buffer(LAYOUT), table(LAYOUT, 64, 10)
        loaded = cache.retrieve(tokens, dst, dst_table, mask=suffix_mask(64, 24))
        assert torch.equal(loaded, suffix_mask(64, 24))
        assert untouched(LAYOUT, dst, dst_table, 0, 24)
        assert torch.equal(kv(LAYOUT, dst, dst_table, 24, 64), kv(LAYOUT, src, src_table, 24, 64))
        assert not cache.retrieve(tokens, dst, dst_table, mask=torch.zeros(64, dtype=torch.bool)).any()


@pytest.mark.parametrize(
    ("mask", "message"),
    [
        (suffix_mask(64, 24), "multiple of chunk_size"),
        (torch.tensor([False] * 16 + [True] * 16 + [False] * 32), "token 16 is True but token 32"),
        (torch.ones(63, dtype=torch.bool), r"one entry per token \(64\)"),
        (torch.ones(64, dtype=torch.int64), "torch.bool"),
        (torch.ones(8, 8, dtype=torch.bool), "1-D"),
        ([True] * 64, "got list"),
    ],
)
def test_a_mask_that_breaks_the_contract_is_refused_before_anything_is_stored(
    source: tuple[list[torch.Tensor], list[int]], mask: Any, message: str
) -> None:
    src, src_table = source
    with engine() as cache:
        with pytest.raises(CacheRequestError, match=message):
            cache.store(prompt(64), src, src_table, mask=mask)
        assert cache.stats()["memory"].entries == 0


def test_retrieve_refuses_a_mask_true_then_false(source: tuple[list[torch.Tensor], list[int]]) -> None:
    src, src_table = source
    with engine() as cache, pytest.raises(CacheRequestError, match="FFF...TTT"):
        cache.retrieve(prompt(64), src, src_table, mask=~suffix_mask(64, 32))


# -- chunks: partial, shared, missing ----------------------------------------------------------------
def test_a_partial_last_chunk_serves_the_same_prompt_never_a_longer_one(
    source: tuple[list[torch.Tensor], list[int]],
) -> None:
    src, src_table = source
    tokens = prompt(64)
    with engine() as cache:
        assert cache.store(tokens[:40], src, src_table) == 40  # chunks 0-1 and 8 tokens of chunk 2
        assert cache.lookup(tokens[:40]) == 40
        assert cache.lookup(tokens[:32]) == 32
        assert cache.lookup(tokens) == 32  # chunk 2 of the longer prompt holds 16 tokens: another key
        dst, dst_table = nan_buffer(LAYOUT), table(LAYOUT, 64, 11)
        assert int(cache.retrieve(tokens, dst, dst_table).sum()) == 32
        assert untouched(LAYOUT, dst, dst_table, 32, 64)
        assert cache.retrieve(tokens[:40], dst, dst_table).all()
        assert torch.equal(kv(LAYOUT, dst, dst_table, 0, 40), kv(LAYOUT, src, src_table, 0, 40))
        assert cache.store(tokens, src, src_table) == 32  # the full chunks 2 and 3; 0-1 are held


def test_a_prefix_shared_by_two_prompts_is_stored_once_and_serves_both(
    source: tuple[list[torch.Tensor], list[int]],
) -> None:
    src, src_table = source
    first = prompt(64)
    second = first[:32] + prompt(30, salt=1)  # the first two chunks are the first prompt's
    with engine() as cache:
        cache.store(first, src, src_table)
        assert cache.lookup(second) == 32
        dst, dst_table = nan_buffer(LAYOUT), table(LAYOUT, 62, 12)
        assert torch.equal(cache.retrieve(second, dst, dst_table), ~suffix_mask(62, 32))
        assert torch.equal(kv(LAYOUT, dst, dst_table, 0, 32), kv(LAYOUT, src, src_table, 0, 32))
        assert untouched(LAYOUT, dst, dst_table, 32, 62)
        other = random_buffer(LAYOUT, 13)  # the second prompt's own KV (its suffix differs)
        assert cache.store(second, other, dst_table) == 30  # its shared chunks are held: only its own are stored
        assert cache.stats()["memory"].entries == 4 + 2


def test_a_miss_in_the_middle_ends_the_run(source: tuple[list[torch.Tensor], list[int]]) -> None:
    src, src_table = source
    tokens = prompt(64)
    with engine() as cache:
        cache.store(tokens, src, src_table)
        keys = cache.keys(tokens)
        assert cache.tier.remove([keys.keys[2]]) == 1  # evicted: chunk 3 is still held
        assert cache.lookup(tokens) == 32
        dst, dst_table = nan_buffer(LAYOUT), table(LAYOUT, 64, 14)
        assert torch.equal(cache.retrieve(keys, dst, dst_table), ~suffix_mask(64, 32))
        assert untouched(LAYOUT, dst, dst_table, 32, 64)  # chunk 3 is not loaded behind the hole
        assert torch.equal(cache.retrieve(keys, dst, dst_table, mask=suffix_mask(64, 48)), suffix_mask(64, 48))
        assert torch.equal(kv(LAYOUT, dst, dst_table, 48, 64), kv(LAYOUT, src, src_table, 48, 64))


def test_retrieve_reads_in_batches_and_stops_at_the_first_short_one(
    source: tuple[list[torch.Tensor], list[int]],
) -> None:
    src, src_table = source
    tokens = prompt(64)
    with KVCacheEngine(LAYOUT, MemoryTier(LAYOUT, 1 << 20), CS, fingerprint=FP, load_batch_chunks=1) as cache:
        cache.store(tokens, src, src_table)
        cache.tier.remove([cache.keys(tokens).keys[2]])
        dst, dst_table = nan_buffer(LAYOUT), table(LAYOUT, 64, 15)
        assert torch.equal(cache.retrieve(tokens, dst, dst_table), ~suffix_mask(64, 32))
        assert (cache.stats()["memory"].hits, cache.stats()["memory"].misses) == (
            2,
            1,
        )  # one chunk per read; none after the miss
        assert torch.equal(kv(LAYOUT, dst, dst_table, 0, 32), kv(LAYOUT, src, src_table, 0, 32))
        assert untouched(LAYOUT, dst, dst_table, 32, 64)


# -- the levels behind ----------------------------------------------------------------------------------
@pytest.fixture(params=["memory", "disk", "redis"])
def level(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    if request.param == "memory":
        yield "memory", {}
    elif request.param == "disk":
        yield "disk", {"memory_bytes": 0, "disk_path": str(tmp_path / "disk")}
    else:
        server: LocalRedis = request.getfixturevalue("redis_server")
        yield (
            "redis",
            {
                "memory_bytes": 0,
                "redis_url": server.url,
                "redis_namespace": f"{request.node.name}-{time.monotonic_ns()}:",
            },
        )


def test_each_level_serves_what_another_engine_stored(
    level: tuple[str, dict[str, Any]], source: tuple[list[torch.Tensor], list[int]]
) -> None:
    """Memory serves its own engine; disk serves the next engine on the directory (a restart); Redis serves any
    engine."""
    name, tier = level
    src, src_table = source
    tokens = prompt(56)
    writer = engine(**tier)
    try:
        assert writer.store(tokens, src, src_table) == 56
        assert writer.flush(10)
    finally:
        if name != "memory":
            writer.close()
    reader = writer if name == "memory" else engine(**tier)
    with reader:
        assert reader.lookup(tokens) == 56
        dst, dst_table = nan_buffer(LAYOUT), table(LAYOUT, 56, 16)
        assert reader.retrieve(tokens, dst, dst_table).all()
        stats = reader.stats()[name]
        assert (stats.hits, stats.hit_tokens) == (4, 56)
    assert torch.equal(kv(LAYOUT, dst, dst_table, 0, 56), kv(LAYOUT, src, src_table, 0, 56))


def test_a_salt_partitions_every_level(
    level: tuple[str, dict[str, Any]], source: tuple[list[torch.Tensor], list[int]]
) -> None:
    """Stored under one salt, a prompt is found under that salt only: not unsalted, not under another salt,
    whichever level serves it (every level addresses chunks by key alone, and the salt is in every key)."""
    name, tier = level
    src, src_table = source
    tokens = prompt(56)
    writer = engine(**tier)
    try:
        assert writer.store(tokens, src, src_table, salt="tenant-a") == 56
        assert writer.flush(10)
    finally:
        if name != "memory":
            writer.close()
    reader = writer if name == "memory" else engine(**tier)
    with reader:
        assert reader.lookup(tokens) == 0
        assert reader.lookup(tokens, salt="tenant-b") == 0
        dst, dst_table = nan_buffer(LAYOUT), table(LAYOUT, 56, 16)
        assert not reader.retrieve(tokens, dst, dst_table, salt="tenant-b").any()
        assert untouched(LAYOUT, dst, dst_table, 0, 56)
        assert reader.stats()[name].hits == 0
        assert reader.lookup(tokens, salt="tenant-a") == 56
        assert reader.retrieve(PromptKeys.of(tokens, FP, CS, "tenant-a"), dst, dst_table).all()
        assert reader.stats()[name].hits == 4
    assert torch.equal(kv(LAYOUT, dst, dst_table, 0, 56), kv(LAYOUT, src, src_table, 0, 56))


def test_store_does_not_wait_for_a_hung_redis(
    redis_server: LocalRedis, source: tuple[list[torch.Tensor], list[int]]
) -> None:
    """The redis-server is stopped (SIGSTOP) while a prompt is stored: store returns with the chunks in memory
    and queued for Redis; flush cannot finish until the server runs again, then another engine finds them there."""
    src, src_table = source
    tokens = prompt(64)
    tier: dict[str, Any] = {
        "redis_url": redis_server.url,
        "redis_namespace": f"hung-{time.monotonic_ns()}:",
        "redis_timeout_s": 60,
    }
    with engine(**tier) as cache:
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        try:
            assert cache.store(tokens, src, src_table) == 64
            assert cache.stats()["memory"].entries == 4 and cache.tier.pending_bytes == LAYOUT.chunk_bytes(64)
            assert not cache.flush(0.3)
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        assert cache.flush(30)
    with engine(**{**tier, "memory_bytes": 0}) as other:
        assert other.lookup(tokens) == 64


# -- keys, errors, lifecycle ------------------------------------------------------------------------------
def test_keyed_prompts_stand_for_their_tokens_and_must_match_the_engine(
    source: tuple[list[torch.Tensor], list[int]],
) -> None:
    src, src_table = source
    tokens = prompt(40)
    keyed = PromptKeys.of(tokens, FP, CS)
    with engine() as cache:
        assert cache.keys(tokens) == keyed
        assert cache.store(keyed.prefix(32), src, src_table) == 32
        assert cache.lookup(tokens) == 32
        with pytest.raises(CacheRequestError, match="multiple of chunk_size"):
            keyed.prefix(20)
        with pytest.raises(CacheRequestError, match="fingerprint 'other-model'"):
            cache.lookup(PromptKeys.of(tokens, "other-model", CS))
        with pytest.raises(CacheRequestError, match="chunk_size 8"):
            cache.lookup(PromptKeys.of(tokens, FP, 8))
        with pytest.raises(CacheRequestError, match="3 chunk keys, got 2"):
            PromptKeys(keyed.keys[:2], 40, CS, FP)
        with pytest.raises(CacheRequestError, match="keys made under cache salt 'a'; the call names salt 'b'"):
            cache.lookup(PromptKeys.of(tokens, FP, CS, "a"), salt="b")
        with pytest.raises(CacheRequestError, match="cache salt"):
            cache.store(tokens, src, src_table, salt=b"bytes")  # type: ignore[arg-type]


def test_bad_tokens_buffers_and_tables_are_refused_with_what_is_wrong(
    source: tuple[list[torch.Tensor], list[int]],
) -> None:
    src, src_table = source
    with engine() as cache:
        with pytest.raises(CacheRequestError, match="1-D sequence of integer token ids"):
            cache.store([[1, 2], [3, 4]], src, src_table)  # type: ignore[list-item]
        with pytest.raises(CacheRequestError, match="integer token ids, got shape \\(3,\\) of float64"):
            cache.lookup([1.0, 2.5, 3.0])  # type: ignore[list-item]
        with pytest.raises(LayoutError, match="block table has 4 blocks, tokens up to 64 need 8"):
            cache.store(prompt(64), src, src_table[:4])
        with pytest.raises(LayoutError, match="block id out of range"):
            cache.retrieve(prompt(16), src, [0, BLOCKS])
        with pytest.raises(LayoutError, match="layout expects"):
            cache.retrieve(prompt(16), LAYOUTS["per_layer HND bs16 f16"].allocate(4), src_table)
        with pytest.raises(LayoutError, match="needs 2 tensors, got 1"):
            cache.store(prompt(16), src[:1], src_table)
        assert cache.stats()["memory"].entries == 0
        assert cache.store([], src, []) == 0 and cache.retrieve([], src, []).numel() == 0 and cache.lookup([]) == 0


def test_construction_errors_name_what_to_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tier\.memory_bytes"):
        KVCacheEngine(LAYOUT, {"memory_bytes": -1}, fingerprint=FP)
    with pytest.raises(ConfigError, match="enables no cache level"):
        KVCacheEngine(LAYOUT, {"memory_bytes": 0}, fingerprint=FP)
    with pytest.raises(ConfigError, match="fingerprint must be a non-empty string"):
        KVCacheEngine(LAYOUT, {}, fingerprint="")
    with pytest.raises(ConfigError, match="chunk_size must be a positive integer"):
        KVCacheEngine(LAYOUT, {}, 0, fingerprint=FP)


def test_the_public_object_closes_its_levels_with_the_block(
    tmp_path: Path, source: tuple[list[torch.Tensor], list[int]]
) -> None:
    src, src_table = source
    with pdkv.KVCacheEngine(LAYOUT, {"disk_path": str(tmp_path)}, CS, fingerprint=FP) as cache:
        cache.store(prompt(32), src, src_table)
    with pytest.raises(PdkvError, match="closed"):
        cache.lookup(prompt(32))
    with KVCacheEngine(
        LAYOUT, {"memory_bytes": 0, "disk_path": str(tmp_path)}, CS, fingerprint=FP
    ) as again:  # the directory's lock was released
        assert again.lookup(prompt(32)) == 32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_cuda_buffers_round_trip() -> None:
    tokens = prompt(53)
    src, src_table = [t.cuda() for t in random_buffer(LAYOUT, 17)], table(LAYOUT, 53, 18)
    dst, dst_table = [t.cuda() for t in nan_buffer(LAYOUT)], table(LAYOUT, 53, 19)
    with engine() as cache:
        assert cache.store(tokens, src, src_table) == 53
        loaded = cache.retrieve(tokens, dst, dst_table, mask=suffix_mask(53, 20))
    assert loaded.device.type == "cpu" and torch.equal(loaded, suffix_mask(53, 20))
    assert torch.equal(kv(LAYOUT, dst, dst_table, 20, 53), kv(LAYOUT, src, src_table, 20, 53))
    assert untouched(LAYOUT, dst, dst_table, 0, 20)


# -- save_unfull_chunk: LMCache's switch ----------------------------------------------------------------
@pytest.mark.parametrize("save_unfull_chunk", [True, False])
def test_save_unfull_chunk_decides_whether_a_partial_last_chunk_is_stored_looked_up_and_retrieved(
    save_unfull_chunk: bool, source: tuple[list[torch.Tensor], list[int]]
) -> None:
    """53 tokens in chunks of 16: True (pdkv's default) serves all 53; False (LMCache's default) acts as if the
    prompt ended at 48, in every call."""
    src, src_table = source
    tokens = prompt(53)
    covered = 53 if save_unfull_chunk else 48
    with KVCacheEngine(
        LAYOUT, {"memory_bytes": 1 << 20}, CS, fingerprint=FP, save_unfull_chunk=save_unfull_chunk
    ) as cache:
        assert cache.store(tokens, src, src_table) == covered
        assert cache.stats()["memory"].entries == (4 if save_unfull_chunk else 3)
        assert cache.lookup(tokens) == covered
        dst, dst_table = nan_buffer(LAYOUT), table(LAYOUT, 53, 21)
        assert int(cache.retrieve(tokens, dst, dst_table).sum()) == covered
        assert torch.equal(kv(LAYOUT, dst, dst_table, 0, covered), kv(LAYOUT, src, src_table, 0, covered))
        assert save_unfull_chunk or untouched(LAYOUT, dst, dst_table, 48, 53)
        # a retrieve whose mask starts inside the partial chunk loads it only when it is kept
        assert int(cache.retrieve(tokens, nan_buffer(LAYOUT), dst_table, mask=suffix_mask(53, 50)).sum()) == (
            3 if save_unfull_chunk else 0
        )


def test_save_unfull_chunk_defaults_to_true_and_must_be_a_bool() -> None:
    with engine() as cache:
        assert cache.save_unfull_chunk is True
    with pytest.raises(ConfigError, match="save_unfull_chunk"):
        KVCacheEngine(LAYOUT, {"memory_bytes": 1 << 20}, CS, fingerprint=FP, save_unfull_chunk="no")  # type: ignore[arg-type]
