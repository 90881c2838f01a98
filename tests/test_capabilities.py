"""The data plane is capability-based whatever the secret (issue 17).

A decode worker's KV buffer and staging area are *guarded* regions: a peer
writes only into the blocks of a reservation it opened, under the token its
Hello carried, and reads nothing it was not offered; a refused frame lands
nothing and fails only its own transfer. A sender that went silent is fenced
before its blocks are reused, so a write it had queued while frozen can never
land in another request's KV, not even in its own next request's.
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Iterator

import pytest
import torch

from pdkv.blocks import BlockAllocator
from pdkv.channels import Channel, TransferOp, create_channel
from pdkv.config import TransferConfig
from pdkv.errors import ChannelError
from pdkv.layout import KVLayout, gather
from pdkv.memory import emulate_device
from pdkv.transfer.receiver import KVReceiver
from pdkv.transfer.sender import KVSender

from tests.conftest import KV_MEMORIES, wait_until

TIMEOUT = 10.0
ENFORCING = [
    "mock",
    "tcp",
    pytest.param(
        "ucx",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("ucxx") is None, reason="the 'ucx' extra is not installed: pip install 'pdkv[ucx]'"
        ),
    ),
]
NIXL = pytest.param(
    "nixl",
    marks=pytest.mark.skipif(
        importlib.util.find_spec("nixl") is None, reason="the 'nixl' extra is not installed: pip install 'pdkv[nixl]'"
    ),
)
_names = iter(range(10**6))


@pytest.fixture(params=ENFORCING)
def agents(
    request: pytest.FixtureRequest, frame_loop: str
) -> Iterator[tuple[Channel, Channel, bytearray, bytearray, int, int]]:
    """An initiator and a target of one channel kind (a tcp one serving frames with each ``frame_loop``); the
    target's region 0 guarded, region 1 open."""
    n = next(_names)
    src, dst = bytearray(range(256)) * 64, bytearray(16384)
    initiator = create_channel(request.param, f"cap-i{n}")
    target = create_channel(request.param, f"cap-t{n}")
    try:
        local = initiator.register(src)
        guarded = target.register(dst)
        target.register(bytearray(4096))  # open: the raw channel's semantics
        target.guard(guarded)
        initiator.add_peer(target.metadata())
        target.add_peer(initiator.metadata())
        yield initiator, target, src, dst, local, guarded
    finally:
        initiator.close()
        target.close()


def _write(ch: Channel, peer: str, op: TransferOp, token: bytes) -> None:
    ch.wait(ch.write(peer, [op], b"n", token=token), TIMEOUT)


def test_a_peer_writes_only_what_it_was_granted_and_a_refusal_costs_only_that_transfer(agents) -> None:  # noqa: ANN001
    initiator, target, src, dst, local, guarded = agents
    peer = target.agent_name
    target.grant(b"A" * 16, "write", [(guarded, 4096, 4096)])
    _write(initiator, peer, TransferOp(local, 0, guarded, 4096, 4096), b"A" * 16)  # inside its grant
    assert dst[4096:8192] == src[:4096]
    before = bytes(dst)
    for op, token in [
        (TransferOp(local, 0, guarded, 4096 + 64, 4096), b"A" * 16),  # runs past its grant
        (TransferOp(local, 0, guarded, 64, 128), b"A" * 16),  # somewhere else entirely
        (TransferOp(local, 0, guarded, 4096, 4096), b"B" * 16),  # the right range, another peer's token
        (TransferOp(local, 0, guarded, 4096, 4096), b""),  # no token at all
    ]:
        with pytest.raises(ChannelError, match="not reserved for this peer|refused"):
            _write(initiator, peer, op, token)
    assert bytes(dst) == before, "a refused frame landed bytes"
    _write(initiator, peer, TransferOp(local, 4096, guarded, 4096, 4096), b"A" * 16)  # the same link goes on
    assert dst[4096:8192] == src[4096:8192]
    _write(initiator, peer, TransferOp(local, 0, 1, 0, 4096), b"")  # an unguarded region is open to anyone
    target.revoke(b"A" * 16, "write", [(guarded, 4096, 4096)], TIMEOUT)
    with pytest.raises(ChannelError):
        _write(initiator, peer, TransferOp(local, 0, guarded, 4096, 4096), b"A" * 16)
    assert target.get_notifications() and all(n.payload == b"n" for n in target.get_notifications() or [])


def test_a_write_with_one_run_outside_its_grant_lands_none_of_its_runs(agents) -> None:  # noqa: ANN001
    """All or nothing: a write's ops travel together (over tcp, in one DATA frame), and one run the grant does not
    cover refuses them all before a byte of any lands."""
    initiator, target, src, dst, local, guarded = agents
    peer = target.agent_name
    target.grant(b"A" * 16, "write", [(guarded, 0, 8192)])
    granted = [TransferOp(local, 0, guarded, 0, 1024), TransferOp(local, 4096, guarded, 2048, 1024)]
    before = bytes(dst)
    outside = TransferOp(local, 1024, guarded, 8192, 64)
    with pytest.raises(ChannelError, match="not reserved for this peer|refused"):
        initiator.wait(initiator.write(peer, [*granted, outside], b"n", token=b"A" * 16), TIMEOUT)
    assert bytes(dst) == before, "a write refused for one run landed its other runs"
    initiator.wait(initiator.write(peer, granted, b"n", token=b"A" * 16), TIMEOUT)  # the same runs alone land
    assert dst[:1024] == src[:1024] and dst[2048:3072] == src[4096:5120]


