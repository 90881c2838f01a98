"""The nixl channel against real NIXL agents: DRAM between two processes (UCX, cma + tcp on lo).

The peer runs in a spawned process driven over a pipe (``Peer``, also used
by test_channel_ucx.py), so these tests cross a real process boundary the
way prefill and decode workers do. CI installs the ``nixl`` extra, so they
run there; elsewhere they skip with the reason.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from pdkv.channels import Channel, TransferOp, XferState, channel_class, create_channel
from pdkv.channels.handle import BlockWrite, Notification
from pdkv.errors import ChannelError, ConfigError, TransferTimeout

from tests.conftest import wait_until

# Skipped, not import-failed, without nixl: test_channel_ucx.py imports the peer harness from here.
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("nixl") is None, reason="the 'nixl' extra is not installed: pip install 'pdkv[nixl]'"
)

REGION = 1 << 20
PIPE_TIMEOUT_S = 60.0  # a spawned process importing torch and NIXL takes seconds on a busy machine


# -- the peer process ----------------------------------------------------------------------------


def _serve(conn: Connection, channel_name: str, name: str, close_at_exit: bool) -> None:
    """A peer: one channel with one registered region, driven by (command, *args) messages."""
    channel = create_channel(channel_name, name)
    buf = torch.zeros(REGION, dtype=torch.uint8)
    channel.register(buf)
    conn.send(channel.metadata())
    notifs: list[Any] = []
    while True:
        cmd, *args = conn.recv()
        if cmd == "add_peer":
            conn.send(channel.add_peer(args[0]))
        elif cmd == "fill":  # offset, bytes
            buf[args[0] : args[0] + len(args[1])] = torch.frombuffer(bytearray(args[1]), dtype=torch.uint8)
            conn.send(None)
        elif cmd == "bytes":  # offset, length
            conn.send(bytes(buf[args[0] : args[0] + args[1]].numpy()))
        elif cmd == "notifs":  # how many to wait for, timeout
            deadline = time.monotonic() + args[1]
            while len(notifs) < args[0] and time.monotonic() < deadline:
                notifs.extend(channel.get_notifications())
                time.sleep(0.001)
            conn.send([(n.peer, n.payload) for n in notifs])
            notifs.clear()
        elif cmd == "write":  # peer, local offset, remote region, remote offset, length, notif
            peer, off, rregion, roff, length, notif = args
            handle = channel.write(peer, [TransferOp(0, off, rregion, roff, length)], notif)
            channel.wait(handle, 10.0)
            conn.send(handle.state.value)
        elif cmd == "exit":
            if close_at_exit:
                channel.close()
            conn.send(None)
            return  # without close_at_exit the channel is left open: the atexit hook must cope


class Peer:
    """The parent's end of a ``_serve`` process running a ``channel_name`` channel."""

    def __init__(self, name: str, close_at_exit: bool = True, channel_name: str = "nixl") -> None:
        ctx = mp.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(theirs, channel_name, name, close_at_exit), name=name, daemon=True)
        self.proc.start()
        self.metadata: bytes = self._recv()

    def _recv(self) -> Any:
        if not self.conn.poll(PIPE_TIMEOUT_S):
            raise TimeoutError(f"peer process {self.proc.name} did not answer within {PIPE_TIMEOUT_S}s")
        return self.conn.recv()

    def call(self, *msg: Any) -> Any:
        self.conn.send(msg)
        return self._recv()

    def exit(self) -> int | None:
        self.call("exit")
        self.proc.join(PIPE_TIMEOUT_S)
        return self.proc.exitcode

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(PIPE_TIMEOUT_S)


def running_peer(name: str, channel_name: str = "nixl") -> Iterator[Peer]:
    """A long-lived peer process for a module's round-trip tests; it must exit cleanly at the end (asserted)."""
    p = Peer(name, channel_name=channel_name)
    try:
        yield p
    finally:
        if p.proc.is_alive():
            code = p.exit()
            assert code == 0, f"peer process exited with {code} after closing its channel"


@pytest.fixture(scope="module")
def peer() -> Iterator[Peer]:
    yield from running_peer("nixl-test-peer")


_made = iter(range(1 << 30))


def channel_factory(channel_name: str) -> Iterator[Callable[..., Channel]]:
    """Yields a maker of ``channel_name`` channels in this process; closes them all afterwards."""
    made: list[Channel] = []

    def make(**options: Any) -> Channel:
        channel = create_channel(channel_name, f"{channel_name}-test-{os.getpid()}-{next(_made)}", options)
        made.append(channel)
        return channel

    yield make
    for channel in made:
        channel.close()


@pytest.fixture
def make_channel() -> Iterator[Callable[..., Channel]]:
    """Nixl channels in this process; all closed at teardown."""
    yield from channel_factory("nixl")


def pattern(n: int, seed: int) -> torch.Tensor:
    """``n`` reproducible random bytes."""
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


# -- two processes -------------------------------------------------------------------------------


