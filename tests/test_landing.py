"""Hashing what the tcp channel lands as it lands (channels/landing.py): the value equals the checksum of the bytes as
they sit in memory, whatever the frames, streams and block table; whatever did not land exactly once is read back.

Real sockets between two channels of this process; every wait is bounded.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from pdkv import native
from pdkv.channels import TransferOp
from pdkv.channels.landing import LandingSums
from pdkv.channels.tcp import TcpChannel, TcpOptions, wire
from pdkv.channels.tcp import native as tcp_native
from pdkv.checksum import blocks_checksum
from pdkv.errors import ChannelError
from pdkv.layout import gather

from tests.conftest import MakePair, wait_until

pytestmark = pytest.mark.skipif(not native.available(), reason="the native kernels are not built")

BLOCK = 16 << 10
BLOCKS = 16
TENSORS = 2
TOKEN = b"t" * 16


@dataclass
class Pair:
    p: TcpChannel
    d: TcpChannel
    src: list[torch.Tensor]
    dst: list[torch.Tensor]
    src_regions: list[int]
    dst_regions: list[int]

    def write(self, pairs: list[tuple[int, int]], offset: int = 0, length: int = BLOCK) -> None:
        """Write bytes [offset, offset+length) of P block a to D block b, for each (a, b), every tensor; wait."""
        ops = [
            TransferOp(self.src_regions[t], a * BLOCK + offset, self.dst_regions[t], b * BLOCK + offset, length)
            for t in range(TENSORS)
            for a, b in pairs
        ]
        self.p.wait(self.p.write("d", ops, token=TOKEN), 20)

    def grant(self, ids: list[int]) -> None:
        self.d.grant(TOKEN, "write", [(r, b * BLOCK, BLOCK) for r in self.dst_regions for b in ids])

    def hot(self, ids: list[int]) -> int:
        return self.d.landed_checksum(self.dst_regions, ids, BLOCK)

    def cold(self, ids: list[int]) -> int:
        return blocks_checksum([t.view(-1) for t in self.dst], ids, BLOCK)

    def reread(self) -> int:
        return self.d.stats().get("landed_blocks_reread", 0)


def _pair(**opts: int) -> Iterator[Pair]:
    d = TcpChannel("d", TcpOptions(io_timeout=5, connect_timeout=5, **opts))
    p = TcpChannel("p", TcpOptions(io_timeout=5, connect_timeout=5, **opts))
    gen = torch.Generator().manual_seed(7)
    src = [torch.randint(0, 256, (BLOCKS * BLOCK,), dtype=torch.uint8, generator=gen) for _ in range(TENSORS)]
    dst = [torch.zeros(BLOCKS * BLOCK, dtype=torch.uint8) for _ in range(TENSORS)]
    src_regions = [p.register(t) for t in src]
    dst_regions = [d.register(t) for t in dst]
    for r in dst_regions:
        d.guard(r)
        assert d.hash_landing(r, BLOCK)
    p.add_peer(d.metadata())
    try:
        yield Pair(p, d, src, dst, src_regions, dst_regions)
    finally:
        p.close()
        d.close()


@pytest.fixture
def pair(frame_loop: str) -> Iterator[Pair]:
    # frames of 6 KiB: several frames a block, a frame ending inside a block; two streams share each transfer
    yield from _pair(max_frame_bytes=6 << 10, streams=2, stream_min_bytes=40 << 10, one_host_shares=2)


def test_hot_value_is_the_landed_bytes_checksum(pair: Pair) -> None:
    ids = [9, 2, 14, 3, 4, 11]  # fragmented: runs of 1 and 2 blocks
    pair.grant(ids)
    pair.write(list(enumerate(ids)))
    assert pair.d.stats().get("landed_blocks_reread", 0) == 0
    value = pair.hot(ids)
    assert value == pair.cold(ids)
    assert value == blocks_checksum([t.view(-1) for t in pair.src], list(range(len(ids))), BLOCK)
    assert pair.reread() == 0  # every block came from what was hashed as it landed
    assert pair.hot(ids[::-1]) == pair.cold(ids[::-1])  # the position weights apply at verification


def test_partly_landed_block_is_read_back(pair: Pair) -> None:
    ids = [5, 6, 7]
    pair.grant(ids)
    pair.write([(0, 5), (2, 7)])
    pair.write([(1, 6)], length=BLOCK // 2)  # block 6: its second half never arrives
    value = pair.hot(ids)
    assert value == pair.cold(ids)
    assert value != blocks_checksum([t.view(-1) for t in pair.src], [0, 1, 2], BLOCK)
    assert pair.reread() == TENSORS  # block 6 of each tensor


def test_block_landed_twice_is_read_back(pair: Pair) -> None:
    pair.grant([1, 2])
    pair.write([(0, 1), (1, 2)])
    pair.write([(3, 1)], offset=0, length=BLOCK // 2)  # half of block 1 again, other bytes
    value = pair.hot([1, 2])
    assert pair.reread() == TENSORS
    assert value == pair.cold([1, 2])
    assert value != blocks_checksum([t.view(-1) for t in pair.src], [0, 1], BLOCK)


def test_grant_forgets_what_landed_before(pair: Pair) -> None:
    pair.grant([4])
    pair.write([(0, 4)])
    assert pair.hot([4]) == pair.cold([4]) and pair.reread() == 0
    for t in pair.dst:  # the block goes to someone else, who writes into it outside the channel
        t[4 * BLOCK : 5 * BLOCK] = 0
    pair.grant([4])  # a new reservation of it: nothing it holds was landed under this grant
    assert pair.hot([4]) == pair.cold([4])
    assert pair.reread() == TENSORS


def test_corrupted_byte_fails_verification(pair: Pair) -> None:
    pair.grant([8])
    expected = blocks_checksum([t.view(-1) for t in pair.src], [0], BLOCK)
    pair.src[1][100] ^= 0xFF  # the sender's bytes differ from those it hashed
    pair.write([(0, 8)])
    assert pair.hot([8]) == pair.cold([8]) != expected


def test_misaligned_pieces_are_read_back() -> None:
    # frames of an odd size: pieces that are not whole words of their block cannot be hashed alone
    for pair in _pair(max_frame_bytes=(6 << 10) + 3, streams=1):
        pair.grant([0, 1])
        pair.write([(2, 0), (3, 1)])
        assert pair.hot([0, 1]) == pair.cold([0, 1])
        assert 0 < pair.reread() <= 2 * TENSORS


def test_bad_arguments_are_channel_errors(pair: Pair) -> None:
    with pytest.raises(ChannelError, match="out of range"):
        pair.hot([BLOCKS])
    with pytest.raises(ChannelError, match="units of"):
        pair.d.landed_checksum(pair.dst_regions, [0], BLOCK * 2)
    with pytest.raises(ChannelError, match="not hashed"):
        pair.d.landed_checksum([pair.dst_regions[0] + 10], [0], BLOCK)


def test_unguarded_region_is_not_hashed() -> None:
    d = TcpChannel("d2", TcpOptions())
    try:
        region = d.register(bytearray(BLOCK))
        assert not d.hash_landing(region, BLOCK)  # anyone may write there: a hash of it proves nothing
    finally:
        d.close()


def test_random_block_tables_match() -> None:
    rng = random.Random(3)
    for pair in _pair(max_frame_bytes=10 << 10, streams=2, stream_min_bytes=24 << 10, one_host_shares=2):
        for _ in range(3):
            ids = rng.sample(range(BLOCKS), 5)
            pair.grant(ids)
            pair.write(list(enumerate(ids)))
            assert pair.hot(ids) == pair.cold(ids)
        assert pair.reread() == 0


def test_receive_cut_halfway_is_read_back(pair: Pair) -> None:
    pair.grant([3])
    pair.write([(0, 3)])  # block 3 landed whole and hashed...
    name = b"cut"
    hello = wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.HELLO, 0, len(TOKEN), 0, 0, 77, 0, len(TOKEN) + len(name))
    size = 6 << 10  # the fixture's max_frame_bytes
    frame = bytes(wire.data_frame(1, [(pair.dst_regions[0], 3 * BLOCK, size)], size, wire.LAST, 1))
    with socket.create_connection(("127.0.0.1", pair.d.port), timeout=10) as sock:
        # ...then a frame under the same token rewrites part of it, and the connection drops halfway through
        sock.sendall(hello + TOKEN + name + frame + b"\x55" * (size // 2))
        sock.shutdown(socket.SHUT_WR)
        while sock.recv(1 << 16):  # until the channel hangs up on the truncated frame
            pass
    wait_until(lambda: bytes(pair.dst[0][3 * BLOCK : 3 * BLOCK + 8].numpy()) == b"\x55" * 8, 10)
    value = pair.hot([3])
    assert pair.reread() == 1  # the hash of the first landing no longer stands for block 3 of tensor 0
    assert value == pair.cold([3])


@pytest.mark.parametrize(
    ("runs", "length", "ok"),
    [
        ([(0, 0, 16), (1, 8, 8), (0, 16, 16)], 40, True),
        ([(0, 0, 16), (0, 8, 16)], 32, False),  # overlap
        ([(0, 16, 16), (0, 0, 17)], 33, False),  # overlap, out of order
        ([(0, 0, 0), (0, 8, 8)], 8, False),  # an empty run
        ([(1, BLOCK - 8, 16)], 16, False),  # past the region's end
        ([(0, (1 << 64) - 8, 16)], 16, False),  # offset + length wraps
        ([(2, 0, 8)], 8, False),  # a region id past every registered one
        ([(0, 0, 16)], 24, False),  # adds up to less than the frame says
    ],
)
def test_native_run_check(runs: list[tuple[int, int, int]], length: int, ok: bool) -> None:
    sums = LandingSums()
    regions = [bytearray(BLOCK), bytearray(BLOCK)]
    for i, buf in enumerate(regions):
        sums.add_region(i, memoryview(buf))
    snap = sums.snapshot
    table = b"".join(wire.RUN.pack(*run) for run in runs)
    assert tcp_native.check_runs(table, len(runs), snap.address, snap.count, length) is ok


def test_receiver_verifies_direct_chunks_from_the_landing_sums(make_pair: MakePair) -> None:
    pair = make_pair(channel="tcp")
    assert pair.receiver.memory.landed_checksum is not None  # the receiver took the channel's capability
    held = pair.allocator.allocate(12)
    pair.allocator.free(held[::2])  # D's free list now hands out blocks that are not adjacent
    table = [9, 3, 4, 20, 21, 40, 1]  # 100 tokens in 7 blocks of 16 on P, not adjacent either
    xfer = pair.sender.open("r1", pair.receiver.address, 100, table)
    xfer.send_all()
    xfer.wait(10)
    blocks = pair.receiver.wait("r1", 10).blocks
    assert torch.equal(
        gather(pair.p_layout, pair.p_kv, table, 0, 100), gather(pair.d_layout, pair.d_kv, blocks, 0, 100)
    )
    stats = pair.receiver.stats()
    assert stats["chunks_landed"] == 4 and stats.get("checksum_failures", 0) == 0  # over the tcp channel, verified
    assert pair.d_channel.stats().get("landed_blocks_reread", 0) == 0  # from the landing sums, nothing read back
    pair.allocator.free(blocks + held[1::2])
