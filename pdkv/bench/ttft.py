"""`pdkv bench ttft`: time to first token cold and served from each cache level, plus the Mooncake trace.

Three measurements, one run, one JSON object:

1. ``results``: a 2048-token prompt on the default model (SmolLM2-135M,
   float32, chunks of 256). The baseline is the plain prefill with no tier at
   all (``cold, tier off``); then its first sight with the tier on (every
   chunk computed, and offered to the tier as a worker does), and the same
   prompt served from memory, from disk (a fresh memory level, the disk files
   evicted from the page cache first) and from a real redis-server on
   loopback (fresh memory and disk). The cases run in rounds, every case once
   per round, ``--repeats`` rounds; each row is the median of its repeats and
   its ratio is over the baseline's median. Each cached run must give the
   baseline's first token and bit-identical KV. The chunk holding the last
   token is always computed (``pdkv.worker.tiering``), so at best 7 of 8
   chunks are loaded.
2. ``trace``: the Mooncake conversation trace (12,031 requests, prefix-chained
   512-token blocks) replayed through a ``MemoryTier`` (real keys, tiny
   values) at a few sizes and both policies: the block hit rate against the
   infinite-cache bound of the same trace (0.366).
3. ``replay``: a scaled-down replay through real ``pdkv launch`` workers
   (one decode, two prefill: tier off and on), whole conversations from the
   trace, each 512-token block shrunk to ``REPLAY_BLOCK_TOKENS`` tokens;
   requests go one at a time (this is a 2-core CPU), each to both prefill
   workers in turn so load drifts hit both alike. TTFT is what a client of
   the router sees: the prefill request (its KV pushed to the decode worker)
   plus the decode worker's first streamed token.

The trace ships with pdkv (``pdkv/bench/data/mooncake``, Apache-2.0, the
Mooncake project's; its README says where from); ``$PDKV_MOONCAKE_TRACE``
names another file (JSON lines, plain or ``.xz``). Without one, parts 2 and 3
report why they were skipped.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import http.client
import json
import lzma
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import torch
import yaml

from pdkv.bench import plot
from pdkv.checksum import layer_digests
from pdkv.demo import metric
from pdkv.engine.reference import ReferenceEngine
from pdkv.engine.sampling import SamplingParams
from pdkv.errors import ConfigError, PdkvError
from pdkv.keys import chunk_key, chunk_keys
from pdkv.launch.procs import WorkerProcess, start_worker
from pdkv.layout import KVLayout
from pdkv.tier import CacheTier, DiskTier, MemoryTier, RedisTier, TieredCache
from pdkv.tier.localredis import INSTALL_HINT, local_redis, server_binary
from pdkv.worker.metrics import WorkerMetrics
from pdkv.worker.tiering import Tiering

Report = dict[str, Any]

PROMPT_TOKENS = 2048
CHUNK = 256
REPEATS = 3
TARGET_RATIO = 0.2

TRACE_ENV = "PDKV_MOONCAKE_TRACE"
TRACE_FILE = Path(__file__).resolve().parent / "data" / "mooncake" / "conversation_trace.jsonl.xz"
TRACE_BLOCK_TOKENS = 512
TRACE_BOUND = 0.366  # the issue's figure; the run recomputes it from the file
SIM_LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, dtype="float32")  # 8 bytes/token: the hit rate needs keys, not KV
SIM_SIZES = (4096, 16384, 65536)  # L1 capacity in 512-token blocks

REPLAY_CONVERSATIONS = 8  # whole conversations (same first two blocks) with at least two requests
REPLAY_BLOCK_TOKENS = 8
REPLAY_MAX_BLOCKS = 48
REPLAY_CHUNK = 32


def run(args: argparse.Namespace) -> int:
    sizes = {"--prompt-tokens": args.prompt_tokens, "--repeats": args.repeats, "--replay-conversations": args.replay_conversations}
    for flag, value in sizes.items():
        if value < 1:
            raise ConfigError(f"bench ttft {flag} {value}: expected >= 1")
    if args.trace_requests < 0:
        raise ConfigError(f"bench ttft --trace-requests {args.trace_requests}: expected >= 0 (0: the whole trace)")
    plot.check(args.plot)
    report = measure(args.model, args.prompt_tokens, args.repeats, args.trace_requests, args.replay_conversations)
    print(json.dumps(report) if args.json else format_report(report))
    if args.plot:
        draw(report, args.plot)
    return 0


def measure(model: str = "default", prompt_tokens: int = PROMPT_TOKENS, repeats: int = REPEATS, trace_requests: int = 0, replay_conversations: int = REPLAY_CONVERSATIONS) -> Report:
    trace = trace_path()
    requests = load_trace(trace, trace_requests or None) if trace is not None else None
    engine = ReferenceEngine.load(model, progress=False)
    report: Report = {
        "bench": "ttft",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads()},
        **prompt_ttft(engine, model, prompt_tokens, repeats),
    }
    skipped = f"the Mooncake trace was not found (looked at ${TRACE_ENV} and {TRACE_FILE})"
    report["trace"] = trace_hit_rates(requests, str(trace)) if requests is not None else {"skipped": skipped}
    report["replay"] = replay(requests, replay_conversations, model, engine.vocab_size) if requests is not None else {"skipped": skipped}
    return report


# -- 1. one long prompt, cold and from each level -----------------------------------------
@dataclass
class Sample:
    seconds: float
    loaded_tokens: int
    first_token: int
    digests: list[str]


def _ttft(engine: ReferenceEngine, tiering: Tiering, prompt: list[int]) -> Sample:
    """A prefill worker's path for one prompt, timed from admission to the first token."""
    start = time.perf_counter()
    request = engine.new_request(prompt, SamplingParams(max_tokens=1, temperature=0))
    try:
        cached = tiering.load_sync(request)
        hook = tiering.offer(cached, None)
        logits = None
        for begin in range(request.num_computed, len(prompt), CHUNK):
            end = min(begin + CHUNK, len(prompt))
            logits = engine.prefill(request, begin, end)
            if hook is not None:
                hook(request, begin, end)
        assert logits is not None
        token = engine.sample(request, logits)
        seconds = time.perf_counter() - start
        return Sample(seconds, cached.tokens, token, layer_digests(engine.layout, engine.kv_buffer, request.block_table, len(prompt)))
    finally:
        engine.free(request)


