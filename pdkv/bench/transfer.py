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
moving the same number of bytes (``pdkv bench channel``'s baseline for that
channel: plain sockets for tcp, the raw NIXL agent for nixl, raw ucxx for ucx,
memcpy for mock), one transfer per repetition of all the requests' bytes: no
reservation, no checksum, no descriptors per block. That is the best a plain
program does with those bytes, so ``ratio`` is what the whole pdkv pipeline
costs; a ratio near 1 means the pipeline is not what limits a transfer.

Every repetition's KV is checked bit for bit on the decode side (a digest of
each request's canonical KV compared with the sender's), outside the timed part.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import torch
import xxhash

from pdkv.bench.channel import BASELINES, IN_PROCESS, _describe, _load, _peer, _recv
from pdkv.blocks import BlockAllocator
from pdkv.channels import create_channel
from pdkv.config import TransferConfig
from pdkv.errors import ConfigError, TransferError
from pdkv.layout import KVLayout, gather
from pdkv.memory import byte_view

SENDER_LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32")
STAGING_LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=32, dtype="float32", order="HND")
FINGERPRINT = "bench-transfer-smollm2-135m-fp32"
# (tokens per request, concurrent requests): a short chat turn, one chunk, a long prompt, and two loads
SCENARIOS: list[tuple[int, int]] = [(40, 1), (256, 1), (2048, 1), (256, 16), (2048, 4)]
ROUNDS = 5
TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Scenario:
    mode: str  # "direct" or "staging"
    tokens: int
    requests: int

    @property
    def nbytes(self) -> int:
        return self.requests * SENDER_LAYOUT.chunk_bytes(self.tokens)


def _digest(layout: KVLayout, kv: list[torch.Tensor], blocks: list[int], tokens: int) -> int:
    """A layout-independent digest of a request's KV: xxh3 of its canonical form."""
    return xxhash.xxh3_64_intdigest(byte_view(gather(layout, kv, blocks, 0, tokens)))


def _receiver_side(conn: Connection, channel_name: str, layout: KVLayout, num_blocks: int, config: TransferConfig) -> None:
    """The decode side: a KVReceiver that claims each announced request, digests its KV and frees its blocks."""
    from pdkv.receiver import KVReceiver

    try:
        channel = create_channel(channel_name, f"bench-decode-{uuid.uuid4().hex[:6]}")
        kv = layout.allocate(num_blocks)
        allocator = BlockAllocator(num_blocks)
        receiver = KVReceiver(channel, layout, kv, allocator, FINGERPRINT, config)
    except Exception as exc:  # noqa: BLE001 - reported to the sender, which raises it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    try:
        conn.send(("address", receiver.address))
        while (msg := _recv(conn, "a command"))[0] != "close":
            _, ids, tokens = msg
            digests = []
            for rid in ids:
                got = receiver.wait(rid, TIMEOUT_S)
                digests.append(_digest(layout, kv, got.blocks, tokens))
                allocator.free(got.blocks)
            conn.send(("digests", digests, receiver.stats()))
    except Exception as exc:  # noqa: BLE001 - reported to the sender, which raises it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        receiver.close()
        channel.close()


