"""Faults on the device path, one module for the GPU check and the CPU suite.

``run_faults(device)`` runs three faults between a prefill side in this process and a decode side in a child
process, both with their KV in ``device`` memory, over the nixl channel (the path that writes device memory
directly): KV in CUDA memory when tests/gpu/check.py runs it (part ``faults``) on a GPU, in emulated device memory
(``pdkv.memory.emulate_device``: CPU memory that refuses host views, registered by address) when
tests/test_gpu_faults.py runs it in CI. The same code, so what CI checks is what the GPU check runs.

1. ``killed_mid_transfer``: D is SIGKILLed with a request's KV half landed in its device memory (it stops as chunk 1's
   notice arrives). P's transfer must fail with one of our errors within its timeouts and P hold nothing after.
2. ``restarted_same_address``: a new D on the same address; P handshakes again and a fresh request's KV lands bit
   for bit (``wrong_bytes`` 0: no wrong token can come of it), and D holds nothing once it is claimed and freed.
3. ``released_region``: memory P released is refused, never written from: a device buffer registered then
   deregistered is refused by NIXL itself (``NixlChannel.registered_with_nixl``) and by the channel, before
   posting; and a request whose KV region P released fails cleanly on both sides (D computes the prompt), its
   blocks back at once (nothing was posted, so nothing may land).

After each, no registration leaked: P's channel holds exactly the regions its sender registered, and NIXL agrees.
The result is one JSON-able dict; ``ok`` is whether every fault ended as it must.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

import torch

from pdkv.blocks import BlockAllocator
from pdkv.channels import Channel, TransferOp, create_channel
from pdkv.config import TransferConfig
from pdkv.errors import ChannelError, PdkvError, TransferError
from pdkv.layout import KVLayout, gather
from pdkv.memory import emulate_device
from pdkv.transfer.protocol import ChunkNotice
from pdkv.transfer.receiver import KVReceiver
from pdkv.transfer.sender import KVSender

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="float16")
BLOCKS = 64
TOKENS = 256  # four 64-token chunks
TABLE = list(range(5, 21))  # P's blocks of the request
FINGERPRINT = "fault-check"
CFG = TransferConfig(
    chunk_size=64,
    handshake_timeout_s=5.0,
    reserve_timeout_s=5.0,
    chunk_timeout_s=5.0,
    transfer_timeout_s=10.0,
    lease_s=3.0,
    heartbeat_s=0.1,
    drain_timeout_s=0.5,
    unfenced_quarantine_s=3.0,
    pool_tokens=0,
)
SLACK_S = 5.0  # a bound on "ended within its timeout", not a performance assertion
CHILD_S = 120.0  # a spawned child importing torch, NIXL (and CUDA) is slow on a loaded machine


def device_kv(device: str, seed: int | None = None) -> list[torch.Tensor]:
    """A KV buffer in ``device`` memory ("cuda" or "emulated"), seeded random or zero."""
    kv = LAYOUT.allocate(BLOCKS, device="cuda" if device == "cuda" else "cpu")
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        for t in kv:
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    if device == "emulated":
        for t in kv:
            emulate_device(t)
    return kv


def host_copy(kv: list[torch.Tensor], table: list[int]) -> torch.Tensor:
    """The request's KV gathered and copied to host memory, to compare across processes."""
    return gather(LAYOUT, kv, table, 0, TOKENS).cpu()


# -- the decode side, in its own process -----------------------------------------------------------------------
def _decode_child(conn: multiprocessing.connection.Connection, device: str, port: int, stop_mid: bool) -> None:
    """D: a receiver over nixl with its KV in ``device`` memory, answering the parent's commands; with ``stop_mid``
    it stops for good as chunk 1's notice arrives (the parent kills it there)."""
    channel = create_channel("nixl", "fault-decode")  # a restarted D comes back under its name, too
    allocator = BlockAllocator(BLOCKS)
    kv = device_kv(device)
    receiver = KVReceiver(channel, LAYOUT, kv, allocator, FINGERPRINT, CFG, port=port)
    if stop_mid:
        land = receiver.arrivals.land

        def stop_at_chunk_1(peer: str, notice: ChunkNotice, got: int | None = None, **how: bool) -> Any:
            if notice.chunk_index == 1:
                _stop(conn)
            return land(peer, notice, got, **how)

        receiver.arrivals.land = stop_at_chunk_1  # type: ignore[method-assign]
    conn.send(receiver.address)
    while True:
        try:
            cmd, *args = conn.recv()
        except EOFError:  # the parent went away: no orphan outlives it
            os._exit(0)
        if cmd == "stats":
            conn.send(receiver.stats())
        elif cmd == "claim":  # the decode worker asks for the KV: adopted (and what it holds), or its fallback
            try:
                got = receiver.wait(args[0], CFG.transfer_timeout_s)
            except TransferError as exc:
                conn.send(("recompute", f"{type(exc).__name__}: {exc}"))
                continue
            conn.send(("adopted", host_copy(kv, got.blocks)))
            allocator.free(got.blocks)
        elif cmd == "exit":
            receiver.close()
            channel.close()
            conn.send(None)
            return


