"""``pdkv bench checksum``: the chunk checksum's cost against ``copy_`` of the same bytes, on the bytes' device.

Every chunk is hashed on both sides of a transfer, where its bytes are
(``pdkv.checksum``), so its cost is set against the cheapest thing one can do
with the same bytes on the same device in the same run: a torch ``copy_``
into another buffer (memcpy on CPU, a device-to-device copy on CUDA). ``cost``
is checksum time over copy time, ``ratio`` its inverse (the issue's bar:
<= 0.10 on CPU, <= 0.05 on a GPU). Rows: the bytes hashed as one staged frame
and as the KV blocks of a direct-mode chunk (``unit`` = one block), in one
piece and in one piece per block (a fragmented block table: no two blocks
adjacent), each by the path a call takes (``native``: the CPU or CUDA kernel, or
``torch``: the torch ops, the fallback; both where the kernel is there, the
torch rows being what the transfer path ran before the kernels), plus on CPU
the xxh3-64 of host bytes used before that, for scale. Then the checksum
folded into the staging copies: ``gather + checksum`` / ``scatter +
checksum`` (a Llama-3-8B chunk of the same bytes, a fragmented block table)
against the same gather/scatter without it, in the same rounds: there
``gbps`` is the op with the checksum, ``without_gbps`` the op without,
``ratio`` the time without over the time with (1.0: the checksum is free) and
``cost`` the *extra* time over copy time, ``(t_with - t_without) / t_copy``.
Reps of every row of a size and the copy alternate, warm caches (the chunk was
just gathered or just landed); medians. On CPU ``cpu_cost`` is the same ratio
in the calling thread's CPU seconds (steadier than wall time on a loaded
machine; one thread does all the work with the default ``--threads 1``: on a
shared machine, worker threads waiting for a busy core swamp both sides of the
comparison).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from pdkv import native
from pdkv.bench import plot
from pdkv.bench.gather import LLAMA3_8B
from pdkv.checksum import checksum, chunk_checksum, flat_bytes, frame_checksum
from pdkv.errors import ConfigError
from pdkv.memory import byte_view

SIZES = (1 << 20, 8 << 20, 32 << 20)  # a few blocks, a 64-token chunk, a 256-token Llama-3-8B chunk
REPEATS = 15


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _torch_path(on: bool) -> Iterator[None]:
    """Calls inside take the torch path when ``on`` (``PDKV_NATIVE=0``, which pdkv.native reads on every call)."""
    old = os.environ.get(native.ENV_VAR)
    if on:
        os.environ[native.ENV_VAR] = "0"
    try:
        yield
    finally:
        if on:
            if old is None:
                del os.environ[native.ENV_VAR]
            else:
                os.environ[native.ENV_VAR] = old


def _alternate(
    fns: dict[str, tuple[Callable[[], object], bool]], device: torch.device, repeats: int
) -> dict[str, tuple[float, float]]:
    """Median (wall, calling thread's CPU) seconds of each fn, queued device work included, reps round-robin;
    each fn's flag: run it on the torch path."""
    wall: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    for fn, torch_only in fns.values():  # warm-up: lazy init, weights, scratch buffers
        with _torch_path(torch_only):
            fn()
    for _ in range(repeats):
        for name, (fn, torch_only) in fns.items():
            with _torch_path(torch_only):
                _sync(device)
                w, c = time.perf_counter(), time.thread_time()
                fn()
                _sync(device)
                cpu[name].append(time.thread_time() - c)
                wall[name].append(time.perf_counter() - w)
    return {name: (statistics.median(wall[name]), statistics.median(cpu[name])) for name in fns}


def _row(name: str, n: int, t: tuple[float, float], copy: tuple[float, float], cpu: bool, **extra: Any) -> dict:
    """One result row; ``t`` is the (wall, CPU) seconds charged to the checksum; ``extra`` may override ``ratio``."""
    row = {
        "hash": name,
        "bytes": n,
        "gbps": float(f"{n / t[0] / 1e9:.4g}"),
        "copy_gbps": float(f"{n / copy[0] / 1e9:.4g}"),
        "ratio": float(f"{copy[0] / t[0]:.4g}"),
        "cost": float(f"{t[0] / copy[0]:.4g}"),
        **extra,
    }
    if cpu:
        row["cpu_cost"] = float(f"{t[1] / copy[1]:.4g}")
    return row


def _hash_rows(dev: torch.device, n: int, unit: int, paths: list[str], repeats: int) -> list[dict[str, Any]]:
    """The checksum alone, of ``n`` bytes, by each path, against ``copy_`` of them."""
    on_cpu = dev.type == "cpu"
    src = torch.empty(n, dtype=torch.uint8, device=dev).random_(0, 256)
    dst = torch.empty_like(src)
    blocks = [src[i : i + unit] for i in range(0, n, unit)]  # a block table with no two blocks adjacent
    candidates: dict[str, tuple[Callable[[], object], bool]] = {"copy": (lambda: dst.copy_(src), False)}
    for path in paths:
        slow = path == "torch"
        candidates[f"frame|{path}"] = (lambda: chunk_checksum([src]), slow)
        candidates[f"blocks|{path}"] = (lambda: chunk_checksum([src], unit=unit), slow)
        candidates[f"blocks, one piece each|{path}"] = (lambda: chunk_checksum(blocks, unit=unit), slow)
    if on_cpu:
        candidates["xxh3 (host, before)|xxh3"] = (lambda: checksum([byte_view(src)]), False)
        candidates["xxh3, one piece each|xxh3"] = (lambda: checksum(byte_view(b) for b in blocks), False)
    times = _alternate(candidates, dev, repeats)
    copy = times.pop("copy")
    rows = []
    for key, t in times.items():
        name, path = key.split("|")
        rows.append(_row(name, n, t, copy, on_cpu, path=path))
    return rows


def _staging_rows(dev: torch.device, size: int, repeats: int) -> list[dict[str, Any]]:
    """The checksum folded into the staging gather and scatter of a Llama-3-8B chunk of about ``size`` bytes (whole
    blocks, at least one: its own copy baseline)."""
    layout = LLAMA3_8B
    tokens = max(layout.block_size, size // layout.chunk_bytes(1) // layout.block_size * layout.block_size)
    blocks = tokens // layout.block_size
    kv = layout.allocate(2 * blocks, device=dev)
    for t in kv:
        t.view(torch.int16).random_()
    table = random.Random(0).sample(range(2 * blocks), blocks)  # fragmented: P's free list after a while
    chunk = torch.empty(layout.chunk_shape(tokens), dtype=layout.torch_dtype, device=dev)
    frame = flat_bytes(chunk)
    paged = native.PagedBuffer(layout, kv)  # as a sender's or receiver's memory keeps it
    one_pass = paged.gather_summed(table, 0, tokens, chunk, True)[1] is not None  # else copy, then hash
    src, dst = frame.clone(), torch.empty_like(frame)
    times = _alternate(
        {
            "copy": (lambda: dst.copy_(src), False),
            "gather": (lambda: paged.gather_summed(table, 0, tokens, chunk), False),
            "gather + checksum": (
                lambda: frame_checksum(frame, paged.gather_summed(table, 0, tokens, chunk, True)[1]),
                False,
            ),
            "scatter": (lambda: paged.scatter_summed(table, 0, chunk), False),
            "scatter + checksum": (
                lambda: frame_checksum(frame, paged.scatter_summed(table, 0, chunk, True)),
                False,
            ),
        },
        dev,
        repeats,
    )
    rows = []
    for op in ("gather", "scatter"):
        plain, fused = times[op], times[f"{op} + checksum"]
        extra = (fused[0] - plain[0], fused[1] - plain[1])  # negative when noise outweighs the checksum
        row = _row(
            f"{op} + checksum",
            frame.numel(),
            fused,
            times["copy"],
            dev.type == "cpu",
            path="native, one pass" if one_pass else "copy, then checksum",
            without_gbps=float(f"{frame.numel() / plain[0] / 1e9:.4g}"),
            ratio=float(f"{plain[0] / fused[0]:.4g}"),
            cost=float(f"{extra[0] / times['copy'][0]:.4g}"),
        )
        if dev.type == "cpu":
            row["cpu_cost"] = float(f"{extra[1] / times['copy'][1]:.4g}")
        rows.append(row)
    return rows


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
    on_cpu = dev.type == "cpu"
    kernel = native.available() if on_cpu else native.cuda_checksum_available()
    paths = ["native", "torch"] if kernel else ["torch"]
    unit = LLAMA3_8B.block_bytes
    rows = []
    for size in sizes:
        n = size // unit * unit
        rows.extend(_hash_rows(dev, n, unit, paths, repeats))
        rows.extend(_staging_rows(dev, n, repeats))
    return {
        "bench": "checksum",
        "device": str(dev),
        "baseline": f"torch copy_ of the same bytes on {dev}",
        "threads": torch.get_num_threads(),
        "unit_bytes": unit,
        "native": native.reason() or "in use",
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
        print(f"{'hash':<24} {'path':<20} {'MiB':>6} {'GB/s':>8} {'copy GB/s':>10} {'cost':>6} {'cpu cost':>8}")
        for r in out["results"]:
            print(
                f"{r['hash']:<24} {r['path']:<20} {r['bytes'] / 2**20:6.1f} {r['gbps']:8.2f} {r['copy_gbps']:10.2f} "
                f"{r['cost']:6.3f} {r.get('cpu_cost', float('nan')):8.3f}"
            )
    if getattr(args, "plot", None):
        rows = out["results"]
        plot.bars(
            args.plot,
            f"pdkv bench checksum on {out['device']}",
            "GB/s",
            [f"{r['hash']} ({r['path']})\n{r['bytes'] / 2**20:.0f} MiB" for r in rows],
            {"checksum": [r["gbps"] for r in rows], "baseline: copy_": [r["copy_gbps"] for r in rows]},
        )
    return 0
