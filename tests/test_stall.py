"""A posted write that neither completes nor fails: given up on within its stall bound (pdkv/transfer/stall.py).

Without the bound, such a write (a NIXL transfer to a frozen peer stays in progress for ever) keeps its transfer
from settling: its send credit, the prefill blocks it reads and the decode blocks it writes stay held. Here the
write is failed within ``transfer.stall_timeout_s``, the request fails cleanly on both sides (the decode side
computes the prompt), the receiver holds the blocks as a write that may still land (the late-write quarantine,
never reused before it ends) and the sender counts it (``stalled_writes``, exported as
``pdkv_transfer_events_total{event="stalled_writes"}``). Over the mock channel (its ``faults.stall``) and over real
NIXL agents with the decode process SIGSTOPped mid-transfer.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch

from pdkv.blocks import BlockAllocator
from pdkv.channels import create_channel
from pdkv.config import TransferConfig, convert_config
from pdkv.errors import ConfigError, TransferError, TransferTimeout
from pdkv.layout import KVLayout
from pdkv.testing.http import metric
from pdkv.transfer.receiver import KVReceiver
from pdkv.transfer.sender import KVSender
from pdkv.transfer.stall import RATE_WINDOW, StallBound
from pdkv.worker.metrics import WorkerMetrics

from tests.conftest import MakePair, wait_until
from tests.test_pool import warm

SLACK_S = 2.0  # a bound on "failed within its stall bound", not a performance assertion
STALLED = "neither completed nor failed within"


# -- the bound ---------------------------------------------------------------------------------------------------
def test_the_bound_is_the_floor_until_a_rate_is_seen_then_a_multiple_of_what_the_bytes_need() -> None:
    bound = StallBound(TransferConfig(stall_floor_s=2.0, stall_multiple=4.0))
    assert bound.limit(1 << 30) == 2.0  # nothing seen yet: the floor
    bound.observe(100 << 20, 1.0)  # 100 MiB/s
    bound.observe(10 << 20, 1.0)  # 10 MiB/s: the slowest rate seen counts
    assert bound.limit(1 << 20) == 2.0  # 0.4 s needed: the floor still
    assert bound.limit(100 << 20) == pytest.approx(40.0)  # 4 x 10 s
    assert "10.5 MB/s" in bound.describe()
    for _ in range(RATE_WINDOW):  # one slow write does not stretch the bound for good
        bound.observe(100 << 20, 1.0)
    assert bound.limit(100 << 20) == pytest.approx(4.0)


def test_an_explicit_stall_timeout_overrides_the_derived_bound() -> None:
    bound = StallBound(TransferConfig(stall_timeout_s=0.5, stall_floor_s=30.0))
    bound.observe(1, 100.0)  # a very slow link seen: still the number set
    assert bound.limit(1 << 30) == 0.5
    assert bound.describe() == "transfer.stall_timeout_s"


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [("stall_timeout_s", 0, "Expected `float` > 0"), ("stall_multiple", 0.5, ">= 1"), ("stall_floor_s", -1, "> 0")],
)
def test_a_bad_stall_setting_fails_at_start_naming_the_field(field: str, value: float, expected: str) -> None:
    with pytest.raises(ConfigError, match=rf"'transfer\.{field}' = {value}: .*{expected}"):
        convert_config({"transfer": {field: value}})


# -- over the mock channel ---------------------------------------------------------------------------------------
@pytest.mark.device_emulation
def test_a_stalled_write_is_failed_within_its_bound_and_its_blocks_quarantined(make_pair: MakePair) -> None:
    cfg = TransferConfig(
        chunk_size=32, stall_timeout_s=0.3, transfer_timeout_s=30, drain_timeout_s=1.0, pool_tokens=0, heartbeat_s=0.1
    )
    pair = make_pair(config=cfg)
    xfer = pair.sender.open("stalls", pair.receiver.address, 64, list(range(4)))
    xfer.send_chunk(0)
    wait_until(lambda: 0 in xfer.landed, 10, "chunk 0 to land")
    pair.p_channel.faults.stall = True  # type: ignore[attr-defined]  # the next write never completes nor fails
    xfer.send_chunk(1)
    posted = time.monotonic()
    with pytest.raises(TransferTimeout, match=f"{STALLED} 0.3s"):
        xfer.wait(0.3 + SLACK_S)  # without the bound: "did not confirm", at this timeout
    assert time.monotonic() - posted < 0.3 + SLACK_S
    # the sender settled: no credit, no open transfer held by the write it gave up on
    wait_until(lambda: pair.sender.stats()["open_transfers"] == 0, 5, "the sender to settle")
    assert pair.sender.stats()["inflight_bytes"] == 0
    assert pair.sender.stats()["stalled_writes"] == 1
    metrics = WorkerMetrics("prefill")
    metrics.events(pair.sender.stats, frozenset())
    assert metric(metrics.render().decode(), "pdkv_transfer_events_total", event="stalled_writes") == 1
    # the decode side: a clean failure (it computes the prompt), the blocks held past the Cancel
    with pytest.raises(TransferError, match="sender cancelled"):
        pair.receiver.wait("stalls", 5)
    assert xfer.writes_may_land
    time.sleep(cfg.drain_timeout_s / 2)  # the Cancel was taken well before: a Cancel that vouched would have freed them
    assert pair.receiver.stats()["reserved_blocks"] == 4, "blocks a write may still land in were reused"
    wait_until(lambda: pair.receiver.stats()["reservations"] == 0, 10, "the quarantine to end")
    assert pair.receiver.stats()["fences"] == 1  # no word to trust: the sender is cut off before the blocks go back
    assert pair.held_blocks() == 0


def test_a_stalled_write_into_a_pool_keeps_the_pools_blocks_from_reuse(make_pair: MakePair) -> None:
    """A one-chunk request written into the sender's pool: the receiver has not heard of it (the notice carries
    its Reserve), so the Cancel saying the write may still land takes the pool back with its blocks held."""
    cfg = TransferConfig(chunk_size=32, stall_timeout_s=0.3, drain_timeout_s=1.0, pool_tokens=32, heartbeat_s=0.1)
    pair = make_pair(config=cfg)
    warm(pair)
    pair.p_channel.faults.stall = True  # type: ignore[attr-defined]
    xfer = pair.sender.open("pooled", pair.receiver.address, 30, [10, 11])
    assert xfer.claim is not None  # written into the pool, no Reserve
    xfer.send_all()
    with pytest.raises(TransferTimeout, match=STALLED):
        xfer.wait(0.3 + SLACK_S)
    wait_until(lambda: pair.receiver.stats().get("pools_lapsed") == 1, 5, "the receiver to take the pool back")
    time.sleep(cfg.drain_timeout_s / 2)
    assert pair.receiver.stats()["pooled_blocks"] == 2, "a pool a write may still land in was reused"
    wait_until(lambda: pair.receiver.stats()["pooled_blocks"] == 0, 10, "the hold to end")
    assert pair.receiver.stats()["fences"] == 1 and pair.held_blocks() == 0


def test_writes_that_complete_are_never_counted_as_stalled(make_pair: MakePair) -> None:
    """The derived bound (no stall_timeout_s) learns the link from completed writes and fails none of them."""
    pair = make_pair(config=TransferConfig(chunk_size=32, stall_floor_s=0.05, stall_multiple=50.0))
    for i in range(5):
        xfer = pair.sender.open(f"ok{i}", pair.receiver.address, 64, list(range(4)))
        xfer.send_all()
        xfer.wait(10)
        pair.allocator.free(pair.receiver.wait(f"ok{i}", 10).blocks)
    assert pair.sender._ctx.stall.slowest_rate() is not None  # private, read on purpose: the link was measured
    assert pair.sender.stats().get("stalled_writes", 0) == 0


# -- over real NIXL agents and UCX workers, the decode process frozen ---------------------------------------------
def _needs(module: str, extra: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        importlib.util.find_spec(module) is None,
        reason=f"the '{extra}' extra is not installed: pip install 'pdkv[{extra}]'",
    )


# the channels whose writes a frozen peer leaves pending (tcp fails its link after its own io_timeout)
UCX_BASED = [pytest.param("nixl", marks=_needs("nixl", "nixl")), pytest.param("ucx", marks=_needs("ucxx", "ucx"))]
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32")
BLOCKS = 64
CFG_REAL = TransferConfig(
    chunk_size=64,
    stall_timeout_s=1.0,
    transfer_timeout_s=60,
    lease_s=30,
    heartbeat_s=0.1,
    drain_timeout_s=2.0,  # the quarantine where the channel can fence (ucx): well past the checks that it holds
    unfenced_quarantine_s=3.0,
    pool_tokens=0,
)
PIPE_S = 60.0  # a spawned process importing torch and NIXL takes seconds on a busy machine


def _decode(conn: Connection, channel_name: str) -> None:
    """A decode worker's receiver over ``channel_name``, answering the test's questions over a pipe."""
    channel = create_channel(channel_name, "stall-decode")
    receiver = KVReceiver(channel, LAYOUT, LAYOUT.allocate(BLOCKS), BlockAllocator(BLOCKS), "m", CFG_REAL)
    conn.send(receiver.address)
    while True:
        cmd, *args = conn.recv()
        if cmd == "stats":
            conn.send(receiver.stats())
        elif cmd == "wait":  # the decode worker asks for the KV: an error is its fallback
            try:
                receiver.wait(args[0], 5.0)
                conn.send("adopted")
            except TransferError as exc:
                conn.send(f"{type(exc).__name__}: {exc}")
        elif cmd == "exit":
            receiver.close()
            channel.close()
            conn.send(None)
            return


class Decode:
    def __init__(self, channel_name: str) -> None:
        self.conn, theirs = mp.get_context("spawn").Pipe()
        self.proc = mp.get_context("spawn").Process(target=_decode, args=(theirs, channel_name), daemon=True)
        self.proc.start()
        self.address: str = self.call()

    def call(self, *msg: Any) -> Any:
        if msg:
            self.conn.send(msg)
        assert self.conn.poll(PIPE_S), "the decode process did not answer"
        return self.conn.recv()

    def signal(self, sig: signal.Signals) -> None:
        os.kill(self.proc.pid, sig)  # type: ignore[arg-type]

    def freeze(self) -> None:
        """SIGSTOP, and wait until every thread stopped: a write posted before then may still be answered."""
        self.signal(signal.SIGSTOP)
        tasks = Path(f"/proc/{self.proc.pid}/task")
        wait_until(
            lambda: all(t.joinpath("stat").read_text().rpartition(")")[2].split()[0] == "T" for t in tasks.iterdir()),
            10,
            "the decode process to stop",
        )


@pytest.fixture
def decode(channel_name: str) -> Iterator[Decode]:
    d = Decode(channel_name)
    yield d
    if d.proc.is_alive():
        d.signal(signal.SIGCONT)
        d.call("exit")
    d.proc.join(10)
    d.conn.close()
    if not d.proc.is_alive():
        d.proc.close()  # its sentinel fd


@pytest.mark.parametrize("channel_name", UCX_BASED)
def test_a_write_to_a_frozen_decode_process_is_given_up_on_and_its_blocks_quarantined(
    decode: Decode, channel_name: str
) -> None:
    channel = create_channel(channel_name, f"stall-prefill-{os.getpid()}")
    kv = LAYOUT.allocate(BLOCKS)
    for t in kv:
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(1)))
    sender = KVSender(channel, LAYOUT, kv, "m", CFG_REAL)
    try:
        # two chunks, one sent: the transfer cannot complete, whatever lands after D wakes up
        xfer = sender.open("frozen", decode.address, 128, list(range(8)))  # the connection is up: D answered
        decode.freeze()  # frozen mid-transfer, as a hung process or a lost link leaves it
        xfer.send_chunk(0)
        with pytest.raises(TransferTimeout, match=f"{channel_name} write of .* {STALLED} 1s"):
            xfer.wait(1.0 + SLACK_S)  # without the bound: "did not confirm", at this timeout
        wait_until(lambda: sender.stats()["open_transfers"] == 0, 5, "the sender to settle")
        assert sender.stats()["inflight_bytes"] == 0 and sender.stats()["stalled_writes"] == 1
        decode.signal(signal.SIGCONT)
        fallback = decode.call("wait", "frozen")  # D computes the prompt
        assert fallback.startswith("TransferError") and "sender cancelled" in fallback and STALLED in fallback
        stats = decode.call("stats")
        assert stats["reserved_blocks"] == 8, "blocks a write may still land in were freed on the Cancel"
        deadline = time.monotonic() + CFG_REAL.late_write_hold(channel.enforces_grants) + 10
        while (stats := decode.call("stats"))["reservations"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert stats["reservations"] == 0 and stats["reserved_blocks"] == 0, "the quarantine never ended"
        assert stats["fences"] == 1
    finally:
        sender.close()
        channel.close()
