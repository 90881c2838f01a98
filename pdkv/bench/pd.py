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

The P/D path's first token needs the prefill; since the router hands a
streamed answer's first token on from P (``router.stream_first_token``), the
rest of D's part (the last chunks' transfer, then the decode worker's first
step) lands on the second token, which is reported beside the first, both
ways: on a slow link the transfer stops hiding behind the compute, and shows
there. Each P/D request must move every prompt token's KV: the
decode worker's ``pdkv_fallbacks_total`` and transferred prompt tokens are
checked, and a run where one fell back reports it (``fallbacks``) instead of
passing it off as a transfer TTFT. The tier is off on every worker (no
prompt is served from a cache). Every wait has a timeout (``TIMEOUT_S``).

Several ``--tokens`` (``16,64,256``): the PD overhead a user sees on short
prompts, where the compute is small and what disaggregation adds (the
router's hops, the Reserve, the transfer's tail, D adopting the KV) is not
hidden. Per prompt length, ``SHORT_WARMUP`` requests each way, then
``--repeats`` (default ``SHORT_REPEATS``) pairs, one worker then P/D, back to
back; the overhead is each pair's difference, its median and p99. That
difference carries the compute's jitter of two requests (a prefill of 170 ms
varies by tens of ms on a busy 2-core machine), so each request's own split
is reported too: after every pair P's and the one worker's own
time-to-first-token histograms are read, and each path's time beyond its
worker's own for that request (``pd_outside_prefill_ms``: the router's hops,
the relay and the client's HTTP around P's prefill;
``baseline_outside_worker_ms``: the client's HTTP around the one worker's)
has its median and p99: the PD overhead's tail with the compute left out.
Also each process's CPU ms per request (``cpu_ms_per_request``: router, prefill, decode,
their sum and what it adds to the one worker's; the number a loaded machine
blurs least). Where the
time goes comes from the processes' own histograms, as means over the
measured requests (deltas of their sums and counts): P's time to its first
token (``prefill``), the router's prefill hop beyond it (``router_to_prefill``),
the router's own part of its time to first token (``router_rest``: relaying
P's event) and the client's HTTP to the router (``client``); they add up to
the P/D TTFT's mean. D's part is reported beside them (``decode_ms``): its
wait for the KV (``pdkv_transfer_wait_seconds``: ``transfer_wait``) and its
time to its first token beyond that wait (``decode_first_step``: adopting the
KV and the first step). Without the handoff (``first_token_handoffs`` short of
the requests) D's parts are in the sum, and ``router_rest`` is the decode
hop's HTTP and relaying. Every P/D
request must have moved its KV (no fallback, transferred tokens equal to
prompt tokens), or the bench fails.
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
from pdkv.bench.cpu import process_cpu_s
from pdkv.bench.netrig import Host, Placement, bench_link
from pdkv.config import PdkvConfig
from pdkv.errors import PdkvError
from pdkv.testing.http import get_text, metric, stream_events
from pdkv.testing.procs import WorkerProcess, start_worker

TIMEOUT_S = 600.0  # one request, prefill included: minutes for a long prompt on a busy 2-core CPU
START_TIMEOUT_S = 600.0
SECRET = "pdkv-bench-pd"
MAX_TOKENS = 4
SHORT_WARMUP = 3
SHORT_REPEATS = 30
# breakdown part -> (worker, histogram, labels): its mean over the measured requests comes from that worker's /metrics
HISTOGRAMS: dict[str, tuple[str, str, dict[str, str]]] = {
    "prefill": ("prefill", "pdkv_ttft_seconds", {"role": "prefill"}),
    "router_prefill_hop": ("router", "pdkv_router_hop_seconds", {"hop": "prefill"}),
    "transfer_wait": ("decode", "pdkv_transfer_wait_seconds", {"role": "decode"}),
    "decode_ttft": ("decode", "pdkv_ttft_seconds", {"role": "decode"}),
    "router_ttft": ("router", "pdkv_ttft_seconds", {"role": "router"}),
    "single_ttft": ("single", "pdkv_ttft_seconds", {"role": "decode"}),
}