def test_write_then_read_round_trip_with_notifications(peer: Peer, make_channel: Callable[..., Channel]) -> None:
    local = make_channel()
    src = pattern(REGION, 1)
    region = local.register(src)
    name = local.add_peer(peer.metadata)
    assert name == "nixl-test-peer"

    handle = local.write(name, [TransferOp(region, 4096, 0, 8192, 64 << 10)], notif=b"chunk-0")
    local.wait(handle, 10.0)
    local.release(handle)
    assert handle.state is XferState.DONE
    assert peer.call("notifs", 1, 10.0) == [(local.agent_name, b"chunk-0")]
    assert peer.call("bytes", 8192, 64 << 10) == bytes(src[4096 : 4096 + (64 << 10)].numpy())

    # READ pulls the peer's bytes into a different local spot; its notification reaches the peer.
    theirs = bytes(pattern(10_000, 2).numpy())
    peer.call("fill", 300_000, theirs)
    handle = local.read(name, [TransferOp(region, 700_000, 0, 300_000, len(theirs))], notif=b"pulled")
    local.wait(handle, 10.0)
    assert bytes(src[700_000 : 700_000 + len(theirs)].numpy()) == theirs
    assert peer.call("notifs", 1, 10.0) == [(local.agent_name, b"pulled")]


def test_peer_writes_into_us_and_we_get_its_notification(peer: Peer, make_channel: Callable[..., Channel]) -> None:
    local = make_channel()
    dst = torch.zeros(REGION, dtype=torch.uint8)
    local.register(dst)
    local.add_peer(peer.metadata)
    peer_name = peer.call("add_peer", local.metadata())
    assert peer_name == local.agent_name
    payload = bytes(pattern(5000, 3).numpy())
    peer.call("fill", 0, payload)
    assert peer.call("write", local.agent_name, 0, 0, 123, len(payload), b"from-peer") == "done"
    deadline = time.monotonic() + 10.0
    got: list[Any] = []
    while not got and time.monotonic() < deadline:
        got = local.get_notifications()
        time.sleep(0.001)
    assert [(n.peer, n.payload) for n in got] == [("nixl-test-peer", b"from-peer")]
    assert bytes(dst[123 : 123 + len(payload)].numpy()) == payload


def test_many_descriptors_in_one_transfer(peer: Peer, make_channel: Callable[..., Channel]) -> None:
    local = make_channel()
    src = pattern(REGION, 4)
    region = local.register(src)
    name = local.add_peer(peer.metadata)
    peer.call("fill", 0, bytes(REGION))
    # 64 scattered 1000-byte pieces, reversed on the far side, plus 16 adjacent 512-byte blocks.
    scattered = [TransferOp(region, i * 4096, 0, (63 - i) * 8192 + 1, 1000) for i in range(64)]
    adjacent = [TransferOp(region, 600_000 + j * 512, 0, 800_000 + j * 512, 512) for j in range(16)]
    handle = local.write(name, scattered + adjacent, notif=b"many")
    assert handle.descriptors == 64 + 1, "adjacent blocks must merge into one descriptor"  # type: ignore[attr-defined]
    local.wait(handle, 10.0)
    assert peer.call("notifs", 1, 10.0) == [(local.agent_name, b"many")]
    landed = peer.call("bytes", 0, REGION)
    for op in scattered + adjacent:
        assert landed[op.remote_offset : op.remote_offset + op.length] == bytes(
            src[op.local_offset : op.local_offset + op.length].numpy()
        )
    assert landed[0] == 0 and landed[8192] == 0, "bytes outside the descriptors must stay untouched"


def test_hung_dead_and_restarted_peer(make_channel: Callable[..., Channel]) -> None:
    doomed = Peer("nixl-test-doomed")
    try:
        local = make_channel()
        region = local.register(pattern(REGION, 5))
        name = local.add_peer(doomed.metadata)
        ops = [TransferOp(region, 0, 0, 0, 4096)]

        os.kill(doomed.proc.pid, signal.SIGSTOP)  # hung: never answers the connection
        handle = local.write(name, ops, notif=b"hung")
        started = time.monotonic()
        with pytest.raises(TransferTimeout):
            local.wait(handle, 1.0)
        assert time.monotonic() - started < 5.0
        local.release(handle)
        assert handle.state is XferState.ERROR

        os.kill(doomed.proc.pid, signal.SIGCONT)
        doomed.kill()  # dead: the process is gone
        started = time.monotonic()
        with pytest.raises(ChannelError, match="disconnected|ERR|failed"):
            handle = local.write(name, ops, notif=b"dead")
            local.wait(handle, 10.0)
        assert time.monotonic() - started < 10.0, "a dead peer must surface as an error, not as the timeout"

        # The worker restarts under the same name: its new metadata replaces the old agent.
        reborn = Peer("nixl-test-doomed")
        try:
            assert local.add_peer(reborn.metadata) == name
            handle = local.write(name, ops, notif=b"again")
            local.wait(handle, 10.0)
            assert reborn.call("notifs", 1, 10.0) == [(local.agent_name, b"again")]
            local.remove_peer(name)
            with pytest.raises(ChannelError, match="unknown peer"):
                local.write(name, ops)
        finally:
            reborn.kill()
    finally:
        doomed.kill()


def test_child_that_leaves_its_channel_open_exits_with_code_0(make_channel: Callable[..., Channel]) -> None:
    local = make_channel()
    dst = torch.zeros(REGION, dtype=torch.uint8)
    local.register(dst)
    child = Peer("nixl-test-leaver", close_at_exit=False)
    try:
        payload = bytes(pattern(2048, 6).numpy())
        child.call("fill", 0, payload)
        child.call("add_peer", local.metadata())
        assert child.call("write", local.agent_name, 0, 0, 0, len(payload), b"bye") == "done"
        assert bytes(dst[: len(payload)].numpy()) == payload
        assert child.exit() == 0
    finally:
        child.kill()


