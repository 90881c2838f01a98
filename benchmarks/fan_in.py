"""A decode worker receiving from many prefill workers at once (issue 46's fan-in row): its thread count and a chunk's
host time on it, with N senders pushing one short request each at the same moment, against one sender in the same run.

    python benchmarks/fan_in.py --senders 16 --tokens 40 --rounds 30

Prints one JSON line: per sender count (1 and N), the receiver's threads, its host microseconds per chunk
(``host_us_per_chunk``: the landing, verification and verdict of one chunk, pdkv/transfer/hosttime.py) and the
requests' p50 wall time; the ratio of N's to 1's, their rounds alternating. Each count has a receiver of its own,
in a process of its own (``TransferRig``), so that the one sender's never serves the others' idle connections
besides; the extra senders are ``KVSender``s in this one, each with its own channel and agent name, as separate
prefill workers would be.
Every request's KV (each sender's from blocks of its own) is checked bit for bit on the decode side. The host time
is wall time: with N senders in this process on few cores, D's spans also hold the time it waits for a core that the
senders' work took, which one sender's never meets; a thread count or the CPU per chunk says what is D's own.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import uuid

import torch

from pdkv.bench.channel import _recv, channel_options
from pdkv.bench.transfer import FINGERPRINT, SENDER_LAYOUT, TransferRig, _digest
from pdkv.channels import create_channel
from pdkv.config import TransferConfig
from pdkv.transfer.sender import KVSender


def push_at_once(pushes: list[tuple[KVSender, str, str, list[int]]], tokens: int, tag: str) -> list[float]:
    """Each (sender, request id, receiver address, block table) pushed at the same moment, one thread each; each one's
    seconds. Raises unless every push completed."""
    spent = [0.0] * len(pushes)
    failed: list[BaseException] = []
    start = threading.Barrier(len(pushes))

    def push(i: int) -> None:
        sender, rid, address, table = pushes[i]
        try:
            start.wait(60)
            t0 = time.perf_counter()
            xfer = sender.open(rid, address, tokens, table)
            xfer.send_all()
            xfer.wait(60)
            spent[i] = time.perf_counter() - t0
        except BaseException as exc:  # noqa: BLE001 - reported below, on the measuring thread
            failed.append(exc)

    threads = [threading.Thread(target=push, args=(i,)) for i in range(len(pushes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if failed or any(t.is_alive() for t in threads):
        raise SystemExit(f"round {tag}: a push failed or hung: {failed}")
    return spent


def one_round(rig: TransferRig, senders: list[KVSender], tokens: int, tag: str) -> list[float]:
    """Every sender pushes one request at once, each from blocks of its own; each one's seconds. Raises unless every
    push completed and the decode side holds each request's own KV bit for bit (a request landed in another's
    blocks, or twice, fails here)."""
    rids = [f"{tag}-{i}" for i in range(len(senders))]
    n = SENDER_LAYOUT.blocks_for(tokens)
    tables = [list(range(i * n, (i + 1) * n)) for i in range(len(senders))]
    rig.conn.send(("expect", [(rid, tokens) for rid in rids]))
    spent = push_at_once(
        [(sender, rid, rig.address, table) for sender, rid, table in zip(senders, rids, tables, strict=True)],
        tokens,
        tag,
    )
    rig.conn.send(("check",))
    digests = _recv(rig.conn, "the receiver's digests")[1]
    if digests != [_digest(rig.layout, rig.kv, table, tokens) for table in tables]:
        raise SystemExit(f"round {tag}: the decode side holds other KV than was sent")
    return spent


def receiver_threads(rig: TransferRig) -> int:
    rig.conn.send(("threads",))
    return len(_recv(rig.conn, "the receiver's threads")[1])


def measure(
    sets: dict[str, tuple[TransferRig, list[KVSender]]], tokens: int, rounds: int
) -> dict[str, dict[str, float]]:
    """Each set of senders, with its own receiver, warmed (the receiver's threads counted once it is), then their
    rounds alternating, so the two counts meet the same load; per set its threads, chunk host time and requests'
    p50. Two receivers, so that the one sender's never holds the others' connections: a lone sender's receiver."""
    threads = {}
    for name, (rig, senders) in sets.items():
        for i in range(3):  # handshakes and first pools
            one_round(rig, senders, tokens, f"warm{name}-{i}")
            time.sleep(0.05)
        threads[name] = receiver_threads(rig)
        rig.host_times()  # forget the warm-ups' spans
    walls: dict[str, list[float]] = {name: [] for name in sets}
    chunks: dict[str, list[int]] = {name: [] for name in sets}
    for i in range(rounds):
        for name, (rig, senders) in sets.items():
            time.sleep(0.01)  # the next pools granted, the previous round's work done
            walls[name] += one_round(rig, senders, tokens, f"r{name}-{i}")
            chunks[name] += rig.host_times()["decode"]["chunk"]
    return {
        name: {
            "receiver_threads": threads[name],
            "host_us_per_chunk_p50": statistics.median(chunks[name]) / 1e3 if chunks[name] else float("nan"),
            "p50_ms": statistics.median(walls[name]) * 1e3,
            "requests": len(walls[name]),
        }
        for name in sets
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--senders", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--channel", default="tcp")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = TransferConfig()
    blocks = SENDER_LAYOUT.blocks_for(config.pool_tokens)
    # every sender's pool within the pools' share of the receiver's blocks, and room for the requests besides
    receiver_blocks = int(args.senders * blocks / config.pool_blocks_share) + 2 * args.senders * blocks
    out: dict[str, object] = {"channel": args.channel, "tokens": args.tokens, "receiver_blocks": receiver_blocks}
    sender_blocks = max(64, args.senders * SENDER_LAYOUT.blocks_for(args.tokens))  # each sender's request its own
    with (
        TransferRig(args.channel, SENDER_LAYOUT, sender_blocks, receiver_blocks, config) as alone,
        TransferRig(args.channel, SENDER_LAYOUT, sender_blocks, receiver_blocks, config) as rig,
    ):
        options = channel_options(args.channel, "127.0.0.1", {})
        extra = [
            KVSender(
                create_channel(args.channel, f"bench-prefill-{uuid.uuid4().hex[:6]}", options),
                SENDER_LAYOUT,
                rig.kv,
                FINGERPRINT,
                config,
            )
            for _ in range(args.senders - 1)
        ]
        try:
            sets = {"1": (alone, [alone.sender]), str(args.senders): (rig, [rig.sender, *extra])}
            got = measure(sets, args.tokens, args.rounds)
        finally:
            for sender in extra:
                sender.close()
                sender.channel.close()
    one, many = got["1"], got[str(args.senders)]
    out["1"], out[str(args.senders)] = one, many
    out["ratio"] = {k: many[k] / one[k] for k in ("receiver_threads", "host_us_per_chunk_p50", "p50_ms")}

    print(json.dumps(out))


if __name__ == "__main__":
    main()
