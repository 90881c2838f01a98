"""``pdkv bench transfer``: a request's KV, sender -> receiver, against the raw channel moving the same bytes.

The channel bench times bytes; this one times what a prefill worker asks of
pdkv for each request: ``KVSender.open`` (handshake once, reserve room on the
decode side), ``send_all`` (every chunk gathered or addressed in place,
checksummed, written with its notification) and ``wait`` (the receiver verified
every chunk and said so). The receiver is a ``KVReceiver`` in another process
(a thread for channels that cannot span processes) that claims each request
with ``wait``, as a decode worker does, and frees its blocks.

The KV is shaped like SmolLM2-135M's in float32 (30 layers, 3 KV heads of 64,
blocks of 16 tokens: 46,080 bytes a token, 94 MB for 2048 tokens), the model
pdkv runs by default. ``direct``: both sides have that layout, whole blocks move.
``staging``: the decode side keeps blocks of 32 tokens in HND order, so each
chunk is gathered into canonical form, written into a staging slot and
scattered in.

Baseline, measured in the same run with rounds alternating: the raw channel
moving the bytes pdkv moves (``moved_bytes``: in direct mode a request's whole
blocks, so a 40-token request's 3 blocks of 16 tokens, 2.21 MB where its
tokens are 1.84 MB; ``pdkv bench channel``'s baseline for that
channel: plain sockets for tcp, the raw NIXL agent for nixl, raw ucxx for ucx,
memcpy for mock), one transfer per repetition of all the requests' bytes: no
reservation, no checksum, no descriptors per block. That is the best a plain
program does with those bytes, so ``ratio`` is what the whole pdkv pipeline
costs; a ratio near 1 means the pipeline is not what limits a transfer. For
tcp the baseline moves each scenario's bytes over one stream and over as many
as the channel would split them into; the row's ratio is against the faster
(``baseline_used``, every variant in ``baselines``). For nixl in direct
mode a second baseline, ``blocks``, moves each request's whole blocks the
way vLLM's NixlConnector does (``pdkv.bench.nixl_raw``): lists prepared once
per block, one transfer per request. Each nixl baseline runs twice, with
NIXL's progress thread on (as vLLM runs its agent) and off (labelled
``, no progress thread``), since neither is the faster program at every
size. ``ratios`` holds the row's ratio against every variant. Beside
``blocks``, the same rounds time one checksum
pass over the blocks moved (``verify_ms``, on the first device's rows only:
the pass is timed on its KV), which D cannot skip where the bytes land
unseen; ``blocks_plus_verify`` is the row's ratio against the raw post
(the faster ``blocks`` program) followed by that pass, in series (issue 46's
bar for nixl direct: >= 1.0). A plain program that hashed one request while
the next one's bytes moved would take less, towards the longer of the two,
so this bar is the lenient one and ``ratios["blocks"]`` the strict one.

Wall time on a shared machine swings; CPU time does not. Each row also has
``cpu_s_per_gb``: the CPU seconds each side's process (``sender``: this one,
``receiver``: the ``KVReceiver``'s) spent per GB moved, read from the
processes' CPU clocks (``pdkv.bench.cpu``) from just before the receiver
hears of a repetition's requests until each side's work for them is done,
the bit-for-bit check left out; ``baseline_cpu_s_per_gb`` is the same for the
raw program's two processes, and ``cpu_ratio`` ours over theirs, per side.

Where the CPU goes, per chunk and per request (issue 37, item 6, after NIXL's ``agent_xfer_post_time``):
``host_us_per_chunk`` and ``host_us_per_request`` (each ``p50``, ``mean`` and ``n`` in microseconds, for
``prefill`` and ``decode``) are the wall-time spans each side records (``pdkv.transfer.hosttime``). On P a
chunk is ``send_chunk``'s posting, its credit wait left out, and a request's fixed cost is ``open`` (with its
Reserve's round trip when it found no pool) plus its last ``Landed`` to settled; on D a chunk is its share of the
I/O thread's pass from waking on the notification to the ``Landed`` sent (the data thread's landing and hashing
not included: that is in the CPU), and a request is its admission (``Reserve`` answered, or a pooled chunk's
Reserve). ``cpu_us_per_chunk`` is the CPU clock behind ``cpu_s_per_gb``, per side, over the row's chunks.

The receiver has room for a pool, as a decode worker does (``pool.pool_size`` within ``pool_blocks_share`` of
its blocks), so a one-chunk request in direct mode is written into the pool its receiver granted ahead, as it is
there, with no Reserve's round trip; ``pooled_share`` is the row's share of requests that were (one request per
pool at a time: of a scenario's concurrent requests, one a repetition).

Every repetition's KV is checked bit for bit on the decode side (a digest of
each request's canonical KV compared with the sender's), outside the timed part.
``TransferRig`` is that harness; the tests use it too, to prove the data path
over real channels with concurrent requests.

``--device cpu|emulated|cuda`` (several, comma-separated, measured in the
same run) says where both sides' KV lives: host memory; emulated device
memory (``pdkv.memory.emulate_device``: CPU memory the channel may not take a
host view of, so tcp stages it through pinned host memory as it would VRAM);
or a CUDA device (nixl: VRAM to VRAM; tcp: pinned staging). Each row says
where the KV lived (``kv_memory``), the mode the receiver granted and the path
the bytes took (``path``: host direct, host staging, pinned staging, direct
device), and rows of another device than ``cpu`` carry ``vs_host``: their
GB/s over the same scenario's with the KV in host memory.

``--tls`` (tcp only) runs one more sender/receiver pair (KV in host memory)
whose channel has mutual TLS (certificates of a CA made for the run) in the
same rounds: each ``cpu`` row adds ``tls_gbps``, ``tls_p50_ms`` and
``tls_ratio`` (TLS / clear pdkv). ``--secret`` likewise runs a pair that
shares a secret (every handshake proven, every control message and chunk
notice tagged): ``secret_gbps``, ``secret_p50_ms``, ``secret_ratio``.

``--link RATE`` puts the receiver on a second host of ``pdkv.bench.netrig``
across a veth pair shaped to RATE (its control plane and channel on that
host's address), the sender and the baseline's sender on the first.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import torch

from pdkv.bench import plot
from pdkv.bench.channel import (
    BASELINES,
    IN_PROCESS,
    _describe,
    _load,
    _peer,
    _recv,
    baseline_fields,
    baseline_variants,
    channel_options,
    cpu_pair,
    tls_options,
    variant_pids,
    warm_up,
)
from pdkv.bench.cpu import SIDES, CpuMeter, charge, ratios
from pdkv.bench.netrig import LOOPBACK, Placement, bench_link, call_on
from pdkv.blocks import BlockAllocator
from pdkv.channels import create_channel
from pdkv.checksum import blocks_checksum, chunk_checksum, flat_bytes
from pdkv.config import TransferConfig
from pdkv.errors import ConfigError, TransferError
from pdkv.layout import KVLayout, gather
from pdkv.memory import emulate_device
from pdkv.transfer.hosttime import KINDS as HOST_KINDS
from pdkv.transfer.hosttime import summary
from pdkv.transfer.pool import pool_size

SENDER_LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32")
STAGING_LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=32, dtype="float32", order="HND")
FINGERPRINT = "bench-transfer-smollm2-135m-fp32"
# One torch thread on each side. The untimed bit-for-bit check after each repetition (a gather and a hash)
# otherwise leaves OpenMP's worker threads spinning into the next timed one, taking a core from the transfer:
# a 40-token request measured 4.6 ms that way, 1.7 ms without. (Staging's gather and scatter run on one thread too.)
ONE_THREAD = 1
# (tokens per request, concurrent requests): a short chat turn, one chunk, a long prompt, and two loads
SCENARIOS: list[tuple[int, int]] = [(40, 1), (256, 1), (2048, 1), (256, 16), (2048, 4)]
ROUNDS = 5
TIMEOUT_S = 60.0
SECRET = "bench-transfer-secret"  # --secret: what both sides of that pair share
DEVICES = ("cpu", "emulated", "cuda")
HOST_SIDES = ("prefill", "decode")  # the sides of host_us_per_chunk and host_us_per_request


def place_kv(kv: list[torch.Tensor], device: str) -> list[torch.Tensor]:
    """A KV buffer moved to where ``device`` (one of ``DEVICES``) says it lives."""
    if device == "cuda":
        return [t.to("cuda") for t in kv]
    if device == "emulated":
        return [emulate_device(t) for t in kv]
    return kv


@dataclass(frozen=True)
class Scenario:
    mode: str  # "direct" or "staging"
    tokens: int
    requests: int

    @property
    def nbytes(self) -> int:
        return self.requests * SENDER_LAYOUT.chunk_bytes(self.tokens)

    @property
    def block_bytes(self) -> int:
        """The bytes of the sender's whole blocks that hold the requests' tokens (direct mode moves these)."""
        return self.requests * moved_bytes(SENDER_LAYOUT, self.tokens, "direct")

    @property
    def moved(self) -> int:
        """The bytes pdkv moves for the scenario, which its baseline moves too (``moved_bytes``); the row's GB/s are
        of these."""
        return self.requests * moved_bytes(SENDER_LAYOUT, self.tokens, self.mode)


def moved_bytes(layout: KVLayout, tokens: int, mode: str) -> int:
    """The bytes one request of ``tokens`` takes on the wire from a sender of ``layout``: in direct mode its whole
    blocks of every KV tensor (a request ends mid-block, and the block goes whole), in staging its tokens."""
    if mode == "direct":
        return layout.blocks_for(tokens) * layout.num_tensors * layout.block_bytes
    return layout.chunk_bytes(tokens)


def variants_for(baseline: Any, sc: Scenario) -> dict[str, dict[str, int]]:
    """The baseline's ways of moving a scenario's bytes; in direct mode, also as the requests' whole blocks of the
    sender's layout, one transfer per request, where the baseline can (``RawNixl``: as vLLM's NixlConnector)."""
    grid = {"block_bytes": SENDER_LAYOUT.block_bytes, "tensors": SENDER_LAYOUT.num_tensors, "requests": sc.requests}
    return baseline_variants(baseline, sc.moved, grid if sc.mode == "direct" else None)


def verify_pass_s(rig: TransferRig, sc: Scenario) -> float:
    """Seconds of one checksum pass over the blocks a scenario moves, read in place from the sender's KV: the pass
    a receiver makes to verify bytes a one-sided channel (nixl) landed without it seeing them. Measured beside the
    raw agent's ``blocks`` baseline, so that pdkv is held to the raw post plus the one pass it cannot skip."""
    blocks = list(range(sc.requests * SENDER_LAYOUT.blocks_for(sc.tokens)))
    start = time.perf_counter()
    blocks_checksum([flat_bytes(t) for t in rig.kv], blocks, SENDER_LAYOUT.block_bytes)
    return time.perf_counter() - start


