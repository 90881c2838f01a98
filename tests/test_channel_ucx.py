"""The ucx channel (ucxx tag messages into registered regions) between two processes.

Uses the peer-process harness of test_channel_nixl.py. Skips with the reason
where the ``ucx`` extra (ucxx-cu12) is not installed.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from test_channel_nixl import REGION, Peer, channel_factory, pattern, running_peer  # the shared peer-process harness

from pdkv.channels import Channel, TransferOp, XferState
from pdkv.errors import ChannelError, TransferTimeout

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("ucxx") is None, reason="the 'ucx' extra is not installed: pip install 'pdkv[ucx]'"
)


@pytest.fixture(scope="module")
def peer() -> Iterator[Peer]:
    yield from running_peer("ucx-test-peer", channel_name="ucx")


@pytest.fixture
def make_channel() -> Iterator[Callable[..., Channel]]:
    """Ucx channels in this process; all closed at teardown."""
    yield from channel_factory("ucx")


def _connected(peer: Peer, make_channel: Callable[..., Channel], buf: torch.Tensor) -> tuple[Channel, int, str]:
    """A local channel with ``buf`` registered, and the peer and it added to each other (ucx needs both)."""
    local = make_channel()
    region = local.register(buf)
    name = local.add_peer(peer.metadata)
    assert peer.call("add_peer", local.metadata()) == local.agent_name
    return local, region, name


def test_write_then_read_round_trip_with_notifications(peer: Peer, make_channel: Callable[..., Channel]) -> None:
    src = pattern(REGION, 11)
    local, region, name = _connected(peer, make_channel, src)
    handle = local.write(name, [TransferOp(region, 1000, 0, 5000, 300_000)], notif=b"w")
    local.wait(handle, 10.0)
    assert handle.state is XferState.DONE
    assert peer.call("notifs", 1, 10.0) == [(local.agent_name, b"w")]
    assert peer.call("bytes", 5000, 300_000) == bytes(src[1000:301_000].numpy())

    theirs = bytes(pattern(70_000, 12).numpy())
    peer.call("fill", 600_000, theirs)
    handle = local.read(name, [TransferOp(region, 0, 0, 600_000, len(theirs))], notif=b"r")
    local.wait(handle, 10.0)
    assert bytes(src[: len(theirs)].numpy()) == theirs
    assert peer.call("notifs", 1, 10.0) == [(local.agent_name, b"r")]


def test_many_ranges_in_one_transfer(peer: Peer, make_channel: Callable[..., Channel]) -> None:
    src = pattern(REGION, 13)
    local, region, name = _connected(peer, make_channel, src)
    peer.call("fill", 0, bytes(REGION))
    ops = [TransferOp(region, i * 4096, 0, (99 - i) * 8192 + 7, 777) for i in range(100)]
    handle = local.write(name, ops, notif=b"many")
    local.wait(handle, 10.0)
    assert peer.call("notifs", 1, 10.0) == [(local.agent_name, b"many")]
    landed = peer.call("bytes", 0, REGION)
    for op in ops:
        assert landed[op.remote_offset : op.remote_offset + op.length] == bytes(
            src[op.local_offset : op.local_offset + op.length].numpy()
        )
    assert landed[8192] == 0, "bytes outside the ranges must stay untouched"


def test_target_refuses_what_it_does_not_have_and_strangers(make_channel: Callable[..., Channel]) -> None:
    a, b, stranger = make_channel(), make_channel(), make_channel()
    ra = a.register(pattern(4096, 14))
    dst = torch.zeros(4096, dtype=torch.uint8)
    b.register(dst)
    name = a.add_peer(b.metadata())
    b.add_peer(a.metadata())
    b.deregister(0)  # a's copy of b's region table is now stale: only b can catch this
    handle = a.write(name, [TransferOp(ra, 0, 0, 0, 4096)], notif=b"stale")
    with pytest.raises(ChannelError, match="not registered"):
        a.wait(handle, 10.0)
    assert b.get_notifications() == [] and not dst.any(), "a refused transfer must move no byte"

    b.register(dst)  # region 1 now
    rs = stranger.register(pattern(4096, 15))
    stranger.add_peer(b.metadata())  # b never added the stranger
    handle = stranger.write(b.agent_name, [TransferOp(rs, 0, 1, 0, 4096)], notif=b"sneaky")
    with pytest.raises(TransferTimeout):
        stranger.wait(handle, 0.5)
    stranger.release(handle)
    assert handle.state is XferState.ERROR
    assert b.get_notifications() == [] and not dst.any()


def test_dead_peer_fails_within_the_timeout(make_channel: Callable[..., Channel]) -> None:
    doomed = Peer("ucx-test-doomed", channel_name="ucx")
    try:
        local, region, name = _connected(doomed, make_channel, pattern(REGION, 16))
        handle = local.write(name, [TransferOp(region, 0, 0, 0, 4096)])
        local.wait(handle, 10.0)
        doomed.kill()
        started = time.monotonic()
        with pytest.raises(ChannelError, match="failed"):
            # Writes keep coming after the peer died, as a sender's pipeline does: each fails (or is refused at
            # once) and the process lives (UCX's rendezvous abort crashed it: hence UCX_RNDV_THRESH=inf).
            for _ in range(50):
                local.wait(local.write(name, [TransferOp(region, 0, 0, 0, 1 << 20)]), 10.0)
        assert time.monotonic() - started < 10.0, "a dead peer must surface as an error, not as the timeout"
    finally:
        doomed.kill()


def test_child_that_leaves_its_channel_open_exits_with_code_0(make_channel: Callable[..., Channel]) -> None:
    dst = torch.zeros(REGION, dtype=torch.uint8)
    child = Peer("ucx-test-leaver", close_at_exit=False, channel_name="ucx")
    try:
        local, _, _ = _connected(child, make_channel, dst)
        payload = bytes(pattern(4096, 17).numpy())
        child.call("fill", 0, payload)
        assert child.call("write", local.agent_name, 0, 0, 10, len(payload), b"bye") == "done"
        assert bytes(dst[10 : 10 + len(payload)].numpy()) == payload
        assert [(n.peer, n.payload) for n in local.get_notifications()] == [("ucx-test-leaver", b"bye")]
        assert child.exit() == 0
    finally:
        child.kill()


def test_cuda_memory_is_refused_with_a_pointer_to_nixl(make_channel: Callable[..., Channel]) -> None:
    channel = make_channel()
    with pytest.raises(ChannelError, match="writable"):
        channel.register(b"read-only")
    if torch.cuda.is_available():
        with pytest.raises(ChannelError, match="nixl"):
            channel.register(torch.zeros(16, device="cuda"))
