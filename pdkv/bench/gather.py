"""`pdkv bench gather`: paged gather/scatter GB/s against memcpy of the same bytes.

Gather and scatter run for every chunk on both sides of every transfer, so
their cost is compared with the cheapest way to move the same bytes on the
same machine in the same run: libc memcpy (through ctypes, GIL released).
The baseline is the faster of one memcpy of the whole region and the region
split over the intra-op threads in 256 KiB memcpy calls, so a multi-threaded
gather is not flattered by a single-threaded baseline.

The chunk is Llama-3-8B shaped (32 layers, 8 KV heads, head_dim 128, bf16,
256 tokens = 32 MiB, block size 16) and its blocks are scattered at random
through a buffer of 4096 blocks. The buffer is allocated with torch.empty and
only the blocks in use are written, so it costs 32 MiB of RAM however many
blocks it spans. Every timed repeat, of the copy and of the baseline alike,
starts with cold caches (a scratch buffer several times the last-level cache
is written first): on a serving worker the KV was written by the forward pass
long before the chunk moves. Rows alternate op and baseline repeats so a
noisy shared machine slows both alike; the ratio is of medians.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import torch

from pdkv import layout as torch_path
from pdkv import native
from pdkv.bench import plot
from pdkv.errors import ConfigError
from pdkv.layout import KVLayout

LLAMA3_8B = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
TOKENS = 256
NUM_BLOCKS = 4096
LAYOUTS = tuple(
    msgspec.structs.replace(LLAMA3_8B, kind=kind, order=order)
    for kind, order in (
        *(("per_layer", o) for o in ("NHD", "HND")),
        *(("cross_layer", o) for o in ("NHD", "HND")),
        ("per_layer", "NHKD"),  # vLLM 0.32's GPU cache in its default LBNHC layout
        ("split_kv", "NHD"),  # K and V planes
    )
)
REPEATS = {"native": 15, "torch": 5}  # the torch path is ~10x slower; fewer repeats keep the run short
FLUSH_BYTES = 128 << 20  # 4x the 32 MiB L3 of the machine this was tuned on
PIECE_BYTES = 256 << 10


Report = dict[str, Any]


class Memcpy:
    """The baseline: libc memcpy of ``nbytes`` between two preallocated regions."""

    def __init__(self, nbytes: int, threads: int, pool: ThreadPoolExecutor) -> None:
        self.nbytes = nbytes
        self.threads = threads
        self.pool = pool
        self.src = torch.empty(nbytes, dtype=torch.uint8).random_()
        self.dst = torch.zeros(nbytes, dtype=torch.uint8)

    def whole(self) -> None:
        ctypes.memmove(self.dst.data_ptr(), self.src.data_ptr(), self.nbytes)

    def split(self) -> None:
        share = -(-self.nbytes // self.threads)
        parts = [
            self.pool.submit(self._pieces, lo, min(lo + share, self.nbytes)) for lo in range(0, self.nbytes, share)
        ]
        for part in parts:
            part.result()

    def _pieces(self, lo: int, hi: int) -> None:
        dst, src = self.dst.data_ptr(), self.src.data_ptr()
        for off in range(lo, hi, PIECE_BYTES):
            ctypes.memmove(dst + off, src + off, min(PIECE_BYTES, hi - off))


def run(args: argparse.Namespace) -> int:
    tokens, repeats = getattr(args, "tokens", TOKENS), getattr(args, "repeats", 0)
    if tokens < 1 or repeats < 0:
        raise ConfigError(
            f"bench gather: --tokens {tokens} must be >= 1 and --repeats {repeats} >= 0 (0: 15 native, 5 torch)"
        )
    plot.check(getattr(args, "plot", None))
    report = measure(tokens, repeats)
    print(json.dumps(report) if args.json else format_table(report))
    if getattr(args, "plot", None):
        draw(report, args.plot)
    return 0


def measure(tokens: int = TOKENS, repeats: int = 0) -> Report:
    """Time every (op, impl, layout) row against the same-run memcpy baseline (``repeats`` 0: ``REPEATS``)."""
    threads = torch.get_num_threads()
    with ThreadPoolExecutor(threads) as pool:
        return _measure(threads, Memcpy(LLAMA3_8B.chunk_bytes(tokens), threads, pool), tokens, repeats)


def _measure(threads: int, baseline: Memcpy, tokens: int, repeats: int) -> Report:
    rng = torch.Generator().manual_seed(0)
    scratch = torch.zeros(FLUSH_BYTES, dtype=torch.uint8)
    impls: dict[str, tuple[Callable[..., torch.Tensor], Callable[..., None]]] = {}
    if native.available():
        impls["native"] = (native.gather, native.scatter)
    impls["torch"] = (torch_path.gather, torch_path.scatter)
    rows: list[dict[str, object]] = []
    for layout in LAYOUTS:
        tensors = [
            torch.empty(layout.tensor_shape(NUM_BLOCKS), dtype=layout.torch_dtype) for _ in range(layout.num_tensors)
        ]
        table = torch.randperm(NUM_BLOCKS, generator=rng)[: layout.blocks_for(tokens)]
        for t in tensors:
            t[table] = torch.randn(t[table].shape, generator=rng).to(layout.torch_dtype)
        chunk = torch_path.gather(layout, tensors, table, 0, tokens)
        nbytes = layout.chunk_bytes(tokens)
        out = torch.empty_like(chunk)
        for impl, (gather, scatter) in impls.items():
            ops: dict[str, Callable[[], object]] = {
                "gather": functools.partial(gather, layout, tensors, table, 0, tokens, out),
                "scatter": functools.partial(scatter, layout, tensors, table, 0, chunk),
            }
            for op, fn in ops.items():
                gbps, base_gbps = _compare(fn, baseline, scratch, repeats or REPEATS[impl], nbytes)
                rows.append(
                    {
                        "op": op,
                        "impl": impl,
                        "layout": f"{layout.kind} {layout.order}",
                        "bytes": nbytes,  # 4 significant digits: a slow row is not 0
                        "gbps": float(f"{gbps:.4g}"),
                        "baseline_gbps": float(f"{base_gbps:.4g}"),
                        "ratio": float(f"{gbps / base_gbps:.4g}"),
                    }
                )
    return {
        "bench": "gather",
        "baseline": "memcpy",
        "config": {
            **{f: getattr(LLAMA3_8B, f) for f in ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype")},
            "tokens": tokens,
            "num_blocks": NUM_BLOCKS,
            "threads": threads,
            "cache": "cold (scratch written before each timed repeat)",
        },
        "native": {"available": "native" in impls, "reason": native.reason()},
        "results": rows,
    }


def _compare(
    fn: Callable[[], object], baseline: Memcpy, scratch: torch.Tensor, repeats: int, nbytes: int
) -> tuple[float, float]:
    """(op GB/s, best memcpy GB/s): medians over ``repeats`` interleaved cold-cache repeats."""
    fn()  # warm-up: first touch of the output, lazy init
    times: dict[str, list[float]] = {"op": [], "whole": [], "split": []}
    for _ in range(repeats):
        for name, step in (("op", fn), ("whole", baseline.whole), ("split", baseline.split)):
            scratch.add_(1)
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    op_s = statistics.median(times["op"])
    base_s = min(statistics.median(times["whole"]), statistics.median(times["split"]))
    return nbytes / op_s / 1e9, nbytes / base_s / 1e9


def draw(report: Report, path: str) -> None:
    """``--plot``: GB/s of each (op, impl, layout) beside memcpy of the same bytes in the same run."""
    rows = report["results"]
    plot.bars(
        path,
        f"pdkv bench gather: {report['config']['tokens']}-token Llama-3-8B chunk, cold cache, "
        f"{report['config']['threads']} threads",
        "GB/s",
        [f"{r['op']} {r['impl']}\n{r['layout']}" for r in rows],
        {"gather/scatter": [r["gbps"] for r in rows], "baseline: memcpy": [r["baseline_gbps"] for r in rows]},
    )


def format_table(report: Report) -> str:
    lines = [
        f"paged gather/scatter vs memcpy, {report['config']['tokens']}-token Llama-3-8B chunk, cold cache, "
        f"{report['config']['threads']} threads"
    ]
    if not report["native"]["available"]:
        lines.append(f"native: unavailable ({report['native']['reason']})")
    lines.append(f"{'op':<8} {'impl':<7} {'layout':<16} {'MiB':>6} {'GB/s':>7} {'memcpy GB/s':>12} {'ratio':>6}")
    for row in report["results"]:
        lines.append(
            f"{row['op']:<8} {row['impl']:<7} {row['layout']:<16} {row['bytes'] / 2**20:>6.1f} "
            f"{row['gbps']:>7.2f} {row['baseline_gbps']:>12.2f} {row['ratio']:>6.2f}"
        )
    return "\n".join(lines)
