"""`pdkv bench tier`: GB/s of each cache level's batched put and get, against a memcpy of the same bytes.

Chunks are the default model's (SmolLM2-135M: 30 layers, 3 KV heads of 64,
float32; 256 tokens, 11.8 MB), put and read back in batches of
``load_batch_chunks`` (4, what a worker reads per batch), each level fresh
per round: memory; disk (the files dropped from the page cache before the
reads); a redis-server and an S3 server (SeaweedFS) on loopback, each
started by the bench where installed (a row says why it is missing
otherwise). GB/s counts the chunks' KV bytes (not headers), over the median
of ``--repeats`` rounds. The baseline is ``memcpy``: the same chunks copied
into the same read buffers by torch in the same rounds; each row's ``ratio``
is its GB/s over that one's for get (``put_ratio`` for put). A memory put
keeps the caller's tensor (no copy), so its put GB/s only says it costs
next to nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from pdkv.bench import plot
from pdkv.bench.ttft import drop_page_cache
from pdkv.errors import ConfigError, PdkvError
from pdkv.keys import chunk_keys
from pdkv.layout import KVLayout
from pdkv.testing import redis as test_redis
from pdkv.testing import s3 as test_s3
from pdkv.tier import CacheTier, DiskTier, MemoryTier, RedisTier
from pdkv.tier.s3 import S3Options, S3Tier

Report = dict[str, Any]

LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32")  # the default model's
CHUNK_TOKENS = 256
BATCH = 4
LEVELS = ("memory", "disk", "redis", "s3")


def run(args: argparse.Namespace) -> int:
    levels = [name.strip() for name in args.levels.split(",") if name.strip()]
    unknown = set(levels) - set(LEVELS)
    if unknown or not levels:
        raise ConfigError(f"bench tier --levels {args.levels!r}: expected a comma-separated subset of {LEVELS}")
    if args.chunks < 1 or args.repeats < 1:
        raise ConfigError(f"bench tier --chunks {args.chunks} --repeats {args.repeats}: expected >= 1 each")
    plot.check(args.plot)
    report = measure(levels, args.chunks, args.repeats)
    print(json.dumps(report) if args.json else json.dumps(report, indent=2))
    if args.plot:
        draw(report, args.plot)
    return 0


@contextlib.contextmanager
def _servers(levels: list[str]) -> Iterator[dict[str, Any]]:
    """The servers the asked levels need, started here where installed; ``skipped`` says why one is not."""
    out: dict[str, Any] = {"skipped": {}}
    with contextlib.ExitStack() as stack:
        if "redis" in levels:
            if test_redis.server_binary() is None:
                out["skipped"]["redis"] = f"no redis-server found: {test_redis.INSTALL_HINT}"
            else:
                out["redis"] = stack.enter_context(test_redis.local_redis(maxmemory="4gb"))
        if "s3" in levels:
            if test_s3.server_binary() is None:
                out["skipped"]["s3"] = f"no SeaweedFS found: {test_s3.INSTALL_HINT}"
            else:
                out["s3"] = stack.enter_context(test_s3.local_s3())
        yield out


def _opener(name: str, servers: dict[str, Any], tmp: Path, nbytes: int) -> Callable[[int], CacheTier]:
    """A function that opens a fresh level ``name`` for round ``r``."""
    run_id = uuid.uuid4().hex[:8]
    if name == "memory":
        return lambda r: MemoryTier(LAYOUT, 2 * nbytes)
    if name == "disk":
        return lambda r: DiskTier(LAYOUT, tmp / f"disk-{r}", 2 * nbytes)
    if name == "redis":
        return lambda r: RedisTier(LAYOUT, servers["redis"].url, namespace=f"bench:tier:{run_id}:{r}:", timeout_s=30)
    s3 = servers["s3"]
    return lambda r: S3Tier(
        LAYOUT, S3Options(**s3.level_options("pdkv-bench", prefix=f"tier/{run_id}/{r}/", timeout_s=30))
    )


def measure(levels: list[str], chunks: int = 16, repeats: int = 3) -> Report:
    keys = chunk_keys(list(range(chunks * CHUNK_TOKENS)), "bench-tier", CHUNK_TOKENS)
    data = [
        torch.randn(LAYOUT.chunk_shape(CHUNK_TOKENS), generator=torch.Generator().manual_seed(i)) for i in range(chunks)
    ]
    outs = [torch.empty_like(d) for d in data]
    nbytes = sum(d.numel() * d.element_size() for d in data)
    batches = [range(i, min(i + BATCH, chunks)) for i in range(0, chunks, BATCH)]
    seconds: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="pdkv-bench-tier-") as tmp, _servers(levels) as servers:
        openers = {n: _opener(n, servers, Path(tmp), nbytes) for n in levels if n not in servers["skipped"]}
        for out, d in zip(outs, data, strict=True):  # untimed: the first copy into fresh buffers faults their pages in
            out.copy_(d)
        for r in range(repeats):
            start = time.perf_counter()
            for out, d in zip(outs, data, strict=True):
                out.copy_(d)
            copy = time.perf_counter() - start
            seconds.setdefault("memcpy", {"put": [], "get": []})
            seconds["memcpy"]["put"].append(copy)
            seconds["memcpy"]["get"].append(copy)
            for name, open_level in openers.items():
                seconds.setdefault(name, {"put": [], "get": []})
                level = open_level(r)
                try:
                    level.ping()
                    put, get = _round(
                        level, keys, data, outs, batches, Path(tmp) / f"disk-{r}" if name == "disk" else None
                    )
                finally:
                    level.close()
                seconds[name]["put"].append(put)
                seconds[name]["get"].append(get)
        skipped = dict(servers["skipped"])
    gbps = {name: {op: nbytes / statistics.median(s[op]) / 1e9 for op in ("put", "get")} for name, s in seconds.items()}
    rows = [
        {
            "level": name,
            "put_gbps": round(g["put"], 3),
            "get_gbps": round(g["get"], 3),
            "ratio": round(g["get"] / gbps["memcpy"]["get"], 4),  # get: what a worker's load waits for
            "put_ratio": round(g["put"] / gbps["memcpy"]["put"], 4),
            "put_samples_s": [round(x, 4) for x in seconds[name]["put"]],
            "get_samples_s": [round(x, 4) for x in seconds[name]["get"]],
        }
        for name, g in gbps.items()
        if name != "memcpy"
    ]
    return {
        "bench": "tier",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "loadavg": os.getloadavg()},
        "chunk_tokens": CHUNK_TOKENS,
        "chunk_bytes": LAYOUT.chunk_bytes(CHUNK_TOKENS),
        "chunks": chunks,
        "batch_chunks": BATCH,
        "repeats": repeats,
        "baseline": "memcpy: the same chunks copied by torch into the same read buffers, in the same rounds",
        "baseline_gbps": round(gbps["memcpy"]["get"], 3),
        "results": rows,
        "skipped": skipped,
    }


def _round(
    level: CacheTier,
    keys: list[bytes],
    data: list[torch.Tensor],
    outs: list[torch.Tensor],
    batches: list[range],
    disk_dir: Path | None,
) -> tuple[float, float]:
    """Seconds to put every chunk, then to read every one back, batch by batch; checks what came back."""
    start = time.perf_counter()
    for b in batches:
        level.put([keys[i] for i in b], [data[i] for i in b])
    put = time.perf_counter() - start
    if disk_dir is not None:
        drop_page_cache(disk_dir)
    start = time.perf_counter()
    for b in batches:
        if level.get([keys[i] for i in b], [outs[i] for i in b]) != len(b):
            raise PdkvError(f"bench tier: {next(iter(level.stats()))} served fewer chunks than were put")
    get = time.perf_counter() - start
    if not all(torch.equal(o, d) for o, d in zip(outs, data, strict=True)):
        raise PdkvError(f"bench tier: {next(iter(level.stats()))} read back other bytes")
    return put, get


def draw(report: Report, path: str) -> None:
    rows = report["results"]
    plot.bars(
        path,
        f"pdkv bench tier: {report['chunks']} chunks of {report['chunk_bytes'] / 1e6:.1f} MB, batches of "
        f"{report['batch_chunks']}",
        "GB/s",
        [r["level"] for r in rows],
        {
            "put": [r["put_gbps"] for r in rows],
            "get": [r["get_gbps"] for r in rows],
            "baseline: memcpy": [report["baseline_gbps"]] * len(rows),
        },
        note=f"median of {report['repeats']} rounds; get ratios to memcpy: "
        + ", ".join(f"{r['level']} {r['ratio']:.3f}" for r in rows),
    )