def _plus_verify(sc: Scenario, fields: dict[str, Any], verify: list[float], gbps: float) -> dict[str, float]:
    """The row's ratio against the raw ``blocks`` post followed by one verification pass in series (a lenient bar: a
    program overlapping them takes less), and that pass's time."""
    if not verify:
        return {}
    raw_gbps = max(b["gbps"] for label, b in fields["baselines"].items() if label.startswith("blocks"))
    raw_s, verify_s = sc.moved / raw_gbps / 1e9, statistics.median(verify)
    return {"blocks_plus_verify": (raw_s + verify_s) / (sc.moved / gbps / 1e9), "verify_ms": 1e3 * verify_s}


def _digest(layout: KVLayout, kv: list[torch.Tensor], blocks: list[int], tokens: int) -> int:
    """A layout-independent digest of a request's KV: the device checksum of its canonical form, where the KV is."""
    return chunk_checksum([flat_bytes(gather(layout, kv, blocks, 0, tokens))])


def _receiver_side(
    conn: Connection,
    channel_name: str,
    layout: KVLayout,
    num_blocks: int,
    config: TransferConfig,
    host: str,
    device: str,
    extra: dict[str, Any],
) -> None:
    """The decode side on ``host``: a KVReceiver that claims each announced request, digests its KV and frees its
    blocks."""
    from pdkv.transfer.receiver import KVReceiver

    torch.set_num_threads(ONE_THREAD)
    try:
        channel = create_channel(
            channel_name, f"bench-decode-{uuid.uuid4().hex[:6]}", channel_options(channel_name, host, extra)
        )
        kv = place_kv(layout.allocate(num_blocks), device)
        allocator = BlockAllocator(num_blocks)
        # it waits for requests it was told of before the sender opens them (handshake included): no announce window
        receiver = KVReceiver(
            channel,
            layout,
            kv,
            allocator,
            FINGERPRINT,
            msgspec.structs.replace(config, announce_timeout_s=TIMEOUT_S),
            host=host,
            secret=extra.get("secret", ""),
        )
    except Exception as exc:  # noqa: BLE001 - reported to the sender, which raises it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    try:
        conn.send(("address", receiver.address))
        while (msg := _recv(conn, "a command"))[0] != "close":
            if msg[0] == "stats":
                conn.send(("stats", receiver.stats()))
                continue
            if msg[0] == "host":  # the host time spans recorded since the last ask (pdkv/transfer/hosttime.py)
                conn.send(("host", receiver.parts.host.take()))
                continue
            if msg[0] == "threads":  # the OS thread ids of its threads, by name (schedstat is per OS thread)
                conn.send(("threads", {t.native_id: t.name for t in threading.enumerate()}))
                continue
            # claimed as they land, or (``expect`` with ``later``) once the sender's wait returned: a decode request
            # that comes after the router's hop from P, its claim timed (the receiver's cost to take landed KV)
            later = len(msg) > 2 and msg[2]
            claimed = [] if later else [(receiver.wait(rid, TIMEOUT_S).blocks, tokens) for rid, tokens in msg[1]]
            # the check waits until the sender's clock stopped: run at once, it took a core from the
            # transfer's last acknowledgement (a 256-token request measured 3-4 ms slower that way)
            if _recv(conn, "the go-ahead to check")[0] == "close":  # the sender failed: nothing to check
                break
            claim_ns = []
            for rid, tokens in msg[1] if later else []:
                began = time.perf_counter_ns()
                claimed.append((receiver.wait(rid, TIMEOUT_S).blocks, tokens))
                claim_ns.append(time.perf_counter_ns() - began)
            spent = time.process_time()  # the end of this process's CPU window: all the transfer's work is done
            digests = [_digest(layout, kv, blocks, tokens) for blocks, tokens in claimed]
            conn.send(("digests", digests, spent, claim_ns))
            for blocks, _ in claimed:
                allocator.free(blocks)
    except Exception as exc:  # noqa: BLE001 - reported to the sender, which raises it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        receiver.close()
        channel.close()


