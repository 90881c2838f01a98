"""The vLLM connector's worker side with vLLM-shaped KV caches in CUDA memory: one JSON line.

What tests/test_vllm_connector.py runs on CPU (host memory, and emulated
device memory), here with the caches on the GPU and real CUDA events
(``ordering.DeviceOrder``) and streams: P and D ``WorkerSide`` objects in one
process, P's cache random, D's zeros, a 300-token prompt pushed in two steps
(chunked prefill) and loaded into D's blocks, for each of D's paths:

* ``staged``: tcp: pinned slots scattered into vLLM's own blocks on the
  device;
* ``direct``: nixl: written VRAM to VRAM into vLLM's own blocks (run only
  where nixl imports);
* ``*_prefix_hit``: either, with D's prefix cache holding the prompt's first
  128 tokens: only the blocks past them move, and the hit's blocks stay as
  they were (zeros).

Each case runs with the caches of an attention backend and, for the GPU
backends, a ``VLLM_KV_CACHE_LAYOUT`` (``caches``: P's and D's): vLLM 0.32's
FlashAttention in its default ``LBNHC`` (per-layer views permuted over one
allocation, as vLLM's GPU worker registers them), FlashInfer in ``LBHNC``
into FlashAttention (a layout conversion: staged through the CUDA
gather/scatter kernels), and the CPU backend's layout placed on CUDA. Each
says whether the K and V D holds, read the way D's backend reads them, equal
P's (``bit_exact``), which path D took, and the counters that show no
fallback. The ``tp*`` cases run P and D at tensor parallel on the one GPU, a worker
side per rank (equal sizes in place; different sizes through head windows,
staged). Not vLLM itself. Usage: ``python tests/gpu/vllm_connector.py [--out FILE]`` (needs what
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

BS, LAYERS, HEADS, HEAD_DIM = 16, 4, 8, 128
TOKENS = 300
P_BLOCKS = [17, 2, 9, 30, 5, 11, 0, 22, 14, 3, 8, 25, 1, 19, 6, 27, 12, 4, 29]  # 19 blocks of 16: 300 tokens
D_BLOCKS = [31, 7, 13, 2, 20, 16, 9, 1, 24, 11, 5, 28, 18, 0, 26, 3, 15, 22, 10]


def _cache(
    spec: str, num_blocks: int, random: bool, heads: int = HEADS, device: str = "cuda"
) -> dict[str, torch.Tensor]:
    """Per-layer logical [blocks, heads, block_size, 2 * head_dim] views over one CUDA allocation, in the physical
    order ``spec`` names (``BACKEND/VLLM_KV_CACHE_LAYOUT``; the CPU backend's is contiguous)."""
    make = torch.randn if random else torch.zeros
    if spec.endswith("/LBNHC"):  # layers, blocks, block offsets, heads, a row's K then V
        raw = make((LAYERS, num_blocks, BS, heads, 2 * HEAD_DIM), device=device).to(torch.bfloat16)
        return {f"layers.{i}.attn": raw[i].transpose(1, 2) for i in range(LAYERS)}
    raw = make((LAYERS, num_blocks, heads, BS, 2 * HEAD_DIM), device=device).to(torch.bfloat16)  # LBHNC, CPU_ATTN
    return {f"layers.{i}.attn": raw[i] for i in range(LAYERS)}


def _tokens(spec: str, cache: dict[str, torch.Tensor], table: list[int]) -> torch.Tensor:
    """[layers, kv, tokens, heads, head_dim] of the request, read the way the backend's forward reads its cache."""
    device = next(iter(cache.values())).device
    pos = torch.arange(TOKENS, device=device)
    blocks, offsets = torch.tensor(table, device=device)[pos // BS], pos % BS
    out = []
    for t in cache.values():
        if spec == CPU_BACKEND:  # K rows then V rows of each block and head
            heads = t.shape[1]
            k, v = (x.transpose(1, 2) for x in t.view(t.shape[0], heads, 2 * BS, HEAD_DIM).split(BS, dim=2))
        else:  # kv_cache.transpose(1, 2).split(head_size, dim=-1)
            k, v = t.transpose(1, 2).split(HEAD_DIM, dim=-1)
        out.append(torch.stack([k[blocks, offsets], v[blocks, offsets]]))
    return torch.stack(out)


def _collect(side: WorkerSide, finished: set[str], timeout: float = 30.0) -> tuple[set[str], set[str], set[str]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = side.results(finished)
        finished = set()
        if any(got):
            return got
        time.sleep(0.005)
    return set(), set(), set()


def case(channel: str, skip: int, caches: tuple[str, str]) -> dict[str, Any]:
    """``skip``: tokens D's own prefix cache holds (whole blocks): P pushes only the rest."""
    cfg = convert_config({"num_blocks": 32, "channel": {"name": channel}, "transfer": {"chunk_size": 128}})
    p_cache, d_cache = _cache(caches[0], 32, True), _cache(caches[1], 32, False)
    p = WorkerSide(cfg, "fp-gpu", is_producer=True, is_consumer=False, agent_name=f"p-{channel}-{skip}")
    d = WorkerSide(cfg, "fp-gpu", is_producer=False, is_consumer=True, agent_name=f"d-{channel}-{skip}")
    try:
        p.register(*vllm_cache_layout(p_cache, BS, caches[0].partition("/")[0]))
        d.register(*vllm_cache_layout(d_cache, BS, caches[1].partition("/")[0]))
        assert d.receiver is not None
        t0 = time.perf_counter()
        for ready in (128, TOKENS):  # two steps of chunked prefill; each marks a CUDA event on the current stream
            p.push(StepMetadata(sends=[SendSpec("r1", "t-1", [d.receiver.address], TOKENS, P_BLOCKS, ready)]))
        d.start_loads(StepMetadata(loads=[LoadSpec("r1", "t-1", TOKENS, skip, D_BLOCKS)]))
        _, recving, failed = _collect(d, set())
        seconds = time.perf_counter() - t0
        sending = _collect(p, {"r1"})[0]
        exact = torch.equal(
            _tokens(caches[0], p_cache, P_BLOCKS)[:, :, skip:], _tokens(caches[1], d_cache, D_BLOCKS)[:, :, skip:]
        )
        hit = D_BLOCKS[: skip // BS]
        hit_untouched = all(not t[hit].any() for t in d_cache.values())
        assert p._order is not None
        return {
            "caches": list(caches),
            "layouts": [side.layout.order if side.layout else None for side in (p, d)],
            "channel": channel,
            "skip_tokens": skip,
            "landing": d.landing,
            "loaded": recving == {"r1"} and not failed,
            "hit_untouched": hit_untouched,
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


def tp_case(channel: str, p_tp: int, d_tp: int, spec: str, device: str = "cuda") -> dict[str, Any]:
    """Tensor parallel on one GPU: a worker side per rank of P (``p_tp``) and of D (``d_tp``), each rank's cache its
    share of one model's ``HEADS`` KV heads (``parallel.pieces``: equal sizes in place, different sizes through head
    windows, staged), pushed through each decode rank's own receiver; ``bit_exact``: the model's K and V on D, every
    head in order, equal P's."""
    cfg = convert_config({"channel": {"name": channel}, "transfer": {"chunk_size": 128, "transfer_timeout_s": 30}})
    full = [t for t in _cache(spec, 32, True, HEADS, device).values()]
    backend = spec.partition("/")[0]

    def share(tp: int, r: int, caches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        per = HEADS // tp  # rank r's contiguous heads, as vLLM shards them, in the same physical order
        out = _cache(spec, 32, False, per, device)
        for t, whole in zip(out.values(), caches, strict=True):
            t.copy_(whole[:, r * per : (r + 1) * per])
        return out

    p_caches = [share(p_tp, r, full) for r in range(p_tp)]
    d_caches = [_cache(spec, 32, False, HEADS // d_tp, device) for _ in range(d_tp)]
    ps = [
        WorkerSide(cfg, "fp-gpu", True, False, f"p-tp{r}", tp_rank=r, tp_size=p_tp, total_kv_heads=HEADS)
        for r in range(p_tp)
    ]
    ds = [
        WorkerSide(cfg, "fp-gpu", False, True, f"d-tp{r}", tp_rank=r, tp_size=d_tp, total_kv_heads=HEADS)
        for r in range(d_tp)
    ]
    try:
        for side, cache in [*zip(ps, p_caches, strict=True), *zip(ds, d_caches, strict=True)]:
            side.register(*vllm_cache_layout(cache, BS, backend))
        addresses = [d.receiver.address for d in ds if d.receiver is not None]
        t0 = time.perf_counter()
        for p in ps:
            p.push(StepMetadata(sends=[SendSpec("r1", "t-1", addresses, TOKENS, P_BLOCKS, TOKENS)]))
        for d in ds:
            d.start_loads(StepMetadata(loads=[LoadSpec("r1", "t-1", TOKENS, 0, D_BLOCKS, prefill_tp=p_tp)]))
        results = [_collect(d, set()) for d in ds]
        seconds = time.perf_counter() - t0
        released = [_collect(p, {"r1"})[0] for p in ps]

        def model(caches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
            return {name: torch.cat([c[name] for c in caches], dim=1) for name in caches[0]}

        exact = torch.equal(_tokens(spec, model(p_caches), P_BLOCKS), _tokens(spec, model(d_caches), D_BLOCKS))
        return {
            "caches": spec,
            "channel": channel,
            "tp": [p_tp, d_tp],
            "landing": [d.landing for d in ds],
            "loaded": all(r[1] == {"r1"} and not r[2] for r in results),
            "released_on_p": all(r == {"r1"} for r in released),
            "bit_exact": bool(exact),
            "transfers": sum(p.counters["push_ok"] for p in ps),
            "d_counters": [dict(d.counters) for d in ds],
            "staged_chunks": [d.receiver.stats().get("chunks_staged_to_device", 0) for d in ds if d.receiver],
            "seconds_push_to_loaded": round(seconds, 4),
        }
    finally:
        for side in (*ps, *ds):
            side.close()


FA, FI = "FLASH_ATTN/LBNHC", "FLASHINFER/LBHNC"  # vLLM 0.32's default GPU backend and layout; FlashInfer head-major
CASES = {
    "staged_tcp": ("tcp", 0, (FA, FA)),
    "direct_nixl": ("nixl", 0, (FA, FA)),
    "staged_tcp_prefix_hit": ("tcp", 128, (FA, FA)),
    "direct_nixl_prefix_hit": ("nixl", 128, (FA, FA)),
    "staged_tcp_flashinfer_to_fa": ("tcp", 0, (FI, FA)),  # converted on the GPU by the gather/scatter kernels
    "direct_nixl_flashinfer_to_fa": ("nixl", 0, (FI, FA)),  # layouts differ: nixl staging, VRAM slots
    "staged_tcp_cpu_layout": ("tcp", 0, (CPU_BACKEND, CPU_BACKEND)),
}
TP_CASES = {  # tensor parallel: (channel, P's size, D's size, caches)
    "tp2_to_tp2_nixl": ("nixl", 2, 2, FA),  # in place, each rank its own receiver
    "tp2_to_tp1_tcp": ("tcp", 2, 1, FA),  # head windows, staged through the host
    "tp2_to_tp1_nixl": ("nixl", 2, 1, FA),  # head windows, staged in VRAM slots
    "tp1_to_tp2_nixl": ("nixl", 1, 2, FI),
    "tp4_to_tp2_tcp": ("tcp", 4, 2, FI),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--cases", default=",".join([*CASES, *TP_CASES]))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no GPU: torch sees no CUDA device"}))
        return 2
    summary: dict[str, Any] = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "cases": {}}
    for name in args.cases.split(","):
        try:
            summary["cases"][name] = tp_case(*TP_CASES[name]) if name in TP_CASES else case(*CASES[name])
        except Exception as exc:  # noqa: BLE001 - one case's failure is reported, the others still run
            summary["cases"][name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    text = json.dumps(summary)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    cases = summary["cases"].values()
    ok = all(
        "error" not in c and c["bit_exact"] and c["loaded"] and c.get("hit_untouched") is not False for c in cases
    )  # the tp cases have no prefix hit to leave untouched
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
