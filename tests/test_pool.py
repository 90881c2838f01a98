"""Pre-granted pools (``transfer.pool_tokens``): a one-chunk request written before it is reserved, its Reserve on
the chunk's notice, and the guarantees that still hold: admission, grants on every frame, exactly-once free,
the late-write fence."""

from __future__ import annotations

import time

import msgspec
import pytest
import torch

from pdkv.bench.transfer import TransferRig
from pdkv.channels.base import Channel
from pdkv.channels.mock import MockChannel
from pdkv.channels.tcp import streams
from pdkv.channels.tcp.conn import Conn
from pdkv.channels.tcp.streams import Sealed
from pdkv.config import TransferConfig
from pdkv.errors import ChannelError, ChecksumError, ReservationError, TransferError
from pdkv.layout import KVLayout
from pdkv.transfer import protocol
from pdkv.transfer.peers import ReceiverPeer
from pdkv.transfer.posting import ChunkPoster
from pdkv.transfer.sender import KVSender

from tests.conftest import TCP_AND_NIXL, MakePair, Pair, wait_until
from tests.test_transfer import assert_same_kv, push

POOLED = TransferConfig(chunk_size=32, lease_s=5, drain_timeout_s=2, pool_tokens=32)  # 2 blocks of 16 tokens
# a decode worker whose blocks P cannot write in place (32 tokens, head-major): its pools are a staging slot too
STAGED = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=32, dtype="float32", order="HND")


def pooled_peer(pair: Pair, after: int = 0) -> ReceiverPeer:
    """The sender's record of the pair's receiver once it holds a pool newer than generation ``after``."""

    def ready() -> bool:
        peer = pair.sender.handshake.peers.get(pair.receiver.address)
        return peer is not None and peer.pool is not None and peer.pool.generation > after

    wait_until(ready, 5, "the receiver to grant the sender a pool")
    return pair.sender.handshake.peers[pair.receiver.address]


def warm(pair: Pair) -> ReceiverPeer:
    """Handshake with one ordinary request; the pool is granted right after the Hello."""
    pair.allocator.free(push(pair, "warm", 64, [0, 1, 2, 3]))  # two chunks: always reserved the usual way
    wait_until(lambda: pair.sender.stats()["open_transfers"] == 0, 5, "the sender to settle 'warm'")
    return pooled_peer(pair)


def test_a_one_chunk_request_is_written_into_the_pool_without_a_reserve(make_pair: MakePair) -> None:
    pair = make_pair(config=POOLED)
    peer = warm(pair)
    pool = peer.pool
    assert pool is not None and len(pool.block_ids) == 2
    assert pair.receiver.stats()["pooled_blocks"] == 2
    reserved = pair.receiver.stats()["reserved"]
    table = [10, 11]
    xfer = pair.sender.open("pooled", pair.receiver.address, 30, table, prompt_key=b"K" * 16)
    assert xfer.mode == "direct" and xfer.remote_blocks == pool.block_ids  # the pool's blocks, no round trip
    assert peer.pool is None  # one request per pool
    xfer.send_all()
    xfer.wait(10)
    nxt = peer.pool  # the next pool came in the request's Landed: held before wait() returned
    assert nxt is not None and nxt.generation > pool.generation
    got = pair.receiver.wait("pooled", 10, prompt_key=b"K" * 16)
    assert got.blocks == pool.block_ids and got.num_tokens == 30
    assert_same_kv(pair, table, got.blocks, 30)
    assert pair.sender.stats()["reserved_from_pool"] == 1
    d = pair.receiver.stats()
    assert d["pooled_requests"] == 1 and d["reserved"] == reserved + 1 and d["bytes_landed"] > 0
    assert d.get("pooled_refused", 0) == 0
    assert not set(nxt.block_ids) & set(got.blocks)  # granted while the request held its own
    pair.allocator.free(got.blocks)
    # more than one chunk, or more tokens than the pool holds: reserved the usual way
    pair.allocator.free(push(pair, "two-chunks", 48, [20, 21, 22]))
    assert pair.sender.stats()["reserved_from_pool"] == 1


