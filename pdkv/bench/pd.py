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

from pdkv.bench import plot
from pdkv.bench.netrig import Host, Placement, bench_link
from pdkv.config import PdkvConfig
from pdkv.errors import PdkvError
from pdkv.testing.http import get_text, metric, stream_events
from pdkv.testing.procs import WorkerProcess, start_worker

TIMEOUT_S = 600.0  # one request, prefill included: minutes for a long prompt on a busy 2-core CPU
START_TIMEOUT_S = 600.0
SECRET = "pdkv-bench-pd"
MAX_TOKENS = 4


def _config(model: str, tokens: int, path: Path, codec: str = "none") -> Path:
    """Room for one request (one sender may hold only ``max_peer_blocks_share`` of a receiver's blocks), tier off."""
    defaults = PdkvConfig()
    blocks = math.ceil(-(-(tokens + 64) // defaults.block_size) / defaults.transfer.max_peer_blocks_share) + 8
    path.write_text(
        yaml.safe_dump(
            {
                "model": model,
                "secret": SECRET,
                "num_blocks": blocks,
                "tier": {"enabled": False},
                "transfer": {"codec": codec},
            }
        )
    )
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
def _roles(
    placement: Placement, config: Path, modes: list[str], codec: str = "none"
) -> Iterator[tuple[dict[str, WorkerProcess], WorkerProcess, WorkerProcess, WorkerProcess]]:
    """(a router per ``router.disaggregate`` mode, prefill, decode, single), each started on its host with only its
    own address as ``--host``."""
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
        single = start(
            hub, "decode", placement.sender_addr, "--config", str(config)
        )  # a worker alone: any role computes a plain request
        started.append(single)
        routers = {}
        for mode in modes:
            rcfg = config.with_name(f"router-{mode}.yaml")
            rcfg.write_text(
                yaml.safe_dump(
                    {
                        "secret": SECRET,
                        "router": {"disaggregate": mode, "disaggregate_codec": "" if codec == "none" else codec},
                    }
                )
            )
            routers[mode] = start(
                hub,
                "router",
                placement.sender_addr,
                "--config",
                str(rcfg),
                "--prefill",
                prefill.url,
                "--decode",
                decode.url,
            )
            started.append(routers[mode])
        yield routers, prefill, decode, single
    finally:
        for worker in reversed(started):
            worker.stop()


def measure(
    model: str, tokens: int, repeats: int, placement: Placement, modes: list[str] | None = None, codec: str = "none"
) -> dict[str, Any]:
    """The result object of ``pdkv bench pd --json``; HTTP goes out from the first host.

    ``modes``: with more than ``always``, a router per ``router.disaggregate`` mode, each measured in turn
    (``auto`` first serves a warm-up prompt each way, as it would in production). ``codec``: the workers'
    ``transfer.codec`` (every transfer through ``always`` is encoded; ``auto`` may use it or not)."""
    modes = modes or ["always"]
    prompt = [
        100 + (31 * i + 7) % 200 for i in range(tokens)
    ]  # ids inside every model's vocabulary, the tiny test model's too
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pdkv-bench-pd-")))
        routers, prefill, decode, single = stack.enter_context(
            _roles(placement, _config(model, tokens, tmp / "worker.yaml", codec), modes, codec)
        )
        if placement.link is not None:
            stack.enter_context(placement.link.hub.entered())
        ttft(single.url, prompt)  # warm-ups: first requests pay one-off costs (connections, allocations)
        for mode, router in routers.items():
            for _ in range((3 if codec != "none" else 2) if mode == "auto" else 1):
                ttft(router.url, prompt)
        before = get_text(decode.url + "/metrics")
        times: dict[str, list[float]] = {mode: [] for mode in routers}
        single_times = []
        for _ in range(repeats):
            single_times.append(ttft(single.url, prompt))
            for mode, router in routers.items():
                times[mode].append(ttft(router.url, prompt))
        after = get_text(decode.url + "/metrics")
        p_metrics = get_text(prefill.url + "/metrics")
        ways = {
            mode: {
                w: metric(get_text(r.url + "/metrics"), "pdkv_router_disaggregation_total", way=w)
                for w in ("transfer", "transfer_codec", "local")
            }
            for mode, r in routers.items()
        }
    transferred = metric(after, "pdkv_prompt_tokens_total", source="transferred") - metric(
        before, "pdkv_prompt_tokens_total", source="transferred"
    )
    fallbacks = metric(after, "pdkv_fallbacks_total") - metric(before, "pdkv_fallbacks_total")
    moved = metric(p_metrics, "pdkv_transfer_bytes_total")
    single_s = statistics.median(single_times)
    if modes != ["always"] or codec != "none":
        return {
            "bench": "pd",
            "model": model,
            "tokens": tokens,
            "link": placement.label,
            "codec": codec,
            "baseline": "one worker doing it all: the same prompt streamed straight to it, same run",
            "results": [
                {
                    "link": placement.label,
                    "disaggregate": mode,
                    "ttft_s": statistics.median(times[mode]),
                    "baseline_ttft_s": single_s,
                    "ratio": statistics.median(times[mode]) / single_s,
                    "runs_s": times[mode],
                    "ways": ways[mode],
                }
                for mode in routers
            ],
            "baseline_runs_s": single_times,
            "transferred_tokens": transferred,
            "fallbacks": fallbacks,
            "kv_bytes_transferred": moved,
            "load": os.getloadavg(),
        }
    pd_times = times["always"]
    pd_s = statistics.median(pd_times)
    return {
        "bench": "pd",
        "model": model,
        "tokens": tokens,
        "link": placement.label,
        "baseline": "one worker doing it all: the same prompt streamed straight to it, same run",
        "results": [
            {
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
            }
        ],
        "load": os.getloadavg(),
    }


def _table(out: dict[str, Any]) -> str:
    row = out["results"][0]
    lines = [
        f"TTFT of a {out['tokens']}-token prompt ({out['model']}), P/D across {out['link']} vs one worker",
        f"  P/D through the router: {row['pd_ttft_s']:.3f} s   one worker: {row['baseline_ttft_s']:.3f} s   ratio "
        f"{row['ratio']:.2f}",
        f"  KV per request {row['kv_bytes_per_request'] / 1e6:.1f} MB; transferred {row['transferred_tokens']:.0f} of "
        f"{row['expected_transferred_tokens']} prompt tokens, {row['fallbacks']:.0f} fallbacks",
    ]
    return "\n".join(lines)


def draw(out: dict[str, Any], path: str) -> None:
    """``--plot``: median TTFT through P/D beside one worker doing it all, per link measured."""
    rows = out["results"]
    if "disaggregate" in rows[0]:
        plot.bars(
            path,
            f"pdkv bench pd: {out['tokens']}-token prompt across {out['link']}, per router.disaggregate",
            "time to first token (s)",
            [r["disaggregate"] for r in rows],
            {
                "through the router": [r["ttft_s"] for r in rows],
                "baseline: one worker": [r["baseline_ttft_s"] for r in rows],
            },
        )
        return
    plot.bars(
        path,
        f"pdkv bench pd: {out['tokens']}-token prompt, P/D across a link vs one worker",
        "time to first token (s)",
        [r["link"] for r in rows],
        {
            "P/D through the router": [r["pd_ttft_s"] for r in rows],
            "baseline: one worker": [r["baseline_ttft_s"] for r in rows],
        },
    )


def run(args: argparse.Namespace) -> int:
    if args.tokens < 1 or args.repeats < 1:
        raise PdkvError(f"bench pd: --tokens {args.tokens} and --repeats {args.repeats} must be positive")
    bad = set(args.disaggregate.split(",")) - {"always", "never", "auto"}
    if bad:
        raise PdkvError(f"bench pd: --disaggregate {args.disaggregate!r}: {sorted(bad)} not among always, never, auto")
    plot.check(getattr(args, "plot", None))
    with bench_link(args.link) as placement:
        out = measure(args.model, args.tokens, args.repeats, placement, args.disaggregate.split(","), args.codec)
    print(json.dumps(out) if args.json or args.disaggregate != "always" else _table(out))
    if getattr(args, "plot", None):
        draw(out, args.plot)
    return 0
