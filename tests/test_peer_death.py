"""Peer death at every protocol step, on either side, over the real tcp channel; clients that hang up.

One side runs in a child process (forked from a forkserver that has torch
and pdkv imported, so a child starts in milliseconds) that stops at a chosen
step: a hook reports the step over a pipe and blocks the thread that would
go on. The test SIGKILLs it there. The side in the test process must end
the request with one of our exception classes within its configured
timeout, hold nothing afterwards (no reservation, no reserved block, no
staging slot, no in-flight byte, no open transfer) and, when a receiver
comes back on the same address, handshake with it again and move a fresh
request bit for bit.

Last, an HTTP client that reads one event of a streamed completion and
hangs up: the request stops on every worker, nothing stays held, and no
server logs a traceback for what is the client's choice.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import multiprocessing.connection
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import aiohttp
import pytest
import torch
from aiohttp import web

from pdkv import native
from pdkv.blocks import BlockAllocator
from pdkv.channels.base import SummedWrites
from pdkv.channels.tcp import TcpChannel, TcpOptions
from pdkv.config import RouterConfig, TransferConfig, convert_config
from pdkv.engine.reference import ReferenceEngine
from pdkv.errors import TransferError, TransferTimeout
from pdkv.layout import KVLayout, gather
from pdkv.memory import EMULATE_ENV
from pdkv.router.app import Router
from pdkv.testing.http import metric
from pdkv.transfer.protocol import ChunkNotice, Done, Heartbeat, decode_notice
from pdkv.transfer.receiver import KVReceiver
from pdkv.transfer.sender import KVSender
from pdkv.worker.server import Worker

from tests.conftest import KV_MEMORIES, held_blocks, held_slots, wait_until

FINGERPRINT = "tiny-model"
P_LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, dtype="float32")
STAGED = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=32, order="HND", dtype="float32")
NUM_BLOCKS = 32
TOKENS = 128  # four 32-token chunks
TABLE = list(range(3, 11))  # the prefill side's blocks of the request: 8 blocks of 16 tokens
OLD_TABLE = list(range(12, 20))  # another request's, with other bytes
SEED = 1234
CFG = TransferConfig(
    chunk_size=32,
    handshake_timeout_s=1.0,
    reserve_timeout_s=1.0,
    chunk_timeout_s=1.0,
    transfer_timeout_s=2.0,
    lease_s=0.6,
    heartbeat_s=0.1,
    claim_timeout_s=10.0,
    drain_timeout_s=0.5,
)
TCP = TcpOptions(streams=1, connect_timeout=1.0, io_timeout=1.0)
SLACK_S = 3.0  # generous: a bound on "ended within its timeout", not a performance assertion
STEP_S = 10.0  # longest a child may take to reach its step
READY_S = 60.0  # longest a child may take to start: generous, a loaded 2-core machine is slow to fork and import

_ctx = multiprocessing.get_context("forkserver")
_ctx.set_forkserver_preload(["torch", "pdkv.transfer.sender", "pdkv.transfer.receiver", "pdkv.channels.tcp"])


def prefill_kv() -> list[torch.Tensor]:
    """The prefill side's paged KV: the same seeded bytes in every process, so either side can check them."""
    kv = P_LAYOUT.allocate(NUM_BLOCKS)
    gen = torch.Generator().manual_seed(SEED)
    for t in kv:
        t.copy_(torch.randn(t.shape, generator=gen))
    return kv


def expected_chunk() -> torch.Tensor:
    return gather(P_LAYOUT, prefill_kv(), TABLE, 0, TOKENS)


# -- the child side: run to a step, report it, block there -------------------------------------------------------
def _child_setup() -> None:
    # A child only has to reach its step and die: the torch path gives the same bytes, so the
    # children run the fallback path that a machine without the kernels would take.
    os.environ[native.ENV_VAR] = "0"


def _stop_here(conn: multiprocessing.connection.Connection, step: str) -> NoReturn:
    conn.send(("at", step))
    while True:
        time.sleep(3600)  # the test kills us here