def _stop(conn: multiprocessing.connection.Connection) -> NoReturn:
    conn.send("stopped mid-transfer")
    while True:
        time.sleep(3600)  # killed here


class DecodeProcess:
    """The parent's end of a ``_decode_child``."""

    def __init__(self, device: str, port: int = 0, stop_mid: bool = False) -> None:
        ctx = multiprocessing.get_context("spawn")  # CUDA does not survive a fork
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_decode_child, args=(theirs, device, port, stop_mid), daemon=True)
        self.proc.start()
        theirs.close()
        self.address: str = self.next(CHILD_S)

    def next(self, timeout: float = CFG.transfer_timeout_s + SLACK_S) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"the decode process did not answer within {timeout}s")
        return self.conn.recv()

    def call(self, *msg: Any) -> Any:
        self.conn.send(msg)
        return self.next()

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def kill(self) -> None:
        """SIGKILL it (if still running) and release our ends; idempotent."""
        if self.conn.closed:
            return
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)  # type: ignore[arg-type]
        self.proc.join(10)
        self.conn.close()
        if not self.proc.is_alive():
            self.proc.close()  # its sentinel fd

    def exit(self) -> None:
        if not self.conn.closed and self.proc.is_alive():
            self.call("exit")
        self.kill()


# -- what every fault checks ----------------------------------------------------------------------------------------
def _wait(pred: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def sender_holds_nothing(sender: KVSender) -> bool:
    """No open transfer and no byte in flight, once what failed has settled."""
    return _wait(lambda: sender.stats()["open_transfers"] == 0, CFG.transfer_timeout_s + SLACK_S) and (
        sender.stats()["inflight_bytes"] == 0
    )


def registrations(channel: Channel, sender: KVSender) -> dict[str, Any]:
    """pdkv's count of the channel's regions against the sender's own (KV tensors and staging), and NIXL's word on
    each of them: a leak is a region more, a lost one a region less."""
    ours = [*sender.source.kv_regions, sender.source.staging_region]
    held = [region for region, _ in channel.regions.items()]
    buffers = [*sender.source.kv, sender.source.staging]
    nixl = [channel.registered_with_nixl(b) for b in buffers]  # type: ignore[attr-defined]
    return {"pdkv_regions": len(held), "sender_regions": len(ours), "nixl_registered": all(nixl)}


def _registrations_ok(reg: dict[str, Any]) -> bool:
    return reg["pdkv_regions"] == reg["sender_regions"] and reg["nixl_registered"]


def _outcome(fn: Callable[[], object]) -> tuple[str, float]:
    """What ``fn`` ended with: "ok", or the class and message of our error (anything else propagates), and when."""
    started = time.monotonic()
    try:
        fn()
    except PdkvError as exc:
        return f"{type(exc).__name__}: {exc}", time.monotonic() - started
    return "ok", time.monotonic() - started


# -- the faults -------------------------------------------------------------------------------------------------
def killed_mid_transfer(device: str, channel: Channel, sender: KVSender) -> tuple[dict[str, Any], int]:
    """D dies with the request's KV half landed in its device memory; the port it listened on, for the restart."""
    d = DecodeProcess(device, stop_mid=True)
    try:
        xfer = sender.open("killed", d.address, TOKENS, TABLE)
        xfer.send_all()
        stopped = d.next() == "stopped mid-transfer"
        d.kill()
        outcome, seconds = _outcome(lambda: xfer.wait(CFG.transfer_timeout_s + SLACK_S))
    finally:
        d.kill()
    reg = registrations(channel, sender)
    result = {
        "stopped_mid_transfer": stopped,
        "landed_before_death": sorted(xfer.landed),
        "outcome": outcome,
        "seconds": round(seconds, 3),
        "sender_holds_nothing": sender_holds_nothing(sender),
        "registrations": reg,
    }
    result["ok"] = (
        stopped
        and outcome.split(":")[0] in ("TransferError", "TransferTimeout", "TransferCancelled")
        and seconds < CFG.transfer_timeout_s + SLACK_S
        and result["sender_holds_nothing"]
        and _registrations_ok(reg)
    )
    return result, d.port


def restarted_same_address(channel: Channel, sender: KVSender, port: int, d: DecodeProcess) -> dict[str, Any]:
    """A new D on the dead one's address: a fresh request moves bit for bit, and nothing stays held."""
    xfer = sender.open("after-restart", d.address, TOKENS, TABLE)
    xfer.send_all()
    outcome, _ = _outcome(lambda: xfer.wait(CFG.transfer_timeout_s))
    verdict, got = d.call("claim", "after-restart")
    want = host_copy(sender.source.kv, TABLE)
    wrong = int((got.view(torch.uint8) != want.view(torch.uint8)).sum()) if verdict == "adopted" else -1
    stats = d.call("stats")
    reg = registrations(channel, sender)
    result = {
        "same_address": d.port == port,
        "outcome": outcome,
        "decode": verdict,
        "wrong_bytes": wrong,
        "decode_reservations": stats["reservations"],
        "decode_free_blocks": stats["free_blocks"],
        "sender_holds_nothing": sender_holds_nothing(sender),
        "registrations": reg,
    }
    result["ok"] = (
        result["same_address"]
        and outcome == "ok"
        and wrong == 0
        and stats["reservations"] == 0
        and stats["free_blocks"] == BLOCKS
        and result["sender_holds_nothing"]
        and _registrations_ok(reg)
    )
    return result


def released_region(device: str, channel: Channel, sender: KVSender, d: DecodeProcess) -> dict[str, Any]:
    """Memory P released is refused, by NIXL and the channel, and a request over it fails cleanly on both sides."""
    spare = device_kv(device)[0]
    region = channel.register(spare)
    before = channel.registered_with_nixl(spare)  # type: ignore[attr-defined]
    channel.deregister(region)
    after = channel.registered_with_nixl(spare)  # type: ignore[attr-defined]
    peer = next(iter(sender.handshake.peers.values())).agent
    try:
        channel.write(peer, [TransferOp(region, 0, 0, 0, 4096)])
        refused = "posted"
    except ChannelError as exc:
        refused = f"ChannelError: {exc}"
    # The engine frees P's KV under an open request (its buffer released): the request must fail, not write.
    xfer = sender.open("released", d.address, TOKENS, TABLE)
    channel.deregister(sender.source.kv_regions[0])
    outcome, _ = _outcome(xfer.send_all)
    verdict, why = d.call("claim", "released")
    back = _wait(lambda: d.call("stats")["reserved_blocks"] == 0, CFG.drain_timeout_s + SLACK_S)
    result = {
        "nixl_registered_before_release": before,
        "nixl_registered_after_release": after,
        "write_into_released_region": refused,
        "outcome": outcome,
        "decode": verdict,
        "decode_reason": why,
        "decode_blocks_back": back,
        "sender_holds_nothing": sender_holds_nothing(sender),
    }
    result["ok"] = (
        before
        and not after
        and refused.startswith("ChannelError")
        and outcome.startswith("TransferError")
        and verdict == "recompute"
        and back
        and result["sender_holds_nothing"]
    )
    return result


def run_faults(device: str) -> dict[str, Any]:
    """The three faults in order, KV in ``device`` memory ("cuda" or "emulated"); see the module docstring."""
    channel = create_channel("nixl", f"fault-prefill-{os.getpid()}")
    sender = KVSender(channel, LAYOUT, device_kv(device, seed=7), FINGERPRINT, CFG)
    out: dict[str, Any] = {"device": device, "channel": "nixl"}
    d: DecodeProcess | None = None
    try:
        out["killed_mid_transfer"], port = killed_mid_transfer(device, channel, sender)
        d = DecodeProcess(device, port=port)
        out["restarted_same_address"] = restarted_same_address(channel, sender, port, d)
        out["released_region"] = released_region(device, channel, sender, d)
    except Exception as exc:  # noqa: BLE001 - reported in the JSON: the GPU check's other parts still run
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc(limit=8)
    finally:
        if d is not None:
            d.exit()
        sender.close()
        channel.close()
    faults = ("killed_mid_transfer", "restarted_same_address", "released_region")
    out["ok"] = "error" not in out and all(out.get(f, {}).get("ok") for f in faults)
    return out
