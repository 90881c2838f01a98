"""Where D's pushed KV lands: vLLM's own blocks past D's local prefix hit, with and without a hit.

One pair of the connector's worker sides (P and D, ``WorkerSide``) in one
process over the real tcp channel, with vLLM-shaped CPU caches (no vLLM),
one prompt at a time, alternating:

* ``no_hit``: D's prefix cache holds nothing of the prompt: every token moves.
* ``hit``: D's prefix cache holds the prompt's first ``--hit`` tokens (whole
  blocks): D's Reserved says so and P pushes only the tokens past them, into
  the blocks vLLM allocated past the hit (the hit's blocks are never written).

In both, P's Reserve is granted only once D's scheduler allocated the blocks,
so D's critical path is the transfer, with no copy after it.
``d_path_s``: from D's ``start_loads`` to the request reported loaded;
``total_s``: from P's push to that; ``bytes_moved``: what D's receiver landed
per request, against ``prompt_bytes``. Medians; the first round is a warm-up.

    python benchmarks/vllm_landing.py [--tokens 1024] [--hit 512] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pdkv.config import convert_config
from pdkv.integration.vllm.kvcache import CPU_BACKEND, vllm_cache_layout
from pdkv.integration.vllm.metadata import LoadSpec, SendSpec, StepMetadata
from pdkv.integration.vllm.worker_side import WorkerSide

BS, LAYERS, HEADS, HEAD_DIM = 32, 16, 8, 128


def _cache(num_blocks: int, random: bool) -> dict[str, torch.Tensor]:
    shape = (num_blocks, HEADS, BS, 2 * HEAD_DIM)  # vLLM's CPU backend layout
    make = torch.randn if random else torch.zeros
    return {f"layers.{i}.attn": make(shape).to(torch.bfloat16) for i in range(LAYERS)}


def _reported(side: WorkerSide, finished: set[str]) -> None:
    while not any(side.results(finished)):
        finished = set()
        time.sleep(0.0005)


def _pair(num_blocks: int) -> tuple[WorkerSide, WorkerSide]:
    cfg = convert_config({"num_blocks": num_blocks, "transfer": {"chunk_size": 256}})
    p = WorkerSide(cfg, "fp-bench", is_producer=True, is_consumer=False, agent_name="p-bench")
    d = WorkerSide(cfg, "fp-bench", is_producer=False, is_consumer=True, agent_name="d-bench")
    p.register(*vllm_cache_layout(_cache(num_blocks, True), BS, CPU_BACKEND))
    d.register(*vllm_cache_layout(_cache(num_blocks, False), BS, CPU_BACKEND))
    return p, d


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hit", type=int, default=512, help="tokens D's prefix cache holds (whole blocks)")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if args.hit % BS or not 0 < args.hit < args.tokens:
        parser.error(f"--hit must be a whole number of {BS}-token blocks, above 0 and below --tokens")
    n = -(-args.tokens // BS)
    p, d = _pair(2 * n)
    skips = {"no_hit": 0, "hit": args.hit}
    times: dict[str, dict[str, list[float]]] = {name: {"d_path_s": [], "total_s": [], "bytes": []} for name in skips}
    assert d.receiver is not None
    try:
        for rep in range(args.repeats + 1):
            for name, skip in skips.items():
                tid = f"{name}-{rep}"
                landed, loaded = d.receiver.stats().get("bytes_landed", 0), d.counters["load_ok"]
                t0 = time.perf_counter()
                p.push(
                    StepMetadata(
                        sends=[SendSpec(tid, tid, [d.receiver.address], args.tokens, list(range(n)), args.tokens)]
                    )
                )
                t1 = time.perf_counter()
                d.start_loads(StepMetadata(loads=[LoadSpec(tid, tid, args.tokens, skip, list(range(n, 2 * n)))]))
                _reported(d, set())
                t2 = time.perf_counter()
                _reported(p, {tid})
                if rep and d.counters["load_ok"] == loaded + 1:  # loaded, not recomputed
                    times[name]["d_path_s"].append(t2 - t1)
                    times[name]["total_s"].append(t2 - t0)
                    times[name]["bytes"].append(d.receiver.stats()["bytes_landed"] - landed)
        out: dict[str, object] = {
            name: {
                "d_path_s": round(statistics.median(t["d_path_s"]), 4),
                "total_s": round(statistics.median(t["total_s"]), 4),
                "bytes_moved": int(statistics.median(t["bytes"])),
            }
            for name, t in times.items()
        }
        out["prompt_bytes"] = args.tokens * LAYERS * 2 * HEADS * HEAD_DIM * 2
        for k in ("d_path_s", "total_s"):
            out[f"hit_over_no_hit_{k}"] = round(
                statistics.median(times["hit"][k]) / statistics.median(times["no_hit"][k]), 2
            )
        print(json.dumps(out))
    finally:
        p.close()
        d.close()


if __name__ == "__main__":
    main()
