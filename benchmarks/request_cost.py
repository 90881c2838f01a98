"""The fixed cost of one request (issue 28, item 3): one short request at a time, sender -> receiver in another
process, against the raw channel moving the same bytes in the same run.

    python benchmarks/request_cost.py --channel tcp --pool-tokens 256 --repeats 200

Prints one JSON line: per request size, the median and p90 of ``open`` + ``send_all`` + ``wait`` (what
``pdkv bench transfer`` times per request) and the raw channel's time for the same bytes. ``--pool-tokens 0``
reserves every request first; on a pdkv without pools (a checkout from before them) the option is ignored, so
the same script measures before and after: run them alternately (benchmarks/RESULTS.md, issue 28).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pdkv.bench.channel import BASELINES, _load
from pdkv.bench.netrig import LOOPBACK
from pdkv.bench.transfer import SENDER_LAYOUT, TransferRig
from pdkv.config import TransferConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--channel", default="tcp")
    parser.add_argument("--pool-tokens", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--tokens", default="40,256")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pools = "pool_tokens" in TransferConfig.__struct_fields__
    config = TransferConfig(**({"pool_tokens": args.pool_tokens} if pools else {}))
    sizes = [int(t) for t in args.tokens.split(",")]
    out: dict[str, object] = {"channel": args.channel, "pool_tokens": args.pool_tokens if pools else None}
    biggest = max(SENDER_LAYOUT.chunk_bytes(t) for t in sizes)
    with (
        TransferRig(args.channel, SENDER_LAYOUT, 64, 256, config) as rig,
        _load(BASELINES[args.channel])(biggest, LOOPBACK) as raw,
    ):
        rig.push([("warm", sizes[0])])
        for tokens in sizes:
            nbytes = SENDER_LAYOUT.chunk_bytes(tokens)
            times = []
            for i in range(args.repeats):
                if pools and args.pool_tokens:  # the next pool is granted right after the previous request
                    deadline = time.monotonic() + 0.05
                    while time.monotonic() < deadline and not any(
                        p.pool is not None for p in rig.sender.handshake.peers.values()
                    ):
                        time.sleep(0.0002)
                _, each = rig.push([(f"r{tokens}-{i}", tokens)])
                times.append(each[0])
            raw_s = [nbytes / (raw.gbps(nbytes, 20) * 1e9) for _ in range(5)]
            times.sort()
            out[str(tokens)] = {
                "p50_ms": 1e3 * statistics.median(times),
                "p90_ms": 1e3 * times[int(0.9 * (len(times) - 1))],
                "raw_ms": 1e3 * statistics.median(raw_s),
                "bytes": nbytes,
            }
        out["sender"] = {k: v for k, v in rig.sender.stats().items() if k in ("reserved_from_pool", "transfers_ok")}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
