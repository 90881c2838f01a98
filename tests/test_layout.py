import itertools

import msgspec
import pytest
import torch

from pdkv.errors import LayoutError
from pdkv.layout import KVLayout, block_ranges, block_runs, gather, scatter

KINDS = ["per_layer", "cross_layer", "split_kv"]
ORDERS = ["NHD", "HND", "HKND", "NHKD", "HNKD"]


def layouts(mla: bool = False, dtype: str = "float32") -> list[KVLayout]:
    heads = 1 if mla else 2
    return [
        KVLayout(num_layers=3, num_kv_heads=heads, head_dim=8, block_size=bs, dtype=dtype, kind=k, order=o, mla=mla)
        for k, o, bs in itertools.product(KINDS, ORDERS, (16, 32))
        if k != "split_kv" or (o in ("NHD", "HND") and not mla)  # K and V planes: no MLA, no interleaved K/V
    ]


def filled(layout: KVLayout, num_blocks: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tensors = layout.allocate(num_blocks)
    for t in tensors:
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    return tensors


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_round_trip_between_every_layout_pair(mla: bool, dtype: str) -> None:
    num_tokens = 100  # not a multiple of any block size: partial last blocks
    for src, dst in itertools.product(layouts(mla, dtype), repeat=2):
        p_kv = filled(src, 20, 1)
        d_kv = dst.allocate(20)
        p_table = torch.randperm(20)[: src.blocks_for(num_tokens)].tolist()
        d_table = torch.randperm(20)[: dst.blocks_for(num_tokens)].tolist()
        for start in range(0, num_tokens, 48):  # chunks not aligned to blocks
            n = min(48, num_tokens - start)
            scatter(dst, d_kv, d_table, start, gather(src, p_kv, p_table, start, n))
        a = gather(src, p_kv, p_table, 0, num_tokens)
        b = gather(dst, d_kv, d_table, 0, num_tokens)
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (src, dst)


def test_nhd16_into_hnd32_places_each_token_where_the_layout_says() -> None:
    p = KVLayout(2, 2, 4, block_size=16, dtype="float32", order="NHD")
    d = KVLayout(2, 2, 4, block_size=32, dtype="float32", order="HND")
    p_kv, d_kv = filled(p, 8, 3), d.allocate(4)
    scatter(d, d_kv, [3, 1], 0, gather(p, p_kv, [5, 2, 7], 0, 40))
    # token 35 of the request: P block 7 (table[2]) offset 3; D block 1 (table[1]) offset 3
    for layer in range(2):
        for kv in range(2):
            for head in range(2):
                assert torch.equal(p_kv[layer][7, kv, 3, head], d_kv[layer][1, kv, head, 3])


def test_canonical_chunk_shape_and_order() -> None:
    lay = KVLayout(2, 2, 4, block_size=4, dtype="float32")
    kv = filled(lay, 4, 0)
    chunk = gather(lay, kv, [2, 0], 1, 5)
    assert chunk.shape == (2, 2, 5, 2, 4)
    assert torch.equal(chunk[1, 0, 0], kv[1][2, 0, 1])  # token 1 -> block 2 offset 1
    assert torch.equal(chunk[0, 1, 4], kv[0][0, 1, 1])  # token 5 -> table[1] = block 0, offset 1


def test_bounds_are_checked() -> None:
    lay = KVLayout(2, 2, 4, block_size=4, dtype="float32")
    kv = lay.allocate(4)
    with pytest.raises(LayoutError, match="out of range"):
        gather(lay, kv, [0, 4], 0, 8)
    with pytest.raises(LayoutError, match="out of range"):
        gather(lay, kv, [-1], 0, 2)
    with pytest.raises(LayoutError, match="block table has 1 blocks"):
        gather(lay, kv, [0], 0, 5)
    with pytest.raises(LayoutError, match="chunk is"):
        scatter(lay, kv, [0, 1], 0, torch.zeros(2, 2, 5, 2, 3))
    with pytest.raises(LayoutError, match="out of range"):
        block_ranges(lay, [4], 4)
    with pytest.raises(LayoutError, match="num_kv_heads"):
        KVLayout(2, 4, 8, mla=True)
    with pytest.raises(LayoutError, match="dtype"):
        KVLayout(2, 2, 8, dtype="int8")


def test_block_ranges_cover_whole_blocks_in_wire_order() -> None:
    lay = KVLayout(2, 2, 4, block_size=4, dtype="float32")
    ranges = block_ranges(lay, [3, 1], 4)
    size = 2 * 4 * 2 * 4 * 4
    assert ranges == [(0, 3 * size, size), (0, size, size), (1, 3 * size, size), (1, size, size)]
    cross = KVLayout(2, 2, 4, block_size=4, dtype="float32", kind="cross_layer")
    assert block_ranges(cross, [3], 4) == [(0, 3 * 2 * size, 2 * size)]


def test_block_runs_pair_blocks_adjacent_on_both_sides_and_keep_wire_order() -> None:
    assert block_runs([4, 5, 6, 9, 10, 2], [0, 1, 7, 8, 9, 3]) == [(4, 0, 2), (6, 7, 1), (9, 8, 2), (2, 3, 1)]
    assert block_runs([3, 4, 5, 1]) == [(3, 3, 3), (1, 1, 1)]
    assert block_runs([]) == []
    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float32")
    size = lay.block_bytes
    joined = [(t, a * size, k * size) for t in range(2) for a, _, k in block_runs([3, 4, 0])]
    singles = block_ranges(lay, [3, 4, 0], 8)
    flat = lambda rs: [(t, o + i) for t, o, n in rs for i in range(n)]  # noqa: E731 - the bytes each list names, in order
    assert flat(joined) == flat(singles)
    with pytest.raises(LayoutError, match="different lengths"):
        block_runs([1, 2], [1])


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_split_kv_planes_hold_what_the_per_layer_tensor_holds(order: str) -> None:
    """A split_kv buffer is the K and V planes of a per-layer one (vLLM's FlashAttention cache against
    FlashInfer's): tensor 2*l + kv is ``per_layer[l][:, kv]``, token for token, and both gather the same chunk."""
    whole = KVLayout(3, 2, 8, block_size=4, dtype="bfloat16", order=order)
    split = msgspec.structs.replace(whole, kind="split_kv")
    assert split.num_tensors == 6 and split.block_bytes * 2 == whole.block_bytes
    assert split.tensor_shape(5) == ((5, 4, 2, 8) if order == "NHD" else (5, 2, 4, 8))
    assert not split.wire_mismatches(whole)
    whole_kv = filled(whole, 10, 5)
    planes = [t[:, kv].contiguous() for t in whole_kv for kv in range(2)]
    table = [7, 2, 9, 0]
    chunk = gather(split, planes, table, 3, 12)
    assert torch.equal(chunk.view(torch.int16), gather(whole, whole_kv, table, 3, 12).view(torch.int16))
    # the naive reference: token p sits in block table[p // 4] at offset p % 4 of plane 2*l + kv
    for p, (layer, kv, head) in itertools.product(range(3, 15), itertools.product(range(3), range(2), range(2))):
        plane = planes[2 * layer + kv][table[p // 4]]
        row = plane[p % 4, head] if order == "NHD" else plane[head, p % 4]
        assert torch.equal(chunk[layer, kv, p - 3, head], row)
    back = split.allocate(10)
    scatter(split, back, table, 3, chunk)
    assert torch.equal(gather(split, back, table, 3, 12).view(torch.int16), chunk.view(torch.int16))
    untouched = [b for b in range(10) if b not in table]
    assert all(not t[untouched].any() for t in back)
    with pytest.raises(LayoutError, match="split_kv"):
        KVLayout(2, 2, 8, kind="split_kv", order="HKND")
    with pytest.raises(LayoutError, match="split_kv"):
        KVLayout(2, 1, 8, kind="split_kv", mla=True)
