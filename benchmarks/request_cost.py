"""The fixed cost of one request (issue 28, item 3): one short request at a time, sender -> receiver in another
process, against the raw channel moving the same bytes in the same run.

    python benchmarks/request_cost.py --channel tcp --pool-tokens 256 --repeats 200

Prints one JSON line: per request size, the median and p90 of ``open`` + ``send_all`` + ``wait`` (what
``pdkv bench transfer`` times per request), the median CPU time each side's process spent on one request (all
its threads, /proc schedstat: steadier than wall time on a loaded machine), and the raw channel's time and
CPU for the same bytes. ``--pool-tokens 0``
reserves every request first (default: the config's, one chunk); on a pdkv without pools the option is ignored, so
the same script measures before and after: run them alternately
(benchmarks/history/2026-11-26-cost-of-a-byte-and-a-request-issue-28.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import statistics
import time

import torch

from pdkv.bench.channel import BASELINES, _load, _recv
from pdkv.bench.netrig import LOOPBACK
from pdkv.bench.transfer import SENDER_LAYOUT, TransferRig, _digest
from pdkv.config import TransferConfig


def cpu_ns(pid: int) -> int:
    """CPU time of every thread of ``pid`` so far, in ns (/proc/PID/task/*/schedstat: exact, unlike ticks)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/schedstat") as f:
            total += int(f.read().split()[0])
    return total


def one_request(rig: TransferRig, rid: str, tokens: int, table: list[int], peer: int) -> tuple[float, int, int, float]:
    """Move one request as ``TransferRig.push`` does; (seconds, sender CPU ns, receiver CPU ns, seconds in
    ``open``) of the transfer alone, then check its KV bit for bit outside the measured part."""
    rig.conn.send(("expect", [(rid, tokens)]))
    c0, p0, t0 = cpu_ns(os.getpid()), cpu_ns(peer), time.perf_counter()
    xfer = rig.sender.open(rid, rig.address, tokens, table)
    opened = time.perf_counter()
    xfer.send_all()
    xfer.wait(60)
    t1, c1, p1 = time.perf_counter(), cpu_ns(os.getpid()), cpu_ns(peer)
    rig.conn.send(("check",))
    digests = _recv(rig.conn, "the receiver's digests")[1]
    if digests != [_digest(rig.layout, rig.kv, table, tokens)]:
        raise SystemExit(f"{rid}: the decode side holds other KV than was sent")
    return t1 - t0, c1 - c0, p1 - p0, opened - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--channel", default="tcp")
    parser.add_argument("--pool-tokens", type=int, default=None, help="default: the config's (one chunk)")
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--tokens", default="40,256")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pools = "pool_tokens" in TransferConfig.__struct_fields__
    config = TransferConfig(**({"pool_tokens": args.pool_tokens} if pools and args.pool_tokens is not None else {}))
    pool_tokens = getattr(config, "pool_tokens", 0)
    sizes = [int(t) for t in args.tokens.split(",")]
    out: dict[str, object] = {"channel": args.channel, "pool_tokens": pool_tokens if pools else None}
    biggest = max(SENDER_LAYOUT.chunk_bytes(t) for t in sizes)
    with TransferRig(args.channel, SENDER_LAYOUT, 64, 256, config) as rig:
        receiver = [p.pid for p in multiprocessing.active_children()]
        with _load(BASELINES[args.channel])(biggest, LOOPBACK) as raw:
            raw_peer = [p.pid for p in multiprocessing.active_children() if p.pid not in receiver]
            rig.push([("warm", sizes[0])])
            for tokens in sizes:
                nbytes = SENDER_LAYOUT.chunk_bytes(tokens)
                table = rig.allocator.allocate(SENDER_LAYOUT.blocks_for(tokens))
                runs = []
                for i in range(args.repeats):
                    if pool_tokens:  # the next pool is granted right after the previous request
                        deadline = time.monotonic() + 0.05
                        while time.monotonic() < deadline and not any(
                            p.pool is not None for p in rig.sender.handshake.peers.values()
                        ):
                            time.sleep(0.0002)
                    runs.append(one_request(rig, f"r{tokens}-{i}", tokens, table, *receiver))
                rig.allocator.free(table)
                raw_runs = []
                for _ in range(5):
                    c0, p0 = cpu_ns(os.getpid()), sum(cpu_ns(p) for p in raw_peer)
                    gbps = raw.gbps(nbytes, 20)
                    c1, p1 = cpu_ns(os.getpid()), sum(cpu_ns(p) for p in raw_peer)
                    raw_runs.append((nbytes / gbps / 1e9, (c1 - c0) / 20, (p1 - p0) / 20))
                times = sorted(r[0] for r in runs)
                out[str(tokens)] = {
                    "p50_ms": 1e3 * statistics.median(times),
                    "p90_ms": 1e3 * times[int(0.9 * (len(times) - 1))],
                    "open_ms": 1e3 * statistics.median(r[3] for r in runs),  # the Reserve's round trip, or none
                    "sender_cpu_ms": statistics.median(r[1] for r in runs) / 1e6,
                    "receiver_cpu_ms": statistics.median(r[2] for r in runs) / 1e6,
                    "raw_ms": 1e3 * statistics.median(r[0] for r in raw_runs),
                    "raw_sender_cpu_ms": statistics.median(r[1] for r in raw_runs) / 1e6,
                    "raw_receiver_cpu_ms": statistics.median(r[2] for r in raw_runs) / 1e6,
                    "bytes": nbytes,
                }
        out["sender"] = {k: v for k, v in rig.sender.stats().items() if k in ("reserved_from_pool", "transfers_ok")}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
