"""Sender -> receiver over the mock channel: the data path's guarantees."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import torch
import zmq

from pdkv.auth import bound_proof, message_tag, new_nonce, session_key, verify_bound
from pdkv.blocks import BlockAllocator
from pdkv.channels.mock import MockChannel
from pdkv.checksum import read_back_shared
from pdkv.config import TransferConfig
from pdkv.errors import (
    ChecksumError,
    HandshakeError,
    NotAnnouncedError,
    PromptMismatchError,
    ReservationError,
    TransferCancelled,
    TransferError,
    TransferTimeout,
)
from pdkv.integration.vllm.landing import VllmBlocks
from pdkv.layout import KVLayout, gather
from pdkv.transfer import posting, protocol
from pdkv.transfer.receiver import KVReceiver
from pdkv.transfer.sender import KVSender

from tests.conftest import TCP_AND_NIXL, MakePair, Pair, wait_until

pytestmark = pytest.mark.device_emulation  # every pair test also runs with its KV in emulated device memory

F32 = dict(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float32")


def push(pair: Pair, request_id: str, num_tokens: int, table: list[int]) -> list[int]:
    """Send a whole request and return the receiver's blocks (now owned by the test)."""
    xfer = pair.sender.open(request_id, pair.receiver.address, num_tokens, table)
    xfer.send_all()
    xfer.wait(10)
    return pair.receiver.wait(request_id, 10).blocks


def assert_same_kv(pair: Pair, p_table: list[int], d_table: list[int], num_tokens: int) -> None:
    a = gather(pair.p_layout, pair.p_kv, p_table, 0, num_tokens)
    b = gather(pair.d_layout, pair.d_kv, d_table, 0, num_tokens)
    assert torch.equal(a, b)


@pytest.mark.parametrize(
    "d_layout",
    [
        KVLayout(**F32, block_size=16),  # same layout: direct block writes
        KVLayout(**F32, block_size=32, order="HND"),  # the pair: NHD/16 into HND/32
        KVLayout(**F32, block_size=16, kind="cross_layer"),
    ],
    ids=["direct", "nhd16-to-hnd32", "to-cross-layer"],
)
def test_single_request_lands_bit_exact(make_pair: MakePair, d_layout: KVLayout) -> None:
    pair = make_pair(d_layout=d_layout)
    table = list(range(40, 47))  # 100 tokens, 7 blocks of 16
    blocks = push(pair, "r1", 100, table)
    assert len(blocks) == d_layout.blocks_for(100)
    assert_same_kv(pair, table, blocks, 100)
    assert pair.receiver.stats()["chunks_landed"] == 4  # 32-token chunks: 32+32+32+4
    pair.allocator.free(blocks)


@pytest.mark.parametrize(
    ("p_layout", "d_layout", "mode"),
    [
        (KVLayout(**F32, kind="split_kv"), KVLayout(**F32, kind="split_kv"), "direct"),  # K and V planes
        (KVLayout(**F32, kind="split_kv", order="HND"), KVLayout(**F32), "staging"),
        (KVLayout(**F32), KVLayout(**F32, kind="split_kv", block_size=32), "staging"),
        (KVLayout(**F32, order="NHKD"), KVLayout(**F32, order="NHKD"), "direct"),  # vLLM GPU, LBNHC
        # a GPU P into pdkv's own worker (vLLM's CPU cache packs its blocks: refused, tests/test_head_windows.py)
        (KVLayout(**F32, order="NHKD"), KVLayout(**F32, order="HND", block_size=32), "staging"),
        (KVLayout(**F32, order="HNKD"), KVLayout(**F32, order="NHKD"), "staging"),
    ],
    ids=["planes-direct", "planes-to-per-layer", "per-layer-to-planes", "nhkd-direct", "nhkd-to-hnd", "hnkd-to-nhkd"],
)
def test_vllm_gpu_layouts_move_bit_exact(
    make_pair: MakePair, p_layout: KVLayout, d_layout: KVLayout, mode: str
) -> None:
    """The layouts of vLLM's GPU caches (and K/V planes) against each other and against the CPU backend's: the
    same layout writes whole blocks per tensor, different ones convert through staging (and device memory the
    channel cannot reach goes through staging whatever the layouts)."""
    pair = make_pair(p_layout=p_layout, d_layout=d_layout)
    table = [40, 41, 42, 5, 6, 7, 44]  # 100 tokens, 7 blocks of 16: runs of adjacent blocks and single ones
    xfer = pair.sender.open("r1", pair.receiver.address, 100, table)
    assert xfer.mode == (mode if pair.kv_memory == "host" else "staging")  # the mock channel reads host memory only
    xfer.send_all()
    xfer.wait(10)
    blocks = pair.receiver.wait("r1", 10).blocks
    assert_same_kv(pair, table, blocks, 100)
    assert pair.receiver.stats()["chunks_landed"] == 4  # every token came over the channel: 32+32+32+4
    pair.allocator.free(blocks)


