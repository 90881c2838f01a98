"""``pdkv demo``: a prefill worker, a decode worker and the router on this machine, one prompt through them.

Starts all three as real processes (``pdkv launch``), streams a chat
completion from the router (which prefills on one worker, sends that
worker's first token, has the KV moved to the other, and streams the decode
worker's rest of the answer), and checks the answer
against the decode worker generating the same prompt on its own. Prints the
answer, TTFT, the bytes the KV transfer moved and its GB/s, then stops
everything.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from pdkv.testing.http import get_text, metric, post_json, stream_events
from pdkv.testing.procs import WorkerProcess, start_worker

DEFAULT_PROMPT = "Explain in two sentences why the sky is blue."


def _stream(url: str, body: dict[str, Any], t0: float, timeout: float = 300.0) -> tuple[str, list[int], float]:
    """Stream a chat completion; returns (text, token ids, seconds from t0 to the first token)."""
    text, ids, first = [], [], 0.0
    for event in stream_events(url, body, timeout):
        for choice in event.get("choices", []):
            if not ids:
                first = time.perf_counter() - t0
                print("answer: ", end="", flush=True)
            delta = choice.get("delta", {}).get("content", "")
            print(delta, end="", flush=True)
            text.append(delta)
            ids.extend(choice.get("token_ids", []))
    print(flush=True)
    return "".join(text), ids, first


def run(args: argparse.Namespace) -> int:
    prompt = args.prompt or DEFAULT_PROMPT
    common = ["--port", "0", "--model", args.model, "--channel", args.channel]
    workers: list[WorkerProcess] = []
    try:
        print(
            f"starting a decode worker, a prefill worker and the router (model {args.model}, channel {args.channel}) "
            "...",
            file=sys.stderr,
            flush=True,
        )
        decode = start_worker("decode", *common)
        workers.append(decode)
        prefill = start_worker("prefill", *common)
        workers.append(prefill)
        router = start_worker("router", "--port", "0", "--prefill", prefill.url, "--decode", decode.url)
        workers.append(router)
        messages = [{"role": "user", "content": prompt}]
        base = {"messages": messages, "temperature": 0, "return_token_ids": True}
        print(f"prompt: {prompt}", flush=True)

        t0 = time.perf_counter()
        text, ids, ttft = _stream(router.url + "/v1/chat/completions", {**base, "max_tokens": args.max_tokens}, t0)
        total = time.perf_counter() - t0

        local = post_json(decode.url + "/v1/chat/completions", {**base, "max_tokens": args.max_tokens})
        deadline = time.monotonic() + 10  # the transfer settles on P a moment after D answered
        while (
            metric(p_metrics := get_text(prefill.url + "/metrics"), "pdkv_open_transfers")
            and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        d_metrics = get_text(decode.url + "/metrics")
        moved = metric(p_metrics, "pdkv_transfer_bytes_total")
        # what the wire did: each chunk from its post to its verdict, and the tail the request waited for
        chunk_s, chunks = metric(p_metrics, "pdkv_chunk_seconds_sum"), metric(p_metrics, "pdkv_chunk_seconds_count")
        tail_s = metric(p_metrics, "pdkv_transfer_tail_seconds_sum")
        summary = {
            "model": args.model,
            "channel": args.channel,
            "prompt_tokens": local["usage"]["prompt_tokens"],
            "completion_tokens": len(ids),
            "ttft_s": round(ttft, 4),
            "total_s": round(total, 4),
            "kv_bytes_moved": int(moved),
            "kv_chunks": int(chunks),
            "kv_chunk_post_to_verdict_ms": round(chunk_s / chunks * 1e3, 3) if chunks else None,
            "kv_exposed_tail_ms": round(tail_s * 1e3, 3),
            "kv_gbps": round(moved / chunk_s / 1e9, 3) if chunk_s else None,
            "transferred_prompt_tokens": int(metric(d_metrics, "pdkv_prompt_tokens_total", source="transferred")),
            "fallbacks": int(metric(d_metrics, "pdkv_fallbacks_total")),
            "matches_local_generation": local["choices"][0]["token_ids"] == ids,
        }
        print(json.dumps(summary, indent=2), flush=True)
        return 0 if summary["matches_local_generation"] and summary["fallbacks"] == 0 else 1
    finally:
        for w in reversed(workers):
            w.stop()
