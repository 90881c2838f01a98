"""The vLLM connector's worker side with vLLM-shaped KV caches in CUDA memory: one JSON line.

What tests/test_vllm_connector.py runs on CPU (host memory, and emulated
device memory), here with the caches on the GPU and real CUDA events
(``ordering.DeviceOrder``) and streams: P and D ``WorkerSide`` objects in one
process, P's cache random, D's zeros, a 300-token prompt pushed in two steps
(chunked prefill) and loaded into D's blocks, for each of D's paths:

* ``landing``: prefix caching on, tcp: a host landing buffer, copied into
  vLLM's blocks on pdkv's stream;
* ``staged``: prefix caching off, tcp: pinned slots scattered into vLLM's
  own blocks on the device;
* ``direct``: prefix caching off, nixl: written VRAM to VRAM into vLLM's own
  blocks (run only where nixl imports).

Each case says whether the bytes D holds equal P's (``bit_exact``), which
path D took, and the counters that show no fallback. Not vLLM itself: the
tensors are shaped like vLLM's CPU backend (the only layout mapped), placed on
CUDA. Usage: ``python tests/gpu/vllm_connector.py [--out FILE]`` (needs what
tests/gpu/README.md says check.py needs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from typing import Any

import torch

from pdkv.config import convert_config
from pdkv.integration.vllm.kvcache import CPU_BACKEND, vllm_cache_layout
from pdkv.integration.vllm.metadata import LoadSpec, SendSpec, StepMetadata
from pdkv.integration.vllm.worker_side import WorkerSide
from pdkv.layout import gather

BS, LAYERS, HEADS, HEAD_DIM = 16, 4, 8, 128
TOKENS = 300
P_BLOCKS = [17, 2, 9, 30, 5, 11, 0, 22, 14, 3, 8, 25, 1, 19, 6, 27, 12, 4, 29]  # 19 blocks of 16: 300 tokens
D_BLOCKS = [31, 7, 13, 2, 20, 16, 9, 1, 24, 11, 5, 28, 18, 0, 26, 3, 15, 22, 10]


def _cache(num_blocks: int, random: bool) -> dict[str, torch.Tensor]:
    shape = (num_blocks, HEADS, BS, 2 * HEAD_DIM)  # vLLM's CPU backend layout, on the GPU
    make = torch.randn if random else torch.zeros
    return {f"layers.{i}.attn": make(shape, device="cuda").to(torch.bfloat16) for i in range(LAYERS)}


def _collect(side: WorkerSide, finished: set[str], timeout: float = 30.0) -> tuple[set[str], set[str], set[str]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = side.results(finished)
        finished = set()
        if any(got):
            return got
        time.sleep(0.005)
    return set(), set(), set()


def case(channel: str, prefix_caching: bool) -> dict[str, Any]:
    cfg = convert_config({"num_blocks": 32, "channel": {"name": channel}, "transfer": {"chunk_size": 128}})
    p_cache, d_cache = _cache(32, True), _cache(32, False)
    p = WorkerSide(cfg, "fp-gpu", is_producer=True, is_consumer=False, agent_name=f"p-{channel}-{prefix_caching}")
    d = WorkerSide(
        cfg,
        "fp-gpu",
        is_producer=False,
        is_consumer=True,
        agent_name=f"d-{channel}-{prefix_caching}",
        prefix_caching=prefix_caching,
    )
    try:
        p.register(*vllm_cache_layout(p_cache, BS, CPU_BACKEND))
        d.register(*vllm_cache_layout(d_cache, BS, CPU_BACKEND))
        assert d.receiver is not None
        t0 = time.perf_counter()
        for ready in (128, TOKENS):  # two steps of chunked prefill; each marks a CUDA event on the current stream
            p.push(StepMetadata(sends=[SendSpec("r1", "t-1", d.receiver.address, TOKENS, P_BLOCKS, ready)]))
        d.start_loads(StepMetadata(loads=[LoadSpec("r1", "t-1", TOKENS, 0, D_BLOCKS)]))
        _, recving, failed = _collect(d, set())
        seconds = time.perf_counter() - t0
        sending = _collect(p, {"r1"})[0]
        p_layout, p_views = vllm_cache_layout(p_cache, BS, CPU_BACKEND)
        d_layout, d_views = vllm_cache_layout(d_cache, BS, CPU_BACKEND)
        exact = torch.equal(
            gather(p_layout, p_views, P_BLOCKS, 0, TOKENS), gather(d_layout, d_views, D_BLOCKS, 0, TOKENS)
        )
        assert p._order is not None
        return {
            "channel": channel,
            "prefix_caching": prefix_caching,
            "landing": d.landing,
            "landing_buffer_blocks": int(d.landing_buffer[0].shape[0]) if d.landing_buffer else 0,
            "loaded": recving == {"r1"} and not failed,
            "released_on_p": sending == {"r1"},
            "bit_exact": bool(exact),
            "event_type": type(p._order.mark()).__name__,
            "d_counters": dict(d.counters),
            "p_counters": dict(p.counters),
            "receiver": {k: v for k, v in d.receiver.stats().items() if isinstance(v, int)},
            "sender": {k: v for k, v in p.sender.stats().items() if isinstance(v, int)} if p.sender else {},
            "seconds_push_to_loaded": round(seconds, 4),
        }
    finally:
        p.close()
        d.close()


CASES = {"landing_tcp": ("tcp", True), "staged_tcp": ("tcp", False), "direct_nixl": ("nixl", False)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no GPU: torch sees no CUDA device"}))
        return 2
    summary: dict[str, Any] = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "cases": {}}
    for name in args.cases.split(","):
        try:
            summary["cases"][name] = case(*CASES[name])
        except Exception as exc:  # noqa: BLE001 - one case's failure is reported, the others still run
            summary["cases"][name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    text = json.dumps(summary)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if all("error" not in c and c["bit_exact"] and c["loaded"] for c in summary["cases"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
