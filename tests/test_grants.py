"""The capability table (``pdkv.channels.grants.Grants``) against the plainest model of it: the set of bytes each
token may write in each region. Grants and revokes in any order, overlapping, touching or not (a pool's blocks, a
reservation's taken back as it lands or when it is claimed), leave it holding exactly the model's bytes and admitting
a frame exactly when every byte of every run is in the model."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pdkv.channels.grants import BlockGrid, Grants, GridSpans
from pdkv.errors import ChannelError

RANGES = st.lists(st.tuples(st.integers(0, 1), st.integers(0, 200), st.integers(1, 60)), min_size=1, max_size=5)


def _model_admits(model: dict[tuple[bytes, int], set[int]], token: bytes, frame: list[tuple[int, int, int]]) -> bool:
    return all(set(range(o, o + n)) <= model.get((token, r), set()) for r, o, n in frame)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    ops=st.lists(st.tuples(st.booleans(), st.sampled_from([b"a", b"b"]), RANGES), max_size=12),
    token=st.sampled_from([b"a", b"b"]),
    frame=RANGES,
)
def test_grants_admit_exactly_the_bytes_granted_and_not_revoked(
    ops: list[tuple[bool, bytes, list[tuple[int, int, int]]]], token: bytes, frame: list[tuple[int, int, int]]
) -> None:
    grants = Grants()
    for region in (0, 1):
        grants.guard(region)
    model: dict[tuple[bytes, int], set[int]] = {}
    for give, who, ranges in ops:
        for region, offset, length in ranges:
            held = model.setdefault((who, region), set())
            span = set(range(offset, offset + length))
            model[(who, region)] = held | span if give else held - span
        if give:
            grants.grant(who, "write", ranges)
        else:
            assert grants.revoke(who, "write", ranges, 0.0)
    for (who, _, region), intervals in grants._ranges.items():
        assert {b for lo, hi in intervals for b in range(lo, hi)} == model.get((who, region), set())
    if _model_admits(model, token, frame):
        grants.end(grants.begin_many(token, "write", frame))
    else:
        with pytest.raises(ChannelError, match="no write grant"):
            grants.begin_many(token, "write", frame)


GRID_BLOCK = 8
BLOCK_SETS = st.lists(st.integers(0, 12), min_size=1, max_size=5)


@settings(max_examples=300, deadline=None, derandomize=True)
@example(ops=[(True, b"a", [0, 1]), (False, b"a", [1])], token=b"a", frame=[(1, 8, 1)])
@given(
    ops=st.lists(st.tuples(st.booleans(), st.sampled_from([b"a", b"b"]), BLOCK_SETS), max_size=12),
    token=st.sampled_from([b"a", b"b"]),
    frame=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 110), st.integers(1, 30)), min_size=1, max_size=4),
)
def test_grid_grants_admit_exactly_the_blocks_granted_in_every_region(
    ops: list[tuple[bool, bytes, list[int]]], token: bytes, frame: list[tuple[int, int, int]]
) -> None:
    """Blocks granted and revoked over a grid (``GridSpans``: a KV buffer's tensors at once) admit a frame in any
    region of the grid exactly when the model, the same blocks in each region, holds every byte of it; a region
    beside the grid keeps its own grants by range."""
    grants = Grants()
    for region in (0, 1, 2):
        grants.guard(region)
    grid = BlockGrid((0, 1), GRID_BLOCK)
    grants.grant(b"a", "write", [(2, 0, 40)])  # not in the grid: by range, as before
    model: dict[bytes, set[int]] = {}
    for give, who, blocks in ops:
        span = {b for block in blocks for b in range(block * GRID_BLOCK, (block + 1) * GRID_BLOCK)}
        model[who] = model.get(who, set()) | span if give else model.get(who, set()) - span
        if give:
            grants.grant(who, "write", GridSpans(grid, grid.spans(blocks)))
        else:
            assert grants.revoke(who, "write", GridSpans(grid, grid.spans(blocks)), 0.0)
    for (who, held_grid), spans in grants._blocks.items():
        assert held_grid is grid
        assert {b for lo, hi in spans for b in range(lo, hi)} == model.get(who, set())
    held = model.get(token, set())
    admits = all(
        set(range(o, o + n)) <= (held if r in grid.regions else set(range(40)) if token == b"a" else set())
        for r, o, n in frame
    )
    if admits:
        grants.end(grants.begin_many(token, "write", frame))
    else:
        with pytest.raises(ChannelError, match="no write grant"):
            grants.begin_many(token, "write", frame)


def test_a_grid_region_is_written_through_its_grid_alone() -> None:
    """Write grants by range into a grid's region are refused, and so is a second grid over it or a grid over a region
    holding grants by range (they would be kept apart here but not in the native mirror); reads stay by range."""
    grants = Grants()
    grid = BlockGrid((0, 1), GRID_BLOCK)
    grants.grant(b"a", "write", [(2, 0, 8)])
    grants.grant(b"a", "write", GridSpans(grid, grid.spans([1])))
    with pytest.raises(ChannelError, match="by GridSpans"):
        grants.grant(b"a", "write", [(1, 0, 8)])
    with pytest.raises(ChannelError, match="by GridSpans"):
        grants.revoke(b"a", "write", [(0, 8, 8)], 0.0)
    with pytest.raises(ChannelError, match="another grid"):
        grants.grant(b"a", "write", GridSpans(BlockGrid((1,), GRID_BLOCK), [(0, 8)]))
    with pytest.raises(ChannelError, match="by range"):
        grants.grant(b"a", "write", GridSpans(BlockGrid((2,), GRID_BLOCK), [(0, 8)]))
    with pytest.raises(ChannelError, match="for writing"):
        grants.grant(b"a", "read", GridSpans(grid, [(0, 8)]))
    with pytest.raises(ChannelError, match="for writing"):
        grants.revoke(b"a", "read", GridSpans(grid, [(0, 8)]), 0.0)
    # a grid never granted holds nothing to take back, and taking it back claims none of its regions
    other = BlockGrid((2,), GRID_BLOCK)
    assert grants.revoke(b"a", "write", GridSpans(other, [(0, 8)]), 0.0)
    grants.grant(b"a", "write", [(2, 8, 8)])
    grants.grant(b"a", "read", [(0, 0, 8)])
    assert grid.ranges(grid.spans([3, 1, 2, 7])) == [(0, 8, 24), (0, 56, 8), (1, 8, 24), (1, 56, 8)]
    with pytest.raises(ChannelError, match="distinct regions"):
        BlockGrid((0, 0), GRID_BLOCK)


def test_a_sealed_region_is_granted_to_nobody_and_admits_nothing() -> None:
    """A sealed region (a prefill worker's KV and staging area) takes no grant, by range or by grid, for writing or
    reading, and a frame into it is refused like one into any guarded region without a grant; a guarded region
    beside it is granted as before."""
    grants = Grants()
    grants.guard(0, sealed=True)
    grants.guard(1)
    assert grants.sealed() == {0} and grants.guarded(0)
    for access in ("write", "read"):
        with pytest.raises(ChannelError, match=r"\[0\] are sealed"):
            grants.grant(b"a", access, [(1, 0, 8), (0, 0, 8)])
    with pytest.raises(ChannelError, match="sealed"):
        grants.grant(b"a", "write", GridSpans(BlockGrid((1, 0), GRID_BLOCK), [(0, 8)]))
    for token, access in ((b"a", "write"), (b"a", "read"), (b"", "write")):
        with pytest.raises(ChannelError, match="not reserved for this peer"):
            grants.begin(token, access, 0, 0, 8)
    assert grants.exposure([0, 1]) == "closed" and grants.exposure([0, 1], "read") == "closed"  # none was kept
    grants.grant(b"a", "write", [(1, 0, 8)])
    grants.end(grants.begin(b"a", "write", 1, 0, 8))
    with pytest.raises(ChannelError, match="region 1 bytes \\[8, 16\\)"):
        grants.begin(b"a", "write", 1, 8, 8)


def test_a_grid_revoke_waits_out_a_frame_landing_in_any_of_its_regions() -> None:
    """A frame the Python loop admitted into one region of a grid holds the grid's revoke of those blocks (the
    fence) until it ends; a frame elsewhere does not."""
    grants = Grants()
    for region in (0, 1, 2):
        grants.guard(region)
    grid = BlockGrid((0, 1), GRID_BLOCK)
    grants.grant(b"a", "write", GridSpans(grid, grid.spans([0, 1, 2])))
    grants.grant(b"a", "write", [(2, 0, 8)])
    elsewhere = grants.begin_many(b"a", "write", [(2, 0, 8)])
    landing = grants.begin_many(b"a", "write", [(1, 9, 4)])
    assert not grants.revoke(b"a", "write", GridSpans(grid, grid.spans([1])), 0.0)
    grants.end(landing)
    assert grants.revoke(b"a", "write", GridSpans(grid, grid.spans([1])), 0.0)
    grants.end(elsewhere)
    with pytest.raises(ChannelError, match="no write grant"):
        grants.begin_many(b"a", "write", [(0, 8, 8)])
