"""Where D's pushed KV lands: in place (vLLM's own blocks) against a landing buffer copied into them.

Two pairs of the connector's worker sides (P and D, ``WorkerSide``) in one
process over the real tcp channel, with vLLM-shaped CPU caches (no vLLM),
one prompt at a time, alternating:

* ``landing`` (D's prefix caching on): P pushes while it computes, so the KV
  has landed by the time D's scheduler hands the loader the request's blocks;
  D's critical path is then the copy into vLLM's blocks.
* ``direct`` (prefix caching off): P's Reserve is granted only once D's
  scheduler allocated the blocks, so D's critical path is the whole transfer,
  with no copy after it.

``d_path_s``: from D's ``start_loads`` to the request reported loaded;
``total_s``: from P's push to that. Medians; the first round is a warm-up.

    python benchmarks/vllm_landing.py [--tokens 1024] [--repeats 7]
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
from pdkv.transfer.incoming import State

BS, LAYERS, HEADS, HEAD_DIM = 32, 16, 8, 128


def _cache(num_blocks: int, random: bool) -> dict[str, torch.Tensor]:
    shape = (num_blocks, HEADS, BS, 2 * HEAD_DIM)  # vLLM's CPU backend layout
    make = torch.randn if random else torch.zeros
    return {f"layers.{i}.attn": make(shape).to(torch.bfloat16) for i in range(LAYERS)}


def _reported(side: WorkerSide, finished: set[str]) -> None:
    while not any(side.results(finished)):
        finished = set()
        time.sleep(0.0005)


def _pair(num_blocks: int, prefix_caching: bool) -> tuple[WorkerSide, WorkerSide]:
    cfg = convert_config({"num_blocks": num_blocks, "transfer": {"chunk_size": 256}})
    p = WorkerSide(cfg, "fp-bench", is_producer=True, is_consumer=False, agent_name="p-bench")
    d = WorkerSide(
        cfg, "fp-bench", is_producer=False, is_consumer=True, agent_name="d-bench", prefix_caching=prefix_caching
    )
    p.register(*vllm_cache_layout(_cache(num_blocks, True), BS, CPU_BACKEND))
    d.register(*vllm_cache_layout(_cache(num_blocks, False), BS, CPU_BACKEND))
    return p, d


def _landed(d: WorkerSide, transfer_id: str) -> bool:
    assert d.receiver is not None
    with d.receiver.book.lock:
        r = d.receiver.book.res.get(transfer_id)
        return r is not None and r.state is State.READY


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    n = -(-args.tokens // BS)
    pairs = {"landing": _pair(2 * n, True), "direct": _pair(2 * n, False)}
    times: dict[str, dict[str, list[float]]] = {name: {"d_path_s": [], "total_s": []} for name in pairs}
    try:
        for rep in range(args.repeats + 1):
            for name, (p, d) in pairs.items():
                assert d.receiver is not None and d.landing == name
                tid = f"{name}-{rep}"
                t0 = time.perf_counter()
                p.push(
                    StepMetadata(
                        sends=[SendSpec(tid, tid, d.receiver.address, args.tokens, list(range(n)), args.tokens)]
                    )
                )
                while name == "landing" and not _landed(d, tid):  # D's request comes once P pushed it all
                    time.sleep(0.0005)
                t1 = time.perf_counter()
                d.start_loads(StepMetadata(loads=[LoadSpec(tid, tid, args.tokens, 0, list(range(n, 2 * n)))]))
                _reported(d, set())
                t2 = time.perf_counter()
                _reported(p, {tid})
                if rep and d.counters["load_ok"] == rep + 1:
                    times[name]["d_path_s"].append(t2 - t1)
                    times[name]["total_s"].append(t2 - t0)
        out: dict[str, object] = {
            name: {k: round(statistics.median(v), 4) for k, v in t.items()} for name, t in times.items()
        }
        out["bytes"] = args.tokens * LAYERS * 2 * HEADS * HEAD_DIM * 2
        for k in ("d_path_s", "total_s"):
            out[f"direct_over_landing_{k}"] = round(
                statistics.median(times["direct"][k]) / statistics.median(times["landing"][k]), 2
            )
        print(json.dumps(out))
    finally:
        for p, d in pairs.values():
            p.close()
            d.close()


if __name__ == "__main__":
    main()