_DROPPED_CHANNEL = """
import atexit, threading

def report() -> None:
    print("watchers at exit:", sorted(t.name for t in threading.enumerate() if t.name.endswith("-watch")), flush=True)

atexit.register(report)  # registered first, so it runs last: after the channels' own exit hook

import torch
from pdkv.channels import create_channel

def open_and_drop() -> None:
    # a watcher that is nearly always inside a NIXL call, as a busy one is: the moment finalization would kill it
    channel = create_channel("nixl", "nixl-test-dropped", {"max_poll_interval_s": 1e-6, "watch_min_s": 1e-7})
    channel.register(torch.zeros(4096, dtype=torch.uint8))

open_and_drop()
"""


def test_a_channel_dropped_without_close_is_still_closed_at_exit() -> None:
    """The channel object is gone while its watcher thread still runs; the exit hook must still close it.

    Before, the hook held channels weakly and never saw this one: its watcher was killed by the interpreter's
    finalization inside a NIXL call, and the process aborted ("terminate called without an active exception")
    whenever the watcher was in one at that moment.
    """
    done = subprocess.run(
        [sys.executable, "-c", _DROPPED_CHANNEL], capture_output=True, text=True, timeout=PIPE_TIMEOUT_S
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "watchers at exit: []" in done.stdout, done.stdout


# -- one process -----------------------------------------------------------------------------------


def test_bad_ranges_and_unknown_peers_are_refused_before_posting(make_channel: Callable[..., Channel]) -> None:
    a, b = make_channel(), make_channel()
    ra = a.register(torch.zeros(4096, dtype=torch.uint8))
    b.register(torch.zeros(1024, dtype=torch.uint8))
    with pytest.raises(ChannelError, match="unknown peer"):
        a.write(b.agent_name, [TransferOp(ra, 0, 0, 0, 10)])
    name = a.add_peer(b.metadata())
    for op, what in [
        (TransferOp(ra, 0, 0, 1000, 100), "fit region 0 of 1024"),  # past the peer's region
        (TransferOp(ra, 4000, 0, 0, 200), "fit region"),  # past ours
        (TransferOp(ra, 0, 7, 0, 10), "not registered"),  # no such remote region
        (TransferOp(ra, 0, 0, 0, 0), "fit region"),  # empty
        (TransferOp(ra, -1, 0, 0, 10), "fit region"),
    ]:
        with pytest.raises(ChannelError, match=what):
            a.write(name, [op])
    with pytest.raises(ChannelError, match="empty transfer"):
        a.read(name, [])


def test_metadata_is_checked(make_channel: Callable[..., Channel]) -> None:
    import msgspec

    a, b = make_channel(), make_channel()
    b.register(torch.zeros(4096, dtype=torch.uint8))
    with pytest.raises(ChannelError, match="malformed"):
        a.add_peer(b"\x93garbage")
    with pytest.raises(ChannelError, match="own name"):
        a.add_peer(a.metadata())
    meta = msgspec.msgpack.decode(b.metadata())
    with pytest.raises(ChannelError, match="version"):
        a.add_peer(msgspec.msgpack.encode({**meta, "version": 99}))
    region = meta["regions"][0]
    forged = {**meta, "regions": {0: [region[0] + 4096, region[1], region[2], region[3]]}}
    with pytest.raises(ChannelError, match="does not match its registrations"):
        a.add_peer(msgspec.msgpack.encode(forged))
    for block, what in [(1000, "whole number"), (-4, "malformed")]:  # a block grid it cannot have
        uneven = {**meta, "regions": {0: [*region[:4], block]}}
        with pytest.raises(ChannelError, match=what):
            a.add_peer(msgspec.msgpack.encode(uneven))
    a_small = make_channel(max_region_blocks=16)
    with pytest.raises(ChannelError, match="at most 16 blocks"):
        a_small.add_peer(msgspec.msgpack.encode({**meta, "regions": {0: [*region[:4], 128]}}))
    gridded = {**meta, "regions": {0: [region[0] + 4096, region[1], region[2], region[3], 1024]}}
    with pytest.raises(ChannelError, match="does not match its registrations"):
        a.add_peer(msgspec.msgpack.encode(gridded))
    with pytest.raises(ChannelError, match="unknown peer"):  # a refused peer leaves nothing behind
        a.write(b.agent_name, [TransferOp(0, 0, 0, 0, 1)])
    assert a.add_peer(b.metadata()) == b.agent_name


def test_options_and_buffers_are_validated(make_channel: Callable[..., Channel]) -> None:
    nixl_channel = channel_class("nixl")
    with pytest.raises(ConfigError, match="progress_delay_us"):
        nixl_channel.parse_options({"progress_delay_us": 0})
    with pytest.raises(ConfigError, match="no_such_option"):
        nixl_channel.parse_options({"no_such_option": 1})
    with pytest.raises(ChannelError, match="not available"):
        make_channel(backends=["NO_SUCH_BACKEND"])
    channel = make_channel()
    with pytest.raises(ChannelError, match="writable"):
        channel.register(b"read-only bytes")
    with pytest.raises(ChannelError, match="empty"):
        channel.register(torch.zeros(0, dtype=torch.uint8))
    assert nixl_channel.parse_options({"backends": ["UCX"], "progress_thread": False}) == nixl_channel.Options(
        progress_thread=False
    )


@pytest.mark.parametrize("progress_thread", [False, True])
def test_in_process_pair_and_close(make_channel: Callable[..., Channel], progress_thread: bool) -> None:
    # without NIXL's progress thread (the default) the callers' polls are the only progress, as documented
    a, b = make_channel(progress_thread=progress_thread), make_channel(progress_thread=progress_thread)
    src, dst = pattern(REGION, 7), torch.zeros(REGION, dtype=torch.uint8)
    ra, rb = a.register(src), b.register(dst)
    name = a.add_peer(b.metadata())
    handle = a.write(name, [TransferOp(ra, 0, rb, 0, REGION)], notif=b"all")
    deadline = time.monotonic() + 10.0
    got: list[Any] = []
    while (a.poll(handle) is XferState.PENDING or not got) and time.monotonic() < deadline:
        got += b.get_notifications()
    assert handle.state is XferState.DONE and [n.payload for n in got] == [b"all"]
    assert torch.equal(src, dst)
    a.deregister(ra)
    with pytest.raises(ChannelError, match="not registered"):
        a.write(name, [TransferOp(ra, 0, rb, 0, 1)])
    a.close()
    a.close()  # idempotent
    with pytest.raises(ChannelError, match="closed"):
        a.write(name, [TransferOp(ra, 0, rb, 0, 1)])
    assert b.get_notifications() == []


BLOCK = 4096


def _count_preps(channel: Channel, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts (by descriptor count) every list ``channel`` prepares from now on."""
    made: list[int] = []
    agent = channel._agent.nixl  # type: ignore[attr-defined]  # the NIXL calls are what is counted
    prep = agent.prep_xfer_dlist

    def counted(name: str, descs: Any, *args: Any, **kwargs: Any) -> Any:
        made.append(len(descs))
        return prep(name, descs, *args, **kwargs)

    monkeypatch.setattr(agent, "prep_xfer_dlist", counted)
    return made


def test_whole_blocks_index_the_lists_prepared_once_and_odd_ranges_still_move(
    make_channel: Callable[..., Channel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regions registered with a block size: scattered whole blocks of two regions land bit-exact, one list per
    side prepared when connecting and none per write (as vLLM's NixlConnector); a write of partial blocks takes
    per-write lists and lands too; ranges outside the peer's regions are refused before posting."""
    a, b = make_channel(), make_channel()
    blocks = REGION // BLOCK
    srcs, dsts = [pattern(REGION, 10 + i) for i in range(2)], [torch.zeros(REGION, dtype=torch.uint8) for _ in range(2)]
    ras = [a.register(t, BLOCK) for t in srcs]
    rbs = [b.register(t, BLOCK) for t in dsts]
    made = _count_preps(a, monkeypatch)
    name = a.add_peer(b.metadata())
    assert made == [1, 1], "add_peer checks each of the peer's regions whole"
    a.connect(name, 10.0)
    assert made[2:] == [2 * blocks, 2 * blocks], "connect prepares one list over every block of each side's regions"
    a.connect(name, 10.0)
    assert len(made) == 4, "and only once"
    ours, theirs = [3, 4, 5, 17, 200, 9], [60, 61, 62, 2, 255, 100]  # runs of three, then scattered single blocks
    for n, notif in enumerate((b"first", b"second")):
        ops = [
            TransferOp(ras[t], i * BLOCK, rbs[t], j * BLOCK, BLOCK)
            for t in range(2)
            for i, j in zip(ours[3 * n :], theirs[3 * n :], strict=False)
        ]
        handle = a.write(name, ops, notif=notif)
        a.wait(handle, 10.0)
        for op in ops:
            got = dsts[rbs.index(op.remote_region)][op.remote_offset : op.remote_offset + op.length]
            assert torch.equal(got, srcs[ras.index(op.local_region)][op.local_offset : op.local_offset + op.length])
    assert len(made) == 4, "writes of whole blocks prepare no list of their own"
    assert int(dsts[0][: 2 * BLOCK].count_nonzero()) == 0, "blocks not written stay untouched"
    odd = [TransferOp(ras[0], 100, rbs[1], 7 * BLOCK + 5, 3000), TransferOp(ras[1], 0, rbs[0], 8 * BLOCK, BLOCK)]
    a.wait(a.write(name, odd, notif=b"odd"), 10.0)
    assert made[4:] == [2, 2], "a write that is not all whole blocks prepares lists of its ranges"
    for op in odd:
        got = dsts[rbs.index(op.remote_region)][op.remote_offset : op.remote_offset + op.length]
        assert torch.equal(got, srcs[ras.index(op.local_region)][op.local_offset : op.local_offset + op.length])
    deadline, got_notifs = time.monotonic() + 10.0, []
    while len(got_notifs) < 3 and time.monotonic() < deadline:
        got_notifs += [n.payload for n in b.get_notifications()]
    assert sorted(got_notifs) == [b"first", b"odd", b"second"]
    for op in (TransferOp(ras[0], 0, rbs[0], REGION, BLOCK), TransferOp(ras[0], REGION - BLOCK, rbs[0], 0, 2 * BLOCK)):
        with pytest.raises(ChannelError, match="fit region"):
            a.write(name, [op])
    with pytest.raises(ChannelError, match="whole number"):
        a.register(torch.zeros(BLOCK + 1, dtype=torch.uint8), BLOCK)


def test_a_block_writes_route_is_worked_out_again_when_a_region_comes_or_goes(
    make_channel: Callable[..., Channel],
) -> None:
    """A block write's route (each region's first block in each side's block list) is kept across writes, and worked
    out again when the lists change under it: a region before ours deregistered here, then one at the peer (its
    metadata added again). A route kept past either would index blocks by the old lists' places: another region's
    bytes, or none."""
    a, b = make_channel(), make_channel()
    blocks = REGION // BLOCK
    srcs = [pattern(REGION, 40 + i) for i in range(2)]
    dsts = [torch.zeros(REGION, dtype=torch.uint8) for _ in range(2)]
    ras, rbs = [a.register(t, BLOCK) for t in srcs], [b.register(t, BLOCK) for t in dsts]
    name = a.add_peer(b.metadata())
    a.connect(name, 10.0)

    def write_and_check(ours: list[int], theirs: list[int], local: int, remote: int) -> None:
        write = BlockWrite(
            (ras[local],), (rbs[remote],), np.array(ours, dtype=np.int64), np.array(theirs, dtype=np.int64), BLOCK
        )
        a.wait(a.write_blocks(name, write), 10.0)
        for i, j in zip(ours, theirs, strict=True):
            got = dsts[remote][j * BLOCK : (j + 1) * BLOCK]
            assert torch.equal(got, srcs[local][i * BLOCK : (i + 1) * BLOCK]), f"block {i} -> {j}"

    write_and_check([1, 2, blocks - 1], [5, 6, 7], local=1, remote=1)
    write_and_check([3, 4], [8, 9], local=1, remote=1)  # the same regions again: the route kept
    a.deregister(ras[0])  # our list is made again without it: region 1's blocks now come first
    write_and_check([10, 11], [12, 13], local=1, remote=1)
    b.deregister(rbs[0])  # the peer's too, once its metadata says so
    name = a.add_peer(b.metadata())
    write_and_check([20, 21, 22], [30, 31, 2], local=1, remote=1)
    assert int(dsts[0].count_nonzero()) == 0, "nothing landed in the region before"


def _asleep_behind_a_guard(
    make_channel: Callable[..., Channel], a_buf: torch.Tensor, b_buf: torch.Tensor
) -> tuple[Channel, Any, int, int, str, int]:
    """Channels ``a`` and ``b`` with a region each, ``b``'s guarded and granted to nobody, ``a`` a peer of ``b``'s, and
    ``b``'s watcher asleep (checked): (a, b, a's region, b's, b's name at a, b's watcher passes so far)."""
    from pdkv.channels.nixl import NixlChannel

    a, b = make_channel(), make_channel()
    assert isinstance(b, NixlChannel)
    ra, rb = a.register(a_buf), b.register(b_buf)
    b.guard(rb)
    name = a.add_peer(b.metadata())
    time.sleep(0.05)  # the watcher's last passes from the registration, before the guard
    asleep = b.watch_polls
    time.sleep(0.2)  # a timer of 1 ms would have polled ~200 times here
    assert b.watch_polls == asleep
    return a, b, ra, rb, name, asleep


def test_watcher_sleeps_until_a_grant_and_then_delivers_the_notification(
    make_channel: Callable[..., Channel],
) -> None:
    """A receiver whose regions are all guarded and granted to nobody can get no write: its watcher sleeps on an
    event, with no timer. A grant wakes it, and the write's notification reaches the inbox's fd by itself."""
    src, dst = pattern(REGION, 3), torch.zeros(REGION, dtype=torch.uint8)
    a, b, ra, rb, name, asleep = _asleep_behind_a_guard(make_channel, src, dst)
    b.grant(b"T" * 16, "write", [(rb, 0, REGION)])
    handle = a.write(name, [TransferOp(ra, 0, rb, 0, REGION)], notif=b"granted", token=b"T" * 16)
    a.wait(handle, 10.0)
    readable, _, _ = select.select([b.notification_fd()], [], [], 10.0)
    assert readable, "the watcher did not deliver the notification"
    assert [n.payload for n in b.inbox.drain()] == [b"granted"] and torch.equal(src, dst)
    assert b.watch_polls > asleep


class _StubNixl:
    """The calls ``Transfers`` makes of a ``nixl_agent``, with the write's state set by the test."""

    def __init__(self) -> None:
        self.state, self.notif = "PROC", b""

    def make_prepped_xfer(self, op: str, local: Any, ours: Any, remote: Any, theirs: Any, notif: bytes) -> Any:
        self.notif = notif
        return SimpleNamespace(release=lambda: None)

    def transfer(self, xfer: Any) -> str:
        return "PROC"

    def check_xfer_state(self, xfer: Any) -> str:
        return self.state


def test_an_answer_seen_before_its_write_is_done_completes_it_outside_the_agents_lock() -> None:
    """Without NIXL's progress thread, over UCX's tcp, the target's answer is often read before the write's own DONE.
    The write then completes in the poll that sees DONE; its done callback releases it through the channel, as
    ``Completions`` does with a verdict, which takes the agent's lock: the poll must not hold it then (it did, and a
    two-host bench hung on it)."""
    from pdkv.channels import answers
    from pdkv.channels.answers import Asks
    from pdkv.channels.nixl.transfers import NixlTransferHandle, Transfers

    nixl = _StubNixl()
    agent = SimpleNamespace(nixl=nixl, lock=threading.Lock(), closed=False)
    peers = SimpleNamespace(answering={"d"}, broken=set())
    transfers = Transfers(agent, peers, Asks(), SimpleNamespace(fetch=lambda: 0))  # type: ignore[arg-type]
    handle = NixlTransferHandle("d", "write", 10, 1)
    with agent.lock:  # as the channel submits
        transfers.submit(handle, lambda: (None, [0], None, [0]), b"notice")
    ask = nixl.notif[1 : 1 + 16]
    assert transfers.asks.answered("d", answers.ANSWER + bytes([answers.ANSWERED]) + ask + b"verdict")
    assert handle.state is XferState.PENDING  # answered, not yet written
    released: list[bool] = []
    handle.add_done_callback(lambda h: released.append(transfers.release(h) is None))
    nixl.state = "DONE"
    poller = threading.Thread(target=transfers.poll, args=(handle,), daemon=True)
    poller.start()
    poller.join(10.0)
    assert not poller.is_alive(), "the poll that completed the write deadlocked on the agent's lock"
    assert handle.state is XferState.DONE and handle.answer == b"verdict" and released == [True]
    assert not transfers.inflight and not transfers.asks


def test_a_read_grant_keeps_the_watcher_polling_and_the_read_lands(make_channel: Callable[..., Channel]) -> None:
    """Without NIXL's progress thread (the default) the watcher's polls are this agent's only progress, and a peer's
    READ of a region needs them over a transport that moves it through the target (UCX's tcp): a region granted for
    reading alone keeps the watcher polling, as a write grant does, and the READ finishes."""
    src, dst = pattern(REGION, 5), torch.zeros(REGION, dtype=torch.uint8)
    a, b, ra, rb, name, asleep = _asleep_behind_a_guard(make_channel, dst, src)
    b.grant(b"R" * 16, "read", [(rb, 0, REGION)])
    # a sleeping watcher never passes again: the wait fails (a pace, not a timing, is what it checks)
    wait_until(lambda: b.watch_polls - asleep >= 5, 10.0, "the watcher to poll a region granted for reading")
    handle = a.read(name, [TransferOp(ra, 0, rb, 0, REGION)], token=b"R" * 16)
    a.wait(handle, 10.0)
    assert torch.equal(src, dst)


@pytest.mark.skipif(not Path("/proc/self/timerslack_ns").exists(), reason="Linux >= 4.6 shows a thread's timer slack")
def test_the_watcher_sleeps_with_tight_timer_slack(make_channel: Callable[..., Channel]) -> None:
    """The watcher's 50 us pauses while a transfer is in flight would run ~130 us at Linux's default 50 us of timer
    slack; its own thread's slack is set to WATCH_TIMER_SLACK_NS, and no other thread's changes."""
    from pdkv.channels.nixl import WATCH_TIMER_SLACK_NS

    channel = make_channel()
    tid = channel._watcher.thread.native_id  # type: ignore[attr-defined]
    path = Path(f"/proc/{tid}/timerslack_ns")  # /proc/TID is every thread's own, though not listed
    wait_for = time.monotonic() + 10.0
    while int(path.read_text()) != WATCH_TIMER_SLACK_NS and time.monotonic() < wait_for:
        time.sleep(0.01)
    assert int(path.read_text()) == WATCH_TIMER_SLACK_NS
    assert int(Path(f"/proc/{threading.get_native_id()}/timerslack_ns").read_text()) != WATCH_TIMER_SLACK_NS


def test_an_idle_grant_is_watched_at_the_slow_pace_and_a_write_still_lands(
    make_channel: Callable[..., Channel],
) -> None:
    """A grant nothing used for ``granted_idle_s`` (a pool a sender holds between requests) is watched every
    ``max_poll_interval_s``, not every ``granted_poll_s``: an idle receiver does not spin. A write into it is still
    delivered."""
    from pdkv.channels.nixl import NixlChannel

    a = make_channel()
    b = make_channel(granted_idle_s=0.05, granted_poll_s=0.0002, max_poll_interval_s=0.02)
    assert isinstance(b, NixlChannel)
    src, dst = pattern(REGION, 4), torch.zeros(REGION, dtype=torch.uint8)
    ra, rb = a.register(src), b.register(dst)
    b.guard(rb)
    name = a.add_peer(b.metadata())
    b.grant(b"P" * 16, "write", [(rb, 0, REGION)])
    time.sleep(0.2)  # past granted_idle_s: the pace has backed off to max_poll_interval_s
    idle = b.watch_polls
    time.sleep(0.5)
    # at most one pass per 20 ms (25 here); 0.2 ms polls would have made ~2,500
    assert b.watch_polls - idle <= 30
    handle = a.write(name, [TransferOp(ra, 0, rb, 0, REGION)], notif=b"pooled", token=b"P" * 16)
    a.wait(handle, 10.0)
    readable, _, _ = select.select([b.notification_fd()], [], [], 10.0)
    assert readable, "the watcher did not deliver the notification"
    assert [n.payload for n in b.inbox.drain()] == [b"pooled"] and torch.equal(src, dst)


def test_a_sealed_region_is_left_out_of_the_metadata_and_a_shown_one_still_takes_writes(
    make_channel: Callable[..., Channel],
) -> None:
    """NIXL cannot refuse a one-sided op at the target, so a sealed region (a prefill worker's KV) is kept out of what
    peers learn: its metadata is NIXL's partial metadata of the other regions, with which a peer writes into a granted
    region as before and names no sealed one, and its NIXL holds no key to the sealed memory."""
    from pdkv.channels.nixl.lib import NIXL_ERRORS

    a, b = make_channel(), make_channel()
    src, shown, sealed = pattern(REGION, 6), torch.zeros(REGION, dtype=torch.uint8), pattern(REGION, 7)
    ra, rs, rb = a.register(src), b.register(sealed), b.register(shown)
    b.guard(rs, sealed=True)
    b.guard(rb)
    name = a.add_peer(b.metadata())
    b.grant(b"P" * 16, "write", [(rb, 0, REGION)])
    a.wait(a.write(name, [TransferOp(ra, 0, rb, 0, REGION)], notif=b"n", token=b"P" * 16), 10.0)
    assert torch.equal(src, shown)
    with pytest.raises(ChannelError, match="not registered"):
        a.wait(a.write(name, [TransferOp(ra, 0, rs, 0, REGION)], notif=b"n", token=b"P" * 16), 10.0)
    with pytest.raises(NIXL_ERRORS):
        a._agent.nixl.prep_xfer_dlist(name, [(sealed.data_ptr(), REGION, 0)], "DRAM").release()  # type: ignore[attr-defined]
    assert torch.equal(sealed, pattern(REGION, 7))


def _tcp_sockets() -> int:
    """How many TCP sockets this process holds open (its fds found in the kernel's tcp and tcp6 tables)."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/self/net/{table}").read_text().splitlines()[1:]:
            inodes.add(line.split()[9])
    held = 0
    for entry in os.scandir("/proc/self/fd"):
        try:
            link = os.readlink(entry.path)
        except FileNotFoundError:
            continue
        held += link.startswith("socket:[") and link[8:-1] in inodes
    return held


def test_a_peer_forgotten_and_added_again_reuses_its_connections(make_channel: Callable[..., Channel]) -> None:
    """The receiver fences the sender after a lease ran out, the sender drops the receiver after it lost the
    control connection, then both hand their metadata over again: the soak's link faults (issue 31). Unloading
    the NIXL agent each time left UCX's TCP connections open on both sides, one more per round."""
    sender, receiver = make_channel(), make_channel()
    src, dst = pattern(REGION, 8), torch.zeros(REGION, dtype=torch.uint8)
    rs, rr = sender.register(src), receiver.register(dst)
    held = []
    for round_ in range(4):
        name = sender.add_peer(receiver.metadata())
        back = receiver.add_peer(sender.metadata())
        handle = sender.write(name, [TransferOp(rs, round_, rr, round_, 4096)], notif=b"round")
        sender.wait(handle, 10.0)
        assert handle.state is XferState.DONE and torch.equal(dst[round_ : round_ + 4096], src[round_ : round_ + 4096])
        held.append(_tcp_sockets())
        receiver.fence(back, b"")
        sender.remove_peer(name)
        with pytest.raises(ChannelError, match="unknown peer"):  # forgotten until it hands its metadata over again
            sender.write(name, [TransferOp(rs, 0, rr, 0, 1)])
    assert held[1:] == held[:1] * 3, f"TCP sockets after each round: {held}"


def test_forgotten_peers_past_parked_peers_are_unloaded(make_channel: Callable[..., Channel]) -> None:
    """A peer that never comes back (a decode worker restarted under a new name) does not stay loaded forever."""
    local = make_channel(parked_peers=1)
    peers = [make_channel() for _ in range(3)]
    names = [local.add_peer(p.metadata()) for p in peers]
    for name in names:
        local.remove_peer(name)
    assert sorted(local._peers.loaded) == [names[-1]]  # the last one forgotten is kept for its add_peer
    assert local.add_peer(peers[0].metadata()) == names[0]  # loaded again
    assert sorted(local._peers.loaded) == sorted([names[0], names[-1]])


def test_progress_thread_delay_is_kept_and_the_binding_restored(make_channel: Callable[..., Channel]) -> None:
    import nixl._bindings as bindings

    from pdkv.channels.nixl import keep_delay_config

    original = bindings.nixlAgentConfig
    config = keep_delay_config(2500)()
    config.pthrDelay = 0  # what nixl_agent.__init__ assigns
    assert config.pthrDelay == 2500
    make_channel(progress_thread=True, progress_delay_us=2500)
    assert bindings.nixlAgentConfig is original, "the swapped config class must not outlive the constructor"


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: tests/gpu/check.py runs the VRAM path on a GPU"
)
def test_vram_round_trip(make_channel: Callable[..., Channel]) -> None:
    a, b = make_channel(), make_channel()
    src = pattern(REGION, 8).cuda()
    dst = torch.zeros(REGION, dtype=torch.uint8, device="cuda")
    ra, rb = a.register(src), b.register(dst)
    name = a.add_peer(b.metadata())
    handle = a.write(name, [TransferOp(ra, 0, rb, 0, REGION)], notif=b"vram")
    a.wait(handle, 10.0)
    torch.cuda.synchronize()
    assert torch.equal(src.cpu(), dst.cpu())


def test_a_write_in_flight_when_its_peer_is_forgotten_is_marked_as_possibly_still_landing(
    make_channel: Callable[..., Channel],
) -> None:
    """A one-sided write cannot be called back: failed because its peer was forgotten while in flight, its handle
    says its bytes may still land, and the transfer layer tells the receiver so (``Cancel.writes_may_land``).

    The write in flight is the channel's own record of one (a write between two agents on this host completes
    inside its post, too fast to catch in flight); what is checked is what forgetting its peer does to it."""
    from pdkv.channels.nixl import NixlChannel, NixlTransferHandle

    a, b = make_channel(), make_channel()
    assert isinstance(a, NixlChannel)
    name = a.add_peer(b.metadata())
    in_flight = NixlTransferHandle(name, "write", 4096, 1)
    with a._agent.lock:
        a._transfers.inflight[in_flight.id] = in_flight
    a.remove_peer(name)
    assert in_flight.state is XferState.ERROR and in_flight.may_still_land
    src = pattern(REGION, 5)
    ra, rb = a.register(src), b.register(torch.zeros(REGION, dtype=torch.uint8))
    name = a.add_peer(b.metadata())
    done = a.write(name, [TransferOp(ra, 0, rb, 0, REGION)])
    a.wait(done, 10.0)
    assert done.state is XferState.DONE and not done.may_still_land  # a finished write is not in doubt


def test_the_raw_baseline_runs_each_way_by_both_programs_and_each_target_gets_every_notification() -> None:
    """``pdkv bench transfer``'s nixl baselines: a direct scenario's requests moved as whole blocks too, one transfer
    and notification per request; every way by the program with NIXL's progress thread and the one without, each
    its own pair of agents and target process (its ``CpuMeter`` reads that one); leaving the baseline raises unless
    each target got every notification its pair asked for."""
    from pdkv.bench.channel import variant_pids
    from pdkv.bench.nixl_raw import WARMUP, RawNixl
    from pdkv.bench.transfer import Scenario, variants_for

    sc = Scenario("direct", 40, 2)
    with RawNixl(sc.block_bytes) as raw:
        assert set(variants_for(raw, Scenario("staging", 40, 2))) == {"raw", "raw, no progress thread"}
        variants = variants_for(raw, sc)
        assert set(variants) == {"raw", "blocks", "raw, no progress thread", "blocks, no progress thread"}
        for kw in variants.values():
            assert raw.gbps(sc.nbytes, 2, **kw) > 0
        for on, pair in raw.pairs.items():
            assert pair.notified == (WARMUP + 2) * (1 + sc.requests)  # one per transfer, one per request
            assert variant_pids(raw, {"progress_thread": on})["receiver"] == pair.proc.pid
        assert raw.pairs[True].proc.pid != raw.pairs[False].proc.pid
        with pytest.raises(ChannelError, match="do not fit"):
            raw.gbps(2 * sc.block_bytes, 1, **variants["blocks"])


def test_an_answering_peer_answers_each_write_with_a_notification_of_its_own(
    make_channel: Callable[..., Channel],
) -> None:
    """``answer_notifications`` on nixl: the target says so in its metadata, the initiator's write asks for an
    answer in its notification, and its handle completes only with that answer (``TransferHandle.answer``); an
    answerer that fails fails its write alone; a read's notification is delivered, not answered."""
    a, b = make_channel(), make_channel()
    failing = {b"boom"}

    def answer(notifs: list[Notification]) -> list[bytes]:
        if any(n.payload in failing for n in notifs):
            raise RuntimeError("no room for it")
        return [f"{n.peer} wrote {n.payload.decode()}".encode() for n in notifs]

    assert b.answer_notifications(answer)
    src, dst = pattern(REGION, 5), torch.zeros(REGION, dtype=torch.uint8)
    ra, rb = a.register(src), b.register(dst)
    name = a.add_peer(b.metadata())
    b.add_peer(a.metadata())  # an answer is a notification of its own: the target must know the initiator's agent
    handle = a.write(name, [TransferOp(ra, 0, rb, 0, REGION)], notif=b"chunk 1")
    a.wait(handle, 10.0)
    assert handle.answer == f"{a.agent_name} wrote chunk 1".encode() and torch.equal(src, dst)
    failed = a.write(name, [TransferOp(ra, 0, rb, 0, BLOCK)], notif=b"boom")
    with pytest.raises(ChannelError, match="could not take its notification: no room for it"):
        a.wait(failed, 10.0)
    read = a.read(name, [TransferOp(ra, 0, rb, 0, BLOCK)], notif=b"read it")
    a.wait(read, 10.0)
    deadline = time.monotonic() + 10.0
    got: list[bytes] = []
    while not got and time.monotonic() < deadline:
        got += [n.payload for n in b.get_notifications()]
    assert got == [b"read it"] and read.answer == b""
    again = a.write(name, [TransferOp(ra, 0, rb, 0, BLOCK)], notif=b"chunk 2")  # the peer goes on
    a.wait(again, 10.0)
    assert again.answer.endswith(b"wrote chunk 2")


def test_a_write_waiting_for_its_answer_fails_when_its_peer_is_forgotten(make_channel: Callable[..., Channel]) -> None:
    a, b = make_channel(), make_channel()
    held = threading.Event()
    b.answer_notifications(lambda notifs: [b"late"] * len(notifs) if held.wait(10.0) else [])
    src, dst = pattern(REGION, 6), torch.zeros(REGION, dtype=torch.uint8)
    ra, rb = a.register(src), b.register(dst)
    name = a.add_peer(b.metadata())
    b.add_peer(a.metadata())
    handle = a.write(name, [TransferOp(ra, 0, rb, 0, BLOCK)], notif=b"n")
    wait_until(lambda: torch.equal(src[:BLOCK], dst[:BLOCK]), 10, "the bytes to land")
    a.remove_peer(name)
    with pytest.raises(ChannelError, match="removed"):  # before it was written, or before it answered
        a.wait(handle, 10.0)
    held.set()
