"""A prefill worker sending to many decode workers at once (issue 46's step 4 on the prefill side): its tcp threads and
a request's host time on it, with one request to each of N decode workers at the same moment, against one decode
worker in the same run.

    python benchmarks/fan_out.py --receivers 8 --tokens 40 --rounds 20

Prints one JSON line: per receiver count (1 and N), the prefill worker's tcp threads (its workers, link watcher
and its own target's serve threads; a thread per stream and a watcher per link before), its host microseconds per
request (``host_us_per_request``: open, plan and posting, pdkv/transfer/hosttime.py) and the requests' p50 wall time;
the ratio of N's to 1's, their rounds alternating. Each decode worker is a ``TransferRig``'s receiver, in a process
of its own; the one prefill worker is the first rig's ``KVSender``, which sends to all of them. Every request's KV
is checked bit for bit on its decode side. The wall times are on this machine's cores shared by N + 1 processes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import threading
import time

import torch
from fan_in import push_at_once

from pdkv.bench.channel import _recv
from pdkv.bench.transfer import SENDER_LAYOUT, TransferRig, _digest
from pdkv.config import TransferConfig
from pdkv.transfer.sender import KVSender


def one_round(sender: KVSender, rigs: list[TransferRig], kv: list[torch.Tensor], tokens: int, tag: str) -> list[float]:
    """One request to each rig's receiver at once, each from blocks of its own; each one's seconds. Raises unless every
    push completed and each decode side holds its request's KV bit for bit."""
    n = SENDER_LAYOUT.blocks_for(tokens)
    tables = [list(range(i * n, (i + 1) * n)) for i in range(len(rigs))]
    for i, rig in enumerate(rigs):
        rig.conn.send(("expect", [(f"{tag}-{i}", tokens)]))
    spent = push_at_once([(sender, f"{tag}-{i}", rig.address, tables[i]) for i, rig in enumerate(rigs)], tokens, tag)
    for i, rig in enumerate(rigs):
        rig.conn.send(("check",))
        if _recv(rig.conn, "the receiver's digests")[1] != [_digest(SENDER_LAYOUT, kv, tables[i], tokens)]:
            raise SystemExit(f"round {tag}: decode worker {i} holds other KV than was sent")
    return spent


def sender_threads(sender: KVSender) -> int:
    """The prefill worker's tcp threads (every thread its channel named)."""
    prefix = f"tcp-{sender.channel.agent_name}"
    return sum(1 for t in threading.enumerate() if t.name.startswith(prefix))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--receivers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = TransferConfig()
    sender_blocks = max(64, args.receivers * SENDER_LAYOUT.blocks_for(args.tokens))
    counts = (1, args.receivers)
    with contextlib.ExitStack() as stack:
        rigs = [
            stack.enter_context(TransferRig("tcp", SENDER_LAYOUT, sender_blocks, 256, config))
            for _ in range(args.receivers)
        ]
        sender, kv, host = rigs[0].sender, rigs[0].kv, rigs[0].sender.parts.host
        threads = {}
        for k in counts:
            for i in range(3):  # handshakes and first pools
                one_round(sender, rigs[:k], kv, args.tokens, f"warm{k}-{i}")
                time.sleep(0.05)
            threads[k] = sender_threads(sender)
        host.take()  # forget the warm-ups' spans
        walls: dict[int, list[float]] = {k: [] for k in counts}
        requests: dict[int, list[int]] = {k: [] for k in counts}
        for i in range(args.rounds):
            for k in counts:
                time.sleep(0.01)  # the next pools granted, the previous round's work done
                walls[k] += one_round(sender, rigs[:k], kv, args.tokens, f"r{k}-{i}")
                requests[k] += host.take().get("request", [])
    out: dict[str, object] = {"channel": "tcp", "tokens": args.tokens}
    for k in counts:
        out[str(k)] = {
            "sender_threads": threads[k],
            "host_us_per_request_p50": statistics.median(requests[k]) / 1e3,
            "p50_ms": statistics.median(walls[k]) * 1e3,
            "requests": len(walls[k]),
        }
    one, many = out["1"], out[str(args.receivers)]
    assert isinstance(one, dict) and isinstance(many, dict)
    out["ratio"] = {k: many[k] / one[k] for k in ("sender_threads", "host_us_per_request_p50", "p50_ms")}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
