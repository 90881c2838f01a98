"""NIXL's post time against descriptor count (issue 46, step 3): what a request's descriptor count costs it, and so what
a cross-layer KV layout (one descriptor per block, not per layer and block) would buy.

    python benchmarks/nixl_post.py --total-mib 2 --repeats 200

The raw NIXL agent (``pdkv.bench.nixl_raw.RawNixl``: two processes, agents built as the nixl channel builds its
own, host memory) moves the same ``--total-mib`` bytes as 1, 30, 240 and 3,840 descriptors, each a gap apart on
both sides so NIXL cannot merge them (a request's blocks of 30 layers x K/V are apart in vLLM's per-layer layout:
240 = 8 blocks x 30, 3,840 = 128 blocks x 30). Prints one JSON object: per count the medians of building the
prepped transfer (``make_prepped_xfer``), posting it (``transfer``: over cma on one host the copy happens inside it)
and from the post to DONE, in microseconds, and each against one descriptor's (the baseline: the same bytes as one
range), the counts taking turns within each repeat; by each of the baseline's two programs (``progress_thread``:
NIXL's progress thread on, as vLLM runs its agent, and off, as the nixl channel runs its own).
"""

from __future__ import annotations

import argparse
import json
import math
import os

from pdkv.bench.nixl_raw import RawNixl

COUNTS = (1, 30, 240, 3840)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--total-mib", type=float, default=2.0, help="bytes per transfer (2 MiB: a 40-token request)")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--counts", type=int, nargs="+", default=list(COUNTS))
    args = parser.parse_args()
    total = int(args.total_mib * (1 << 20))
    total -= total % math.lcm(*args.counts)  # every count cuts it into equal descriptors
    out_rows = []
    with RawNixl(2 * total) as raw:
        for on in raw.pairs:  # each program: NIXL's progress thread on (as vLLM runs it) and off (as pdkv does)
            rows = raw.post_cost(args.counts, total, args.repeats, progress_thread=on)
            one = rows[min(args.counts)]
            out_rows += [
                {
                    "progress_thread": on,
                    "descriptors": n,
                    **r,
                    **{f"{k[:-3]}_vs_one": round(r[k] / one[k], 2) for k in ("build_us", "post_us", "wire_us")},
                }
                for n, r in rows.items()
            ]
    out = {
        "bench": "nixl_post",
        "bytes": total,
        "repeats": args.repeats,
        "load": os.getloadavg()[0],
        "rows": out_rows,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
