"""Latency of a vLLM P/D pair behind the router against one vLLM doing the whole request.

Start the servers first (see README, "Inside vLLM"): a vLLM prefill and
decode through ``pdkv launch --engine vllm``, the router in ``--mode vllm``,
and a baseline vLLM (a plain ``vllm serve``; the prefill server itself also
serves as one: a request without ``kv_transfer_params`` runs there start to
finish, the connector idle). Every request's prompt starts with a tag
of its own ("Request 7b."), then the fixed text: vLLM's prefix cache keys
blocks by every token from the first, so no request, on either side, finds
any of its blocks cached (the servers keep prefix caching on, as deployed).
The same prompts go to both, one at a time, alternating.

    python benchmarks/vllm_pd.py --baseline http://127.0.0.1:8100 --router http://127.0.0.1:8000 --model MODEL
    [--plot FILE.png]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pdkv.bench import plot
from pdkv.testing.http import post_json

PROMPTS = {
    "short": "Tell me about the sea. The sea is",
    "long": " ".join(f"Item {i} of the inventory is a box of {i * 7 % 13} red apples." for i in range(30)),
}


def timed(url: str, model: str, prompt: str, max_tokens: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    out = post_json(
        url + "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}, 300
    )
    return time.perf_counter() - t0, int(out["usage"]["prompt_tokens"])


def draw(out: dict, path: str) -> None:
    """``--plot``: median latency of each (prompt, max_tokens), one vLLM beside P/D via the router."""
    rows = out["results"]
    plot.bars(
        path,
        f"vLLM P/D via the pdkv router vs one vLLM (median of {out['repeats']})",
        "seconds per request",
        [f"{r['prompt_tokens']} prompt tokens\nmax_tokens {r['max_tokens']}" for r in rows],
        {
            "P/D via router": [r["pd_median_s"] for r in rows],
            "baseline: one vLLM": [r["baseline_median_s"] for r in rows],
        },
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, help="a vLLM that runs the whole request")
    ap.add_argument("--router", required=True, help="pdkv router in --mode vllm in front of the P/D pair")
    ap.add_argument("--model", required=True)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--plot", metavar="FILE.png", default=None, help="also draw the result (needs pdkv[plot])")
    args = ap.parse_args()
    plot.check(args.plot)
    results = []
    for name, base in PROMPTS.items():
        timed(args.baseline, args.model, f"Warm-up a. {base}", 1)  # first use of a shape is slow on both
        timed(args.router, args.model, f"Warm-up b. {base}", 1)
        for n in args.max_tokens:
            mono: list[float] = []
            pd: list[float] = []
            for i in range(args.repeats):
                seconds, tokens = timed(args.baseline, args.model, f"Request {n}-{i}a. {base}", n)
                mono.append(seconds)
                pd.append(timed(args.router, args.model, f"Request {n}-{i}b. {base}", n)[0])
            m, p = statistics.median(mono), statistics.median(pd)
            results.append(
                {
                    "prompt": name,
                    "prompt_tokens": tokens,
                    "max_tokens": n,
                    "baseline_median_s": round(m, 4),
                    "pd_median_s": round(p, 4),
                    "ratio": round(p / m, 3),
                    "pd_overhead_ms": round((p - m) * 1000, 1),
                }
            )
    out = {
        "benchmark": "vllm_pd",
        "baseline": "one vLLM runs the whole request (the prefill server, no kv_transfer_params)",
        "repeats": args.repeats,
        "results": results,
    }
    print(json.dumps(out, indent=1))
    if args.plot:
        draw(out, args.plot)


if __name__ == "__main__":
    main()
