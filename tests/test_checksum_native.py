"""The native chunk checksum (csrc/kvsum.cpp) gives the torch path's bits, alone and folded into gather/scatter.

The torch path is the definition CUDA runs (and the fallback without the
library); ``PDKV_NATIVE=0`` makes a call take it, so every case here is one
value computed both ways. tests/test_device.py checks the value itself
against its integer formula.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TypeVar

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdkv import checksum, native
from pdkv.checksum import (
    BlockSums,
    blocks_checksum,
    blocks_checksums,
    chunk_checksum,
    flat_bytes,
    frame_checksum,
)
from pdkv.errors import LayoutError
from pdkv.layout import KVLayout
from pdkv.layout import gather as torch_gather
from pdkv.layout import scatter as torch_scatter


@pytest.fixture(autouse=True)
def _native_in_use() -> None:
    assert native.available(), native.reason()  # else both sides below would be the torch path


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


T = TypeVar("T", int, list[int])


def _both(monkeypatch: pytest.MonkeyPatch, fn: Callable[[], T]) -> T:
    """``fn()`` on the native path and on the torch path: asserts the two agree, returns the value (or values)."""
    ours = fn()
    with monkeypatch.context() as m:
        m.setenv(native.ENV_VAR, "0")
        theirs = fn()
    assert ours == theirs, (ours, theirs)
    return ours


# Every word size (8, 4, 2, 1 bytes), rows that divide the unit and rows that do not, one-word rows, 4 KiB rows,
# and units big enough (> 256 KiB in all) that threads split one unit between them.
UNITS = [1, 3, 2, 6, 4, 12, 8, 24, 200, 8 * 1000 + 4, 4096, 8192 + 24, 32768, 65536 * 5]


@pytest.mark.parametrize("unit", UNITS)
def test_native_and_torch_checksums_agree_for_every_unit_size(monkeypatch: pytest.MonkeyPatch, unit: int) -> None:
    units = max(3, (1 << 20) // unit // 4)
    data = _bytes(units * unit, seed=unit)
    whole = _both(monkeypatch, lambda: chunk_checksum([data], unit=unit))
    # the same stream from a misaligned address, cut into uneven pieces of whole units
    shifted = torch.empty(units * unit + 1, dtype=torch.uint8)[1:].copy_(data)
    cuts = sorted({0, units * unit, *(random.Random(unit).randrange(units) * unit for _ in range(4))})
    pieces = [shifted[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
    assert _both(monkeypatch, lambda: chunk_checksum(pieces, unit=unit)) == whole


@pytest.mark.parametrize("n", [1, 7, 777, 4096 + 2, 3 * 65536 + 5, (1 << 20) + 8])
def test_native_and_torch_agree_on_frames_of_odd_lengths(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    data = _bytes(n + 3, seed=n)
    _both(monkeypatch, lambda: chunk_checksum([data[:n]]))
    _both(monkeypatch, lambda: chunk_checksum([data[3:], data[1 : n // 2 + 1], data[:0]]))  # one unit a piece


def test_native_and_torch_agree_on_fragmented_block_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    unit = 4096 + 8
    kv = [_bytes(64 * unit, seed=s) for s in range(3)]
    rng = random.Random(0)
    for ids in ([5], list(range(10, 26)), rng.sample(range(64), 16), [3, 2, 1, 0], [9, 9, 40, 63]):
        value = _both(monkeypatch, lambda ids=ids: blocks_checksum(kv, ids, unit))
        assert value == chunk_checksum([t[b * unit : (b + 1) * unit] for t in kv for b in ids], unit=unit)


_UNIT, _BLOCKS = 4096 + 8, 24
_KV = [_bytes(_BLOCKS * _UNIT, seed=s) for s in range(3)]
_RUNS = st.builds(lambda a, n: list(range(a, min(a + n, _BLOCKS))), st.integers(0, _BLOCKS - 1), st.integers(0, 9))
_SCATTERED = st.lists(st.integers(0, _BLOCKS - 1), max_size=9)  # duplicates and the empty chunk included


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chunks=st.lists(st.one_of(_RUNS, _SCATTERED), max_size=6))
def test_many_chunks_hashed_in_one_call_give_each_chunks_own_value(
    monkeypatch: pytest.MonkeyPatch, chunks: list[list[int]]
) -> None:
    values = _both(monkeypatch, lambda: blocks_checksums(_KV, chunks, _UNIT))
    assert values == [blocks_checksum(_KV, ids, _UNIT) for ids in chunks]
    # the definition: each chunk's blocks of every tensor, tensor by tensor, as one byte stream
    assert values == [
        chunk_checksum([t[b * _UNIT : (b + 1) * _UNIT] for t in _KV for b in ids], unit=_UNIT) for ids in chunks
    ]


def test_one_block_sums_hashes_every_chunk_as_the_call_does_and_reads_the_switch_at_each_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ``BlockSums`` kept for many chunks, as a sender's or receiver's memory keeps it: what it read of the tensors
    when it was made (their addresses, their blocks) gives every later chunk the definition's value, a block outside
    them is still refused, and ``PDKV_NATIVE=0`` set after it was made sends its next call down the torch path."""
    sums = BlockSums(_KV, _UNIT)
    rng = random.Random(3)
    chunks = [rng.sample(range(_BLOCKS), rng.randrange(1, 8)) for _ in range(6)] + [[]]
    want = [chunk_checksum([t[b * _UNIT : (b + 1) * _UNIT] for t in _KV for b in ids], unit=_UNIT) for ids in chunks]
    assert [sums([ids])[0] for ids in chunks] == want
    with pytest.raises(LayoutError, match=f"block id {_BLOCKS} is out of range"):
        sums([[0, _BLOCKS]])
    torch_path: list[int] = []
    real = checksum._torch_blocks_checksum
    monkeypatch.setattr(checksum, "_torch_blocks_checksum", lambda *a: torch_path.append(1) or real(*a))
    monkeypatch.setenv(native.ENV_VAR, "0")
    assert sums(chunks[:2]) == want[:2] and torch_path == [1, 1]
    monkeypatch.delenv(native.ENV_VAR)
    assert sums(chunks[:2]) == want[:2] and torch_path == [1, 1]