@pytest.mark.parametrize("lies", [False, True], ids=["true", "lying"])
def test_a_request_over_tcp_is_hashed_as_it_is_sent(
    make_pair: MakePair, lies: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its writes go sealed (issue 46, step 2), a pooled one-chunk request's on the caller's thread and a reserved
    two-chunk one's on the streams: no checksum pass ahead of the send, the channel hashes the bytes as it sends
    them and the notice carries that checksum, which D checks against what landed: true, the request lands
    verified; made to lie, D refuses the chunk for its checksum."""
    sealed: list[int] = []
    passes: list[list[int]] = []
    real_send, real_digests, real_finish = Sealed.send, ChunkPoster._direct_digests, streams.finish

    def send(self: Sealed, conn: Conn) -> None:
        sealed.append(self.frames.shares[self.share][2])
        real_send(self, conn)

    monkeypatch.setattr(Sealed, "send", send)
    monkeypatch.setattr(
        ChunkPoster, "_direct_digests", lambda self, ids: (passes.append(list(ids)), real_digests(self, ids))[1]
    )
    pair = make_pair(config=POOLED, channel="tcp")
    warm(pair)
    assert sum(sealed) == pair.p_layout.chunk_bytes(64) and not any(passes)  # two chunks, each hashed as sent
    sealed.clear()
    if lies:
        monkeypatch.setattr(streams, "finish", lambda *a: real_finish(*a) ^ 1)
    xfer = pair.sender.open("sealed", pair.receiver.address, 30, [10, 11], prompt_key=b"S" * 16)
    xfer.send_all()
    assert sum(sealed) == pair.p_layout.chunk_bytes(32) and not any(passes)  # both blocks of every tensor
    if lies:
        with pytest.raises(ChecksumError, match="failed its checksum"):
            xfer.wait(10)
        assert pair.receiver.stats()["checksum_failures"] == 1
        return
    xfer.wait(10)
    got = pair.receiver.wait("sealed", 10, prompt_key=b"S" * 16)
    assert_same_kv(pair, [10, 11], got.blocks, 30)
    pair.allocator.free(got.blocks)
    d = pair.receiver.stats()
    assert d["pooled_requests"] == 1 and d["tokens_landed"] >= 30 and d.get("checksum_failures", 0) == 0


def test_a_refused_pooled_request_lands_nothing_and_its_bytes_are_discarded(make_pair: MakePair) -> None:
    """A pooled Reserve the rules refuse (here: a transfer id used before) opens no reservation: its bytes,
    written into the pool, count for nothing, no other block is touched, and the pool is granted again."""
    pair = make_pair(config=POOLED)
    peer = warm(pair)
    pool = peer.pool
    assert pool is not None
    outside = [i for i in range(pair.allocator.num_blocks) if i not in pool.block_ids]
    before = [t.clone() for t in pair.d_kv]
    landed = pair.receiver.stats()["chunks_landed"]
    xfer = pair.sender.open("warm", pair.receiver.address, 16, [30])  # "warm" was used on this receiver
    xfer.send_all()
    with pytest.raises(ReservationError, match="already used"):
        xfer.wait(10)
    d = pair.receiver.stats()
    assert d["pooled_refused"] == 1 and d["pooled_bytes_discarded"] == pair.d_layout.chunk_bytes(16)
    assert d["chunks_landed"] == landed and d["reservations"] == 0
    for a, b in zip(pair.d_kv, before, strict=True):
        assert torch.equal(a[outside], b[outside])  # nothing landed outside the blocks granted to the pool
    again = pooled_peer(pair, after=pool.generation).pool
    assert again is not None and again.block_ids == pool.block_ids  # the same blocks, a new generation
    assert pair.allocator.num_free == pair.allocator.num_blocks - 2
    with pytest.raises(TransferError):
        pair.receiver.wait("warm", 1)  # the claimed transfer stays over: the refused one did not reopen it


def test_with_a_secret_the_pooled_reserve_carries_its_proof(make_pair: MakePair) -> None:
    """The Reserve on a pooled chunk's notice is checked as one on the control plane: proven by the peer that
    proved the secret at Hello, else refused and its bytes discarded."""
    pair = make_pair(config=POOLED, secrets=("s3cret", "s3cret"))
    warm(pair)
    pair.allocator.free(push(pair, "proven", 20, [8, 9]))
    assert pair.sender.stats()["reserved_from_pool"] == 1 and pair.receiver.stats().get("auth_failures", 0) == 0
    pair.sender.parts.secret = b"not-the-secret"  # its next proof is made with another secret
    pooled_peer(pair, after=0)
    xfer = pair.sender.open("forged", pair.receiver.address, 16, [30])
    xfer.send_all()
    with pytest.raises(ReservationError, match="proof does not check out"):
        xfer.wait(10)
    d = pair.receiver.stats()
    assert d["auth_failures"] == 1 and d["pooled_refused"] == 1 and d["reservations"] == 0


def test_a_pool_a_refused_request_took_back_stays_the_pools_until_offered_again(
    make_pair: MakePair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refused pooled request hands its pool's blocks back to be offered again: until they are, they count as
    pooled, not as held by nothing (a leak check racing the offer read two blocks as leaked), and a receiver closing
    with the offer still pending frees them."""
    pair = make_pair(config=POOLED, secrets=("s3cret", "s3cret"))
    warm(pair)
    pools = pair.receiver.book.pools
    passes: list[int] = []
    monkeypatch.setattr(pools, "send_refills", lambda: passes.append(1))  # the offer held back
    pair.sender.parts.secret = b"not-the-secret"
    xfer = pair.sender.open("forged", pair.receiver.address, 16, [30])
    xfer.send_all()
    with pytest.raises(ReservationError, match="proof does not check out"):
        xfer.wait(10)
    wait_until(lambda: passes, 5, "the pass that refused it to end")
    assert pair.receiver.stats()["pooled_blocks"] == 2 and pair.held_blocks() == 0
    assert not pools.by_peer
    free = pair.allocator.num_free
    pair.receiver.close()
    assert pair.allocator.num_free == free + 2


def test_a_claim_of_a_pool_that_is_not_the_senders_is_refused(make_pair: MakePair) -> None:
    """A notice naming a pool generation the receiver did not grant this sender (stale, or guessed) reserves
    nothing, and no pool changes hands."""
    pair = make_pair(config=POOLED)
    peer = warm(pair)
    pool = peer.pool
    assert pool is not None
    peer.pool = msgspec.structs.replace(pool, generation=pool.generation + 100)
    xfer = pair.sender.open("stale", pair.receiver.address, 16, [30])
    xfer.send_all()
    with pytest.raises(ReservationError, match="names no pool of yours"):
        xfer.wait(10)
    d = pair.receiver.stats()
    assert d["pooled_refused"] == 1 and d["reservations"] == 0 and d["pooled_blocks"] == 2
    assert pair.receiver.book.pools.by_peer[next(iter(pair.receiver.book.pools.by_peer))].generation == pool.generation


def _pool_writable(channel: Channel, peer: ReceiverPeer, region: int, block_bytes: int, block: int) -> bool:
    try:
        ticket = channel.grants.begin(peer.token, "write", region, block * block_bytes, block_bytes)
    except ChannelError:
        return False
    channel.grants.end(ticket)
    return True


def test_a_dead_senders_pool_is_taken_back_fenced_and_freed(make_pair: MakePair) -> None:
    cfg = TransferConfig(chunk_size=32, lease_s=0.4, heartbeat_s=0.1, drain_timeout_s=0.2, pool_tokens=32)
    pair = make_pair(config=cfg)
    peer = warm(pair)
    assert peer.pool is not None
    block, region, size = peer.pool.block_ids[0], pair.receiver.memory.kv_regions[0], pair.d_layout.block_bytes
    assert _pool_writable(pair.d_channel, peer, region, size, block)
    pair.sender.loop.stop()  # the sender's process "dies": no heartbeat renews the pool
    wait_until(lambda: pair.receiver.stats().get("pools_lapsed") == 1, 5, "the pool's lease to lapse")
    assert not _pool_writable(pair.d_channel, peer, region, size, block)  # its grant is gone at once
    wait_until(lambda: pair.receiver.stats()["pooled_blocks"] == 0, 5, "the pool to wait out late writes and be freed")
    assert pair.allocator.num_free == pair.allocator.num_blocks
    assert pair.receiver.stats()["fences"] >= 1  # it never said it stopped writing: cut off before the free


def test_a_stalled_sender_drops_its_lapsed_pool_and_handshakes_again(make_pair: MakePair) -> None:
    """A sender frozen past its pool's lease never writes into it after it resumes (the receiver took it back
    and fenced the sender): it forgets the pool, reserves the usual way and handshakes again."""
    cfg = TransferConfig(chunk_size=32, lease_s=0.4, heartbeat_s=0.1, drain_timeout_s=0.2, pool_tokens=32)
    pair = make_pair(config=cfg)
    warm(pair)
    with pair.sender.cond:  # frozen: its I/O loop blocks at this lock, no heartbeat leaves it
        wait_until(lambda: pair.receiver.stats()["pooled_blocks"] == 0, 5, "the receiver to take the pool back")
        time.sleep(cfg.heartbeat_s)
    blocks = push(pair, "after-stall", 16, [40])
    assert pair.sender.stats().get("reserved_from_pool", 0) == 0
    assert_same_kv(pair, [40], blocks, 16)
    pair.allocator.free(blocks)
    assert pair.receiver.stats()["fences"] >= 1


def test_a_resumed_senders_word_frees_its_lapsed_pool_before_the_late_write_hold(make_pair: MakePair) -> None:
    """A pool whose lease lapsed waits out late writes (drain_timeout_s; on nixl unfenced_quarantine_s, 300 s)
    unless its sender says it writes into it no more: a sender that resumes from a stall drops the pool and
    returns it, and the receiver frees it then, fencing no one (as a quarantined reservation on its Cancel)."""
    cfg = TransferConfig(chunk_size=32, lease_s=0.4, heartbeat_s=0.1, drain_timeout_s=30, pool_tokens=32)
    pair = make_pair(config=cfg)
    warm(pair)
    with pair.sender.cond:  # frozen: no heartbeat renews the pool
        wait_until(lambda: pair.receiver.stats().get("pools_lapsed") == 1, 5, "the pool's lease to lapse")
    assert pair.receiver.stats()["pooled_blocks"] == 2  # taken back, its blocks held for the late-write hold
    wait_until(lambda: pair.receiver.stats()["pooled_blocks"] == 0, 5, "the resumed sender to return the pool")
    assert pair.held_blocks() == 0 and pair.receiver.stats().get("fences", 0) == 0


def test_pools_are_one_chunk_within_their_share_of_the_receivers_blocks(make_pair: MakePair) -> None:
    """By default a pool is one chunk, and all pools together hold at most pool_blocks_share (a quarter) of the
    receiver's blocks: a sender past that share reserves, and a receiver whose share cannot hold one pool grants
    none, so Reserves keep their room."""
    assert TransferConfig().pool_tokens == TransferConfig().chunk_size
    cfg = TransferConfig(chunk_size=32, lease_s=5, drain_timeout_s=2)  # pools of 2 blocks, a share of 8 // 4
    pair = make_pair(d_blocks=8, config=cfg)
    warm(pair)
    assert pair.receiver.stats()["pooled_blocks"] == 2
    second = KVSender(MockChannel(pair.p_channel.agent_name + "-2"), pair.p_layout, pair.p_kv, "model-a", cfg)
    try:  # a second sender, past the share: no pool, it reserves
        xfer = second.open("second", pair.receiver.address, 16, [0])
        xfer.send_all()
        xfer.wait(10)
        pair.allocator.free(pair.receiver.wait("second", 10).blocks)
        assert second.stats().get("reserved_from_pool", 0) == 0
    finally:
        second.close()
        second.channel.close()
    assert pair.receiver.stats()["pools_unavailable"] == 1 and pair.receiver.stats()["pooled_blocks"] == 2
    small = make_pair(d_blocks=4, config=cfg)  # a share of 1 block: no pool of 2
    small.allocator.free(push(small, "fits", 48, [0, 1, 2]))  # three of its four blocks: all a peer may hold
    assert small.receiver.stats()["pooled_blocks"] == 0


def test_the_leak_check_counts_pooled_blocks_as_the_pools_and_still_catches_a_leak(make_pair: MakePair) -> None:
    pair = make_pair(config=POOLED)
    peer = warm(pair)
    assert peer.pool is not None and pair.allocator.num_free == pair.allocator.num_blocks - 2
    assert pair.held_blocks() == 0  # two blocks out of the allocator, both the pool's
    leak = pair.allocator.allocate(1)  # a block no reservation or pool holds
    assert pair.held_blocks() == 1
    pair.allocator.free(leak)
    pair.allocator.free(peer.pool.block_ids[:1])  # a pool's block freed behind its back: counted twice
    assert pair.held_blocks() == -1
    assert pair.allocator.allocate(1) == peer.pool.block_ids[:1]  # the pool's again, for the teardown's free


def test_a_closing_sender_returns_its_pool_at_once(make_pair: MakePair) -> None:
    pair = make_pair(config=TransferConfig(chunk_size=32, lease_s=60, pool_tokens=32))
    warm(pair)
    assert pair.receiver.stats()["pooled_blocks"] == 2
    pair.sender.close()
    wait_until(lambda: pair.receiver.stats()["pooled_blocks"] == 0, 5, "the returned pool to be freed")
    assert pair.allocator.num_free == pair.allocator.num_blocks
    assert pair.receiver.stats().get("fences", 0) == 0  # returned, not lapsed: nothing to fence


def test_over_tcp_a_landed_reservations_grant_is_taken_back_before_anyone_claims_it(make_pair: MakePair) -> None:
    """Over tcp the receiver takes back the grant of a reservation that landed whole once its verdict is on the wire
    (``ChunkArrivals.after_answers``), not when the decode request claims it: its sender can no longer write there,
    the claim finds nothing left to revoke, and the KV it hands over is the KV sent."""
    pair = make_pair(config=POOLED, channel="tcp")
    peer = warm(pair)
    pool = peer.pool
    assert pool is not None
    region, size = pair.receiver.memory.kv_regions[0], pair.d_layout.block_bytes
    assert all(_pool_writable(pair.d_channel, peer, region, size, b) for b in pool.block_ids)
    revoked = pair.receiver.stats().get("revoked_before_claim", 0)
    table = [10, 11]
    xfer = pair.sender.open("pooled", pair.receiver.address, 30, table)
    xfer.send_all()
    xfer.wait(10)
    # the count appears with the first revoke, which runs once the verdict is out: it may come after our wait returns
    wait_until(
        lambda: pair.receiver.stats().get("revoked_before_claim", 0) == revoked + 1, 5, "the landed grant's revoke"
    )
    assert not any(_pool_writable(pair.d_channel, peer, region, size, b) for b in pool.block_ids)
    got = pair.receiver.wait("pooled", 10)
    assert got.blocks == pool.block_ids
    assert_same_kv(pair, table, got.blocks, 30)
    pair.allocator.free(got.blocks)


@pytest.mark.parametrize("channel", ["mock", "tcp"])
def test_a_staged_one_chunk_request_is_written_into_its_pools_slot_without_a_reserve(
    make_pair: MakePair, channel: str
) -> None:
    """Where P's chunks cannot land in place (D's blocks of another size and order), the pool is D's blocks and
    one staging slot, and the slot is what is granted: a one-chunk request is gathered into it at once, its
    Reserve on the notice, and D scatters it into the pool's blocks; the next pool comes with its verdict."""
    pair = make_pair(config=POOLED, d_layout=STAGED, channel=channel)
    peer = warm(pair)
    pool = peer.pool
    assert pool is not None and pool.staging_slot is not None and len(pool.block_ids) == 1  # one 32-token block
    slots = pair.receiver.config.staging_slots
    d = pair.receiver.stats()
    assert d["pooled_slots"] == 1 and d["free_staging_slots"] == slots - 1 and d["pooled_blocks"] == 1
    reserved, tokens = d["reserved"], d["tokens_landed"]
    table = [10, 11]
    xfer = pair.sender.open("staged", pair.receiver.address, 30, table, prompt_key=b"K" * 16)
    assert xfer.mode == "staging" and xfer.remote_blocks == pool.block_ids  # the pool's, no round trip
    assert peer.pool is None
    xfer.send_all()
    xfer.wait(10)
    nxt = peer.pool
    assert nxt is not None and nxt.generation > pool.generation and nxt.staging_slot is not None
    got = pair.receiver.wait("staged", 10, prompt_key=b"K" * 16)
    assert got.blocks == pool.block_ids and got.num_tokens == 30
    assert_same_kv(pair, table, got.blocks, 30)
    pair.allocator.free(got.blocks)
    assert pair.sender.stats()["reserved_from_pool"] == 1
    d = pair.receiver.stats()
    assert d["pooled_requests"] == 1 and d["reserved"] == reserved + 1 and d.get("pooled_refused", 0) == 0
    assert d["tokens_landed"] == tokens + 30  # the KV came over the channel, into the slot
    assert d["pooled_slots"] == 1 and d["free_staging_slots"] == slots - 1  # the request's slot is free again


def test_a_refused_staged_pooled_request_gives_its_slot_back_to_the_pool(make_pair: MakePair) -> None:
    """Refused, a staged pooled request's bytes in the slot count for nothing, no block is touched, and the same
    slot and blocks are granted again: the slot stays the pools', not free and not leaked."""
    pair = make_pair(config=POOLED, d_layout=STAGED)
    pool = warm(pair).pool
    assert pool is not None and pool.staging_slot is not None
    before = [t.clone() for t in pair.d_kv]
    xfer = pair.sender.open("warm", pair.receiver.address, 16, [30])  # "warm" was used on this receiver
    xfer.send_all()
    with pytest.raises(ReservationError, match="already used"):
        xfer.wait(10)
    d = pair.receiver.stats()
    assert d["pooled_refused"] == 1 and d["reservations"] == 0
    for a, b in zip(pair.d_kv, before, strict=True):
        assert torch.equal(a, b)  # a staged chunk lands in its slot: scattered only once admitted and verified
    again = pooled_peer(pair, after=pool.generation).pool
    assert again is not None and (again.block_ids, again.staging_slot) == (pool.block_ids, pool.staging_slot)
    assert pair.receiver.stats()["pooled_slots"] == 1


def test_staged_pools_hold_at_most_their_share_of_the_staging_slots(make_pair: MakePair) -> None:
    """Each staged pool holds a slot, and all of them at most pool_blocks_share of the slots (a Reserve needs
    one): a receiver of three slots (a share of none) grants no staged pool, and its senders reserve."""
    cfg = TransferConfig(chunk_size=32, lease_s=5, drain_timeout_s=2, pool_tokens=32, staging_slots=3)
    pair = make_pair(config=cfg, d_layout=STAGED)
    pair.allocator.free(push(pair, "warm", 64, [0, 1, 2, 3]))
    wait_until(lambda: pair.receiver.stats().get("pools_unavailable", 0) == 1, 5, "the pool's offer")
    blocks = push(pair, "reserved", 16, [8])
    assert pair.sender.stats().get("reserved_from_pool", 0) == 0
    assert_same_kv(pair, [8], blocks, 16)
    pair.allocator.free(blocks)
    d = pair.receiver.stats()
    assert d["pooled_slots"] == 0 and d["pooled_blocks"] == 0 and d["free_staging_slots"] == 3


def test_a_dead_senders_staged_pool_is_taken_back_and_its_slot_freed(make_pair: MakePair) -> None:
    """A staged pool is on its sender's lease as any pool: lapsed, its slot's grant goes at once, and after the
    late-write hold its sender is fenced and the slot and blocks are free again."""
    cfg = TransferConfig(chunk_size=32, lease_s=0.4, heartbeat_s=0.1, drain_timeout_s=0.2, pool_tokens=32)
    pair = make_pair(config=cfg, d_layout=STAGED)
    peer = warm(pair)
    assert peer.pool is not None and peer.pool.staging_slot is not None
    region, offset = pair.receiver.memory.staging_region, peer.pool.staging_slot
    size = pair.receiver.memory.slot_bytes
    assert _pool_writable(pair.d_channel, peer, region, size, offset // size)
    pair.sender.loop.stop()
    wait_until(lambda: pair.receiver.stats().get("pools_lapsed") == 1, 5, "the pool's lease to lapse")
    assert not _pool_writable(pair.d_channel, peer, region, size, offset // size)
    wait_until(lambda: pair.receiver.stats()["pooled_slots"] == 0, 5, "the pool to wait out late writes")
    d = pair.receiver.stats()
    assert d["free_staging_slots"] == cfg.staging_slots and d["pooled_blocks"] == 0 and d["fences"] >= 1


def test_pool_and_notice_messages_round_trip() -> None:
    reserve = protocol.Reserve("t", 16, b"k")
    notice = protocol.ChunkNotice("t", 0, 7, -1, 0, reserve, 3)
    assert protocol.decode_notice(protocol.encode(notice)) == notice
    plain = protocol.decode_notice(protocol.encode(protocol.ChunkNotice("t", 0, 7, -1)))
    assert plain.reserve is None and plain.pool == 0
    for msg in (protocol.Pool(1, [4, 5], 15.0), protocol.Pool(2, [6], 15.0, staging_slot=4096), protocol.ReturnPool(1)):
        assert protocol.decode(protocol.encode(msg)) == msg
    with pytest.raises(protocol.ProtocolError):
        protocol.decode(protocol.encode(protocol.Pool(1, [], 15.0)))  # a pool of no blocks is malformed
    with pytest.raises(protocol.ProtocolError):
        protocol.decode(protocol.encode(protocol.Pool(1, [4], 15.0, staging_slot=-1)))  # nor a slot before the region


@pytest.mark.parametrize("staged", [False, True], ids=["in-place", "staged"])
@pytest.mark.parametrize("channel", TCP_AND_NIXL)
def test_pooled_requests_over_real_channels_land_bit_exact(channel: str, staged: bool) -> None:
    """Receiver in another process, real sockets or NIXL agents: one-chunk requests go through the pool (its
    blocks, or staged into a receiver of another block size and order: its slot), each bit for bit
    (``TransferRig.push`` checks), and the receiver holds only the pool afterwards."""
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, block_size=16, dtype="bfloat16")
    theirs = msgspec.structs.replace(layout, block_size=32, order="HND") if staged else layout
    cfg = TransferConfig(chunk_size=64, lease_s=10, drain_timeout_s=2, max_peer_blocks_share=1.0, pool_tokens=64)
    with TransferRig(channel, theirs, 64, 32, cfg, sender_layout=layout) as rig:
        rig.push([("first", 100)])  # handshake: the pool comes after the Hello
        for i in range(4):
            wait_until(
                lambda: any(p.pool is not None for p in rig.sender.handshake.peers.values()), 5, "a pool at the sender"
            )
            rig.push([(f"pooled-{i}", 40 + i)])
        sent = rig.sender.stats()
        wait_until(lambda: rig.receiver_stats()["reservations"] == 0, 10, "the receiver to free every reservation")
        got = rig.receiver_stats()
    assert sent["reserved_from_pool"] == got["pooled_requests"] == 4 and got.get("pooled_refused", 0) == 0
    assert rig.modes == {"staging" if staged else "direct"}
    pool = theirs.blocks_for(64)
    assert got["claimed"] == 5 and got["free_blocks"] + got["pooled_blocks"] == 32 and got["pooled_blocks"] == pool
    assert got["pooled_slots"] == staged and got["free_staging_slots"] == cfg.staging_slots - staged