class TransferRig:
    """A ``KVSender`` here over a buffer of seeded random KV, and a ``KVReceiver`` in another process.

    ``push`` moves requests the way a prefill worker does and checks that the
    decode side holds exactly the KV that was sent. Used by this bench and by
    the tests that prove the data path over real channels.
    """

    def __init__(
        self,
        channel: str,
        receiver_layout: KVLayout,
        sender_blocks: int,
        receiver_blocks: int,
        config: TransferConfig,
        sender_layout: KVLayout = SENDER_LAYOUT,
        placement: Placement = LOOPBACK,
        device: str = "cpu",
        extra: tuple[dict[str, Any], dict[str, Any]] = ({}, {}),
    ) -> None:
        """``extra``: the sender's and the receiver's channel options beyond the bench's (``--tls``; a ``secret`` there
        is the sender's and receiver's too, ``--secret``)."""
        from pdkv.transfer.sender import KVSender

        if device not in DEVICES:
            raise ConfigError(f"bench transfer --device {device!r}: expected one of {', '.join(DEVICES)}")
        self.layout = sender_layout
        self.modes: set[str] = set()  # the modes the receiver granted the requests pushed so far
        args = (channel, receiver_layout, receiver_blocks, config, placement.receiver_addr, device, extra[1])
        self._peer = _peer(_receiver_side, args, in_process=channel in IN_PROCESS, netns=placement.receiver_netns)
        peer = self._peer.__enter__()
        self.conn = peer.conn
        self.pids = {"sender": os.getpid(), "receiver": peer.pid}  # for a ``CpuMeter`` of this rig's pushes
        try:
            self.channel = create_channel(
                channel,
                f"bench-prefill-{uuid.uuid4().hex[:6]}",
                channel_options(channel, placement.sender_addr, extra[0]),
            )
            gen = torch.Generator().manual_seed(0)
            self.kv = place_kv(
                [torch.randn(t.shape, generator=gen).to(t.dtype) for t in sender_layout.allocate(sender_blocks)], device
            )
            self.allocator = BlockAllocator(sender_blocks)
            self.sender = KVSender(
                self.channel, sender_layout, self.kv, FINGERPRINT, config, secret=extra[0].get("secret", "")
            )
            _, self.address = _recv(self.conn, "the receiver's address")
        except BaseException:
            self._peer.__exit__(None, None, None)
            raise

    def push(
        self, requests: list[tuple[str, int]], tables: list[list[int]] | None = None, meter: CpuMeter | None = None
    ) -> tuple[float, list[float]]:
        """Move every (request id, tokens) at once, one thread each; (seconds for all, seconds per request).

        ``tables``: the sender's block table per request (default: fresh blocks from its allocator).
        ``meter`` (made with ``pids``): charged with each side's CPU from just before the receiver hears of the
        requests to the moment each side's work for them is done, the bit-for-bit check left out.
        Raises ``TransferError`` if the decode side ends up with KV other than what was sent.
        """
        own = tables is None
        tables = (
            [self.allocator.allocate(self.layout.blocks_for(tokens)) for _, tokens in requests]
            if tables is None
            else tables
        )
        start = meter.read() if meter is not None else {}
        self.conn.send(("expect", requests))
        ends = [0.0] * len(requests)
        moved = [0] * len(requests)  # the bytes each request took on the wire, in the mode it was granted
        errors: list[BaseException] = []

        def one(i: int) -> None:
            rid, tokens = requests[i]
            try:
                xfer = self.sender.open(rid, self.address, tokens, tables[i])
                xfer.send_all()
                xfer.wait(TIMEOUT_S)
                ends[i] = time.perf_counter()
                self.modes.add(xfer.mode)
                moved[i] = moved_bytes(self.layout, tokens, xfer.mode)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread
                errors.append(exc)

        t0 = time.perf_counter()
        if len(requests) == 1:
            one(0)
        else:
            threads = [threading.Thread(target=one, args=(i,), name=f"bench-request-{i}") for i in range(len(requests))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(TIMEOUT_S)
        sender_spent = time.process_time()
        if errors:
            raise errors[0]
        self.conn.send(("check",))
        _, digests, receiver_spent, _ = _recv(self.conn, "the receiver's digests")
        if meter is not None:
            meter.add(start, {"sender": sender_spent, "receiver": receiver_spent}, sum(moved))
        want = [
            _digest(self.layout, self.kv, table, tokens) for table, (_, tokens) in zip(tables, requests, strict=True)
        ]
        if own:
            for table in tables:
                self.allocator.free(table)
        bad = [rid for (rid, _), a, b in zip(requests, digests, want, strict=True) if a != b]
        if bad:
            raise TransferError(
                f"the decode side holds different KV than was sent for {len(bad)} of {len(requests)} requests: "
                f"{bad[:5]}"
            )
        return max(ends) - t0, [e - t0 for e in ends]

    def host_times(self) -> dict[str, dict[str, list[int]]]:
        """Each side's host time spans in ns (``prefill``: our sender, ``decode``: the receiver), per kind
        (``pdkv.transfer.hosttime.KINDS``), recorded since the last call."""
        self.conn.send(("host",))
        _, decode = _recv(self.conn, "the receiver's host times")
        return {"prefill": self.sender.parts.host.take(), "decode": decode}

    def thread_names(self) -> dict[str, dict[int, str]]:
        """Each side's threads, OS thread id -> name (``sender``: this process's, ``receiver``: the peer's)."""
        self.conn.send(("threads",))
        _, theirs = _recv(self.conn, "the receiver's thread names")
        return {"sender": {t.native_id: t.name for t in threading.enumerate()}, "receiver": theirs}

    def receiver_stats(self) -> dict[str, int]:
        self.conn.send(("stats",))
        _, stats = _recv(self.conn, "the receiver's stats")
        return stats  # type: ignore[no-any-return]

    @property
    def path(self) -> str:
        """The way the bytes went: host direct or staging, pinned staging (device KV through host slots), or
        direct device."""
        memory = self.sender.kv_memory
        names = (
            {"direct": "host direct", "staging": "host staging"}
            if memory == "host"
            else {"direct": f"direct device ({memory})", "staging": "pinned staging"}
        )
        return " or ".join(names[m] for m in sorted(self.modes))

    def close(self) -> None:
        try:
            self.sender.close()
            self.channel.close()
        finally:
            self._peer.__exit__(None, None, None)

    def __enter__(self) -> TransferRig:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _measure_mode(
    channel: str,
    mode: str,
    scenarios: list[Scenario],
    repeats: int,
    baseline_class: Callable[..., Any],
    placement: Placement,
    devices: tuple[str, ...],
    also: tuple[str, ...] = (),
) -> list[dict[str, Any]]:
    """Every scenario of one mode, one receiver process per device (and one per variant: over TLS, with a secret),
    the baseline and each rig's rounds alternating.

    Alternating the devices within each round (rather than one device's scenarios after the other's) puts
    them under the same load on a shared machine, so ``vs_host`` compares like with like.
    """
    layout = SENDER_LAYOUT if mode == "direct" else STAGING_LAYOUT
    theirs, ours = (max(lay.blocks_for(s.tokens) * s.requests for s in scenarios) for lay in (layout, SENDER_LAYOUT))
    config = TransferConfig()
    theirs = math.ceil(theirs / config.max_peer_blocks_share)  # one sender may hold only that share of the receiver
    if config.pool_blocks_share:  # and room for a pool, as a decode worker has: a one-chunk request goes pooled there
        theirs = max(theirs, math.ceil(pool_size(layout, config) / config.pool_blocks_share))
    reps = itertools.count()
    rows = []
    with contextlib.ExitStack() as stack:
        # name -> (where the KV lives, extra channel options); made in reverse and warmed at once: each receiver
        # waits for its next command only so long (TIMEOUT_S), so the first rig measured is the last one made
        specs = {device: (device, ({}, {})) for device in devices} | {
            v: ("cpu", tls_options(stack, channel) if v == "tls" else ({"secret": SECRET}, {"secret": SECRET}))
            for v in also
        }
        rigs: dict[str, TransferRig] = {}
        for name, (device, extra) in reversed(specs.items()):
            rigs[name] = stack.enter_context(
                TransferRig(channel, layout, ours, theirs, config, placement=placement, device=device, extra=extra)
            )
            rigs[name].push([("warmup", scenarios[0].tokens)])  # handshake, first connections: not timed
        rigs = {name: rigs[name] for name in specs}
        # sized for whole blocks: the most any scenario or variant moves
        baseline = stack.enter_context(baseline_class(max(s.block_bytes for s in scenarios), placement))
        warm_up(baseline, scenarios[0].moved)
        for sc in scenarios:
            times: dict[str, list[float]] = {name: [] for name in rigs}
            latencies: dict[str, list[float]] = {name: [] for name in rigs}
            meters = {name: CpuMeter(rig.pids) for name, rig in rigs.items()}
            for rig in rigs.values():
                rig.host_times()  # the spans of earlier scenarios and warm-ups: not this row's
            pooled = {name: rig.sender.stats().get("reserved_from_pool", 0) for name, rig in rigs.items()}
            variants = variants_for(baseline, sc)
            base: dict[str, list[float]] = {label: [] for label in variants}
            base_meters = {label: CpuMeter(variant_pids(baseline, kw)) for label, kw in variants.items()}
            verify: list[float] = []  # one read pass over the blocks moved: what D adds where bytes land unseen
            for _ in range(ROUNDS):
                for label, kw in variants.items():
                    call = partial(baseline.gbps, sc.moved, repeats, **kw)
                    base[label].append(charge(base_meters[label], baseline, call))
                if any(label.startswith("blocks") for label in variants):
                    verify.extend(verify_pass_s(rigs[devices[0]], sc) for _ in range(repeats))
                for device, rig in rigs.items():
                    for _ in range(repeats):
                        rep = next(reps)
                        total, each = rig.push(
                            [(f"rep{rep}-{i}", sc.tokens) for i in range(sc.requests)], meter=meters[device]
                        )
                        times[device].append(total)
                        latencies[device].extend(each)
            fields = baseline_fields(
                {label: (statistics.median(base[label]), base_meters[label].per_gb()) for label in variants}
            )
            base_gbps = fields["baseline_gbps"]
            chunks = ROUNDS * repeats * sc.requests * -(-sc.tokens // config.chunk_size)  # each rig's, this row
            for device in devices:
                rig = rigs[device]
                gbps = sc.moved / statistics.median(times[device]) / 1e9
                cpu = meters[device].per_gb()
                spans = rig.host_times()
                row = {
                    "device": device,
                    "kv_memory": rig.sender.kv_memory,
                    "granted_mode": "/".join(sorted(rig.modes)),
                    "path": rig.path,
                    "mode": mode,
                    "tokens": sc.tokens,
                    "requests": sc.requests,
                    "size_bytes": sc.nbytes,
                    "moved_bytes": sc.moved,
                    "gbps": gbps,
                    "baseline_gbps": base_gbps,
                    "ratio": gbps / base_gbps,
                    "ratios": {label: gbps / b["gbps"] for label, b in fields["baselines"].items()},
                    **(_plus_verify(sc, fields, verify, gbps) if device == devices[0] else {}),
                    "p50_ms": 1e3 * _percentile(latencies[device], 0.5),
                    "p99_ms": 1e3 * _percentile(latencies[device], 0.99),
                    "baseline_ms": 1e3 * sc.moved / base_gbps / 1e9,
                    "cpu_s_per_gb": cpu,
                    **fields,
                    "cpu_ratio": ratios(cpu, fields["baseline_cpu_s_per_gb"]),
                    **{
                        f"host_us_per_{kind}": {side: summary(spans[side][kind]) for side in HOST_SIDES}
                        for kind in HOST_KINDS
                    },
                    "cpu_us_per_chunk": {side: 1e6 * t / chunks for side, t in meters[device].spent.items()},
                    # the row's requests that went into a pool the receiver granted ahead (no Reserve's round trip)
                    "pooled_share": (rig.sender.stats().get("reserved_from_pool", 0) - pooled[device])
                    / (ROUNDS * repeats * sc.requests),
                }
                for v in also if device == "cpu" else ():
                    v_gbps = sc.moved / statistics.median(times[v]) / 1e9
                    row.update(
                        {
                            f"{v}_gbps": v_gbps,
                            f"{v}_ratio": v_gbps / gbps,
                            f"{v}_p50_ms": 1e3 * _percentile(latencies[v], 0.5),
                            f"{v}_cpu_s_per_gb": meters[v].per_gb(),
                        }
                    )
                rows.append(row)
    return rows


def measure(
    channel: str,
    modes: list[str],
    scenarios: list[tuple[int, int]],
    repeats: int,
    placement: Placement = LOOPBACK,
    devices: tuple[str, ...] = ("cpu",),
    tls: bool = False,
    secret: bool = False,
) -> dict[str, Any]:
    """The result object of ``pdkv bench transfer --json``."""
    torch.set_num_threads(ONE_THREAD)
    if channel not in BASELINES:
        raise ConfigError(f"bench transfer: no baseline for channel {channel!r}; expected one of {sorted(BASELINES)}")
    for mode in modes:
        if mode not in ("direct", "staging"):
            raise ConfigError(f"bench transfer --modes: {mode!r} is not a mode; expected direct and/or staging")
    if channel in IN_PROCESS and placement.link is not None:
        raise ConfigError(f"bench transfer: the {channel} channel cannot span hosts; --link needs tcp, nixl or ucx")
    for device in devices:
        if device not in DEVICES:
            raise ConfigError(f"bench transfer --device {device!r}: expected one of {', '.join(DEVICES)}")
        if device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("bench transfer --device cuda: torch sees no CUDA device here")
    if tls and (channel != "tcp" or "cpu" not in devices):
        raise ConfigError(
            f"bench transfer --tls: only the tcp channel has TLS, beside a --device cpu row (got {channel!r}, "
            f"{', '.join(devices)})"
        )
    if secret and "cpu" not in devices:
        raise ConfigError(f"bench transfer --secret: measured beside a --device cpu row (got {', '.join(devices)})")
    also = (("tls",) if tls else ()) + (("secret",) if secret else ())
    baseline = _load(BASELINES[channel])
    rows = []
    for mode in modes:
        rows.extend(
            _measure_mode(
                channel,
                mode,
                [Scenario(mode, t, r) for t, r in scenarios],
                repeats,
                baseline,
                placement,
                devices,
                also,
            )
        )
    host = {(r["mode"], r["tokens"], r["requests"]): r["gbps"] for r in rows if r["device"] == "cpu"}
    for r in rows:
        same = host.get((r["mode"], r["tokens"], r["requests"]))
        if r["device"] != "cpu" and same:
            r["vs_host"] = r["gbps"] / same
    return {
        "channel": channel,
        "link": placement.label,
        "baseline": _describe(baseline, BASELINES[channel])
        + ", moving the same bytes in one transfer"
        + (
            " (blocks: each request's whole blocks, one transfer each)"
            if getattr(baseline, "moves_blocks", False)
            else ""
        ),
        "cpu": "CPU seconds per GB moved, per side: the process's user+sys time (all threads) from just before "
        "the receiver hears of a repetition's requests until each side's work for them is done (baseline: over "
        "its timed calls, warm-ups included), divided by the bytes moved",
        "layout": {
            "sender": msgspec.to_builtins(SENDER_LAYOUT),
            "staging_receiver": msgspec.to_builtins(STAGING_LAYOUT),
        },
        "tls": tls,
        "secret": secret,
        "results": rows,
    }


def _host_pair(host: dict[str, dict[str, float | None]]) -> str:
    """``prefill/decode`` p50 host microseconds for a table cell; ``-`` for a side that recorded none."""
    return "/".join("-" if (v := host.get(side, {}).get("p50")) is None else f"{v:.0f}" for side in HOST_SIDES)


def _us_pair(cpu: dict[str, float]) -> str:
    """``sender/receiver`` CPU microseconds for a table cell; ``-`` for a side not measured."""
    return "/".join("-" if (v := cpu.get(side)) is None else f"{v:.0f}" for side in SIDES)


def _table(out: dict[str, Any]) -> str:
    lines = [
        f"channel {out['channel']} over {out['link']}: request-level transfer vs {out['baseline']}",
        f"{'device':>8} {'mode':>8} {'path':>22} {'tokens':>6} {'reqs':>4} {'MB':>8} {'GB/s':>7} {'base':>7} "
        f"{'via':>9} {'ratio':>6} {'vs host':>7} {'p50 ms':>8} {'p99 ms':>8} {'base ms':>8} {'CPU s/GB':>11} "
        f"{'base CPU':>11} {'host us/chunk':>13} {'host us/req':>13} {'CPU us/chunk':>13}"
        + (f" {'TLS GB/s':>8} {'TLS p50':>8} TLS/clear" if out["tls"] else "")
        + (f" {'sec GB/s':>8} {'sec p50':>8} secret/none" if out.get("secret") else ""),
    ]
    for r in out["results"]:
        vs_host = f"{r['vs_host']:7.2f}" if "vs_host" in r else f"{'':>7}"
        lines.append(
            f"{r['device']:>8} {r['mode']:>8} {r['path'][:22]:>22} {r['tokens']:>6} {r['requests']:>4} "
            f"{r['moved_bytes'] / 1e6:8.1f} {r['gbps']:7.3f} {r['baseline_gbps']:7.3f} "
            f"{r['baseline_used'][:9]:>9} {r['ratio']:6.2f} {vs_host} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} "
            f"{r['baseline_ms']:8.2f} {cpu_pair(r['cpu_s_per_gb']):>11} {cpu_pair(r['baseline_cpu_s_per_gb']):>11} "
            f"{_host_pair(r['host_us_per_chunk']):>13} {_host_pair(r['host_us_per_request']):>13} "
            f"{_us_pair(r['cpu_us_per_chunk']):>13}"
            + (f" {r['tls_gbps']:8.3f} {r['tls_p50_ms']:8.2f} {r['tls_ratio']:9.2f}" if "tls_gbps" in r else "")
            + (
                f" {r['secret_gbps']:8.3f} {r['secret_p50_ms']:8.2f} {r['secret_ratio']:11.2f}"
                if "secret_gbps" in r
                else ""
            )
        )
    return "\n".join(lines)


def draw(out: dict[str, Any], path: str) -> None:
    """``--plot``: GB/s against the bytes a scenario moves, per mode, beside the raw channel moving the same bytes."""
    series: dict[str, tuple[list[float], list[float]]] = {}
    for r in sorted(out["results"], key=lambda r: r["moved_bytes"]):
        for label, key in (
            (f"pdkv {r['device']} {r['mode']}", "gbps"),
            (f"baseline ({r['device']} {r['mode']} sizes)", "baseline_gbps"),
        ):
            xs, ys = series.setdefault(label, ([], []))
            xs.append(r["moved_bytes"])
            ys.append(r[key])
    plot.lines(
        path,
        f"pdkv bench transfer --channel {out['channel']}",
        "bytes moved per scenario (all its requests; whole blocks in direct mode)",
        "GB/s",
        series,
        note="baseline: " + out["baseline"][:150],
    )


def run(args: argparse.Namespace) -> int:
    if args.repeats < 1:
        raise ConfigError(f"bench transfer --repeats {args.repeats}: expected >= 1")
    plot.check(getattr(args, "plot", None))
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    devices = tuple(d.strip() for d in args.device.split(",") if d.strip())
    with bench_link(args.link) as placement:
        out = call_on(
            placement.sender_netns,
            measure,
            args.channel,
            modes,
            args.scenarios or SCENARIOS,
            args.repeats,
            placement,
            devices,
            args.tls,
            args.secret,
        )
    print(json.dumps(out) if args.json else _table(out))
    if getattr(args, "plot", None):
        draw(out, args.plot)
    return 0