def test_a_peer_reads_only_what_it_was_offered(agents) -> None:  # noqa: ANN001
    initiator, target, src, dst, local, guarded = agents
    peer = target.agent_name
    dst[:] = bytes(reversed(range(256))) * 64
    mine = bytearray(16384)
    region = initiator.register(mine)
    with pytest.raises(ChannelError):
        initiator.wait(initiator.read(peer, [TransferOp(region, 0, guarded, 0, 4096)], token=b"A" * 16), TIMEOUT)
    assert not any(mine)
    target.grant(b"A" * 16, "read", [(guarded, 0, 4096)])
    initiator.wait(initiator.read(peer, [TransferOp(region, 0, guarded, 0, 4096)], token=b"A" * 16), TIMEOUT)
    assert mine[:4096] == dst[:4096]


LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype="float32")


def test_the_decode_workers_ports_give_a_stranger_nothing() -> None:
    """Issue 17's probe: metadata copied from a decode worker, no Hello, no reservation: no byte read, none written."""
    d_channel = create_channel("tcp", "decode-cap")
    kv = LAYOUT.allocate(8)
    for t in kv:
        t.copy_(torch.randn(t.shape))
    receiver = KVReceiver(d_channel, LAYOUT, kv, BlockAllocator(8), "m", TransferConfig(chunk_size=32))
    stranger = create_channel("tcp", "stranger")
    try:
        buf = bytearray(8192)
        mine = stranger.register(buf)
        peer = stranger.add_peer(receiver.hello().channel_metadata)
        before = [t.clone() for t in kv]
        theirs = receiver.memory.kv_regions[0]
        with pytest.raises(ChannelError):
            stranger.wait(stranger.read(peer, [TransferOp(mine, 0, theirs, 0, 4096)], token=b"x" * 16), TIMEOUT)
        with pytest.raises(ChannelError):
            stranger.wait(
                stranger.write(
                    peer, [TransferOp(mine, 0, receiver.memory.kv_regions[0], 64, 4096)], b"n", token=b"x" * 16
                ),
                TIMEOUT,
            )
        assert not any(buf) and all(torch.equal(a, b) for a, b in zip(before, kv, strict=True))
        assert d_channel.stats()["refused_frames"] == 2 and receiver.stats().get("stray_notices", 0) == 0
    finally:
        stranger.close()
        receiver.close()
        d_channel.close()


@pytest.mark.parametrize("kind", [*ENFORCING, NIXL])
def test_the_prefill_workers_ports_give_a_peer_nothing(kind: str) -> None:
    """The prefill side only pushes, so its KV buffer and staging area are sealed: a peer it talks to
    (its channel's metadata is in every Hello it sends) reads none of the KV it holds for other requests, and
    overwrites none of the KV it would then checksum and send as its own."""
    kv = LAYOUT.allocate(8)
    for t in kv:
        t.copy_(torch.randn(t.shape))
    p_channel = create_channel(kind, f"prefill-cap-{next(_names)}")
    peer_channel = create_channel(kind, f"peer-cap-{next(_names)}")
    sender: KVSender | None = None
    try:
        sender = KVSender(p_channel, LAYOUT, kv, "m", TransferConfig(chunk_size=32))
        buf = bytearray(range(256)) * 16
        mine = peer_channel.register(buf)
        peer = peer_channel.add_peer(p_channel.metadata())
        p_channel.add_peer(peer_channel.metadata())  # a decode worker it sends to, say, that turned
        before = [t.clone() for t in kv]
        staging = bytes(sender.source.staging.numpy())
        theirs = [*sender.source.kv_regions, sender.source.staging_region]
        assert len(theirs) == LAYOUT.num_tensors + 1
        for region in theirs:
            op = TransferOp(mine, 0, region, 0, 4096)
            for post in (peer_channel.read, peer_channel.write):
                with pytest.raises(ChannelError, match="not reserved for this peer|refused|not registered"):
                    peer_channel.wait(post(peer, [op], b"n", token=b"x" * 16), TIMEOUT)
        assert buf == bytearray(range(256)) * 16, "a read of the prefill side's memory landed bytes"
        assert all(torch.equal(a, b) for a, b in zip(before, kv, strict=True)), "a peer's write landed in P's KV"
        assert bytes(sender.source.staging.numpy()) == staging, "a peer's write landed in P's staging area"
        if kind == "tcp":
            assert p_channel.stats()["refused_frames"] == 2 * len(theirs)
        if kind == "nixl":  # NIXL cannot refuse a one-sided op at the target: the peer got no key to P's memory
            from pdkv.channels.nixl.lib import NIXL_ERRORS
            from pdkv.channels.nixl.meta import decode_metadata

            assert not decode_metadata(p_channel.metadata(), "x", 1 << 20).regions
            nixl = peer_channel._agent.nixl  # type: ignore[attr-defined]
            with pytest.raises(NIXL_ERRORS):
                nixl.prep_xfer_dlist(peer, [(kv[0].data_ptr(), 4096, 0)], "DRAM").release()
    finally:
        peer_channel.close()
        if sender is not None:
            sender.close()
        p_channel.close()


