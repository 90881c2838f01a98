"""``TransferPlan``: each chunk's blocks, runs and ops worked out once must be what ``block_runs`` gives per chunk."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdkv.channels import handle as handle_module
from pdkv.channels.handle import TransferOp
from pdkv.errors import TransferError
from pdkv.keys import chunk_spans
from pdkv.layout import block_runs
from pdkv.transfer.plan import TransferPlan

NUM_BLOCKS = 64


def _table(draw: st.DrawFn, n: int) -> list[int]:
    """``n`` distinct block ids: runs of adjacent ids (up or down) mixed with jumps, as an allocator hands out."""
    kind = draw(st.sampled_from(["contiguous", "reversed", "random", "runs"]))
    if kind == "contiguous":
        first = draw(st.integers(0, NUM_BLOCKS - n))
        return list(range(first, first + n))
    if kind == "reversed":
        first = draw(st.integers(n - 1, NUM_BLOCKS - 1))
        return list(range(first, first - n, -1))
    if kind == "random":
        return draw(st.permutations(range(NUM_BLOCKS)))[:n]
    starts = draw(st.permutations(range(0, NUM_BLOCKS, 4)))  # runs of up to four adjacent ids, in random order
    ids = [s + i for s in starts for i in range(4)]
    return ids[:n]


@st.composite
def transfers(draw: st.DrawFn) -> tuple[int, int, int, int, list[int], list[int]]:
    """(tokens, tokens D holds already, chunk size, block size, our table, their table): chunk sizes that are not a
    multiple of the block size too (chunks then share a block), a last chunk that may be partial, and a transfer that
    starts past D's prefix hit (a whole number of blocks, or any token: P gathers a staged chunk from any)."""
    block_size = draw(st.sampled_from([1, 4, 16]))
    chunk_size = draw(st.sampled_from([block_size, 2 * block_size, 3 * block_size, block_size + 3]))
    blocks = draw(st.integers(1, 40))
    tokens = draw(st.integers((blocks - 1) * block_size + 1, blocks * block_size))
    held = draw(st.sampled_from([0, draw(st.integers(0, blocks - 1)) * block_size, draw(st.integers(0, tokens - 1))]))
    return tokens, held, chunk_size, block_size, _table(draw, blocks), _table(draw, blocks)


@pytest.mark.parametrize("numpy_from", [0, handle_module.NUMPY_FROM_BLOCKS], ids=["numpy", "python"])
@settings(max_examples=300, deadline=None)
@given(case=transfers())
def test_the_plan_gives_each_chunk_what_block_runs_gives_it(
    numpy_from: int, case: tuple[int, int, int, int, list[int], list[int]]
) -> None:
    """Either way of finding the runs (numpy for long tables, a Python pass for short ones)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(handle_module, "NUMPY_FROM_BLOCKS", numpy_from)
        _check_against_block_runs(*case)


def _check_against_block_runs(
    tokens: int, held: int, chunk_size: int, block_size: int, ours: list[int], theirs: list[int]
) -> None:
    """Both sides' tables are given whole; the plan gets each from the block holding token ``held``."""
    skip = held // block_size
    plan = TransferPlan.build(
        "t",
        num_tokens=tokens,
        chunk_size=chunk_size,
        block_size=block_size,
        ours=ours[skip:],
        num_blocks=NUM_BLOCKS,
        held=held,
    ).with_peer(theirs[skip:])
    spans = [(held + start, n) for start, n in chunk_spans(tokens - held, chunk_size)]
    assert plan.spans == spans and plan.num_chunks == len(spans) and plan.table_start == skip * block_size
    size = 100
    writes = plan.writes([7, 8], [17, 18], size)
    for i, (start, n) in enumerate(spans):
        first, last = start // block_size, -(-(start + n) // block_size)
        assert plan.blocks[i] == writes[i].local_blocks.tolist() == ours[first:last]
        assert writes[i].remote_blocks.tolist() == theirs[first:last]
        assert writes[i].runs() == block_runs(ours[first:last], theirs[first:last])
    ops = [w.ops() for w in writes]
    want = [
        TransferOp(local, a * size, remote, b * size, k * size)
        for i, (start, n) in enumerate(spans)
        for local, remote in [(7, 17), (8, 18)]
        for a, b, k in block_runs(*(t[start // block_size : -(-(start + n) // block_size)] for t in (ours, theirs)))
    ]
    assert [op for chunk in ops for op in chunk] == want


def test_a_partial_last_chunk_of_a_reversed_table_gets_its_one_block() -> None:
    plan = TransferPlan.build(
        "t", num_tokens=37, chunk_size=32, block_size=16, ours=[9, 8, 7], num_blocks=10
    ).with_peer([1, 2, 3])
    assert plan.spans == [(0, 32), (32, 5)]
    assert plan.blocks == [[9, 8], [7]]
    assert [w.runs() for w in plan.writes([0], [0], 64)] == [[(9, 1, 1), (8, 2, 1)], [(7, 3, 1)]]


@pytest.mark.parametrize(
    ("ours", "why"),
    [([0, 1, 10], "block 10 is not one of 10"), ([-1, 1, 2], "a negative id"), ([0, 1], "too few for 40 tokens")],
)
def test_a_block_table_outside_our_blocks_is_refused_before_any_chunk(ours: list[int], why: str) -> None:
    with pytest.raises(TransferError, match="inside our 10 blocks"):
        TransferPlan.build("t", num_tokens=40, chunk_size=16, block_size=16, ours=ours, num_blocks=10)


def test_a_plan_that_would_move_nothing_is_refused() -> None:
    with pytest.raises(TransferError, match="40 tokens held of 40: nothing left to move"):
        TransferPlan.build("t", num_tokens=40, chunk_size=16, block_size=16, ours=[], num_blocks=10, held=40)


def test_a_peer_with_fewer_blocks_than_the_transfer_needs_is_refused() -> None:
    plan = TransferPlan.build("t", num_tokens=40, chunk_size=16, block_size=16, ours=[0, 1, 2], num_blocks=10)
    with pytest.raises(TransferError, match="holds 2 blocks for a transfer of 3"):
        plan.with_peer([5, 6])
