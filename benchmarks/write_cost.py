"""The host time of posting one direct chunk (issue 37): a channel's ``write`` of the chunk's ops, as the sender
posted it before, against ``write_blocks`` of the same blocks as arrays, in one process, alternately.

    python benchmarks/write_cost.py --channel nixl --tensors 30 --runs 1 8 16 --repeats 300

Two channels of one kind in this process, ``--tensors`` regions each registered with ``--block-bytes`` blocks; a
chunk of 16 blocks per tensor cut into ``--runs`` runs adjacent on both sides (so ``tensors x runs`` ops). Times
from the call until it returns (posting only: the wait for completion and the notification are outside); prints
one JSON line, per run count the median and p90 microseconds of each path and their ratio. On a pdkv without
``write_blocks`` only the ops path is measured, so the same script runs against the base.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from pdkv.channels import Channel, create_channel
from pdkv.transfer.plan import TransferPlan

CHUNK_BLOCKS = 16


def chunk(runs: int, num_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """Our and their block ids of a 16-block chunk in ``runs`` runs: each run's blocks adjacent on both sides,
    the runs apart on theirs."""
    per = CHUNK_BLOCKS // runs
    ours = np.arange(CHUNK_BLOCKS, dtype=np.int64) + 3
    theirs = np.concatenate([np.arange(per) + r * (per + 1) for r in range(runs)]).astype(np.int64) % num_blocks
    return ours, theirs


def plan_of(ours: np.ndarray, theirs: np.ndarray, num_blocks: int) -> TransferPlan:
    """The chunk as the sender's plan holds it: one chunk of one token per block."""
    n = len(ours)
    return TransferPlan.build(
        "wc", num_tokens=n, chunk_size=n, block_size=1, ours=ours.tolist(), num_blocks=num_blocks
    ).with_peer(theirs.tolist())


def timed(post: object, channel: Channel, receiver: Channel) -> float:
    """Microseconds ``post()`` took; then its handle waited for and the notification drained (not timed)."""
    t0 = time.perf_counter_ns()
    handle = post()  # type: ignore[operator]
    t1 = time.perf_counter_ns()
    channel.wait(handle, 30.0)
    channel.release(handle)
    deadline = time.monotonic() + 30.0
    while not receiver.get_notifications():
        if time.monotonic() > deadline:
            raise SystemExit("no notification within 30 s")
        time.sleep(0.0001)
    return (t1 - t0) / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--channel", default="nixl", choices=["nixl", "tcp"])
    parser.add_argument("--tensors", type=int, default=30)
    parser.add_argument("--runs", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--block-bytes", type=int, default=4096)
    parser.add_argument("--num-blocks", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    a = create_channel(args.channel, f"wc-a-{os.getpid()}", {})
    b = create_channel(args.channel, f"wc-b-{os.getpid()}", {})
    try:
        size = args.num_blocks * args.block_bytes
        bufs = [np.ones(size, dtype=np.uint8) for _ in range(2 * args.tensors)]
        local = [a.register(buf, args.block_bytes) for buf in bufs[: args.tensors]]
        remote = [b.register(buf, args.block_bytes) for buf in bufs[args.tensors :]]
        peer = a.add_peer(b.metadata())
        a.connect(peer, 30.0)
        has_blocks = hasattr(a, "write_blocks")
        rows = {}
        for runs in args.runs:
            ours, theirs = chunk(runs, args.num_blocks)
            plan = plan_of(ours, theirs, args.num_blocks)
            if has_blocks:  # the ops the sender posted before write_blocks: the same write's
                write = plan.writes(local, remote, args.block_bytes)[0]
                ops = write.ops()
            else:
                ops = plan.ops(local, remote, args.block_bytes)[0]
            paths = {"ops": lambda ops=ops: a.write(peer, ops, b"n")}
            if has_blocks:
                paths["blocks"] = lambda write=write: a.write_blocks(peer, write, b"n")
            times: dict[str, list[float]] = {k: [] for k in paths}
            for i in range(args.repeats + 20):
                for name, post in paths.items():
                    took = timed(post, a, b)
                    if i >= 20:  # warm-up left out
                        times[name].append(took)
            row: dict[str, object] = {"ops": len(ops)}
            for name, got in times.items():
                got.sort()
                row[f"{name}_us_p50"] = round(statistics.median(got), 1)
                row[f"{name}_us_p90"] = round(got[int(0.9 * len(got))], 1)
            if has_blocks:
                row["blocks_over_ops"] = round(row["blocks_us_p50"] / row["ops_us_p50"], 3)  # type: ignore[operator]
            rows[f"{args.tensors}x{runs}"] = row
        print(json.dumps({"channel": args.channel, "block_bytes": args.block_bytes, "rows": rows}))
    finally:
        a.close()
        b.close()


if __name__ == "__main__":
    main()