def _receiver_child(conn: multiprocessing.connection.Connection, step: str) -> None:
    """A decode side that stops at ``step``: hello (Hello read, no reply), reserve (Reserve read, no reply),
    mid_chunk (chunk 0 landed, chunk 1's notice read), done (Done read); any other step runs on, idle."""
    _child_setup()
    channel = TcpChannel("decode", TCP)
    receiver = KVReceiver(
        channel, P_LAYOUT, P_LAYOUT.allocate(NUM_BLOCKS), BlockAllocator(NUM_BLOCKS), FINGERPRINT, CFG
    )
    if step == "hello":
        receiver.handshake.on_hello = lambda identity, hello: _stop_here(conn, step)  # type: ignore[method-assign]
    elif step == "reserve":
        receiver._on_reserve = lambda identity, req: _stop_here(conn, step)  # type: ignore[method-assign]
    elif step == "mid_chunk":
        on_notice = receiver.arrivals.land

        def stop_at_chunk_1(peer: str, notice: ChunkNotice, got: int | None = None, **how: bool) -> Any:
            if notice.chunk_index == 1:
                _stop_here(conn, step)
            return on_notice(peer, notice, got, **how)

        receiver.arrivals.land = stop_at_chunk_1  # type: ignore[method-assign]
    elif step == "done":
        on_finished = receiver.book.sender_finished

        def stop_at_done(identity: bytes, msg: Any) -> None:
            if isinstance(msg, Done):
                _stop_here(conn, step)
            on_finished(identity, msg)

        receiver.book.sender_finished = stop_at_done  # type: ignore[method-assign]
    conn.send(("ready", receiver.address))
    _until_parent_gone(conn)


def _sender_child(conn: multiprocessing.connection.Connection, step: str, address: str) -> None:
    """A prefill side that stops at ``step``: hello (receiver's Hello read), reserved, mid_chunk, done (before Done)."""
    _child_setup()
    channel = TcpChannel("prefill", TCP)
    sender = KVSender(channel, P_LAYOUT, prefill_kv(), FINGERPRINT, CFG)

    def script() -> None:
        if step == "hello":
            sender.handshake.on_hello = lambda peer, msg: _stop_here(conn, step)  # type: ignore[method-assign]
            sender.open("r", address, TOKENS, TABLE)
            return
        if step == "done":
            send = sender._dealers.send
            sender._dealers.send = lambda peer, msg: (  # a complete transfer's Done rides a heartbeat
                _stop_here(conn, step) if isinstance(msg, Heartbeat) and msg.done else send(peer, msg)
            )  # type: ignore[method-assign]
        xfer = sender.open("r", address, TOKENS, TABLE)
        if step == "reserved":
            _stop_here(conn, step)
        if step == "mid_chunk":
            xfer.send_chunk(0)
            deadline = time.monotonic() + STEP_S
            while 0 not in xfer.landed and time.monotonic() < deadline:
                time.sleep(0.005)
            xfer.send_chunk(1)  # posted; killed with its bytes on the way or just landed
            _stop_here(conn, step)
        xfer.send_all()

    conn.send(("ready", address))  # before the script runs: its first step may come at once
    threading.Thread(target=script, daemon=True).start()
    _until_parent_gone(conn)


def _until_parent_gone(conn: multiprocessing.connection.Connection) -> None:
    """Block until killed, or exit at once if the test process went away (no orphan outlives the run)."""
    try:
        conn.recv()
    except (EOFError, OSError):
        pass
    os._exit(0)


# -- the test side ------------------------------------------------------------------------------------------------
@dataclass
class Child:
    """A child process running one side, and the pipe it reports its steps on."""

    proc: multiprocessing.process.BaseProcess
    conn: multiprocessing.connection.Connection
    address: str = ""

    def expect(self, what: str, step: str | None = None) -> Any:
        """The child's next report, which must be ``what`` (at ``step``); fails the test, never hangs, if none comes."""
        timeout = READY_S if what == "ready" else STEP_S
        assert self.conn.poll(timeout), f"the child did not report {what!r} within {timeout}s"
        msg = self.conn.recv()
        assert msg[0] == what and (step is None or msg[1] == step), msg
        return msg[1]

    def kill(self) -> float:
        """SIGKILL it and return the time it died."""
        os.kill(self.proc.pid, signal.SIGKILL)  # type: ignore[arg-type]
        self.proc.join(5)
        assert self.proc.exitcode == -signal.SIGKILL
        return time.monotonic()