@pytest.mark.parametrize("kv_memory", KV_MEMORIES)
def test_a_sender_frozen_between_its_lease_check_and_its_write_cannot_touch_the_reused_blocks(kv_memory: str) -> None:
    """The late-write fence: P passes its lease check, freezes, and D reaps the reservation, waits drain_timeout_s,
    fences P and gives the blocks to P's next request. P resumes and posts the old write: nothing of it lands.
    With emulated device KV, tcp stages the chunks: the fence guards the staging slots the same way."""
    cfg = TransferConfig(chunk_size=32, lease_s=0.6, heartbeat_s=0.1, drain_timeout_s=0.4, max_peer_blocks_share=1.0)
    p_channel, d_channel = create_channel("tcp", "prefill-fence"), create_channel("tcp", "decode-fence")
    p_kv = LAYOUT.allocate(16)
    for t in p_kv:
        t.copy_(torch.randn(t.shape))
    d_kv = LAYOUT.allocate(4)  # exactly one 64-token request: B must reuse A's blocks
    if kv_memory == "emulated":
        for t in (*p_kv, *d_kv):
            emulate_device(t)
    allocator = BlockAllocator(4)
    receiver = KVReceiver(d_channel, LAYOUT, d_kv, allocator, "m", cfg)
    sender = KVSender(p_channel, LAYOUT, p_kv, "m", cfg)
    frozen, late = threading.Event(), {}

    def freezing(real_write):  # noqa: ANN001, ANN202
        """``real_write`` (``write`` of a staged chunk, ``write_blocks_summed`` or ``write_blocks`` of a direct one),
        frozen once when armed."""

        def freezing_write(peer, what, notif=None, token=b"", **how):  # noqa: ANN001, ANN003, ANN202
            if late.get("armed"):
                late["armed"] = False
                frozen.wait(TIMEOUT)  # SIGSTOP here: lease checked, bytes not yet on the wire
                handle = real_write(peer, what, notif, token=token, **how)
                try:
                    p_channel.wait(handle, TIMEOUT)
                    late["outcome"] = "landed"
                except ChannelError as exc:
                    late["outcome"] = str(exc)
                return handle
            return real_write(peer, what, notif, token=token, **how)

        return freezing_write

    p_channel.write = freezing(p_channel.write)  # type: ignore[method-assign]
    p_channel.write_blocks = freezing(p_channel.write_blocks)  # type: ignore[method-assign]
    p_channel.write_blocks_summed = freezing(p_channel.write_blocks_summed)  # type: ignore[method-assign]
    try:
        a = sender.open("A", receiver.address, 64, [0, 1, 2, 3])
        a.send_chunk(0)
        wait_until(lambda: receiver.stats().get("chunks_landed") == 1, TIMEOUT, "A's chunk 0 to land")
        late["armed"] = True
        beat = sender.heartbeats.beat
        sender.heartbeats.beat = lambda *args: None  # type: ignore[method-assign] # the frozen process sends no heartbeats
        poster = threading.Thread(target=a.send_chunk, args=(1,), daemon=True)
        poster.start()
        wait_until(
            lambda: receiver.stats().get("fences", 0) >= 1 and receiver.stats()["reservations"] == 0,
            TIMEOUT,
            "D to reap, fence and free A",
        )
        sender.heartbeats.beat = beat  # type: ignore[method-assign]
        b = sender.open("B", receiver.address, 64, [8, 9, 10, 11])  # D asks for a new Hello: a new token
        b.send_all()
        b.wait(TIMEOUT)
        frozen.set()  # P resumes: its old write goes out now, into what are B's blocks
        poster.join(TIMEOUT)
        wait_until(lambda: "outcome" in late, TIMEOUT, "the late write to finish")
        got = receiver.wait("B", TIMEOUT)
        assert late["outcome"] != "landed", "the frozen sender's write landed after its blocks were reused"
        assert torch.equal(gather(LAYOUT, d_kv, got.blocks, 0, 64), gather(LAYOUT, p_kv, [8, 9, 10, 11], 0, 64))
        assert d_channel.stats()["refused_frames"] >= 1
        allocator.free(got.blocks)
    finally:
        frozen.set()
        sender.close()
        receiver.close()
        p_channel.close()
        d_channel.close()
    assert allocator.num_free == 4
