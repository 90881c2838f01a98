"""Latency of a vLLM P/D pair behind the router against one vLLM doing the whole request.

Start the servers first (see README, "Inside vLLM"): a vLLM prefill and
decode through ``pdkv launch --engine vllm``, the router in ``--mode vllm``,
and a baseline vLLM (a plain ``vllm serve``; the prefill server itself also
serves as one: a request without ``kv_transfer_params`` runs there start to
finish, the connector idle). Each prompt is sent with a fresh suffix so
that no prefix cache helps either side; the same prompts go to both, one
at a time, alternating.

    python benchmarks/vllm_pd.py --baseline http://127.0.0.1:8100 --router http://127.0.0.1:8000 --model MODEL
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pdkv.demo import post_json

PROMPTS = {
    "short": "Tell me about the sea. The sea is",
    "long": " ".join(f"Item {i} of the inventory is a box of {i * 7 % 13} red apples." for i in range(30)),
}


def timed(url: str, model: str, prompt: str, max_tokens: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    out = post_json(url + "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}, 300)
    return time.perf_counter() - t0, int(out["usage"]["prompt_tokens"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, help="a vLLM that runs the whole request")
    ap.add_argument("--router", required=True, help="pdkv router in --mode vllm in front of the P/D pair")
    ap.add_argument("--model", required=True)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, nargs="+", default=[1, 16])
    args = ap.parse_args()
    results = []
    for name, base in PROMPTS.items():
        timed(args.baseline, args.model, base + " warm", 1)  # first use of a shape is slow on both
        timed(args.router, args.model, base + " warm", 1)
        for n in args.max_tokens:
            mono: list[float] = []
            pd: list[float] = []
            for i in range(args.repeats):
                seconds, tokens = timed(args.baseline, args.model, f"{base} run {i} {n} a", n)
                mono.append(seconds)
                pd.append(timed(args.router, args.model, f"{base} run {i} {n} b", n)[0])
            m, p = statistics.median(mono), statistics.median(pd)
            results.append({
                "prompt": name, "prompt_tokens": tokens, "max_tokens": n,
                "baseline_median_s": round(m, 4), "pd_median_s": round(p, 4),
                "ratio_pd_over_baseline": round(p / m, 3), "pd_overhead_ms": round((p - m) * 1000, 1),
            })
    print(json.dumps({"benchmark": "vllm_pd", "repeats": args.repeats, "results": results}, indent=1))


if __name__ == "__main__":
    main()