def _drop_page_cache(root: Path) -> None:
    """Make the next read of the disk level's files come from the device, not the page cache."""
    for path in root.rglob("*.kv"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _stack(engine: ReferenceEngine, levels: Sequence[CacheTier]) -> Iterator[tuple[Tiering, TieredCache]]:
    cache = TieredCache(levels)
    try:
        yield Tiering(cache, engine, CHUNK, WorkerMetrics("prefill")), cache
    finally:
        cache.close()


CASES = {
    "cold, tier off": "no tier at all: the plain prefill (the baseline)",
    "cold": "first sight, tier on: every chunk computed, gathered and stored",
    "memory": "L1 hit (same process)",
    "disk": "L2 hit: fresh memory level, files dropped from the page cache (posix_fadvise) before the read",
    "redis": "remote hit: fresh memory and disk levels, redis-server on loopback TCP",
}


def prompt_ttft(engine: ReferenceEngine, model: str, prompt_tokens: int = PROMPT_TOKENS, repeats: int = REPEATS) -> Report:
    """Part 1. ``repeats`` rounds; each round runs every case once, in ``CASES`` order, against a tier of its own
    (fresh memory, disk directory and Redis namespace), so a burst of load on a shared machine hits every case
    alike and every median is over the same count."""
    rng = np.random.default_rng(2048)
    prompt = [int(t) for t in rng.integers(100, engine.vocab_size, prompt_tokens)]
    memory_bytes = 2 * engine.layout.chunk_bytes(prompt_tokens)
    samples: dict[str, list[Sample]] = {case: [] for case in CASES}
    with tempfile.TemporaryDirectory(prefix="pdkv-bench-ttft-") as tmp, contextlib.ExitStack() as stack:
        redis_url = stack.enter_context(local_redis()).url if server_binary() else None

        def levels(disk_dir: Path, namespace: str | None) -> list[CacheTier]:
            out: list[CacheTier] = [MemoryTier(engine.layout, memory_bytes), DiskTier(engine.layout, disk_dir, 4 * memory_bytes)]
            if namespace is not None and redis_url is not None:
                out.append(RedisTier(engine.layout, redis_url, namespace=namespace))
            return out

        for r in range(repeats):
            disk_dir, namespace = Path(tmp) / f"disk-{r}", f"bench:ttft:{os.getpid()}:{r}:"
            samples["cold, tier off"].append(_ttft(engine, Tiering(None, engine, CHUNK, WorkerMetrics("prefill")), prompt))
            with _stack(engine, levels(disk_dir, namespace)) as (tiering, cache):
                samples["cold"].append(_ttft(engine, tiering, prompt))  # computes every chunk, stores each as a worker does
                if not cache.flush(120):
                    raise PdkvError("the cold run's chunks were not written to disk and redis within 120s")
                samples["memory"].append(_ttft(engine, tiering, prompt))
            _drop_page_cache(disk_dir)
            with _stack(engine, levels(disk_dir, None)) as (tiering, _):
                samples["disk"].append(_ttft(engine, tiering, prompt))
            if redis_url is not None:
                with tempfile.TemporaryDirectory(dir=tmp) as fresh, _stack(engine, levels(Path(fresh), namespace)) as (tiering, _):
                    samples["redis"].append(_ttft(engine, tiering, prompt))
            shutil.rmtree(disk_dir)
    off = samples["cold, tier off"]
    base = statistics.median(s.seconds for s in off)
    rows: list[Report] = []
    for case, what in CASES.items():
        got = samples[case]
        if not got:
            continue
        seconds = statistics.median(s.seconds for s in got)
        rows.append({
            "case": case,
            "what": what,
            "ttft_s": round(seconds, 4),
            "samples_s": [round(s.seconds, 4) for s in got],
            "loaded_tokens": got[0].loaded_tokens,
            "computed_tokens": prompt_tokens - got[0].loaded_tokens,
            "identical": all(s.first_token == off[0].first_token and s.digests == off[0].digests for s in got),
            "ratio": round(seconds / base, 4),
        })
    cached = [r["ratio"] for r in rows if r["loaded_tokens"]]
    report: Report = {
        "model": f"{engine.model_name} (--model {model}), {engine.layout.dtype}",
        "prompt_tokens": prompt_tokens,
        "chunk_tokens": CHUNK,
        "chunk_bytes": engine.layout.chunk_bytes(CHUNK),
        "repeats": repeats,
        "baseline": "cold, tier off: the plain prefill, no tier; every case's median over the same repeats, the cases interleaved round by round",
        "cold_ttft_s": round(base, 4),
        "results": rows,
        "target": {"cached_ratio_max": TARGET_RATIO, "met": bool(cached) and max(cached) <= TARGET_RATIO},
    }
    if redis_url is None:
        report["redis_skipped"] = f"no redis-server found: {INSTALL_HINT}"
    return report


def draw(report: Report, path: str) -> None:
    """``--plot``: part 1, the median TTFT of each case beside the baseline's (cold, tier off)."""
    rows = report["results"]
    base = next(r["ttft_s"] for r in rows if r["case"] == "cold, tier off")
    plot.bars(path, f"pdkv bench ttft: {report['prompt_tokens']}-token prompt, {report['model']}", "time to first token (s)",
              [r["case"] for r in rows], {"this case (median)": [r["ttft_s"] for r in rows], "baseline: cold, tier off": [base] * len(rows)},
              note=f"median of {report['repeats']} interleaved repeats; ratios: " + ", ".join(f"{r['case']} {r['ratio']:.3f}" for r in rows))


# -- 2. the Mooncake trace through a memory level ------------------------------------------
@dataclass
class TraceRequest:
    timestamp_ms: int
    hash_ids: list[int]
    output_length: int


def trace_path() -> Path | None:
    """The trace named by $PDKV_MOONCAKE_TRACE, else the one shipped with pdkv; None if neither is there."""
    named = os.environ.get(TRACE_ENV)
    candidates = [Path(named)] if named else []
    candidates.append(TRACE_FILE)
    return next((p for p in candidates if p.is_file()), None)


def load_trace(path: Path, limit: int | None = None) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    with (lzma.open(path, "rt") if path.suffix == ".xz" else open(path)) as f:
        for line in f:
            if limit is not None and len(out) >= limit:
                break
            r = json.loads(line)
            out.append(TraceRequest(int(r["timestamp"]), [int(h) for h in r["hash_ids"]], int(r["output_length"])))
    return out


def block_tokens(hash_id: int, tokens: int = TRACE_BLOCK_TOKENS, vocab: int = 49152) -> np.ndarray:
    """The synthetic token ids of one trace block: same id, same tokens (the trace's README says so)."""
    return np.random.default_rng(hash_id).integers(100, vocab, tokens)


def trace_keys(requests: Sequence[TraceRequest], fingerprint: str, block: int = TRACE_BLOCK_TOKENS) -> list[list[bytes]]:
    """The chunk keys a worker would compute for each request's prompt (its blocks' tokens, chunks of one block).

    Each block's key is computed once, from its parent's: the same keys as
    ``chunk_keys`` over the whole prompt, without hashing each prompt again.
    """
    memo: dict[tuple[bytes, int], bytes] = {}
    out = []
    for r in requests:
        keys: list[bytes] = []
        for h in r.hash_ids:
            parent = keys[-1] if keys else b""
            key = memo.get((parent, h))
            if key is None:
                tokens = block_tokens(h, block)
                key = chunk_key(parent, fingerprint, tokens) if parent else chunk_keys(tokens, fingerprint, block)[0]
                memo[(parent, h)] = key
            keys.append(key)
        out.append(keys)
    return out


def infinite_hit_rate(keys: Sequence[Sequence[bytes]]) -> float:
    """Share of all blocks whose key was seen before: what an unbounded cache would hit."""
    seen: set[bytes] = set()
    hits = total = 0
    for ks in keys:
        total += len(ks)
        hits += sum(k in seen for k in ks)
        seen.update(ks)
    return hits / total


def simulated_hit_rate(keys: Sequence[Sequence[bytes]], capacity_blocks: int, policy: str) -> float:
    """Replay the requests through a ``MemoryTier``: each looks up its prefix, then stores what it computed."""
    tier = MemoryTier(SIM_LAYOUT, capacity_blocks * SIM_LAYOUT.chunk_bytes(TRACE_BLOCK_TOKENS), policy)
    value = torch.zeros(SIM_LAYOUT.chunk_shape(TRACE_BLOCK_TOKENS))  # shared: the tier never writes to what it keeps
    outs = [torch.empty_like(value) for _ in range(max(map(len, keys)))]
    hits = total = 0
    for ks in keys:
        got = tier.get(ks, outs[: len(ks)])
        tier.put(ks[got:], [value] * (len(ks) - got))
        hits += got
        total += len(ks)
    return hits / total


def trace_hit_rates(requests: Sequence[TraceRequest], path: str) -> Report:
    keys = trace_keys(requests, "mooncake-trace")
    bound = infinite_hit_rate(keys)
    unique = len({k for ks in keys for k in ks})
    rows = []
    for blocks in (*SIM_SIZES, unique):
        for policy in ("lru", "s3fifo"):
            rate = simulated_hit_rate(keys, blocks, policy)
            rows.append({"policy": policy, "l1_blocks": blocks, "l1_share_of_unique_blocks": round(blocks / unique, 4), "hit_rate": round(rate, 4), "ratio": round(rate / bound, 4)})
    return {
        "file": path,
        "requests": len(requests),
        "blocks": sum(map(len, keys)),
        "unique_blocks": unique,
        "infinite_cache_hit_rate": round(bound, 4),
        "expected_bound": TRACE_BOUND,
        "baseline": "infinite-cache block hit rate of the same trace (ratio = hit_rate / it)",
        "rows": rows,
    }


# -- 3. scaled-down replay through real workers ----------------------------------------------
def replay_sample(requests: Sequence[TraceRequest], conversations: int = REPLAY_CONVERSATIONS) -> list[TraceRequest]:
    """Every request of the first ``conversations`` conversations (same first two blocks) that have two or more, in trace order."""
    groups: dict[tuple[int, ...], list[int]] = collections.defaultdict(list)
    for i, r in enumerate(requests):
        groups[tuple(r.hash_ids[:2])].append(i)
    chosen = [g for g in groups.values() if len(g) >= 2][:conversations]
    return [requests[i] for i in sorted(i for g in chosen for i in g)]


def _post(url: str, body: dict[str, Any], timeout: float = 600) -> tuple[float, dict[str, Any] | None]:
    """POST JSON; for a streamed answer return when the first event arrives (and drain the rest)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.netloc, timeout=timeout)
    try:
        start = time.perf_counter()
        conn.request("POST", parts.path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise PdkvError(f"{url} answered {resp.status}: {resp.read()[:300]!r}")
        if not body.get("stream"):
            payload = json.loads(resp.read())
            return time.perf_counter() - start, payload
        while not (line := resp.readline()).startswith(b"data: "):
            if not line:
                raise PdkvError(f"{url} closed its stream before the first event")
        first = time.perf_counter() - start
        resp.read()
        return first, None
    finally:
        conn.close()


def _launch(role: str, tmp: Path, name: str, model: str, **settings: Any) -> WorkerProcess:
    cfg = {"model": model, "num_blocks": 128, "transfer": {"chunk_size": REPLAY_CHUNK}, **settings}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return start_worker(role, "--config", str(path), "--port", "0", timeout=600)


def replay(requests: Sequence[TraceRequest], conversations: int = REPLAY_CONVERSATIONS, model: str = "default", vocab: int = 49152) -> Report:
    sample = [dataclasses.replace(r, hash_ids=r.hash_ids[:REPLAY_MAX_BLOCKS]) for r in replay_sample(requests, conversations)]
    prompts = [np.concatenate([block_tokens(h, REPLAY_BLOCK_TOKENS, vocab) for h in r.hash_ids]).tolist() for r in sample]
    workers: list[WorkerProcess] = []
    ttft: dict[str, list[float]] = {"off": [], "on": []}
    mismatches = 0
    with tempfile.TemporaryDirectory(prefix="pdkv-bench-replay-") as tmp:
        try:
            decode = _launch("decode", Path(tmp), "decode", model, num_threads=1, tier={"enabled": False})
            workers.append(decode)
            prefill = {
                "off": _launch("prefill", Path(tmp), "p-off", model, num_threads=2, tier={"enabled": False}),
                "on": _launch("prefill", Path(tmp), "p-on", model, num_threads=2),
            }
            workers.extend(prefill.values())
            d_info = json.loads(_get(decode.url + "/pdkv/info"))
            for i, prompt in enumerate(prompts):
                first: dict[str, int] = {}
                for mode, p in prefill.items():
                    base = {"prompt": prompt, "temperature": 0, "ignore_eos": True}
                    kv = {"do_remote_decode": True, "remote_host": d_info["remote_host"], "remote_port": d_info["remote_port"], "transfer_id": f"r{i}-{mode}"}
                    p_seconds, answer = _post(p.url + "/v1/completions", {**base, "max_tokens": 1, "return_token_ids": True, "kv_transfer_params": kv})
                    assert answer is not None
                    first[mode] = answer["choices"][0]["token_ids"][0]
                    d_seconds, _ = _post(decode.url + "/v1/completions", {**base, "max_tokens": 2, "stream": True, "kv_transfer_params": answer["kv_transfer_params"]})
                    ttft[mode].append(p_seconds + d_seconds)
                mismatches += first["off"] != first["on"]
            on_metrics = _get(prefill["on"].url + "/metrics")
            d_metrics = _get(decode.url + "/metrics")
        finally:
            for w in workers:
                w.stop()
    total_tokens = sum(map(len, prompts))
    mean_off, mean_on = statistics.mean(ttft["off"]), statistics.mean(ttft["on"])
    return {
        "requests": len(prompts),
        "conversations": conversations,
        "scale": f"each 512-token trace block -> {REPLAY_BLOCK_TOKENS} tokens, prompts capped at {REPLAY_MAX_BLOCKS} blocks; chunk {REPLAY_CHUNK} tokens",
        "prompt_tokens": total_tokens,
        "sample_infinite_cache_hit_rate": round(infinite_hit_rate(trace_keys(sample, "replay", REPLAY_BLOCK_TOKENS)), 4),
        "tier_hit_token_share": round(metric(on_metrics, "pdkv_prompt_tokens_total", source="tier") / total_tokens, 4),
        "decode_fallbacks": metric(d_metrics, "pdkv_fallbacks_total"),
        "first_token_mismatches": mismatches,
        "baseline": "the same requests on a prefill worker with the tier off, interleaved",
        "results": [
            {"case": "tier off", "mean_ttft_s": round(mean_off, 4), "ratio": 1.0},
            {"case": "tier on (memory)", "mean_ttft_s": round(mean_on, 4), "ratio": round(mean_on / mean_off, 4)},
        ],
    }


def _get(url: str) -> str:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.netloc, timeout=30)
    try:
        conn.request("GET", parts.path)
        return conn.getresponse().read().decode()
    finally:
        conn.close()


def format_report(report: Report) -> str:
    lines = [f"TTFT of a {report['prompt_tokens']}-token prompt on {report['model']} (baseline, cold with the tier off: {report['cold_ttft_s']:.2f}s)"]
    lines += [f"  {r['case']:<16} {r['ttft_s']:8.3f}s  ratio {r['ratio']:.3f}  loaded {r['loaded_tokens']:>5}  identical {r['identical']}" for r in report["results"]]
    trace = report["trace"]
    if "skipped" in trace:
        lines.append(f"trace: skipped: {trace['skipped']}")
    else:
        lines.append(f"Mooncake trace: {trace['requests']} requests, infinite-cache block hit rate {trace['infinite_cache_hit_rate']}")
        lines += [f"  {r['policy']:<7} L1 {r['l1_blocks']:>7} blocks  hit rate {r['hit_rate']:.4f}  ratio {r['ratio']:.3f}" for r in trace["rows"]]
    rep = report["replay"]
    if "skipped" in rep:
        lines.append(f"replay: skipped: {rep['skipped']}")
    else:
        lines.append(f"replay: {rep['requests']} requests through real workers, tier hit share {rep['tier_hit_token_share']}")
        lines += [f"  {r['case']:<18} mean TTFT {r['mean_ttft_s']:.3f}s  ratio {r['ratio']:.3f}" for r in rep["results"]]
    return "\n".join(lines)
