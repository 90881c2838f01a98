"""``pdkv bench pd``: time to first token of a long prompt with prefill and decode on two hosts.

What disaggregation costs a request's first token when its KV crosses a real
link: a 2048-token prompt (``--tokens``) streamed through the router, the
prefill worker and the router on one host, the decode worker on another,
across a veth pair shaped to ``--link`` (``pdkv.bench.netrig``; without
``--link`` all three share loopback). The baseline, in the same run: one
worker doing it all (the same prompt streamed straight to a worker of the
same config on the first host, no router, no transfer). Both are measured
alternately, ``--repeats`` times after one warm-up each, and reported as
medians; the ratio is P/D over one worker.

The P/D path's first token needs the prefill (chunk by chunk, each chunk's KV
pushed as soon as it is computed) and the last chunks' transfer, then the
decode worker's first step: on a slow link the transfer stops hiding behind
the compute. Each P/D request must move every prompt token's KV: the
decode worker's ``pdkv_fallbacks_total`` and transferred prompt tokens are
checked, and a run where one fell back reports it (``fallbacks``) instead of
passing it off as a transfer TTFT. The tier is off on every worker (no
prompt is served from a cache). Every wait has a timeout (``TIMEOUT_S``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import yaml

from pdkv.bench.netrig import Host, Placement, bench_link
from pdkv.config import PdkvConfig
from pdkv.demo import get_text, metric, stream_events
from pdkv.errors import PdkvError
from pdkv.launch.procs import WorkerProcess, start_worker

TIMEOUT_S = 600.0  # one request, prefill included: minutes for a long prompt on a busy 2-core CPU
START_TIMEOUT_S = 600.0
SECRET = "pdkv-bench-pd"
MAX_TOKENS = 4


def _config(model: str, tokens: int, path: Path) -> Path:
    """Room for one request (one sender may hold only ``max_peer_blocks_share`` of a receiver's blocks), tier off."""
    defaults = PdkvConfig()
    blocks = math.ceil(-(-(tokens + 64) // defaults.block_size) / defaults.transfer.max_peer_blocks_share) + 8
    path.write_text(yaml.safe_dump({"model": model, "secret": SECRET, "num_blocks": blocks, "tier": {"enabled": False}}))
    return path


def ttft(url: str, prompt: list[int]) -> float:
    """Seconds from sending a streamed completion to its first token."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    first = None
    for event in stream_events(url + "/v1/completions", body, TIMEOUT_S):
        if first is None and event.get("choices"):
            first = time.perf_counter() - start
    if first is None:
        raise PdkvError(f"bench pd: {url} streamed no token")
    return first


@contextmanager
def _roles(placement: Placement, config: Path) -> Iterator[tuple[WorkerProcess, WorkerProcess, WorkerProcess, WorkerProcess]]:
    """(router, prefill, decode, single), each started on its host with only its own address as ``--host``."""
    hub: Host | None = placement.link.hub if placement.link is not None else None
    far: Host | None = placement.link.host if placement.link is not None else None

    def start(host: Host | None, role: str, addr: str, *args: str) -> WorkerProcess:
        if host is None:
            return start_worker(role, "--host", addr, "--port", "0", *args, timeout=START_TIMEOUT_S)
        return host.start_worker(role, "--host", addr, "--port", "0", *args, timeout=START_TIMEOUT_S)

    started: list[WorkerProcess] = []
    try:
        decode = start(far, "decode", placement.receiver_addr, "--config", str(config))
        started.append(decode)
        prefill = start(hub, "prefill", placement.sender_addr, "--config", str(config))
        started.append(prefill)
        single = start(hub, "decode", placement.sender_addr, "--config", str(config))  # a worker alone: any role computes a plain request
        started.append(single)
        router = start(hub, "router", placement.sender_addr, "--prefill", prefill.url, "--decode", decode.url)
        started.append(router)
        yield router, prefill, decode, single
    finally:
        for worker in reversed(started):
            worker.stop()


def measure(model: str, tokens: int, repeats: int, placement: Placement) -> dict[str, Any]:
    """The result object of ``pdkv bench pd --json``; HTTP goes out from the first host."""
    prompt = [100 + (31 * i + 7) % 200 for i in range(tokens)]  # ids inside every model's vocabulary, the tiny test model's too
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pdkv-bench-pd-")))
        router, prefill, decode, single = stack.enter_context(_roles(placement, _config(model, tokens, tmp / "worker.yaml")))
        if placement.link is not None:
            stack.enter_context(placement.link.hub.entered())
        ttft(single.url, prompt)  # warm-ups: first requests pay one-off costs (connections, allocations)
        ttft(router.url, prompt)
        before = get_text(decode.url + "/metrics")
        pd_times, single_times = [], []
        for _ in range(repeats):
            single_times.append(ttft(single.url, prompt))
            pd_times.append(ttft(router.url, prompt))
        after = get_text(decode.url + "/metrics")
        p_metrics = get_text(prefill.url + "/metrics")
    transferred = metric(after, "pdkv_prompt_tokens_total", source="transferred") - metric(before, "pdkv_prompt_tokens_total", source="transferred")
    fallbacks = metric(after, "pdkv_fallbacks_total") - metric(before, "pdkv_fallbacks_total")
    moved = metric(p_metrics, "pdkv_transfer_bytes_total")
    pd_s, single_s = statistics.median(pd_times), statistics.median(single_times)
    return {
        "bench": "pd",
        "model": model,
        "tokens": tokens,
        "link": placement.label,
        "baseline": "one worker doing it all: the same prompt streamed straight to it, same run",
        "results": [{
            "link": placement.label,
            "pd_ttft_s": pd_s,
            "baseline_ttft_s": single_s,
            "ratio": pd_s / single_s,
            "pd_runs_s": pd_times,
            "baseline_runs_s": single_times,
            "kv_bytes_per_request": moved / (repeats + 1),
            "transferred_tokens": transferred,
            "expected_transferred_tokens": tokens * repeats,
            "fallbacks": fallbacks,
        }],
        "load": os.getloadavg(),
    }


def _table(out: dict[str, Any]) -> str:
    row = out["results"][0]
    lines = [
        f"TTFT of a {out['tokens']}-token prompt ({out['model']}), P/D across {out['link']} vs one worker",
        f"  P/D through the router: {row['pd_ttft_s']:.3f} s   one worker: {row['baseline_ttft_s']:.3f} s   ratio {row['ratio']:.2f}",
        f"  KV per request {row['kv_bytes_per_request'] / 1e6:.1f} MB; transferred {row['transferred_tokens']:.0f} of "
        f"{row['expected_transferred_tokens']} prompt tokens, {row['fallbacks']:.0f} fallbacks",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.tokens < 1 or args.repeats < 1:
        raise PdkvError(f"bench pd: --tokens {args.tokens} and --repeats {args.repeats} must be positive")
    with bench_link(args.link) as placement:
        out = measure(args.model, args.tokens, args.repeats, placement)
    print(json.dumps(out) if args.json else _table(out))
    return 0