@pytest.mark.parametrize("held", [0, 16, 48, 96], ids=["none", "one-block", "chunk-and-a-half", "all-but-last-block"])
@pytest.mark.parametrize(
    ("d_layout", "channel", "mode"),
    [
        (KVLayout(**F32, block_size=16), "mock", "direct"),
        (KVLayout(**F32, block_size=16), "tcp", "direct"),  # verified from what the channel hashed as it landed
        (KVLayout(**F32, block_size=16, order="HND"), "mock", "staging"),
    ],
    ids=["direct-mock", "direct-tcp", "staging-hnd"],
)
def test_a_transfer_past_what_d_holds_moves_only_the_rest(
    make_pair: MakePair, held: int, d_layout: KVLayout, channel: str, mode: str
) -> None:
    """D's Reserved says it holds the prompt's first ``held`` tokens (its prefix cache hit): P pushes only the tokens
    past them, into the blocks past them, and D counts the transfer complete once those landed and verified; D's
    blocks of the hit (and every other block) keep what they held."""
    pair = make_pair(d_layout=d_layout, channel=channel, allocator=VllmBlocks(64))
    for i, t in enumerate(pair.d_kv):
        t.fill_(100.0 + i)  # what D held before: nothing below ``held`` (nor anywhere else) may change
    before = [t.clone() for t in pair.d_kv]
    p_table, d_table = [40, 41, 42, 5, 6, 7, 44], [50, 3, 4, 5, 20, 21, 9]  # 100 tokens, 7 blocks of 16
    assert isinstance(pair.allocator, VllmBlocks)
    pair.allocator.expect("r1", d_table[held // 16 :], held_tokens=held)
    xfer = pair.sender.open("r1", pair.receiver.address, 100, p_table)
    assert xfer.mode == (mode if pair.kv_memory == "host" else "staging")
    assert xfer.spans[0][0] == held and sum(n for _, n in xfer.spans) == 100 - held
    xfer.send_all()
    xfer.wait(10)
    got = pair.receiver.wait("r1", 10)
    assert got.blocks == d_table[held // 16 :] and got.held_tokens == held and got.num_tokens == 100
    stats = pair.receiver.stats()
    assert stats["tokens_landed"] == 100 - held and stats["chunks_landed"] == -(-(100 - held) // 32)
    sent = gather(pair.p_layout, pair.p_kv, p_table, held, 100 - held)
    assert torch.equal(gather(pair.d_layout, pair.d_kv, d_table, held, 100 - held), sent)
    untouched = [b for b in range(64) if b not in d_table[held // 16 :]]
    assert all(torch.equal(t[untouched], b[untouched]) for t, b in zip(pair.d_kv, before, strict=True))
    pair.allocator.free(got.blocks)


def test_a_reserved_that_says_d_holds_all_or_part_of_a_block_is_refused_by_p(make_pair: MakePair) -> None:
    """``held_tokens`` comes from the wire: P builds no write from one past the prompt or inside a block."""
    pair = make_pair()
    check = pair.sender.reserves._check
    for held, why in ((100, "holds 100 of 100"), (8, "whole number of our 16-token blocks")):
        with pytest.raises(ReservationError, match=why):
            check(protocol.Reserved("r1", "direct", list(range(7)), [], 5.0, held), 100, "none")
    with pytest.raises(ReservationError, match="reserved 4 blocks for tokens 32 to 100 \\(5\\)"):
        check(protocol.Reserved("r1", "direct", list(range(4)), [], 5.0, 32), 100, "none")
    check(protocol.Reserved("r1", "staging", [], [0], 5.0, 8), 100, "none")  # staged: P gathers from any token


def test_many_concurrent_requests(make_pair: MakePair) -> None:
    pair = make_pair(
        d_layout=KVLayout(**F32, block_size=8, order="HND"),
        config=TransferConfig(chunk_size=32, staging_slots=6, slots_per_request=2, max_inflight_bytes=8192),
        p_blocks=256,
        d_blocks=256,
    )
    results: dict[str, list[int]] = {}
    errors: list[BaseException] = []
    tables = {f"req{i}": list(range(i * 6, i * 6 + 6)) for i in range(12)}  # 12 x 90 tokens

    def run(rid: str) -> None:
        try:
            results[rid] = push(pair, rid, 90, tables[rid])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    # 12 requests but only 6 staging slots (2 per request): refused ones are retried until room frees up
    threads = [threading.Thread(target=run, args=(rid,)) for rid in tables]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert pair.sender.stats().get("reservations_retried", 0) > 0
    assert sorted(results) == sorted(tables)
    for rid, blocks in results.items():
        assert_same_kv(pair, tables[rid], blocks, 90)
        pair.allocator.free(blocks)
    all_blocks = [b for blocks in results.values() for b in blocks]
    assert len(all_blocks) == len(set(all_blocks))  # no two requests share a block


def test_corrupted_chunk_fails_the_request_and_frees_its_slots(make_pair: MakePair) -> None:
    pair = make_pair(d_layout=KVLayout(**F32, block_size=32, order="HND"))
    xfer = pair.sender.open("bad", pair.receiver.address, 100, list(range(7)))
    pair.p_channel.faults.corrupt_next = 1
    with pytest.raises(TransferError) as err:
        xfer.send_all()
        xfer.wait(10)
    assert "checksum" in str(err.value)
    with pytest.raises(TransferError, match="checksum"):
        pair.receiver.wait("bad", 10)
    wait_until(lambda: pair.held_blocks() == 0, what="blocks of the failed request to come back")
    assert pair.receiver.stats()["checksum_failures"] == 1
    # the pair keeps working for the next request
    blocks = push(pair, "good", 100, list(range(7, 14)))
    assert_same_kv(pair, list(range(7, 14)), blocks, 100)
    pair.allocator.free(blocks)


def test_checksum_error_type_on_direct_path(make_pair: MakePair) -> None:
    pair = make_pair()
    xfer = pair.sender.open("bad", pair.receiver.address, 64, list(range(4)))
    pair.p_channel.faults.corrupt_next = 1
    xfer.send_chunk(0)
    with pytest.raises(TransferError) as err:
        pair.receiver.wait("bad", 10)
    assert "failed its checksum" in str(err.value)
    with pytest.raises(TransferCancelled, match="checksum"):
        xfer.wait(10)
    assert isinstance(ChecksumError("x"), TransferError)


@pytest.mark.parametrize("shared", [True, False], ids=["read-back-shared", "cpu"])
def test_send_all_hashes_the_chunks_left_in_one_call_where_that_saves_read_backs(
    make_pair: MakePair, monkeypatch: pytest.MonkeyPatch, shared: bool
) -> None:
    """On a GPU (``read_back_shared``) send_all hashes every chunk left before posting the first; on CPU each as it
    is posted, overlapping the previous write. Either way the KV lands, verified."""
    pair = make_pair()
    assert not read_back_shared(pair.p_kv)  # CPU tensors: shared=True stands in for a GPU's
    monkeypatch.setattr(posting, "read_back_shared", lambda kv_bytes: shared)
    hashed: list[list[list[int]]] = []  # P's blocks_checksums calls: each call's chunks
    real = pair.sender.source.sums
    monkeypatch.setattr(
        pair.sender.source, "sums", lambda chunks: hashed.append([list(c) for c in chunks]) or real(chunks)
    )
    xfer = pair.sender.open("r", pair.receiver.address, 100, list(range(7)))
    xfer.send_chunk(0)  # alone: hashed alone
    xfer.send_all()
    xfer.wait(10)
    blocks = pair.receiver.wait("r", 10).blocks
    assert_same_kv(pair, list(range(7)), blocks, 100)
    pair.allocator.free(blocks)
    stats = pair.receiver.stats()
    assert (stats["chunks_landed"], stats.get("checksum_failures", 0)) == (4, 0)
    plan = xfer.plan.blocks
    want = [[plan[0]], [plan[1], plan[2], plan[3]]] if shared else [[plan[i]] for i in range(4)]
    assert hashed == (want if xfer.mode == "direct" else [])


def test_one_pass_over_several_transfers_fails_only_the_one_whose_chunk_is_corrupt(
    make_pair: MakePair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D decodes a pass's notices, hashes its direct chunks in one call, then lands them in arrival order: the
    corrupt chunk fails its transfer only (counted, its next chunk a stray), the others land, one Landed each."""
    pair = make_pair(config=TransferConfig(chunk_size=32, lease_s=5, drain_timeout_s=2, pool_tokens=0))
    passes = _one_pass(monkeypatch, pair, 6)
    hashed: list[int] = []  # each blocks_checksums call's chunk count on D
    real = pair.receiver.memory.sums
    monkeypatch.setattr(pair.receiver.memory, "sums", lambda chunks: hashed.append(len(chunks)) or real(chunks))
    replies = []
    reply = pair.receiver.reply
    monkeypatch.setattr(pair.receiver, "reply", lambda identity, msg: (replies.append(msg), reply(identity, msg)))
    tables = {rid: list(range(4 * k, 4 * k + 4)) for k, rid in enumerate("abc")}
    xfers = {rid: pair.sender.open(rid, pair.receiver.address, 64, table) for rid, table in tables.items()}
    assert all(x.num_chunks == 2 for x in xfers.values())
    pair.p_channel.faults.corrupt_next = 1  # the first write the channel runs: b's chunk 0
    for index in (0, 1):
        for rid in "bac":
            xfers[rid].send_chunk(index)
    for rid in "ac":
        blocks = pair.receiver.wait(rid, 10).blocks
        assert_same_kv(pair, tables[rid], blocks, 64)
        pair.allocator.free(blocks)
        xfers[rid].wait(10)
    with pytest.raises(TransferError, match="chunk 0 of transfer 'b' failed its checksum"):
        pair.receiver.wait("b", 10)
    with pytest.raises(TransferCancelled, match="checksum"):
        xfers["b"].wait(10)
    stats = pair.receiver.stats()
    assert passes == [6]
    assert (stats["checksum_failures"], stats["stray_notices"], stats["chunks_landed"]) == (1, 1, 4)
    assert sorted((m.transfer_id, m.chunk_indices) for m in replies if isinstance(m, protocol.Landed)) == [
        ("a", [0, 1]),
        ("c", [0, 1]),
    ]
    assert hashed == ([6] if pair.same_layout_mode == "direct" else [])  # staged chunks: hashed by their scatter


def _one_pass(monkeypatch: pytest.MonkeyPatch, pair: Pair, count: int) -> list[int]:
    """Hold D's notifications back until ``count`` arrived, so that it sees them in one pass; the passes' sizes."""
    drain, held, passes = pair.d_channel.get_notifications, [], []

    def one_pass() -> list:
        held.extend(drain())
        if len(held) < count:
            return []
        passes.append(len(held))
        out = held[:]
        held.clear()
        return out

    monkeypatch.setattr(pair.d_channel, "get_notifications", one_pass)
    return passes


def test_a_pass_whose_shared_hashing_fails_verifies_each_chunk_alone(
    make_pair: MakePair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hashing a pass's chunks together failing (a device error, say) loses no notification: each chunk is then
    hashed and verified on its own, and both transfers land."""
    pair = make_pair(config=TransferConfig(chunk_size=32, lease_s=5, drain_timeout_s=2, pool_tokens=0))
    passes = _one_pass(monkeypatch, pair, 4)
    calls: list[int] = []
    real = pair.receiver.memory.sums

    def failing_together(chunks: list[list[int]]) -> list[int]:
        calls.append(len(chunks))
        if len(chunks) > 1:
            raise RuntimeError("device lost")
        return real(chunks)

    monkeypatch.setattr(pair.receiver.memory, "sums", failing_together)
    tables = {rid: list(range(4 * k, 4 * k + 4)) for k, rid in enumerate("ac")}
    xfers = {rid: pair.sender.open(rid, pair.receiver.address, 64, table) for rid, table in tables.items()}
    for rid in "ac":
        xfers[rid].send_all()
    for rid in "ac":
        blocks = pair.receiver.wait(rid, 10).blocks
        assert_same_kv(pair, tables[rid], blocks, 64)
        pair.allocator.free(blocks)
        xfers[rid].wait(10)
    assert passes == [4] and pair.receiver.stats()["chunks_landed"] == 4
    assert calls == ([4, 1, 1, 1, 1] if pair.same_layout_mode == "direct" else [])


def test_reservation_that_does_not_fit_is_refused_and_nothing_leaks(make_pair: MakePair) -> None:
    # no pool: the free counts the refusals name are this test's subject, and a pool would hold 2 of the 8 blocks
    cfg = TransferConfig(chunk_size=32, reserve_timeout_s=0.3, max_peer_blocks_share=1.0, pool_tokens=0)
    pair = make_pair(d_blocks=8, config=cfg)
    with pytest.raises(ReservationError, match="need 10 KV blocks, only 8"):
        pair.sender.open("big", pair.receiver.address, 160, list(range(10)))
    assert pair.allocator.num_free == 8
    held = pair.sender.open("fits", pair.receiver.address, 96, list(range(6)))  # 6 of 8 blocks
    with pytest.raises(ReservationError, match="only 2 of 8 free"):
        pair.sender.open("second", pair.receiver.address, 48, list(range(3)))
    held.send_all()
    held.wait(10)
    pair.allocator.free(pair.receiver.wait("fits", 10).blocks)
    wait_until(lambda: pair.sender.stats()["open_transfers"] == 0, what="the sender to settle 'fits'")
    with pytest.raises(ReservationError, match="already used"):
        pair.sender.open("fits", pair.receiver.address, 16, [0])


def test_cancel_from_sender_mid_transfer(make_pair: MakePair) -> None:
    pair = make_pair()
    xfer = pair.sender.open("c1", pair.receiver.address, 128, list(range(8)))
    xfer.send_chunk(0)
    xfer.send_chunk(1)
    xfer.cancel("prefill aborted")
    with pytest.raises(TransferCancelled):
        xfer.send_chunk(2)
    with pytest.raises(TransferError, match="prefill aborted"):
        pair.receiver.wait("c1", 10)


def test_cancel_from_receiver_mid_transfer(make_pair: MakePair) -> None:
    pair = make_pair()
    xfer = pair.sender.open("c2", pair.receiver.address, 128, list(range(8)))
    xfer.send_chunk(0)
    pair.receiver.cancel("c2", "client disconnected")
    with pytest.raises(TransferCancelled, match="client disconnected"):
        xfer.wait(10)
    with pytest.raises(TransferError):
        pair.receiver.wait("c2", 1)


def test_stalled_channel_times_out_on_both_sides(make_pair: MakePair) -> None:
    cfg = TransferConfig(chunk_size=32, transfer_timeout_s=0.5, lease_s=5, drain_timeout_s=0.5)
    pair = make_pair(config=cfg)
    xfer = pair.sender.open("slow", pair.receiver.address, 64, list(range(4)))
    pair.p_channel.faults.stall = True
    xfer.send_all()
    with pytest.raises(TransferTimeout):
        pair.receiver.wait("slow", 0.3)
    with pytest.raises(TransferError):
        xfer.wait(5)


def test_receiver_never_claimed_is_reaped(make_pair: MakePair) -> None:
    pair = make_pair(config=TransferConfig(chunk_size=32, claim_timeout_s=0.2))
    xfer = pair.sender.open("orphan", pair.receiver.address, 64, list(range(4)))
    xfer.send_all()
    xfer.wait(10)
    wait_until(lambda: pair.receiver.stats().get("unclaimed", 0) == 1, what="the unclaimed reservation to be reaped")
    with pytest.raises(TransferError, match="never claimed"):
        pair.receiver.wait("orphan", 1)


def test_dead_sender_lease_expires(make_pair: MakePair) -> None:
    pair = make_pair(config=TransferConfig(chunk_size=32, lease_s=0.3, heartbeat_s=0.1, drain_timeout_s=0.2))
    xfer = pair.sender.open("dead", pair.receiver.address, 64, list(range(4)))
    xfer.send_chunk(0)
    pair.sender.loop.stop()  # the sender's process "dies": no heartbeats, no more messages
    with pytest.raises(TransferError, match="lease expired"):
        pair.receiver.wait("dead", 5)
    assert pair.receiver.stats()["leases_expired"] == 1


def test_sender_stalled_past_its_lease_writes_nothing_into_the_reaped_reservation(make_pair: MakePair) -> None:
    """A frozen prefill (SIGSTOP, a stuck VM) that resumes after its lease expired must not write into blocks
    the receiver may have handed to another request: the receiver holds them until the sender says it is done,
    and the sender refuses to post once its heartbeats have lapsed."""
    cfg = TransferConfig(chunk_size=32, lease_s=0.4, heartbeat_s=0.1, drain_timeout_s=30)
    pair = make_pair(config=cfg)
    xfer = pair.sender.open("stalled", pair.receiver.address, 64, list(range(4)))
    xfer.send_chunk(0)
    wait_until(lambda: pair.receiver.stats().get("chunks_landed") == 1, 5, "chunk 0 to land")
    with pair.sender.cond:  # the sender freezes: its I/O loop blocks at this lock, no heartbeat leaves it
        with pytest.raises(TransferError, match="lease expired"):
            pair.receiver.wait("stalled", 5)
        time.sleep(cfg.heartbeat_s * 3)  # several reaper passes after the expiry
        assert pair.receiver.stats()["reserved_blocks"] == 4  # quarantined, not back in the allocator
        with pytest.raises(TransferTimeout, match="not writing into a reservation that may be gone"):
            xfer.send_chunk(1)
    # Resumed: the sender reads the receiver's Cancel, settles and says so; the blocks come back long before
    # drain_timeout_s.
    wait_until(
        lambda: pair.receiver.stats()["reservations"] == 0, 5, "the receiver to free the blocks once the sender settled"
    )
    assert pair.receiver.stats()["chunks_landed"] == 1 and pair.held_blocks() == 0
    assert isinstance(xfer.error, TransferTimeout)


@pytest.mark.parametrize("channel", TCP_AND_NIXL)
def test_a_silent_senders_blocks_wait_for_its_word_where_its_writes_cannot_be_cut_off(
    make_pair: MakePair, channel: str
) -> None:
    """tcp can cut a silent sender off (its connections closed: nothing it queued lands), so its failed reservation's
    blocks are reused after drain_timeout_s. nixl cannot (a one-sided write posted before a link outage lands when the
    link comes back): the blocks wait for the sender's Cancel, sent once every write of its finished."""
    # no pool: the fences and quarantine asserted are the reservation's (a lapsed pool's: test_pool.py)
    cfg = TransferConfig(
        chunk_size=32, lease_s=0.4, heartbeat_s=0.1, drain_timeout_s=0.3, unfenced_quarantine_s=60, pool_tokens=0
    )
    pair = make_pair(config=cfg, channel=channel)
    xfer = pair.sender.open("silent", pair.receiver.address, 64, list(range(4)))
    xfer.send_chunk(0)
    wait_until(lambda: pair.receiver.stats().get("chunks_landed") == 1, 10, "chunk 0 to land")
    with pair.sender.cond:  # the sender goes silent: no heartbeat, no Cancel leaves it
        with pytest.raises(TransferError, match="lease expired"):
            pair.receiver.wait("silent", 5)
        if channel == "tcp":  # cut off and freed without its word
            wait_until(lambda: pair.receiver.stats()["reserved_blocks"] == 0, 10, "drain_timeout_s to free the blocks")
            assert pair.receiver.stats()["fences"] == 1
        else:  # quarantined (60 s): drain_timeout_s alone proves nothing here
            time.sleep(cfg.drain_timeout_s + 5 * cfg.heartbeat_s)  # well past drain_timeout_s
            assert pair.receiver.stats()["reserved_blocks"] == 4
            assert pair.receiver.stats().get("fences", 0) == 0
    if channel == "nixl":
        wait_until(lambda: pair.receiver.stats()["reservations"] == 0, 10, "the sender's Cancel to free the blocks")
    assert pair.held_blocks() == 0


@pytest.mark.parametrize("may_land", [False, True])
def test_a_cancel_saying_writes_may_still_land_keeps_the_blocks_quarantined(
    make_pair: MakePair, may_land: bool
) -> None:
    """A sender that gave up on a write its channel could not call back says so in its Cancel: the receiver then
    holds the reservation's blocks for its whole late-write quarantine instead of freeing them on the Cancel."""
    cfg = TransferConfig(chunk_size=32, drain_timeout_s=3, unfenced_quarantine_s=3)
    pair = make_pair(config=cfg)
    xfer = pair.sender.open("gave-up", pair.receiver.address, 64, list(range(4)))
    xfer.send_chunk(0)
    wait_until(lambda: pair.receiver.stats().get("chunks_landed") == 1, 10, "chunk 0 to land")
    with xfer.cond:
        xfer.writes_may_land = may_land  # as the channel reports a write it abandoned in flight
    xfer.cancel("test")
    wait_until(lambda: pair.receiver.stats().get("transfers_failed") == 1, 10, "the receiver to take the Cancel")
    if may_land:  # held for the whole quarantine (3 s), well past the moment the Cancel arrived
        assert pair.receiver.stats()["reserved_blocks"] == 4
    else:  # a Cancel that vouches for every write frees the blocks at the reaper's next pass
        wait_until(lambda: pair.receiver.stats()["reserved_blocks"] == 0, 5, "the Cancel to free the blocks")
    wait_until(lambda: pair.receiver.stats()["reservations"] == 0, 30, "the quarantine to end")
    assert pair.receiver.stats().get("fences", 0) == int(may_land)  # no word to trust: the sender is fenced first


def test_hello_mismatch_names_the_field(make_pair: MakePair) -> None:
    pair = make_pair(fingerprints=("llama-8b", "qwen-7b"))
    with pytest.raises(HandshakeError, match="model_fingerprint \\(ours 'qwen-7b', peer 'llama-8b'\\)"):
        pair.sender.open("x", pair.receiver.address, 16, [0])
    pair2 = make_pair(d_layout=KVLayout(num_layers=4, num_kv_heads=2, head_dim=8, dtype="float32"))
    with pytest.raises(HandshakeError, match="layout.num_layers"):
        pair2.sender.open("y", pair2.receiver.address, 16, [0])
    # heads may differ at the handshake (tensor parallel of different sizes), never in one transfer: refused per
    # transfer unless it names its window (tests/test_head_windows.py)
    pair3 = make_pair(d_layout=KVLayout(num_layers=3, num_kv_heads=4, head_dim=8, dtype="float32"))
    with pytest.raises(ReservationError, match=r"layout.num_kv_heads \(this decode 4, prefill 2\)"):
        pair3.sender.open("z", pair3.receiver.address, 16, [0])


@pytest.mark.parametrize(
    ("p_layout", "d_layout", "message"),
    [
        (
            KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float8_e4m3fn"),
            KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="bfloat16"),
            "prefill's KV cache is float8_e4m3fn, this decode's is bfloat16: start both with the same KV cache dtype",
        ),
        (
            KVLayout(num_layers=3, num_kv_heads=1, head_dim=8, dtype="bfloat16", mla=True),
            KVLayout(num_layers=3, num_kv_heads=1, head_dim=8, dtype="bfloat16"),
            "prefill's KV cache is MLA (one latent per layer), this decode's is K and V per layer",
        ),
    ],
    ids=["fp8-bf16", "mla-kv"],
)
def test_hello_refuses_another_kv_dtype_or_form_never_converts_it(
    make_pair: MakePair, p_layout: KVLayout, d_layout: KVLayout, message: str
) -> None:
    """Same shape otherwise: only the dtype (or MLA) differs, and the receiver refuses the sender's Hello, so
    admission never reaches the staging path that would convert between layouts."""
    pair = make_pair(p_layout=p_layout, d_layout=d_layout)
    with pytest.raises(HandshakeError) as err:
        pair.sender.open("x", pair.receiver.address, 16, [0])
    assert message in str(err.value) and "layout." not in str(err.value)  # nothing else differs
    assert pair.receiver.stats()["handshake_failures"] == 1 and pair.receiver.stats().get("reservations", 0) == 0


def test_silent_receiver_times_out(make_pair: MakePair) -> None:
    """Something listens at the address but never answers Hello: the handshake timeout, configurable, bounds it."""
    pair = make_pair(config=TransferConfig(chunk_size=32, handshake_timeout_s=0.3))
    with socket.create_server(("127.0.0.1", 0)) as silent:
        with pytest.raises(TransferTimeout, match="no Hello reply"):
            pair.sender.open("z", f"tcp://127.0.0.1:{silent.getsockname()[1]}", 16, [0])


def test_refused_connection_fails_at_once_not_at_the_handshake_timeout(make_pair: MakePair) -> None:
    pair = make_pair(config=TransferConfig(chunk_size=32, handshake_timeout_s=30))
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]  # closed again: nothing listens there now
    started = time.monotonic()
    with pytest.raises(TransferError, match="connection refused"):
        pair.sender.open("z", f"tcp://127.0.0.1:{port}", 16, [0])
    assert time.monotonic() - started < 10, "a refused connection waited for the 30 s handshake timeout"


def test_kv_is_handed_over_only_for_the_prompt_it_was_computed_from(make_pair: MakePair) -> None:
    """The prompt key travels in the Reserve: a decode side asking with another prompt's key gets no KV, and nothing
    leaks."""
    pair = make_pair()
    xfer = pair.sender.open("bound", pair.receiver.address, 40, list(range(3)), prompt_key=b"K" * 16)
    xfer.send_all()
    xfer.wait(10)
    with pytest.raises(PromptMismatchError, match="another prompt"):
        pair.receiver.wait("bound", 5, prompt_key=b"Q" * 16)
    assert pair.held_blocks() == 0 and pair.receiver.stats()["prompt_mismatches"] == 1
    xfer = pair.sender.open("bound-2", pair.receiver.address, 40, list(range(3)), prompt_key=b"K" * 16)
    xfer.send_all()
    xfer.wait(10)
    got = pair.receiver.wait("bound-2", 5, prompt_key=b"K" * 16)
    assert got.prompt_key == b"K" * 16
    assert_same_kv(pair, list(range(3)), got.blocks, 40)
    pair.allocator.free(got.blocks)


def test_unannounced_transfer_fails_fast(make_pair: MakePair) -> None:
    """No sender ever reserved it: the decode side gives up after announce_timeout_s, not transfer_timeout_s."""
    pair = make_pair(config=TransferConfig(chunk_size=32, announce_timeout_s=0.2, transfer_timeout_s=60))
    started = time.monotonic()
    with pytest.raises(NotAnnouncedError, match="announce_timeout_s"):
        pair.receiver.wait("never-reserved", 60)
    assert time.monotonic() - started < 5
    # a Reserve arriving after that is refused: at open, or (written into a pool) when its chunk's notice lands
    with pytest.raises(ReservationError, match="already used"):
        xfer = pair.sender.open("never-reserved", pair.receiver.address, 16, [0])
        xfer.send_all()
        xfer.wait(5)


def test_one_peer_cannot_take_every_block_or_reservation(make_pair: MakePair) -> None:
    pair = make_pair(
        d_blocks=16,
        # no pool: a pooled request meets these caps when its chunk lands, not at open, where this test asks
        config=TransferConfig(
            chunk_size=32, max_peer_blocks_share=0.5, max_reservations_per_peer=3, reserve_timeout_s=0.3, pool_tokens=0
        ),
    )
    held = [pair.sender.open("a", pair.receiver.address, 64, list(range(4)))]  # 4 of its 8 blocks
    with pytest.raises(ReservationError, match="max_peer_blocks_share"):
        pair.sender.open("too-much", pair.receiver.address, 80, list(range(5)))  # 4 + 5 > 8
    held += [pair.sender.open(f"small-{i}", pair.receiver.address, 16, [i]) for i in range(2)]
    with pytest.raises(ReservationError, match="max_reservations_per_peer"):
        pair.sender.open("one-more", pair.receiver.address, 16, [0])
    other = KVSender(
        MockChannel(pair.p_channel.agent_name + "-other"), pair.p_layout, pair.p_kv, "model-a", pair.receiver.config
    )
    try:  # another peer still gets room: the caps are per peer
        xfer = other.open("other", pair.receiver.address, 80, list(range(5)))
        xfer.send_all()
        xfer.wait(10)
        pair.allocator.free(pair.receiver.wait("other", 5).blocks)
    finally:
        other.close()
        other.channel.close()
    for x in held:
        x.send_all()
        x.wait(10)
        pair.allocator.free(pair.receiver.wait(x.transfer_id, 5).blocks)


def test_shared_secret_authenticates_both_sides(make_pair: MakePair) -> None:
    pair = make_pair(secrets=("s3cret", "s3cret"))
    blocks = push(pair, "authed", 40, list(range(3)))
    assert_same_kv(pair, list(range(3)), blocks, 40)
    pair.allocator.free(blocks)
    assert pair.receiver.stats().get("auth_failures", 0) == 0


def test_wrong_secret_is_refused_and_counted(make_pair: MakePair) -> None:
    pair = make_pair(secrets=("guess", "s3cret"))
    with pytest.raises(HandshakeError, match="did not prove the shared secret"):
        pair.sender.open("x", pair.receiver.address, 16, [0])  # the receiver's proof fails the sender's check


def test_sender_without_the_secret_cannot_reserve(make_pair: MakePair) -> None:
    pair = make_pair(secrets=("", "s3cret"))
    with pytest.raises(ReservationError, match="not authenticated"):
        pair.sender.open("x", pair.receiver.address, 16, [0])
    assert pair.receiver.stats()["auth_failures"] >= 1
    assert pair.held_blocks() == 0


@contextlib.contextmanager
def raw_peer(pair: Pair) -> Iterator[tuple[zmq.Socket, protocol.Hello, protocol.Hello]]:
    """A raw DEALER that has said Hello to the pair's receiver, as a hostile peer would: (socket, its Hello, the
    reply)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(pair.receiver.address)
    try:
        hello = msgspec.structs.replace(pair.sender.hello(), nonce=new_nonce(), data_token=b"T" * 16)
        sock.send(protocol.encode(hello))
        assert sock.poll(5000), "no Hello reply"
        reply = protocol.decode(sock.recv())
        assert isinstance(reply, protocol.Hello)
        yield sock, hello, reply
    finally:
        sock.close(0)


def answers_to(sock: zmq.Socket, n: int) -> list[protocol.Message]:
    """Up to ``n`` messages, each within 5 s, past the ``Pool`` a receiver grants a peer once it is proven (the
    raw peer never writes into it: it lapses, or goes with the receiver)."""
    answers: list[protocol.Message] = []
    while len(answers) < n and sock.poll(5000):
        msg = protocol.decode(sock.recv_multipart()[0])  # a session's messages come with their tag frame
        if not isinstance(msg, protocol.Pool):
            answers.append(msg)
    return answers


def test_peer_with_a_forged_proof_is_refused(make_pair: MakePair) -> None:
    """A raw DEALER speaking the protocol, with a made-up proof, gets no reservation."""
    pair = make_pair(secrets=("", "s3cret"))
    with raw_peer(pair) as (sock, hello, reply):
        assert verify_bound(b"s3cret", "receiver", protocol.hello_transcript(hello, reply), reply.auth)
        sock.send(protocol.encode(protocol.Auth(b"\0" * 32)))
        sock.send(protocol.encode(protocol.Reserve("forged", 16)))
        answers = answers_to(sock, 2)
    assert isinstance(answers[0], protocol.Error) and "authentication failed" in answers[0].message
    assert isinstance(answers[1], protocol.Refused) and "not authenticated" in answers[1].reason
    assert pair.receiver.stats()["auth_failures"] >= 2
    assert pair.held_blocks() == 0


def test_reserve_proof_binds_the_prompt_key_to_the_authenticated_peer(make_pair: MakePair) -> None:
    """With a secret, a Reserve's prompt key is covered by a proof bound to the handshake: altered, it is refused
    (even tagged with the session's key: the proof, not the tag, binds the prompt key)."""
    pair = make_pair(secrets=("s3cret", "s3cret"))
    with raw_peer(pair) as (sock, hello, reply):
        session = protocol.hello_transcript(hello, reply)
        sock.send(protocol.encode(protocol.Auth(bound_proof(b"s3cret", "sender", session))))
        key = session_key(b"s3cret", session)

        def send(msg: protocol.Message) -> None:
            data = protocol.encode(msg)
            sock.send_multipart([data, message_tag(key, "sender", data)])

        honest = protocol.Reserve("honest", 16, b"A" * 16)
        honest.proof = bound_proof(b"s3cret", "reserve", session, *protocol.reserve_fields(honest))
        forged = msgspec.structs.replace(
            honest, transfer_id="forged", prompt_key=b"B" * 16
        )  # the proof of another Reserve
        send(forged)
        send(honest)
        answers = answers_to(sock, 2)
        send(protocol.Cancel("honest", "test over"))
    assert isinstance(answers[0], protocol.Refused) and "proof" in answers[0].reason
    assert isinstance(answers[1], protocol.Reserved) and answers[1].transfer_id == "honest"
    assert pair.receiver.stats()["auth_failures"] == 1


# what a relay between the two might change in either Hello: where the KV goes, whose it is, how it is laid out
SWAPS: dict[str, dict[str, Any]] = {
    "channel_metadata": {"channel_metadata": b"elsewhere"},
    "agent": {"agent": "impostor"},
    "data_token": {"data_token": b"X" * 16},
    "nonce": {"nonce": b"N" * 16},
    "kv_regions": {"kv_regions": [7]},
    "codecs": {"codecs": ["none", "fp8"]},
}


@pytest.mark.parametrize("side", ["sender", "receiver"])
@pytest.mark.parametrize("field", list(SWAPS))
def test_the_receivers_proof_vouches_for_both_hellos_whole(make_pair: MakePair, side: str, field: str) -> None:
    """D's proof holds for the exact pair of Hellos it answered: with any field of either swapped it proves nothing,
    so a relay can neither rewrite D's data address for P nor use D as an oracle for a Hello of its own."""
    pair = make_pair(secrets=("", "s3cret"))
    with raw_peer(pair) as (_, hello, reply):
        assert verify_bound(b"s3cret", "receiver", protocol.hello_transcript(hello, reply), reply.auth)
        if side == "sender":
            hello = msgspec.structs.replace(hello, **SWAPS[field])
        else:
            reply = msgspec.structs.replace(reply, **SWAPS[field])
        assert not verify_bound(b"s3cret", "receiver", protocol.hello_transcript(hello, reply), reply.auth)


def test_a_notice_not_tagged_under_the_session_key_lands_nothing(make_pair: MakePair) -> None:
    """With a secret, a chunk's notice (its checksum, transfer id and index) counts only under the session's tag: one
    written with another key, as a relay on the data path would have to, is dropped and counted, and the request
    never completes on it."""
    pair = make_pair(secrets=("s3cret", "s3cret"))
    blocks = push(pair, "tagged", 40, list(range(3)))  # the session works, tags and all
    pair.allocator.free(blocks)
    xfer = pair.sender.open("forged", pair.receiver.address, 40, list(range(3)))
    honest = xfer.peer.session_key
    xfer.peer.session_key = bytes(32)  # what anyone without the secret can tag with
    try:
        xfer.send_all()
        wait_until(lambda: pair.receiver.stats().get("forged_notices", 0) == 2, 10, "D to drop both notices")
    finally:
        xfer.peer.session_key = honest
    xfer.cancel("test over")
    stats = pair.receiver.stats()
    assert stats["chunks_landed"] == 2  # the first request's, none of this one's
    assert stats.get("transfers_ready", 0) == 1 and stats.get("malformed_notices", 0) == 0


def test_a_notice_lands_only_in_a_reservation_of_the_session_that_tagged_it(make_pair: MakePair) -> None:
    """Two live sessions of one sender (two spellings of the receiver's address): a request reserved in one whose
    notices carry the other's tag lands nothing. The tag vouches for its session, and a session only fills its own
    reservations and pools; the other session's would also have its next pool granted under a key it never holds."""
    pair = make_pair(secrets=("s3cret", "s3cret"))
    pair.allocator.free(push(pair, "first", 40, list(range(3))))
    handshake = pair.sender.handshake
    first = handshake.peers[pair.receiver.address]
    second = handshake.connect(pair.receiver.address.replace("127.0.0.1", "localhost"))
    assert second.agent == first.agent and second.session_key != first.session_key
    landed = pair.receiver.stats()["chunks_landed"]
    xfer = pair.sender.open("crossed", pair.receiver.address, 40, list(range(3)))
    assert xfer.peer is first
    xfer.peer.session_key = second.session_key  # a live session's key, of the same agent, not this reservation's
    try:
        with contextlib.suppress(TransferError):
            xfer.send_all()
        stats = lambda: pair.receiver.stats()  # noqa: E731
        wait_until(
            lambda: stats().get("stray_notices", 0) + stats().get("pooled_refused", 0) >= 1, 10, "D to refuse it"
        )
    finally:
        xfer.peer.session_key = first.session_key
    xfer.cancel("test over")
    assert pair.receiver.stats()["chunks_landed"] == landed
    assert pair.receiver.stats().get("transfers_ready", 0) == 1


def test_a_name_goes_with_the_session_that_installed_it(make_pair: MakePair, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two sessions reach one receiver (two spellings of its address): the first installed its name in the channel;
    when it ends the name stays for the second, which goes on moving KV, and when that ends too the name is removed,
    so nothing is left pointing at an address whose session is gone."""
    pair = make_pair()
    handshake = pair.sender.handshake
    removed: list[str] = []
    remove = pair.p_channel.remove_peer
    monkeypatch.setattr(pair.p_channel, "remove_peer", lambda agent: (removed.append(agent), remove(agent)))
    pair.allocator.free(push(pair, "first", 40, list(range(3))))
    first = handshake.peers[pair.receiver.address]
    alias = pair.receiver.address.replace("127.0.0.1", "localhost")
    second = handshake.connect(alias)
    assert second.agent == first.agent and handshake.installed[first.agent] is first

    handshake.drop(first, "test: the first session ends")
    assert handshake.installed[first.agent] is second and removed == []
    xfer = pair.sender.open("second", alias, 40, list(range(3)))
    xfer.send_all()
    xfer.wait(10)
    pair.allocator.free(pair.receiver.wait("second", 10).blocks)

    handshake.drop(second, "test: the second session ends")
    assert first.agent not in handshake.installed and removed == [first.agent]


def test_receiver_restart_on_the_same_address_is_rehandshaked(make_pair: MakePair) -> None:
    """A decode side that restarts (new agent, same control address) is met with a fresh Hello, not an error."""
    pair = make_pair()
    blocks = push(pair, "before", 40, list(range(3)))
    pair.allocator.free(blocks)
    port = int(pair.receiver.address.rsplit(":", 1)[1])
    pair.receiver.close()
    pair.d_channel.close()
    d_channel = MockChannel(pair.d_channel.agent_name + "-restarted")
    allocator = BlockAllocator(64)
    d_kv = pair.d_layout.allocate(64)
    receiver = KVReceiver(d_channel, pair.d_layout, d_kv, allocator, "model-a", pair.receiver.config, port=port)
    try:
        xfer = pair.sender.open("after", receiver.address, 40, list(range(3)))
        xfer.send_all()
        xfer.wait(10)
        got = receiver.wait("after", 10)
        assert torch.equal(
            gather(pair.p_layout, pair.p_kv, list(range(3)), 0, 40), gather(pair.d_layout, d_kv, got.blocks, 0, 40)
        )
        allocator.free(got.blocks)
        assert pair.sender.stats().get("reservations_refused", 0) == 0
    finally:
        pair.sender.close()
        receiver.close()
        d_channel.close()
    assert allocator.num_free == 64


def test_a_peer_of_the_previous_protocol_is_refused_by_name(make_pair: MakePair) -> None:
    """A peer of protocol 5 (no pool in a Landed) is refused at its Hello naming both versions; protocol 3's
    Reserve (it called the transfer ``request_id``) is malformed."""
    pair = make_pair()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(pair.receiver.address)
    try:
        old = msgspec.structs.replace(pair.sender.hello(), protocol_version=5, nonce=new_nonce(), data_token=b"T" * 16)
        sock.send(protocol.encode(old))
        sock.send(
            msgspec.msgpack.encode({"type": "reserve", "request_id": "r", "num_tokens": 16})
        )  # protocol 3's Reserve
        answers = answers_to(sock, 1)
    finally:
        sock.close(0)
    assert isinstance(answers[0], protocol.Error)
    assert f"protocol_version (ours {protocol.PROTOCOL_VERSION}, peer 5" in answers[0].message
    # the old Reserve: dropped and counted, nothing reserved (it is read after the Hello was answered: wait for it)
    wait_until(lambda: pair.receiver.stats().get("malformed_messages") == 1, 5, "the old Reserve to be dropped")
    assert pair.held_blocks() == 0