class _SenderSide:
    """The prefill side, in this process: a KVSender over a buffer of random KV."""

    def __init__(self, channel_name: str, conn: Connection, num_blocks: int, config: TransferConfig) -> None:
        from pdkv.sender import KVSender

        self.conn = conn
        self.channel = create_channel(channel_name, f"bench-prefill-{uuid.uuid4().hex[:6]}")
        gen = torch.Generator().manual_seed(0)
        self.kv = [torch.randn(t.shape, generator=gen, dtype=t.dtype) for t in SENDER_LAYOUT.allocate(num_blocks)]
        self.allocator = BlockAllocator(num_blocks)
        self.sender = KVSender(self.channel, SENDER_LAYOUT, self.kv, FINGERPRINT, config)
        _, self.address = _recv(conn, "the receiver's address")
        self._reps = 0

    def repetition(self, tokens: int, requests: int) -> tuple[float, list[float]]:
        """Move ``requests`` requests of ``tokens`` tokens at once; (seconds for all, seconds per request)."""
        self._reps += 1
        ids = [f"rep{self._reps}-{i}" for i in range(requests)]
        tables = [self.allocator.allocate(SENDER_LAYOUT.blocks_for(tokens)) for _ in ids]
        self.conn.send(("expect", ids, tokens))
        ends = [0.0] * requests
        errors: list[BaseException] = []

        def one(i: int) -> None:
            try:
                xfer = self.sender.open(ids[i], self.address, tokens, tables[i])
                xfer.send_all()
                xfer.wait(TIMEOUT_S)
                ends[i] = time.perf_counter()
            except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread
                errors.append(exc)

        t0 = time.perf_counter()
        if requests == 1:
            one(0)
        else:
            threads = [threading.Thread(target=one, args=(i,), name=f"bench-request-{i}") for i in range(requests)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(TIMEOUT_S)
        if errors:
            raise errors[0]
        _, digests, _stats = _recv(self.conn, "the receiver's digests")
        want = [_digest(SENDER_LAYOUT, self.kv, table, tokens) for table in tables]
        for table in tables:
            self.allocator.free(table)
        if digests != want:
            raise TransferError(f"bench transfer: the decode side holds different KV than was sent ({sum(a != b for a, b in zip(digests, want))} of {requests} requests differ)")
        return max(ends) - t0, [e - t0 for e in ends]

    def close(self) -> None:
        self.sender.close()
        self.channel.close()


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _measure_mode(channel: str, mode: str, scenarios: list[Scenario], repeats: int, baseline: Callable[..., dict[int, float]]) -> list[dict[str, Any]]:
    """Every scenario of one mode against one receiver process, pdkv and baseline rounds alternating."""
    config = TransferConfig()
    layout = SENDER_LAYOUT if mode == "direct" else STAGING_LAYOUT
    theirs, ours = (max(lay.blocks_for(s.tokens) * s.requests for s in scenarios) for lay in (layout, SENDER_LAYOUT))
    rows = []
    with _peer(_receiver_side, (channel, layout, theirs, config), in_process=channel in IN_PROCESS) as conn:
        side = _SenderSide(channel, conn, ours, config)
        try:
            side.repetition(scenarios[0].tokens, 1)  # handshake, first connections, native build: not timed
            for sc in scenarios:
                times: list[float] = []
                latencies: list[float] = []
                base: list[float] = []
                for _ in range(ROUNDS):
                    base.append(baseline([sc.nbytes], repeats)[sc.nbytes])
                    for _ in range(repeats):
                        total, each = side.repetition(sc.tokens, sc.requests)
                        times.append(total)
                        latencies.extend(each)
                gbps = sc.nbytes / statistics.median(times) / 1e9
                base_gbps = statistics.median(base)
                rows.append({
                    "mode": mode, "tokens": sc.tokens, "requests": sc.requests, "size_bytes": sc.nbytes,
                    "gbps": gbps, "baseline_gbps": base_gbps, "ratio": gbps / base_gbps,
                    "p50_ms": 1e3 * _percentile(latencies, 0.5), "p99_ms": 1e3 * _percentile(latencies, 0.99),
                    "baseline_ms": 1e3 * sc.nbytes / base_gbps / 1e9,
                })  # fmt: skip
        finally:
            side.close()
    return rows


def measure(channel: str, modes: list[str], scenarios: list[tuple[int, int]], repeats: int) -> dict[str, Any]:
    """The result object of ``pdkv bench transfer --json``."""
    if channel not in BASELINES:
        raise ConfigError(f"bench transfer: no baseline for channel {channel!r}; expected one of {sorted(BASELINES)}")
    for mode in modes:
        if mode not in ("direct", "staging"):
            raise ConfigError(f"bench transfer --modes: {mode!r} is not a mode; expected direct and/or staging")
    baseline = _load(BASELINES[channel])
    rows = []
    for mode in modes:
        rows.extend(_measure_mode(channel, mode, [Scenario(mode, t, r) for t, r in scenarios], repeats, baseline))
    return {
        "channel": channel,
        "baseline": _describe(baseline, BASELINES[channel]) + ", moving the same bytes in one transfer",
        "layout": {"sender": msgspec.to_builtins(SENDER_LAYOUT), "staging_receiver": msgspec.to_builtins(STAGING_LAYOUT)},
        "results": rows,
    }


def _table(out: dict[str, Any]) -> str:
    lines = [
        f"channel {out['channel']}: request-level transfer vs {out['baseline']}",
        f"{'mode':>8} {'tokens':>6} {'reqs':>4} {'MB':>8} {'GB/s':>7} {'base':>7} {'ratio':>6} {'p50 ms':>8} {'p99 ms':>8} {'base ms':>8}",
    ]
    for r in out["results"]:
        lines.append(
            f"{r['mode']:>8} {r['tokens']:>6} {r['requests']:>4} {r['size_bytes'] / 1e6:8.1f} {r['gbps']:7.3f} {r['baseline_gbps']:7.3f} "
            f"{r['ratio']:6.2f} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} {r['baseline_ms']:8.2f}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.repeats < 1:
        raise ConfigError(f"bench transfer --repeats {args.repeats}: expected >= 1")
    out = measure(args.channel, [m.strip() for m in args.modes.split(",") if m.strip()], args.scenarios or SCENARIOS, args.repeats)
    print(json.dumps(out) if args.json else _table(out))
    return 0