@pytest.fixture
def emulation(kv_memory: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """``kv_memory`` emulated: PDKV_EMULATE_DEVICE=1 here and in every child, so each sender and receiver treats its
    KV as device memory."""
    if kv_memory == "emulated":
        monkeypatch.setenv(EMULATE_ENV, "1")
    return kv_memory


@pytest.fixture
def spawn(emulation: str) -> Iterator[Callable[..., Child]]:
    children: list[Child] = []

    def start(target: Callable[..., None], *args: Any) -> Child:
        ours, theirs = _ctx.Pipe()
        proc = _ctx.Process(target=target, args=(theirs, *args), daemon=True)
        proc.start()
        theirs.close()
        child = Child(proc, ours)
        children.append(child)
        child.address = child.expect("ready")
        return child

    yield start
    for child in children:
        if child.proc.is_alive():
            child.proc.kill()
        child.proc.join(5)
        child.conn.close()
        if not child.proc.is_alive():
            child.proc.close()  # its sentinel fd


@dataclass
class Decode:
    """A receiver in the test process, with what the leak checks read."""

    receiver: KVReceiver
    channel: TcpChannel
    allocator: BlockAllocator
    kv: list[torch.Tensor]
    layout: KVLayout

    def assert_holds_nothing(self) -> None:
        wait_until(
            lambda: self.receiver.stats()["reservations"] == 0,
            CFG.drain_timeout_s + SLACK_S,
            "the receiver to drop the dead sender's reservation",
        )
        stats = self.receiver.stats()
        assert stats["reserved_blocks"] == 0
        leaked = held_blocks(stats, NUM_BLOCKS)
        assert leaked == 0, f"{leaked} blocks leaked ({stats['pooled_blocks']} in the surviving senders' pools)"
        assert held_slots(stats, CFG.staging_slots) == 0

    def claim_and_check(self, request_id: str) -> None:
        got = self.receiver.wait(request_id, CFG.transfer_timeout_s)
        assert torch.equal(gather(self.layout, self.kv, got.blocks, 0, TOKENS), expected_chunk())
        self.allocator.free(got.blocks)


@pytest.fixture
def start_decode(emulation: str) -> Iterator[Callable[..., Decode]]:
    made: list[Decode] = []

    def start(port: int = 0, layout: KVLayout = P_LAYOUT) -> Decode:
        channel = TcpChannel("decode", TCP)
        allocator = BlockAllocator(NUM_BLOCKS)
        kv = layout.allocate(NUM_BLOCKS)
        receiver = KVReceiver(channel, layout, kv, allocator, FINGERPRINT, CFG, port=port)
        made.append(Decode(receiver, channel, allocator, kv, layout))
        return made[-1]

    yield start
    for d in made:
        d.receiver.close()
        d.channel.close()


@pytest.fixture
def prefill(emulation: str) -> Iterator[KVSender]:
    channel = TcpChannel("prefill", TCP)
    sender = KVSender(channel, P_LAYOUT, prefill_kv(), FINGERPRINT, CFG)
    yield sender
    sender.close()
    channel.close()


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def assert_sender_holds_nothing(sender: KVSender) -> None:
    wait_until(
        lambda: sender.stats()["open_transfers"] == 0,
        CFG.transfer_timeout_s + SLACK_S,
        "the sender to settle the dead receiver's transfer",
    )
    assert sender.stats()["inflight_bytes"] == 0
    # private state, read on purpose: a dropped receiver's control socket must be closed, never reopened
    wait_until(
        lambda: sender._dealers.count() == len(sender.handshake.peers),
        SLACK_S,
        "no control socket to outlive its receiver",
    )


def push_fresh(sender: KVSender, decode: Decode, request_id: str) -> None:
    """The comeback: a new request to the receiver now on that address moves bit for bit."""
    xfer = sender.open(request_id, decode.receiver.address, TOKENS, TABLE)
    xfer.send_all()
    xfer.wait(CFG.transfer_timeout_s)
    decode.claim_and_check(request_id)
    assert_sender_holds_nothing(sender)
    decode.assert_holds_nothing()


# -- the receiver dies ----------------------------------------------------------------------------------------------
LOST = "lost the control connection to receiver "


@pytest.mark.parametrize(
    ("step", "timeout_s"), [("hello", CFG.handshake_timeout_s), ("reserve", CFG.reserve_timeout_s)]
)
def test_receiver_dies_before_answering(
    spawn: Callable[..., Child], prefill: KVSender, start_decode: Callable[..., Decode], step: str, timeout_s: float
) -> None:
    child = spawn(_receiver_child, step)
    with ThreadPoolExecutor(1) as pool:
        opening = pool.submit(prefill.open, "r", child.address, TOKENS, TABLE)
        child.expect("at", step)
        died = child.kill()
        # lost mid-Reserve, the sender asks the address once more (a restart looks the same) and finds nothing there
        with pytest.raises(TransferError, match=f"({LOST}|cannot connect to receiver ){child.address}"):
            opening.result(timeout_s + SLACK_S)
    assert time.monotonic() - died < timeout_s + SLACK_S
    assert_sender_holds_nothing(prefill)
    push_fresh(prefill, start_decode(port_of(child.address)), "after-" + step)


def test_receiver_dies_holding_the_reservation(
    spawn: Callable[..., Child], prefill: KVSender, start_decode: Callable[..., Decode]
) -> None:
    child = spawn(_receiver_child, "reserved")
    xfer = prefill.open("r", child.address, TOKENS, TABLE)
    died = child.kill()
    wait_until(
        lambda: xfer.error is not None, CFG.transfer_timeout_s + SLACK_S, "the sender to notice the receiver died"
    )
    assert time.monotonic() - died < CFG.transfer_timeout_s + SLACK_S
    with pytest.raises(TransferError, match=LOST + child.address):
        xfer.send_all()  # the prefill side keeps computing and pushing: each push fails at once
    with pytest.raises(TransferError, match=LOST):
        xfer.wait()
    assert_sender_holds_nothing(prefill)
    push_fresh(prefill, start_decode(port_of(child.address)), "after-reserved")


def test_receiver_dies_mid_chunk(
    spawn: Callable[..., Child], prefill: KVSender, start_decode: Callable[..., Decode]
) -> None:
    child = spawn(_receiver_child, "mid_chunk")
    xfer = prefill.open("r", child.address, TOKENS, TABLE)
    xfer.send_chunk(0)
    wait_until(lambda: 0 in xfer.landed, STEP_S, "chunk 0 to land")
    xfer.send_all()  # the receiver stops on chunk 1's notice: every write is posted, one chunk confirmed
    child.expect("at", "mid_chunk")
    died = child.kill()
    # Whichever the sender notices first: its control connection gone, or the data link reset under a write.
    with pytest.raises(TransferError, match=f"{re.escape(LOST + child.address)}|tcp: link to peer .* failed"):
        xfer.wait()  # nothing more to send: only the death itself can end this before transfer_timeout_s
    assert time.monotonic() - died < CFG.transfer_timeout_s + SLACK_S
    assert xfer.landed == {0}
    assert_sender_holds_nothing(prefill)
    push_fresh(prefill, start_decode(port_of(child.address)), "after-mid-chunk")


def test_receiver_dies_before_done(
    spawn: Callable[..., Child], prefill: KVSender, start_decode: Callable[..., Decode]
) -> None:
    child = spawn(_receiver_child, "done")
    xfer = prefill.open("r", child.address, TOKENS, TABLE)
    xfer.send_all()
    xfer.wait()  # every chunk verified: the transfer succeeded whatever happens to Done
    child.expect("at", "done")
    child.kill()
    assert xfer.complete and xfer.error is None
    assert_sender_holds_nothing(prefill)
    push_fresh(prefill, start_decode(port_of(child.address)), "after-done")


def test_receiver_that_hangs_mid_chunk_times_out(
    spawn: Callable[..., Child], prefill: KVSender, start_decode: Callable[..., Decode]
) -> None:
    """A frozen receiver (SIGSTOP) keeps its connections open, so no death is seen: the timeouts end it."""
    child = spawn(_receiver_child, "mid_chunk")
    xfer = prefill.open("r", child.address, TOKENS, TABLE)
    xfer.send_all()
    child.expect("at", "mid_chunk")
    os.kill(child.proc.pid, signal.SIGSTOP)  # type: ignore[arg-type]
    frozen = time.monotonic()
    with pytest.raises(TransferError) as err:
        xfer.wait()
    assert time.monotonic() - frozen < CFG.transfer_timeout_s + SLACK_S
    assert LOST not in str(err.value)  # a hang is not mistaken for a death
    assert_sender_holds_nothing(prefill)
    child.kill()
    push_fresh(prefill, start_decode(port_of(child.address)), "after-hang")


def test_receiver_back_under_its_old_name_never_gets_a_write_meant_for_its_previous_run(
    spawn: Callable[..., Child], prefill: KVSender, start_decode: Callable[..., Decode]
) -> None:
    """A receiver restarted with its agent name (as examples/ name theirs: "decode-0") is a new channel peer under
    the old name. A write for a reservation of the dead run, being posted while the sender handshakes with the
    new run, must never land there: the old run's block ids belong to the new run's requests."""
    child = spawn(_receiver_child, "reserved")
    old = prefill.open("old", child.address, TOKENS, OLD_TABLE)
    posting, release = threading.Event(), threading.Event()
    channel = prefill.channel

    def paused(write: Callable[..., Any]) -> Callable[..., Any]:
        """A direct chunk's write (``write_blocks``, or over tcp ``write_blocks_summed``: a ``seal`` for its notice)
        paused while it is old's."""

        def paused_write(peer: str, blocks: Any, notif: Any = None, token: bytes = b"", **how: bool) -> Any:
            notice = notif(0) if callable(notif) else notif
            if notice is not None and decode_notice(notice).transfer_id == "old":
                posting.set()
                release.wait(STEP_S)
            return write(peer, blocks, notif, token, **how)

        return paused_write

    channel.write_blocks = paused(channel.write_blocks)  # type: ignore[method-assign]
    if isinstance(channel, SummedWrites):
        channel.write_blocks_summed = paused(channel.write_blocks_summed)  # type: ignore[method-assign]
    with ThreadPoolExecutor(2) as pool:
        sending = pool.submit(old.send_chunk, 0)
        assert posting.wait(STEP_S)
        child.kill()
        decode = start_decode(port_of(child.address))
        opening = pool.submit(prefill.open, "fresh", decode.receiver.address, TOKENS, TABLE)
        time.sleep(0.3)  # room for the new run's handshake to finish, were nothing holding it
        release.set()
        with pytest.raises(TransferError):
            sending.result(STEP_S)
        fresh = opening.result(STEP_S)
    fresh.send_all()
    fresh.wait()
    decode.claim_and_check("fresh")
    assert decode.receiver.stats().get("stray_notices", 0) == 0, "a write reserved on the dead run reached the new one"
    assert_sender_holds_nothing(prefill)
    decode.assert_holds_nothing()


# -- the sender dies ------------------------------------------------------------------------------------------------
def test_sender_dies_during_hello(
    spawn: Callable[..., Child], prefill: KVSender, start_decode: Callable[..., Decode]
) -> None:
    decode = start_decode()
    child = spawn(_sender_child, "hello", decode.receiver.address)
    child.expect("at", "hello")
    died = child.kill()
    with pytest.raises(TransferTimeout, match="'r' did not arrive"):
        decode.receiver.wait("r", CFG.transfer_timeout_s)
    assert time.monotonic() - died < CFG.transfer_timeout_s + SLACK_S
    decode.assert_holds_nothing()
    push_fresh(prefill, decode, "after-hello")


@pytest.mark.parametrize("kv_memory", KV_MEMORIES)
@pytest.mark.parametrize("step", ["reserved", "mid_chunk"])
@pytest.mark.parametrize("layout", [P_LAYOUT, STAGED], ids=["direct", "staging"])
def test_sender_dies_with_a_reservation_open(
    spawn: Callable[..., Child], prefill: KVSender, start_decode: Callable[..., Decode], step: str, layout: KVLayout
) -> None:
    decode = start_decode(layout=layout)
    child = spawn(_sender_child, step, decode.receiver.address)
    child.expect("at", step)
    assert decode.receiver.stats()["reservations"] == 1
    died = child.kill()
    with pytest.raises(TransferError, match="lease expired.*the prefill side died"):
        decode.receiver.wait("r", CFG.transfer_timeout_s)
    assert time.monotonic() - died < CFG.lease_s + SLACK_S
    decode.assert_holds_nothing()
    if step == "mid_chunk":
        assert decode.receiver.stats()["chunks_landed"] >= 1
    push_fresh(prefill, decode, "after-" + step)


def test_sender_dies_before_done(
    spawn: Callable[..., Child], prefill: KVSender, start_decode: Callable[..., Decode]
) -> None:
    decode = start_decode()
    child = spawn(_sender_child, "done", decode.receiver.address)
    child.expect("at", "done")
    child.kill()
    decode.claim_and_check("r")  # every chunk verified: the KV is good without the sender's Done
    decode.assert_holds_nothing()
    push_fresh(prefill, decode, "after-done")


# -- an HTTP client hangs up mid-stream -----------------------------------------------------------------------------
STREAM = {
    "prompt": "The quick brown fox jumps over the lazy dog. " * 3,
    "max_tokens": 400,
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
}
IDLE = {  # what every worker must be back to once the request is over: nothing running, held or in flight
    "pdkv_running_requests": 0,
    "pdkv_reservations": 0,
    "pdkv_reserved_blocks": 0,
    "pdkv_inflight_bytes": 0,
    "pdkv_open_transfers": 0,
}


async def _serve(app: web.Application, handler_cancellation: bool) -> tuple[web.AppRunner, str]:
    """``handler_cancellation``: a client that hangs up cancels its handler (as ``pdkv launch`` serves); without
    it (aiohttp's default, e.g. ``web.run_app``) the handler only learns when a write to the client fails."""
    runner = web.AppRunner(app, handler_cancellation=handler_cancellation)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def _workers(model: Path, handler_cancellation: bool) -> tuple[list[web.AppRunner], str, str]:
    settings = {"channel": {"name": "tcp"}, "transfer": {"chunk_size": 32}, "tier": {"enabled": False}}
    urls, runners = [], []
    for role in ("prefill", "decode"):
        worker = Worker(convert_config({**settings, "role": role}), ReferenceEngine.load(str(model), progress=False))
        runner, url = await _serve(worker.app(), handler_cancellation)
        runners.append(runner)
        urls.append(url)
    return runners, urls[0], urls[1]


async def _hang_up_after_one_event(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> None:
    async with session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        assert (await resp.content.readuntil(b"\n\n")).startswith(b"data: {")
    # leaving the block with the body unread closes the connection: the client hung up


async def _metrics(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/metrics") as resp:
        return await resp.text()


def _blocks_back(text: str) -> float:
    """A worker's blocks free or in a sender's pool (held between requests, not leaked), from its /metrics."""
    return metric(text, "pdkv_free_blocks") + metric(text, "pdkv_pooled_blocks")


async def _assert_idle(session: aiohttp.ClientSession, url: str, free_blocks: float) -> str:
    """Wait (bounded) until the worker's /metrics say it holds nothing and has every block back."""
    deadline = time.monotonic() + 10
    while True:
        text = await _metrics(session, url)
        held = {name: metric(text, name) for name in IDLE if metric(text, name) != IDLE[name]}
        if not held and _blocks_back(text) == free_blocks:
            return text
        assert time.monotonic() < deadline, (
            f"{url} still holds {held}, blocks back {_blocks_back(text)} of {free_blocks}"
        )
        await asyncio.sleep(0.02)


def _assert_no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    bad = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not bad, "\n".join(f"{r.name}: {r.getMessage()}" for r in bad)


@pytest.mark.parametrize("handler_cancellation", [True, False], ids=["handler-cancellation", "no-handler-cancellation"])
def test_client_hangs_up_mid_stream_through_the_router(
    model_dir: Path, caplog: pytest.LogCaptureFixture, handler_cancellation: bool
) -> None:
    """The router stops relaying, which closes the decode stream and stops the decode worker's generation."""

    async def scenario() -> None:
        runners, p_url, d_url = await _workers(model_dir, handler_cancellation=True)
        router = await Router.start(RouterConfig(prefill=[p_url], decode=[d_url]))
        r_runner, r_url = await _serve(router.app(), handler_cancellation)
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
                free = {url: _blocks_back(await _metrics(s, url)) for url in (p_url, d_url)}
                await _hang_up_after_one_event(s, r_url + "/v1/completions", STREAM)
                await _assert_idle(s, p_url, free[p_url])
                decode = await _assert_idle(s, d_url, free[d_url])
                assert metric(decode, "pdkv_requests_total", outcome="ok") == 0, (
                    "the decode worker generated for nobody"
                )
                assert (
                    metric(decode, "pdkv_prompt_tokens_total", source="transferred") > 0
                )  # it did decode from moved KV
                assert metric(router.metrics.render().decode(), "pdkv_requests_total", outcome="cancelled") == 1
        finally:
            await r_runner.cleanup()
            await router.close()
            for runner in runners:
                await runner.cleanup()

    with caplog.at_level(logging.INFO):
        asyncio.run(scenario())
    _assert_no_traceback(caplog)
    if not handler_cancellation:  # the router learnt it from a failed write: one line, with the request id
        gone = [
            r for r in caplog.records if r.name == "pdkv.router.proxy" and "disconnected mid-stream" in r.getMessage()
        ]
        assert len(gone) == 1 and gone[0].levelno == logging.INFO and gone[0].getMessage().startswith("request ")


def test_client_hangs_up_mid_stream_on_a_worker_without_handler_cancellation(
    model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Served the aiohttp default way, a worker learns of the hang-up from a failed write: it must stop the
    request, free what it holds and log one line, not a traceback."""

    async def scenario() -> None:
        runners, p_url, d_url = await _workers(model_dir, handler_cancellation=False)
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
                free = {url: _blocks_back(await _metrics(s, url)) for url in (p_url, d_url)}
                async with s.get(d_url + "/pdkv/info") as resp:
                    info = await resp.json()
                prefill = {
                    **STREAM,
                    "stream": False,
                    "max_tokens": 1,
                    "kv_transfer_params": {
                        "do_remote_decode": True,
                        "remote_host": info["remote_host"],
                        "remote_port": info["remote_port"],
                        "transfer_id": "t",
                    },
                }
                async with s.post(p_url + "/v1/completions", json=prefill) as resp:
                    kv_params = (await resp.json())["kv_transfer_params"]
                await _hang_up_after_one_event(
                    s, d_url + "/v1/completions", {**STREAM, "kv_transfer_params": kv_params}
                )
                await _assert_idle(s, p_url, free[p_url])
                decode = await _assert_idle(s, d_url, free[d_url])
                assert metric(decode, "pdkv_requests_total", outcome="ok") == 0, "the worker generated for nobody"
                assert metric(decode, "pdkv_prompt_tokens_total", source="transferred") > 0  # it decoded from moved KV
        finally:
            for runner in runners:
                await runner.cleanup()

    with caplog.at_level(logging.INFO):
        asyncio.run(scenario())
    _assert_no_traceback(caplog)
    gone = [r for r in caplog.records if r.name == "pdkv.worker.server" and "disconnected mid-stream" in r.getMessage()]
    assert len(gone) == 1 and gone[0].levelno == logging.INFO and gone[0].getMessage().startswith("request ")
