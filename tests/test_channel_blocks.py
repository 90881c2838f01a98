"""A write of whole blocks handed to a channel as arrays (``Channel.write_blocks``, ``BlockWrite``).

Its check on the arrays (``RegionTable.check_blocks``) must refuse exactly what the per-op check refuses for the
same write as ops, with the same message; over tcp and nixl scattered blocks of several regions land bit-exact.
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdkv.channels import BlockWrite, Channel, XferState, create_channel
from pdkv.channels.regions import RegionTable
from pdkv.errors import ChannelError

BLOCK = 256
BLOCKS = 64  # per region
REGIONS = 3


def _ranges(write: BlockWrite) -> list[tuple[int, int, int, int]]:
    """Every (local region, local offset, remote region, remote offset) of a block the write moves, one per block."""
    size = write.block_bytes
    return sorted(
        (here, int(a) * size, there, int(b) * size)
        for here, there in zip(write.local_regions, write.remote_regions, strict=True)
        for a, b in zip(write.local_blocks, write.remote_blocks, strict=True)
    )


def _op_blocks(write: BlockWrite) -> list[tuple[int, int, int, int]]:
    """The same, read from the write's ops: each op cut back into its blocks."""
    size = write.block_bytes
    return sorted(
        (op.local_region, op.local_offset + k * size, op.remote_region, op.remote_offset + k * size)
        for op in write.ops()
        for k in range(op.length // size)
    )


@st.composite
def tables_and_writes(draw: st.DrawFn) -> tuple[RegionTable[None], BlockWrite]:
    """A region table (ours and a peer's, sizes not always whole blocks) and a block write that fits both, or
    steps outside them in one place: a region not registered, an id negative or past a region's end, no blocks
    or no tensors."""
    block = draw(st.sampled_from([1, 64, 100]))
    table: RegionTable[None] = RegionTable("test")
    mine, theirs = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    for _ in range(mine):
        table.add(None, draw(st.integers(8, 36)) * block + draw(st.sampled_from([0, 0, block // 2])))
    table.add_peer("peer", {r: draw(st.integers(8, 36)) * block for r in range(theirs)})
    tensors, n = draw(st.integers(1, 3)), draw(st.integers(1, 12))
    parts = [
        draw(st.lists(st.integers(0, mine - 1), min_size=tensors, max_size=tensors)),
        draw(st.lists(st.integers(0, theirs - 1), min_size=tensors, max_size=tensors)),
        draw(st.lists(st.integers(0, 7), min_size=n, max_size=n)),  # every region holds at least 8 blocks
        draw(st.lists(st.integers(0, 7), min_size=n, max_size=n)),
    ]
    flaw = draw(st.sampled_from(["none", "none", "none", "local", "remote", "ours", "theirs", "empty"]))
    if flaw == "empty":
        parts = [[], [], *parts[2:]] if draw(st.booleans()) else [*parts[:2], [], []]
    elif flaw != "none":
        part = parts[["local", "remote", "ours", "theirs"].index(flaw)]
        part[draw(st.integers(0, len(part) - 1))] = draw(st.sampled_from([-1, -7, 36, 40, 1 << 40]))
    return table, BlockWrite(
        tuple(parts[0]), tuple(parts[1]), np.array(parts[2], dtype=np.int64), np.array(parts[3], dtype=np.int64), block
    )


@settings(max_examples=400, deadline=None)
@given(tables_and_writes())
def test_the_check_on_arrays_refuses_exactly_what_the_per_op_check_refuses(
    case: tuple[RegionTable[None], BlockWrite],
) -> None:
    table, write = case
    assert _op_blocks(write) == _ranges(write), "the ops move exactly the write's blocks"
    try:
        want: int | str = table.check_ops("peer", write.ops())
    except ChannelError as exc:
        want = str(exc)
    try:
        got: int | str = table.check_blocks("peer", write)
    except ChannelError as exc:
        got = str(exc)
    assert got == want
    if isinstance(got, int):
        assert got == write.nbytes == sum(op.length for op in write.ops())


def test_an_unknown_peer_and_a_malformed_write_are_refused() -> None:
    table: RegionTable[None] = RegionTable("test")
    table.add(None, 1024)
    one = np.array([0], dtype=np.int64)
    with pytest.raises(ChannelError, match="unknown peer 'nobody'"):
        table.check_blocks("nobody", BlockWrite((0,), (0,), one, one, 64))
    for regions, ours, theirs, block in [
        ((0, 1), one, one, 64),  # one remote region for two local ones
        ((0,), np.array([0, 1]), one, 64),  # arrays of two lengths
        ((0,), one.astype(np.float64), one, 64),  # not integers
        ((0,), one.reshape(1, 1), one, 64),  # not 1-D
        ((0,), one, one, 0),  # no block size
    ]:
        with pytest.raises(ChannelError, match="a block write needs"):
            BlockWrite(regions, (0,), ours, theirs, block)


def test_the_check_follows_the_regions_as_they_change() -> None:
    """What the check worked out for a set of regions is forgotten when a region or a peer changes."""
    table: RegionTable[None] = RegionTable("test")
    ours = (table.add(None, 8 * 64), table.add(None, 8 * 64))
    table.add_peer("peer", {0: 8 * 64})
    write = BlockWrite(ours, (0, 0), np.array([7]), np.array([7]), 64)
    assert table.check_blocks("peer", write) == 2 * 64
    table.add_peer("peer", {0: 7 * 64})
    with pytest.raises(ChannelError, match="peer 'peer' range offset=448 length=64 does not fit region 0 of 448"):
        table.check_blocks("peer", write)
    table.add_peer("peer", {0: 8 * 64})
    table.remove(ours[1])
    with pytest.raises(ChannelError, match=f"local region {ours[1]} is not registered"):
        table.check_blocks("peer", write)


def _channels(name: str) -> Iterator[Callable[[], Channel]]:
    made: list[Channel] = []

    def make() -> Channel:
        channel = create_channel(name, f"{name}-blocks-{os.getpid()}-{len(made)}", {})
        made.append(channel)
        return channel

    yield make
    for channel in made:
        channel.close()


@pytest.fixture(params=["tcp", "nixl"])
def make_channel(request: pytest.FixtureRequest) -> Iterator[Callable[[], Channel]]:
    if request.param == "nixl" and importlib.util.find_spec("nixl") is None:
        pytest.skip("nixl is not installed")
    yield from _channels(request.param)


def _notifs(channel: Channel, count: int, timeout: float) -> list[bytes]:
    deadline, got = time.monotonic() + timeout, []
    while len(got) < count and time.monotonic() < deadline:
        got += [n.payload for n in channel.get_notifications()]
        time.sleep(0.001)
    return got


def test_scattered_blocks_of_several_regions_land_bit_exact(make_channel: Callable[[], Channel]) -> None:
    """Runs and single blocks, reversed on the far side, over regions gridded in the write's block size (nixl:
    index arrays into its block lists) and again over regions that are not (the write goes as its ops); the
    guarded target lands them through its grants; blocks not written stay zero."""
    rng = np.random.default_rng(7)
    a, b = make_channel(), make_channel()
    srcs = [rng.integers(0, 256, BLOCKS * BLOCK, dtype=np.uint8) for _ in range(REGIONS)]
    dsts = [np.zeros(BLOCKS * BLOCK, dtype=np.uint8) for _ in range(REGIONS)]
    ras = tuple(a.register(s, BLOCK) for s in srcs)
    rbs = tuple(b.register(d, BLOCK) for d in dsts)
    plain = tuple(b.register(d) for d in (np.zeros(BLOCKS * BLOCK, dtype=np.uint8) for _ in range(REGIONS)))
    ours = np.array([3, 4, 5, 17, 40, 9, 10], dtype=np.int64)
    theirs = np.array([60, 61, 62, 2, 33, 11, 1], dtype=np.int64)
    token = b"t" * 16
    for region in rbs:
        b.guard(region)
    b.grant(token, "write", [(r, int(j) * BLOCK, BLOCK) for r in rbs for j in theirs])
    peer = a.add_peer(b.metadata())
    for remote, notif in ((rbs, b"gridded"), (plain, b"plain")):
        handle = a.write_blocks(peer, BlockWrite(ras, remote, ours, theirs, BLOCK), notif, token)
        a.wait(handle, 10.0)
        assert handle.state is XferState.DONE and handle.nbytes == REGIONS * len(ours) * BLOCK
        assert _notifs(b, 1, 10.0) == [notif]
        if a.name == "nixl":  # the gridded write went as one index per block, the other as its 5 runs' ops
            assert handle.descriptors == REGIONS * (len(ours) if remote == rbs else 5)  # type: ignore[attr-defined]
    for t in range(REGIONS):
        for i, j in zip(ours, theirs, strict=True):
            assert np.array_equal(dsts[t][j * BLOCK : (j + 1) * BLOCK], srcs[t][i * BLOCK : (i + 1) * BLOCK])
        untouched = np.setdiff1d(np.arange(BLOCKS), theirs)
        assert not dsts[t].reshape(BLOCKS, BLOCK)[untouched].any(), "blocks not written stay untouched"
    with pytest.raises(ChannelError, match="does not fit region"):
        a.write_blocks(peer, BlockWrite(ras, rbs, ours, np.full(len(ours), BLOCKS), BLOCK), b"past", token)
