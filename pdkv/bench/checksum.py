"""``pdkv bench checksum``: the chunk checksum's cost against ``copy_`` of the same bytes, on the bytes' device.

Every chunk is hashed on both sides of a transfer, where its bytes are
(``pdkv.checksum.chunk_checksum``), so its cost is set against the cheapest
thing one can do with the same bytes on the same device in the same run: a
torch ``copy_`` into another buffer (memcpy on CPU, a device-to-device copy on
CUDA). ``ratio`` is checksum GB/s over copy GB/s, ``cost`` its inverse:
checksum time over copy time (the issue's bar: <= 0.10 on CPU, <= 0.05 on a
GPU). Rows: the bytes hashed as one staged frame and as
the KV blocks of a direct-mode chunk (``unit`` = one block), in one piece and
in one piece per block (a fragmented block table: no two blocks adjacent),
plus on CPU the xxh3-64 of host bytes the transfer path used before, for
scale. Reps of the
checksum and the copy alternate, warm caches (the chunk was just gathered or
just landed); medians. One torch thread by default (``--threads``): on a
shared machine, OpenMP's worker threads waiting for a busy core swamp both
sides of the comparison.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from pdkv.bench import plot
from pdkv.bench.gather import LLAMA3_8B
from pdkv.checksum import checksum, chunk_checksum
from pdkv.errors import ConfigError
from pdkv.memory import byte_view

SIZES = (1 << 20, 8 << 20, 32 << 20)  # a few blocks, a 64-token chunk, a 256-token Llama-3-8B chunk
REPEATS = 15


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_once(fn: Callable[[], object], device: torch.device, into: list[float]) -> None:
    """Append the seconds ``fn`` takes, the device's queued work included."""
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    into.append(time.perf_counter() - start)


def measure(
    device: str = "cpu", sizes: tuple[int, ...] = SIZES, repeats: int = REPEATS, threads: int = 1
) -> dict[str, Any]:
    """The result object of ``pdkv bench checksum --json``."""
    torch.set_num_threads(threads)
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("bench checksum --device cuda: torch sees no CUDA device here")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"bench checksum --device {device!r}: expected cpu or cuda")
    unit = LLAMA3_8B.block_bytes
    rows = []
    for size in sizes:
        n = size // unit * unit
        src = torch.empty(n, dtype=torch.uint8, device=dev).random_(0, 256)
        dst = torch.empty_like(src)
        blocks = [src[i : i + unit] for i in range(0, n, unit)]  # a block table with no two blocks adjacent
        candidates: dict[str, Callable[[], object]] = {
            "frame": lambda src=src: chunk_checksum([src]),
            "blocks": lambda src=src: chunk_checksum([src], unit=unit),
            "blocks, one piece each": lambda blocks=blocks: chunk_checksum(blocks, unit=unit),
        }
        if dev.type == "cpu":
            candidates["xxh3 (host, before)"] = lambda src=src: checksum([byte_view(src)])
            candidates["xxh3, one piece each"] = lambda blocks=blocks: checksum(byte_view(b) for b in blocks)
        for name, fn in candidates.items():
            fn()  # warm-up: the weights, lazy init
            ours: list[float] = []
            copies: list[float] = []
            for _ in range(repeats):
                _time_once(fn, dev, ours)
                _time_once(lambda src=src, dst=dst: dst.copy_(src), dev, copies)
            t, c = statistics.median(ours), statistics.median(copies)
            rows.append(
                {
                    "hash": name,
                    "bytes": n,
                    "gbps": float(f"{n / t / 1e9:.4g}"),
                    "copy_gbps": float(f"{n / c / 1e9:.4g}"),
                    "ratio": float(f"{c / t:.4g}"),
                    "cost": float(f"{t / c:.4g}"),
                }
            )
    return {
        "bench": "checksum",
        "device": str(dev),
        "baseline": f"torch copy_ of the same bytes on {dev}",
        "threads": torch.get_num_threads(),
        "unit_bytes": unit,
        "results": rows,
    }


def run(args: argparse.Namespace) -> int:
    if args.repeats < 1 or args.threads < 1:
        raise ConfigError(f"bench checksum --repeats {args.repeats} --threads {args.threads}: expected >= 1")
    plot.check(getattr(args, "plot", None))
    out = measure(args.device, repeats=args.repeats, threads=args.threads)
    if args.json:
        print(json.dumps(out))
    else:
        print(f"chunk checksum vs {out['baseline']}, {out['threads']} threads")
        print(f"{'hash':<24} {'MiB':>6} {'GB/s':>8} {'copy GB/s':>10} {'cost':>6}")
        for r in out["results"]:
            print(f"{r['hash']:<24} {r['bytes'] / 2**20:6.1f} {r['gbps']:8.2f} {r['copy_gbps']:10.2f} {r['cost']:6.3f}")
    if getattr(args, "plot", None):
        rows = out["results"]
        plot.bars(
            args.plot,
            f"pdkv bench checksum on {out['device']}",
            "GB/s",
            [f"{r['hash']}\n{r['bytes'] / 2**20:.0f} MiB" for r in rows],
            {"checksum": [r["gbps"] for r in rows], "baseline: copy_": [r["copy_gbps"] for r in rows]},
        )
    return 0
