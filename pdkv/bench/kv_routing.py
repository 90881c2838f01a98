"""`pdkv bench kv-routing`: what KV-aware routing buys on the Mooncake conversation trace, and what a lookup costs.

Two measurements, one run, one JSON object:

1. ``results`` (with its ``baseline``): the router's prefix index (pdkv.kv_events.index) holding
   10^5 blocks over four workers, asked for a prompt's cached prefix on
   every worker; for vLLM's 16-token blocks and pdkv's 256-token chunks.
   The baseline is the least any hash-based lookup does: one xxh3 pass over
   the prompt's token bytes. Also shown: encoding the same prompt as text
   with the default model's tokenizer, which the router does first when
   prompts arrive as text.
2. ``trace``: whole conversations of the Mooncake trace (each 512-token
   block shrunk to ``--block-tokens`` tokens, one tier chunk per block)
   replayed through real ``pdkv launch`` workers: ``--prefill-workers``
   prefill workers (memory tier of ``--memory-mib`` each, KV events on) and
   one decode worker, behind ``--routers`` router replicas per policy
   (requests alternate between them, as behind a load balancer): round-robin,
   least-loaded, prefix with the router's own guess (the policy as it was
   before KV events), and prefix following the workers' KV events. Each
   policy's prompts start with a token of their own, so no policy hits
   another's chunks; requests go in trace order, at most ``--concurrency``
   in flight (default 1), each policy over the whole
   sample in turn, in two passes (the second in reverse order) so a drift
   in the machine's load hits every policy alike. Block hit rate: prompt
   chunks loaded from a worker's tier over all full chunks; TTFT: what a
   client of the router sees (the first streamed event). The bound is one
   infinite cache seeing every request (the chunk with the last token is
   always computed).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import xxhash
import yaml

from pdkv.bench import plot
from pdkv.bench.ttft import TRACE_ENV, TraceRequest, block_tokens, load_trace, replay_sample, trace_path
from pdkv.engine.loader import load_checkpoint
from pdkv.errors import PdkvError
from pdkv.kv_events.index import PrefixIndex
from pdkv.kv_events.wire import BlockStored, KVEventBatch
from pdkv.testing.http import get_text, metric
from pdkv.testing.procs import WorkerProcess, start_worker

Report = dict[str, Any]

POLICIES: dict[str, dict[str, Any]] = {
    "round-robin": {"policy": "round-robin"},
    "least-loaded": {"policy": "least-loaded"},
    "prefix (router's guess)": {"policy": "prefix", "kv_events_discover": False},
    "prefix (KV events)": {"policy": "prefix", "kv_events_discover": True, "kv_events_check_s": 1.0},
}
VOCAB = 49152


def run(args: argparse.Namespace) -> int:
    plot.check(getattr(args, "plot", None))
    report: Report = {
        "bench": "kv-routing",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_before": os.getloadavg()},
    }
    report.update(lookup_cost(args.blocks, tokenizer=args.model))
    trace = Path(args.trace) if args.trace else trace_path()
    if trace is None or not trace.is_file():
        report["trace"] = {"skipped": f"the Mooncake trace was not found (give --trace PATH or set ${TRACE_ENV})"}
    elif args.prefill_workers:
        report["trace"] = replay(load_trace(trace), args)
    report["machine"]["load_after"] = os.getloadavg()
    print(json.dumps(report) if args.json else format_report(report))
    if getattr(args, "plot", None):
        draw(report, args.plot)
    return 0


def draw(report: Report, path: str) -> None:
    """``--plot``: per policy, the trace's chunk hit rate and TTFT against round-robin's; without the trace, the
    lookup."""
    tr = report.get("trace", {})
    if tr.get("results"):
        rows = tr["results"]
        plot.bars(
            path,
            f"pdkv bench kv-routing: {tr['requests']} trace requests, {tr['prefill_workers']} prefill workers",
            "share / ratio",
            [r["policy"] for r in rows],
            {
                "chunk hit rate": [r["chunk_hit_rate"] for r in rows],
                "mean TTFT / round-robin": [r["ratio"] for r in rows],
            },
            note=f"bound (one infinite cache): hit rate {tr['infinite_cache_chunk_hit_rate']}",
        )
        return
    rows = report["results"]
    plot.bars(
        path,
        "pdkv bench kv-routing: prefix index lookup",
        "CPU us per lookup",
        [f"block {r['block_size']}" for r in rows],
        {"lookup": [r["lookup_cpu_us"] for r in rows], report["baseline"]: [r["baseline_hash_cpu_us"] for r in rows]},
    )


# -- 1. lookup cost --------------------------------------------------------------------------------
def _chain_event(tokens: np.ndarray, block_size: int, salt: int) -> BlockStored:
    n = len(tokens) // block_size
    return BlockStored(
        block_hashes=[salt * 1_000_000 + i for i in range(n)],
        parent_block_hash=None,
        token_ids=tokens[: n * block_size].tolist(),
        block_size=block_size,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


def lookup_cost(
    total_blocks: int = 100_000,
    workers: int = 4,
    prompt_tokens: int = 8192,
    lookups: int = 200,
    tokenizer: str = "default",
) -> Report:
    rng = np.random.default_rng(0)
    rows = []
    for block_size in (16, 256):
        index = PrefixIndex()
        names = [f"w{i}" for i in range(workers)]
        chain_blocks = prompt_tokens // block_size
        chains: list[np.ndarray] = []
        for c in range(total_blocks // chain_blocks):  # whole prompts' worth of blocks, spread over the workers
            tokens = rng.integers(100, VOCAB, prompt_tokens)
            chains.append(tokens)
            index.apply(names[c % workers], KVEventBatch(ts=0.0, events=[_chain_event(tokens, block_size, c)]))
        held = sum(len(w) for w in index.workers.values())
        prompts = []
        for _ in range(lookups):  # a cached prefix of random length, then new tokens
            base = chains[int(rng.integers(len(chains)))]
            keep = int(rng.integers(0, prompt_tokens))
            prompts.append(np.concatenate([base[:keep], rng.integers(100, VOCAB, prompt_tokens - keep)]))
        lookup_wall, lookup_cpu = _timed(
            lambda prompts=prompts, index=index, names=names: [index.match(p, names) for p in prompts], lookups
        )
        hash_wall, hash_cpu = _timed(
            lambda prompts=prompts: [
                xxhash.xxh3_64_intdigest(memoryview(np.ascontiguousarray(p, dtype="<i8")).cast("B")) for p in prompts
            ],
            lookups,
        )
        rows.append(
            {
                "block_size": block_size,
                "indexed_blocks": held,
                "workers": workers,
                "prompt_tokens": prompt_tokens,
                "lookup_cpu_us": lookup_cpu,
                "lookup_wall_us": lookup_wall,
                "baseline_hash_cpu_us": hash_cpu,
                "ratio": round(lookup_cpu / hash_cpu, 2),
            }
        )
    tok_wall, tok_cpu = _tokenize_cost(prompt_tokens, tokenizer)
    return {
        "baseline": "one xxh3 pass over the prompt's token bytes (CPU time; wall time is shown too, it includes "
        "waiting for a core)",
        "results": rows,
        "tokenize_text_cpu_us": tok_cpu,
        "tokenize_text_wall_us": tok_wall,
    }


def _timed(fn: Any, count: int) -> tuple[float, float]:
    """(wall, CPU) microseconds per item of one call of ``fn`` doing ``count`` items."""
    wall, cpu = time.perf_counter(), time.thread_time()
    fn()
    return round((time.perf_counter() - wall) / count * 1e6, 1), round((time.thread_time() - cpu) / count * 1e6, 1)


def _tokenize_cost(prompt_tokens: int, model: str) -> tuple[float | None, float | None]:
    """(wall, CPU) microseconds to encode a text prompt of about ``prompt_tokens`` tokens with ``model``'s tokenizer."""
    try:
        from pdkv.router.kv_aware import load_tokenizer

        tok = load_tokenizer(model)
    except PdkvError:
        return None, None
    text = " ".join(f"word{i % 997} is number {i}." for i in range(prompt_tokens // 6))
    tok.encode(text)
    return _timed(lambda: [tok.encode(text) for _ in range(10)], 10)


# -- 2. the trace through real workers --------------------------------------------------------------
def _prompts(sample: Sequence[TraceRequest], block: int, salt: int, vocab: int) -> list[list[int]]:
    return [[salt, *np.concatenate([block_tokens(h, block, vocab) for h in r.hash_ids]).tolist()] for r in sample]


def _bound(sample: Sequence[TraceRequest]) -> float:
    """Chunk hit rate of one infinite cache: the leading chunks seen before. (With the salt token in front,
    the prompt's last token is alone in a partial chunk, so every full chunk can be loaded.)"""
    seen: set[tuple[int, ...]] = set()
    hits = total = 0
    for r in sample:
        keys = [tuple(r.hash_ids[: i + 1]) for i in range(len(r.hash_ids))]
        run = next((i for i, k in enumerate(keys) if k not in seen), len(keys))
        hits += run
        total += len(keys)
        seen.update(keys)
    return hits / total


def _stream_ttft(url: str, prompt: list[int], timeout: float = 600) -> float:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.netloc, timeout=timeout)
    try:
        start = time.perf_counter()
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps({"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "stream": True}),
            {"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        if resp.status != 200:
            raise PdkvError(f"{url} answered {resp.status}: {resp.read()[:300]!r}")
        while not (line := resp.readline()).startswith(b"data: "):
            if not line:
                raise PdkvError(f"{url} closed its stream before the first event")
        ttft = time.perf_counter() - start
        resp.read()
        return ttft
    finally:
        conn.close()


def _totals(workers: Sequence[WorkerProcess]) -> dict[str, Any]:
    out: dict[str, Any] = {"tier_tokens": 0.0, "tier_chunks": 0.0, "prompt_tokens": 0.0, "requests": []}
    for w in workers:
        text = get_text(w.url + "/metrics")
        out["requests"].append(metric(text, "pdkv_requests_total", outcome="ok"))
        out["tier_tokens"] += metric(text, "pdkv_prompt_tokens_total", source="tier")
        out["tier_chunks"] += sum(metric(text, "pdkv_tier_hits_total", tier=t) for t in ("memory", "disk", "redis"))
        out["prompt_tokens"] += metric(text, "pdkv_prompt_tokens_total", source="computed") + metric(
            text, "pdkv_prompt_tokens_total", source="tier"
        )
    return out


def replay(requests: Sequence[TraceRequest], args: argparse.Namespace) -> Report:
    sample = [
        TraceRequest(r.timestamp_ms, r.hash_ids[: args.max_blocks], r.output_length)
        for r in replay_sample(requests, args.conversations)
    ]
    block = args.block_tokens
    vocab = load_checkpoint(
        args.model, progress=False
    ).config.vocab_size  # the trace's token ids must fit the model's vocabulary
    workers: list[WorkerProcess] = []
    routers: dict[str, list[WorkerProcess]] = {}
    runs: dict[str, list[Report]] = {name: [] for name in POLICIES}
    with tempfile.TemporaryDirectory(prefix="pdkv-bench-kv-routing-") as tmp:
        try:
            # generous transfer timeouts: on a loaded shared machine a timed-out transfer is a recompute that
            # would be charged to whichever policy happened to run then
            base = {
                "model": args.model,
                "num_threads": 1,
                "num_blocks": 512,
                "transfer": {"chunk_size": block, "transfer_timeout_s": 900, "chunk_timeout_s": 600, "lease_s": 120},
            }
            decode_cfg = Path(tmp) / "decode.yaml"
            decode_cfg.write_text(yaml.safe_dump({**base, "tier": {"enabled": False}}))
            prefill_cfg = Path(tmp) / "prefill.yaml"
            prefill_cfg.write_text(
                yaml.safe_dump(
                    {
                        **base,
                        "tier": {"memory_bytes": args.memory_mib << 20},
                        "kv_events": {
                            "enable_kv_cache_events": True,
                            "endpoint": "tcp://*:0",
                            "replay_endpoint": "tcp://*:0",
                        },
                    }
                )
            )
            decode = start_worker("decode", "--config", str(decode_cfg), "--port", "0", timeout=900)
            workers.append(decode)
            prefills = [
                start_worker("prefill", "--config", str(prefill_cfg), "--port", "0", timeout=900)
                for _ in range(args.prefill_workers)
            ]
            workers += prefills
            for name, settings in POLICIES.items():
                cfg = Path(tmp) / f"router-{len(routers)}.yaml"
                cfg.write_text(yaml.safe_dump({"router": {**settings, "prefix_chunk_tokens": block}}))
                flags = [a for p in prefills for a in ("--prefill", p.url)]
                routers[name] = [
                    start_worker(
                        "router", "--config", str(cfg), "--port", "0", *flags, "--decode", decode.url, timeout=300
                    )
                    for _ in range(args.routers)
                ]
            time.sleep(3)  # the KV-aware router subscribes to every stream (it checks each second)
            order = list(POLICIES)
            salt = 1
            for pass_no, names in enumerate((order, order[::-1])):
                for name in names:
                    print(f"kv-routing: pass {pass_no}, {name}", file=sys.stderr, flush=True)
                    prompts = _prompts(sample, block, salt, vocab)
                    salt += 1
                    before = _totals(prefills)
                    with ThreadPoolExecutor(
                        args.concurrency
                    ) as pool:  # in trace order, at most --concurrency in flight
                        ttfts = list(
                            pool.map(
                                lambda ip, name=name: _stream_ttft(routers[name][ip[0] % args.routers].url, ip[1]),
                                enumerate(prompts),
                            )
                        )
                    after = _totals(prefills)
                    full_chunks = sum(len(p) // block for p in prompts)
                    runs[name].append(
                        {
                            "pass": pass_no,
                            "mean_ttft_s": statistics.mean(ttfts),
                            "p50_ttft_s": statistics.median(ttfts),
                            "chunk_hit_rate": (after["tier_chunks"] - before["tier_chunks"]) / full_chunks,
                            "token_hit_rate": (after["tier_tokens"] - before["tier_tokens"])
                            / (after["prompt_tokens"] - before["prompt_tokens"]),
                            "requests_per_prefill_worker": [
                                a - b for a, b in zip(after["requests"], before["requests"], strict=True)
                            ],
                        }
                    )
            d_metrics = get_text(decode.url + "/metrics")
            kv_metrics = [get_text(r.url + "/metrics") for r in routers["prefix (KV events)"]]
            kv_lost = sum(metric(m, "pdkv_router_kv_stream_events_total", event="lost") for m in kv_metrics)
            reasons = ("kv_hit", "kv_miss", "kv_load_balanced", "prefix_hit", "prefix_miss")
            kv_decisions = {
                why: sum(metric(m, "pdkv_router_decisions_total", role="prefill", reason=why) for m in kv_metrics)
                for why in reasons
            }
        finally:
            for proc in [*(r for replicas in routers.values() for r in replicas), *workers]:
                proc.stop()
    baseline = statistics.mean(r["mean_ttft_s"] for r in runs["round-robin"])
    results = []
    for name, rs in runs.items():
        mean_ttft = statistics.mean(r["mean_ttft_s"] for r in rs)
        results.append(
            {
                "policy": name,
                "chunk_hit_rate": round(statistics.mean(r["chunk_hit_rate"] for r in rs), 4),
                "token_hit_rate": round(statistics.mean(r["token_hit_rate"] for r in rs), 4),
                "mean_ttft_s": round(mean_ttft, 4),
                "ratio": round(mean_ttft / baseline, 4),
                "passes": [{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()} for r in rs],
                "requests_per_prefill_worker": [
                    sum(col) for col in zip(*(r["requests_per_prefill_worker"] for r in rs), strict=True)
                ],
            }
        )
    return {
        "requests": len(sample),
        "conversations": args.conversations,
        "prefill_workers": args.prefill_workers,
        "memory_mib_per_worker": args.memory_mib,
        "routers_per_policy": args.routers,
        "concurrency": args.concurrency,
        "scale": f"each 512-token trace block -> {block} tokens (one tier chunk), prompts capped at {args.max_blocks} "
        "blocks, plus one salt token",
        "prompt_tokens_per_pass": sum(len(p) for p in _prompts(sample, block, 0, vocab)),
        "infinite_cache_chunk_hit_rate": round(_bound(sample), 4),
        "decode_fallbacks": metric(d_metrics, "pdkv_fallbacks_total"),
        "kv_router_streams_lost": kv_lost,
        "kv_router_decisions": kv_decisions,  # kv_*: made from the events; prefix_*: no stream yet (the router's guess)
        "baseline": "round-robin, same workers, same requests, same passes (ratio = mean TTFT / round-robin's)",
        "results": results,
    }


def format_report(report: Report) -> str:
    lk = report
    lines = [
        f"Prefix index lookup, baseline {lk['baseline']}; encoding the prompt as text: {lk['tokenize_text_cpu_us']} us "
        "CPU:"
    ]
    lines += [
        f"  block {r['block_size']:>4}: {r['indexed_blocks']} blocks, {r['prompt_tokens']}-token prompt: "
        f"{r['lookup_cpu_us']} us CPU ({r['lookup_wall_us']} wall), hash {r['baseline_hash_cpu_us']} us, ratio "
        f"{r['ratio']}"
        for r in lk["results"]
    ]
    tr = report.get("trace", {})
    if "skipped" in tr:
        lines.append(f"trace: skipped: {tr['skipped']}")
    elif tr:
        lines.append(
            f"Mooncake trace: {tr['requests']} requests, {tr['prefill_workers']} prefill workers, bound "
            f"{tr['infinite_cache_chunk_hit_rate']}"
        )
        lines += [
            f"  {r['policy']:<24} hit {r['chunk_hit_rate']:.3f}  mean TTFT {r['mean_ttft_s']:.3f}s  ratio "
            f"{r['ratio']:.3f}"
            for r in tr["results"]
        ]
    lines.append(f"load {report['machine']['load_before']} -> {report['machine']['load_after']}")
    return "\n".join(lines)