def test_one_chunk_outside_the_buffer_refuses_the_whole_call() -> None:
    with pytest.raises(LayoutError, match=f"block id {_BLOCKS} is out of range"):
        blocks_checksums(_KV, [[0, 1], [2, _BLOCKS], []], _UNIT)


def test_the_native_block_checksum_refuses_a_block_outside_the_buffer() -> None:
    kv = [_bytes(8 * 256), _bytes(6 * 256)]  # the shorter tensor bounds the ids
    assert blocks_checksum(kv, [5], 256)
    with pytest.raises(LayoutError, match="block id 6 is out of range"):
        blocks_checksum(kv, [0, 6], 256)
    with pytest.raises(LayoutError, match="block id -1"):
        blocks_checksum(kv, [-1], 256)


LAYOUTS = [
    KVLayout(num_layers=3, num_kv_heads=4, head_dim=32, block_size=8),
    KVLayout(num_layers=3, num_kv_heads=4, head_dim=32, block_size=8, order="HND", dtype="float32"),
    KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=4, kind="cross_layer", dtype="float16"),
    KVLayout(num_layers=2, num_kv_heads=1, head_dim=48, block_size=16, mla=True),
    # 6-byte tokens: runs do not start on whole words of the chunk, so the kernel hashes after copying
    KVLayout(num_layers=2, num_kv_heads=1, head_dim=3, block_size=4, dtype="float16"),
    KVLayout(num_layers=2, num_kv_heads=1, head_dim=3, block_size=4, dtype="float16", order="HND"),
    # fp8 bytes: 3-byte rows, and a latent as an fp8 MLA cache keeps it
    KVLayout(num_layers=2, num_kv_heads=3, head_dim=1, block_size=4, dtype="float8_e4m3fn", order="NHKD"),
    KVLayout(num_layers=2, num_kv_heads=1, head_dim=36, block_size=16, dtype="float8_e5m2", mla=True),
]


@pytest.mark.parametrize(
    "layout", LAYOUTS, ids=lambda lay: f"{lay.kind}-{lay.order}-{lay.head_dim}-{lay.mla}-{lay.dtype}"
)
@pytest.mark.parametrize(("start", "tokens"), [(0, 40), (5, 27)])
def test_gather_and_scatter_hash_the_chunk_they_move(
    monkeypatch: pytest.MonkeyPatch, layout: KVLayout, start: int, tokens: int
) -> None:
    num_blocks = 24
    kv = layout.allocate(num_blocks)
    for t in kv:
        gen = torch.Generator().manual_seed(t.numel())
        t.copy_(
            torch.randn(t.shape, generator=gen)
            if t.is_floating_point()
            else torch.randint(0, 256, t.shape, generator=gen)
        )
    table = random.Random(tokens).sample(range(num_blocks), -(-(start + tokens) // layout.block_size))
    chunk = torch.empty(layout.chunk_shape(tokens), dtype=layout.torch_dtype)
    _, acc = native.PagedBuffer(layout, kv).gather_summed(table, start, tokens, chunk, checksum=True)
    assert acc is not None  # hashed by the kernel, not after it in Python
    assert torch.equal(chunk, torch_gather(layout, kv, table, start, tokens))
    with monkeypatch.context() as m:
        m.setenv(native.ENV_VAR, "0")
        expected = chunk_checksum([flat_bytes(chunk)])
    assert frame_checksum(flat_bytes(chunk), acc) == expected

    landed = layout.allocate(num_blocks)
    other = random.Random(1).sample(range(num_blocks), len(table))
    acc = native.PagedBuffer(layout, landed).scatter_summed(other, start, chunk, checksum=True)
    assert acc is not None and frame_checksum(flat_bytes(chunk), acc) == expected
    reference = layout.allocate(num_blocks)
    torch_scatter(layout, reference, other, start, chunk)
    assert all(torch.equal(a, b) for a, b in zip(landed, reference, strict=True))


def test_a_gather_into_a_strided_output_hashes_the_chunk_in_canonical_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """A strided ``out`` is filled through a contiguous chunk: that one is hashed, the same bytes in order."""
    layout = LAYOUTS[0]
    kv = layout.allocate(8)
    for t in kv:
        t.normal_(generator=torch.Generator().manual_seed(3))
    out = torch.empty((*layout.chunk_shape(8)[:-1], 64), dtype=layout.torch_dtype)[..., :32]
    acc = native.PagedBuffer(layout, kv).gather_summed([1, 2], 0, 8, out, checksum=True)[1]
    frame = flat_bytes(out.contiguous())
    with monkeypatch.context() as m:
        m.setenv(native.ENV_VAR, "0")
        expected = chunk_checksum([frame])
    assert acc is not None and frame_checksum(frame, acc) == expected