# worker -> the role its own time to first token is labelled with: each path's compute, read per request
OWN_TTFT = {"single": "decode", "prefill": "prefill"}


def _config(model: str, tokens: int, path: Path, codec: str = "none") -> Path:
    """Room for one request (one sender may hold only ``max_peer_blocks_share`` of a receiver's blocks) and for
    the sender's pool (all pools together hold at most ``pool_blocks_share``: a decode worker of a real deployment
    has thousands of blocks and grants one), tier off."""
    defaults = PdkvConfig()
    t = defaults.transfer
    request = math.ceil(-(-(tokens + 64) // defaults.block_size) / t.max_peer_blocks_share)
    pool = math.ceil(-(-t.pool_tokens // defaults.block_size) / t.pool_blocks_share) if t.pool_blocks_share else 0
    blocks = max(request, pool) + 8
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


def token_times(url: str, prompt: list[int]) -> tuple[float, float]:
    """Seconds from sending a streamed completion to its first token and to its second.

    Through the router, P sends the first token (``router.stream_first_token``) and D's part of the time (the KV's
    tail, D's claim and first step) lands on the second: both are reported, so that what moved off the first
    token stays in sight."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    times = []
    for event in stream_events(url + "/v1/completions", body, TIMEOUT_S):
        if event.get("choices") and len(times) < 2:
            times.append(time.perf_counter() - start)
    if len(times) < 2:
        raise PdkvError(f"bench pd: {url} streamed {len(times)} tokens of {MAX_TOKENS}")
    return times[0], times[1]


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
        token_times(single.url, prompt)  # warm-ups: first requests pay one-off costs (connections, allocations)
        for mode, router in routers.items():
            for _ in range((3 if codec != "none" else 2) if mode == "auto" else 1):
                token_times(router.url, prompt)
        before = get_text(decode.url + "/metrics")
        pairs: dict[str, list[tuple[float, float]]] = {mode: [] for mode in routers}
        single_pairs = []
        for _ in range(repeats):
            single_pairs.append(token_times(single.url, prompt))
            for mode, router in routers.items():
                pairs[mode].append(token_times(router.url, prompt))
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
    times = {mode: [t for t, _ in runs] for mode, runs in pairs.items()}
    seconds = {mode: statistics.median(t for _, t in runs) for mode, runs in pairs.items()}
    single_times = [t for t, _ in single_pairs]
    single_s, single_second_s = statistics.median(single_times), statistics.median(t for _, t in single_pairs)
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
                    "second_token_s": seconds[mode],
                    "baseline_second_token_s": single_second_s,
                    "second_token_ratio": seconds[mode] / single_second_s,
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
                "pd_second_token_s": seconds["always"],
                "baseline_second_token_s": single_second_s,
                "second_token_ratio": seconds["always"] / single_second_s,
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


def _scrape(workers: dict[str, WorkerProcess]) -> dict[str, str]:
    return {name: get_text(w.url + "/metrics") for name, w in workers.items()}


def _cpu_s(workers: dict[str, WorkerProcess]) -> dict[str, float]:
    """Each process's CPU seconds so far (all its threads): what a request costs, whatever the machine's load."""
    return {name: process_cpu_s(w.proc.pid) for name, w in workers.items()}


def _cpu_row(per_request: dict[str, float]) -> dict[str, float]:
    """CPU ms per request of each process, the P/D path's three together, and what they spend beyond the one
    worker's."""
    pd = sum(per_request[name] for name in ("router", "prefill", "decode"))
    return {**per_request, "pd_total": pd, "pd_extra": pd - per_request["single"]}


def _means_ms(before: dict[str, str], after: dict[str, str]) -> dict[str, float]:
    """Each ``HISTOGRAMS`` entry's mean in ms over the observations between two scrapes."""
    out = {}
    for part, (worker, name, labels) in HISTOGRAMS.items():
        total = metric(after[worker], f"{name}_sum", **labels) - metric(before[worker], f"{name}_sum", **labels)
        count = metric(after[worker], f"{name}_count", **labels) - metric(before[worker], f"{name}_count", **labels)
        if count <= 0:
            raise PdkvError(f"bench pd: {worker} observed no {name}{labels} while measuring")
        out[part] = 1e3 * total / count
    return out


def _breakdown(means: dict[str, float], pd_mean_ms: float, handed_off: bool) -> dict[str, float]:
    """Where a P/D request's mean TTFT goes, in parts that add up to it (see the module docstring); ``handed_off``:
    the client's first token came from P, so D's parts are not in it (``_decode_parts``)."""
    router_rest = means["router_ttft"] - means["router_prefill_hop"]
    parts = {"prefill_ms": means["prefill"], "router_to_prefill_ms": means["router_prefill_hop"] - means["prefill"]}
    if not handed_off:
        parts.update(_decode_parts(means))
        router_rest -= means["decode_ttft"]
    return {**parts, "router_rest_ms": router_rest, "client_ms": pd_mean_ms - means["router_ttft"]}


def _decode_parts(means: dict[str, float]) -> dict[str, float]:
    """D's part of a P/D request: its wait for the KV, and the rest of its time to its first token."""
    return {
        "transfer_wait_ms": means["transfer_wait"],
        "decode_first_step_ms": means["decode_ttft"] - means["transfer_wait"],
    }


def measure_overhead(model: str, token_counts: list[int], repeats: int, placement: Placement) -> dict[str, Any]:
    """The result object of ``pdkv bench pd --tokens A,B,... --json``: the PD overhead per prompt length."""
    rows = []
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pdkv-bench-pd-")))
        routers, prefill, decode, single = stack.enter_context(
            _roles(placement, _config(model, max(token_counts), tmp / "worker.yaml"), ["always"])
        )
        if placement.link is not None:
            stack.enter_context(placement.link.hub.entered())
        router = routers["always"]
        workers = {"router": router, "prefill": prefill, "decode": decode, "single": single}
        for tokens in token_counts:
            prompt = [100 + (31 * i + 7) % 200 for i in range(tokens)]
            for _ in range(SHORT_WARMUP):
                token_times(single.url, prompt)
                token_times(router.url, prompt)
            before = _scrape(workers)
            own = {name: _own_ttft(workers[name], role) for name, role in OWN_TTFT.items()}
            pairs, outside = [], []
            spent = dict.fromkeys(workers, 0.0)
            for _ in range(repeats):
                cpu_before = _cpu_s(workers)  # each pair's alone: rendering /metrics is no request's CPU
                times = {"single": token_times(single.url, prompt), "prefill": token_times(router.url, prompt)}
                for name, t in _cpu_s(workers).items():
                    spent[name] += t - cpu_before[name]
                pairs.append((times["single"], times["prefill"]))
                seen = {name: _own_ttft(workers[name], role) for name, role in OWN_TTFT.items()}
                if any(seen[name][1] != own[name][1] + 1 for name in OWN_TTFT):
                    raise PdkvError(f"bench pd: a worker's first tokens went {own} -> {seen}, not one more each")
                # each path's time to first token beyond its worker's own, this request's (P's, for P/D)
                outside.append({name: 1e3 * (times[name][0] - (seen[name][0] - own[name][0])) for name in OWN_TTFT})
                own = seen
            cpu = {name: 1e3 * t / repeats for name, t in spent.items()}
            after = _scrape(workers)
            rows.append(
                {
                    **_overhead_row(tokens, pairs, before, after),
                    **_outside_row(outside),
                    "cpu_ms_per_request": _cpu_row(cpu),
                }
            )
    return {
        "bench": "pd",
        "model": model,
        "link": placement.label,
        "baseline": "one worker doing it all: the same prompt streamed straight to it, alternating with P/D",
        "results": rows,
        "load": os.getloadavg(),
    }


def _overhead_row(
    tokens: int,
    pairs: list[tuple[tuple[float, float], tuple[float, float]]],
    before: dict[str, str],
    after: dict[str, str],
) -> dict[str, Any]:
    """One prompt length's row; raises if a P/D request did not move its KV."""
    transferred = metric(after["decode"], "pdkv_prompt_tokens_total", source="transferred") - metric(
        before["decode"], "pdkv_prompt_tokens_total", source="transferred"
    )
    fallbacks = metric(after["decode"], "pdkv_fallbacks_total") - metric(before["decode"], "pdkv_fallbacks_total")
    if fallbacks or transferred != tokens * len(pairs):
        raise PdkvError(
            f"bench pd: {len(pairs)} P/D requests of {tokens} tokens moved {transferred:.0f} prompt tokens' KV "
            f"with {fallbacks:.0f} fallbacks (expected {tokens * len(pairs)} and none)"
        )
    handoffs = metric(after["router"], "pdkv_router_first_token_handoffs_total") - metric(
        before["router"], "pdkv_router_first_token_handoffs_total"
    )
    single, pd = ([1e3 * run[side][0] for run in pairs] for side in (0, 1))
    single_2nd, pd_2nd = ([1e3 * run[side][1] for run in pairs] for side in (0, 1))
    extra = [b - a for a, b in zip(single, pd, strict=True)]
    extra_2nd = [b - a for a, b in zip(single_2nd, pd_2nd, strict=True)]
    means = _means_ms(before, after)
    return {
        "tokens": tokens,
        "requests": len(pairs),
        "pd_ttft_ms": statistics.median(pd),
        "baseline_ttft_ms": statistics.median(single),
        "ratio": statistics.median(pd) / statistics.median(single),
        "overhead_ms": {"median": statistics.median(extra), "p99": _p99(extra)},
        # P sends the first token (router.stream_first_token): what D adds lands on the second
        "pd_second_token_ms": statistics.median(pd_2nd),
        "baseline_second_token_ms": statistics.median(single_2nd),
        "second_token_overhead_ms": {"median": statistics.median(extra_2nd), "p99": _p99(extra_2nd)},
        "first_token_handoffs": handoffs,
        "pd_p99_ms": _p99(pd),
        "baseline_p99_ms": _p99(single),
        "breakdown_ms": _breakdown(means, statistics.fmean(pd), handed_off=handoffs == len(pairs)),
        "decode_ms": _decode_parts(means),
        "pd_mean_ms": statistics.fmean(pd),
        # the one worker's own time to first token beside P's (``prefill``): a slower P is no PD overhead
        "baseline_worker_ttft_ms": means["single_ttft"],
        "baseline_mean_ms": statistics.fmean(single),
        "transferred_tokens": transferred,
        "fallbacks": fallbacks,
    }


def _own_ttft(worker: WorkerProcess, role: str) -> tuple[float, float]:
    """``worker``'s own time-to-first-token histogram so far: its sum in seconds and its count. Read after each
    request, the change is that request's."""
    text = get_text(worker.url + "/metrics")
    return metric(text, "pdkv_ttft_seconds_sum", role=role), metric(text, "pdkv_ttft_seconds_count", role=role)


def _outside_row(outside: list[dict[str, float]]) -> dict[str, Any]:
    """Per request, each path's time to first token beyond its worker's own (``OWN_TTFT``): P/D's beyond P's
    prefill (the router's hops, the relay, the client's HTTP), the one worker's beyond its own; medians and p99s.

    ``overhead_ms`` is a difference of two requests' times, each with the compute's jitter in it (tens of ms at
    p99 on a busy 2-core machine); this is what the path adds to one request with that jitter left out, which is
    what the PD overhead's p99 bar asks about."""
    pd, single = ([o[name] for o in outside] for name in ("prefill", "single"))
    return {
        "pd_outside_prefill_ms": {"median": statistics.median(pd), "p99": _p99(pd)},
        "baseline_outside_worker_ms": {"median": statistics.median(single), "p99": _p99(single)},
    }


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def _overhead_table(out: dict[str, Any]) -> str:
    parts = list(out["results"][0]["breakdown_ms"])
    lines = [
        f"PD overhead on short prompts ({out['model']}, {out['link']}): TTFT through router -> P -> D vs one worker",
        f"{'tokens':>6} {'reqs':>4} {'P/D ms':>7} {'one ms':>7} {'over p50':>8} {'over p99':>8} {'2nd over':>8} "
        f"{'out p50':>7} {'out p99':>7}   "
        "mean P/D TTFT = " + " + ".join(p.removesuffix("_ms") for p in parts) + "   (D: transfer wait, first step)",
    ]
    for r in out["results"]:
        lines.append(
            f"{r['tokens']:>6} {r['requests']:>4} {r['pd_ttft_ms']:7.2f} {r['baseline_ttft_ms']:7.2f} "
            f"{r['overhead_ms']['median']:8.2f} {r['overhead_ms']['p99']:8.2f} "
            f"{r['second_token_overhead_ms']['median']:8.2f} "
            f"{r['pd_outside_prefill_ms']['median']:7.2f} {r['pd_outside_prefill_ms']['p99']:7.2f}   "
            f"{r['pd_mean_ms']:.2f} = "
            + " + ".join(f"{r['breakdown_ms'][p]:.2f}" for p in parts)
            + "   ({transfer_wait_ms:.2f}, {decode_first_step_ms:.2f})".format(**r["decode_ms"])
        )
    return "\n".join(lines)


def _table(out: dict[str, Any]) -> str:
    if "tokens" not in out:
        return _overhead_table(out)
    row = out["results"][0]
    lines = [
        f"TTFT of a {out['tokens']}-token prompt ({out['model']}), P/D across {out['link']} vs one worker",
        f"  P/D through the router: {row['pd_ttft_s']:.3f} s   one worker: {row['baseline_ttft_s']:.3f} s   ratio "
        f"{row['ratio']:.2f}",
        f"  second token: P/D {row['pd_second_token_s']:.3f} s   one worker: {row['baseline_second_token_s']:.3f} s   "
        f"ratio {row['second_token_ratio']:.2f}",
        f"  KV per request {row['kv_bytes_per_request'] / 1e6:.1f} MB; transferred {row['transferred_tokens']:.0f} of "
        f"{row['expected_transferred_tokens']} prompt tokens, {row['fallbacks']:.0f} fallbacks",
    ]
    return "\n".join(lines)


def draw(out: dict[str, Any], path: str) -> None:
    """``--plot``: median TTFT through P/D beside one worker doing it all, per link measured (per prompt length
    with several ``--tokens``)."""
    rows = out["results"]
    if "tokens" not in out:
        plot.bars(
            path,
            f"pdkv bench pd: short prompts, P/D on {out['link']} vs one worker",
            "time to first token (ms)",
            [f"{r['tokens']} tokens" for r in rows],
            {
                "P/D through the router": [r["pd_ttft_ms"] for r in rows],
                "baseline: one worker": [r["baseline_ttft_ms"] for r in rows],
            },
        )
        return
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
    tokens = list(args.tokens)
    repeats = args.repeats if args.repeats is not None else (3 if len(tokens) == 1 else SHORT_REPEATS)
    if repeats < 1:
        raise PdkvError(f"bench pd: --repeats {repeats} must be positive")
    bad = set(args.disaggregate.split(",")) - {"always", "never", "auto"}
    if bad:
        raise PdkvError(f"bench pd: --disaggregate {args.disaggregate!r}: {sorted(bad)} not among always, never, auto")
    if len(tokens) > 1 and (args.disaggregate != "always" or args.codec != "none"):
        raise PdkvError("bench pd: several --tokens measure the PD overhead with --disaggregate always, no --codec")
    plot.check(getattr(args, "plot", None))
    with bench_link(args.link) as placement:
        if len(tokens) > 1:
            out = measure_overhead(args.model, tokens, repeats, placement)
        else:
            out = measure(args.model, tokens[0], repeats, placement, args.disaggregate.split(","), args.codec)
    print(json.dumps(out) if args.json or args.disaggregate != "always" else _table(out))
    if getattr(args, "plot", None):
        draw(out, args.plot)
    return 0
