"""The GPU check, one command: ``python tests/gpu/check.py`` on a machine with one NVIDIA GPU.

Prints one JSON object (and writes it to ``--out`` when given) with:

* ``gather_scatter``: the CUDA gather/scatter kernels (csrc/kvcopy_cuda.cu) on
  a Llama-3-8B shaped 256-token chunk in every layout, bit-exact against the
  torch path, GB/s against a device-to-device ``copy_`` of the same bytes;
* ``checksum``: the chunk checksum on the GPU, the CUDA kernel
  (csrc/kvcopy_cuda.cu) and the torch ops, against ``copy_`` of the same bytes
  and with the gather/scatter that hash the chunk in their copy pass (``pdkv
  bench checksum --device cuda``), and the same value on CPU and CUDA, by
  either path, for the same bytes (frames, blocks of a fragmented block table
  hashed in place, aligned and odd lengths, a chunk hashed by the fused gather
  and scatter): ``cpu_equals_cuda``;
* ``checksums_batched``: ``blocks_checksums`` (many chunks, one call, one read-back on pdkv's stream) on the GPU
  gives each chunk's own value (hashed alone) and the CPU's values of the same bytes, for random block tables, and
  hashes the bytes that work queued before it on the caller's stream wrote (its stream waits for the caller's);
  host time a chunk, batched and alone. ``checksums_batched("cpu")`` runs the same logic without a GPU;
* ``transfer_nixl``: a request's KV between two processes on the same GPU over
  nixl, VRAM to VRAM (``pdkv bench transfer --channel nixl --device cuda``),
  against the raw NIXL agent moving the same bytes;
* ``transfer_tcp``: the same over tcp, whose KV goes through pinned staging,
  against plain sockets moving the same bytes;
* ``cache_engine``: ``KVCacheEngine`` store from and retrieve into CUDA KV
  buffers, bit-exact;
* ``nixl_vram_raw``: the raw NIXL agent moving VRAM to VRAM between two
  processes on this GPU, the same sizes as ``transfer_nixl``'s rows (whose
  own baseline moves host memory), with pdkv's UCX settings and with UCX_TLS
  pinned to CUDA IPC, each with the protocols UCX chose (``UCX_PROTO_INFO``),
  by both raw programs (NIXL's progress thread on, and off: ``RawNixl``);
* ``faults``: faults injected with the KV in VRAM on both sides, over nixl
  (``pdkv.testing.faults``, the same code tests/test_gpu_faults.py runs in CI
  with emulated device memory): D killed mid-transfer, D restarted on the same
  address, memory P released refused; each must end in a clean failure or a
  recompute, no wrong byte, no leaked registration (pdkv's regions and NIXL's
  own word): ``ok``, and each fault's fields say which held.

Each part runs on its own: one that fails reports its error and the others
still run. The whole takes a few minutes (budget: under 8). Not a test_*.py
file, so pytest never collects it; tests/gpu/README.md says how to run it on a
lent machine, with the wheels to carry.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

DEADLINE_S = 7 * 60  # parts not started by then are reported as skipped, so the whole stays under 8 minutes


def _timed_gbps(fn: Callable[[], object], nbytes: int, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def gather_scatter() -> dict[str, Any]:
    from pdkv import layout as torch_path
    from pdkv import native
    from pdkv.bench.gather import LAYOUTS, NUM_BLOCKS, TOKENS

    out: dict[str, Any] = {
        "native": native.available(),
        "reason": native.reason(),
        "cuda_kernel": native.cuda_reason() is None,
        "cuda_reason": native.cuda_reason(),
        "rows": [],
    }
    gen = torch.Generator(device="cuda").manual_seed(0)
    for layout in LAYOUTS:
        tensors = [
            torch.empty(layout.tensor_shape(NUM_BLOCKS), dtype=layout.torch_dtype, device="cuda")
            for _ in range(layout.num_tensors)
        ]
        table = torch.randperm(NUM_BLOCKS, device="cuda", generator=gen)[: layout.blocks_for(TOKENS)].cpu()
        for t in tensors:
            t.normal_(generator=gen)
        nbytes = layout.chunk_bytes(TOKENS)
        want = torch_path.gather(layout, tensors, table, 0, TOKENS)
        got = native.gather(layout, tensors, table, 0, TOKENS)
        other = [torch.zeros_like(t) for t in tensors]
        native.scatter(layout, other, table, 0, want)
        back = torch_path.gather(layout, other, table, 0, TOKENS)
        out_buf = torch.empty_like(want)
        src, dst = (
            torch.empty(nbytes, dtype=torch.uint8, device="cuda"),
            torch.empty(nbytes, dtype=torch.uint8, device="cuda"),
        )
        copy = _timed_gbps(lambda src=src, dst=dst: dst.copy_(src), nbytes)
        row = {
            "layout": f"{layout.kind} {layout.order}",
            "bytes": nbytes,
            "gather_bit_exact": bool(torch.equal(got.view(torch.uint8), want.view(torch.uint8))),
            "scatter_bit_exact": bool(torch.equal(back.view(torch.uint8), want.view(torch.uint8))),
            "gather_gbps": _timed_gbps(
                lambda layout=layout, tensors=tensors, table=table, o=out_buf: native.gather(
                    layout, tensors, table, 0, TOKENS, o
                ),
                nbytes,
            ),
            "scatter_gbps": _timed_gbps(
                lambda layout=layout, other=other, table=table, w=want: native.scatter(layout, other, table, 0, w),
                nbytes,
            ),
            "torch_gather_gbps": _timed_gbps(
                lambda layout=layout, tensors=tensors, table=table, o=out_buf: torch_path.gather(
                    layout, tensors, table, 0, TOKENS, o
                ),
                nbytes,
                5,
            ),
            "device_copy_gbps": copy,
            # One block's tokens: what a call costs on the host around the kernel (ctypes, checks, launch).
            "one_block_call_us": 1e6
            * layout.chunk_bytes(layout.block_size)
            / 1e9
            / _timed_gbps(
                lambda layout=layout, tensors=tensors, table=table: native.gather(
                    layout, tensors, table, 0, layout.block_size
                ),
                layout.chunk_bytes(layout.block_size),
            ),
        }
        # A chunk that starts mid-request and mid-block: the kernel takes its slice of the block table.
        start, tokens = layout.block_size + 3, TOKENS - 2 * layout.block_size - 5
        mid = native.gather(layout, tensors, table, start, tokens)
        row["offset_bit_exact"] = bool(torch.equal(mid, torch_path.gather(layout, tensors, table, start, tokens)))
        row["gather_vs_copy"] = row["gather_gbps"] / copy
        row["scatter_vs_copy"] = row["scatter_gbps"] / copy
        out["rows"].append(row)
    out["device_tables_bit_exact"] = _device_tables_case(gen)
    return out


def _device_tables_case(gen: torch.Generator) -> bool:
    """More blocks and layers than the kernel's parameters hold (its stream-ordered device-memory path), both ways."""
    from pdkv import layout as torch_path
    from pdkv import native
    from pdkv.layout import KVLayout

    layout = KVLayout(num_layers=160, num_kv_heads=2, head_dim=64, block_size=1, dtype="float16")
    tokens, blocks = 700, 1024
    tensors = layout.allocate(blocks, device="cuda")
    for t in tensors:
        t.normal_(generator=gen)
    table = torch.randperm(blocks, device="cuda", generator=gen)[:tokens].cpu()
    want = torch_path.gather(layout, tensors, table, 5, tokens - 5)
    other = [torch.zeros_like(t) for t in tensors]
    native.scatter(layout, other, table, 5, want)
    return bool(torch.equal(native.gather(layout, tensors, table, 5, tokens - 5), want)) and bool(
        torch.equal(torch_path.gather(layout, other, table, 5, tokens - 5), want)
    )


def checksum() -> dict[str, Any]:
    import os
    import random

    from pdkv import native
    from pdkv.bench.checksum import measure
    from pdkv.bench.gather import LLAMA3_8B
    from pdkv.checksum import blocks_checksum, chunk_checksum, flat_bytes, frame_checksum

    def torch_path(fn: Callable[[], int]) -> int:
        os.environ[native.ENV_VAR] = "0"
        try:
            return fn()
        finally:
            del os.environ[native.ENV_VAR]

    same = []
    for n, unit in ((1 << 20, 32768), (3 * 32768, 32768), (777, None), (8216 * 5, 8216), (4 << 20, None), (6000, 1000)):
        host = torch.randint(0, 256, (n,), dtype=torch.uint8)
        dev = host.cuda()
        a, b = chunk_checksum([host], unit=unit), chunk_checksum([dev], unit=unit)
        c = torch_path(lambda dev=dev, unit=unit: chunk_checksum([dev], unit=unit))
        same.append(
            {
                "bytes": n,
                "unit": unit,
                "cpu": f"{a:016x}",
                "cuda": f"{b:016x}",
                "cuda_torch": f"{c:016x}",
                "equal": a == b == c,
            }
        )
    # direct mode: a fragmented block table hashed in place, per tensor
    kv = [torch.randint(0, 256, (64 * 32768,), dtype=torch.uint8) for _ in range(4)]
    ids = random.Random(0).sample(range(64), 16)
    a = blocks_checksum(kv, ids, 32768)
    b = blocks_checksum([t.cuda() for t in kv], ids, 32768)
    same.append({"blocks": ids, "cpu": f"{a:016x}", "cuda": f"{b:016x}", "equal": a == b})
    # staging: the gather and scatter that hash the chunk they move, on the GPU, against the CPU's value
    layout, tokens = LLAMA3_8B, 64
    kv_dev = layout.allocate(16, device="cuda")
    for t in kv_dev:
        t.view(torch.int16).random_()
    table = random.Random(1).sample(range(16), tokens // layout.block_size)
    chunk = torch.empty(layout.chunk_shape(tokens), dtype=layout.torch_dtype, device="cuda")
    paged = native.PagedBuffer(layout, kv_dev)
    acc = paged.gather_summed(table, 0, tokens, chunk, True)[1]
    fused = {"one_pass_on_cuda": acc is not None, "gather": f"{frame_checksum(flat_bytes(chunk), acc):016x}"}
    fused["scatter"] = f"{frame_checksum(flat_bytes(chunk), paged.scatter_summed(table, 0, chunk, True)):016x}"
    fused["cpu"] = f"{chunk_checksum([flat_bytes(chunk.cpu())]):016x}"
    fused["equal"] = fused["gather"] == fused["scatter"] == fused["cpu"]
    same.append(fused)
    return {
        "cpu_equals_cuda": all(s["equal"] for s in same),
        "native_cuda": native.cuda_checksum_available(),
        "values": same,
        "bench": measure("cuda"),
    }


def checksums_batched(device: str = "cuda") -> dict[str, Any]:
    """See the module's docstring; ``device``: where the KV lives (``cpu``: this part's logic, off a GPU)."""
    import random

    from pdkv import native
    from pdkv.checksum import blocks_checksum, blocks_checksums

    rng, unit, blocks = random.Random(3), 32768, 64
    host = [torch.randint(0, 256, (blocks * unit,), dtype=torch.uint8) for _ in range(4)]
    kv = [t.to(device) for t in host]
    cases = []
    for _ in range(6):  # scattered tables of 0..12 blocks (the empty chunk too) and one run
        chunks = [rng.sample(range(blocks), rng.randint(0, 12)) for _ in range(rng.randint(1, 9))]
        chunks.append(list(range(rng.randint(0, 40), 50)))
        batched = blocks_checksums(kv, chunks, unit)
        alone = [blocks_checksum(kv, ids, unit) for ids in chunks]
        cpu = blocks_checksums(host, chunks, unit)
        cases.append({"chunks": len(chunks), "equal": batched == alone == cpu})
    # The bytes rewritten on the caller's stream behind a long kernel, then hashed: the new bytes' values only if
    # pdkv's stream waited for the caller's.
    fresh = [torch.randint(0, 256, t.shape, dtype=torch.uint8) for t in host]
    fresh_dev = [t.to(device) for t in fresh]
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # some 100 ms of GPU time queued ahead of the rewrite
    for t, f in zip(kv, fresh_dev, strict=True):
        t.copy_(f)
    chunks = [rng.sample(range(blocks), 8) for _ in range(4)]
    ordered = blocks_checksums(kv, chunks, unit) == blocks_checksums(fresh, chunks, unit)
    # host time a chunk: 16 chunks of 8 blocks in one call, and one call each
    chunks = [rng.sample(range(blocks), 8) for _ in range(16)]

    def per_chunk_us(fn: Callable[[], object]) -> float:
        fn()
        times = []
        for _ in range(20):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return round(statistics.median(times) / len(chunks) * 1e6, 1)

    out: dict[str, Any] = {
        "device": device,
        "native_cuda": native.cuda_checksum_available() if device == "cuda" else None,
        "cases": cases,
        "waits_for_the_callers_stream": ordered,
        "us_per_chunk_batched": per_chunk_us(lambda: blocks_checksums(kv, chunks, unit)),
        "us_per_chunk_alone": per_chunk_us(lambda: [blocks_checksum(kv, ids, unit) for ids in chunks]),
    }
    if not (all(c["equal"] for c in cases) and ordered):
        out["error"] = "blocks_checksums differs from the per-chunk or CPU values, or hashed bytes not yet written"
    return out


def _transfer(channel: str) -> dict[str, Any]:
    from pdkv.bench.transfer import measure

    return measure(channel, ["direct", "staging"], [(256, 1), (2048, 1), (256, 16)], 2, devices=("cuda", "cpu"))


def cache_engine() -> dict[str, Any]:
    from pdkv.cache_engine import KVCacheEngine
    from pdkv.layout import KVLayout, gather

    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16")
    tokens = list(range(1000, 1000 + 300))
    src = layout.allocate(32, device="cuda")
    for t in src:
        t.normal_()
    dst = layout.allocate(32, device="cuda")
    table_src, table_dst = list(range(3, 3 + 19)), list(range(31, 12, -1))
    with KVCacheEngine(layout, {"memory_bytes": 64 << 20}, 64, fingerprint="gpu-check") as cache:
        stored = cache.store(tokens, src, table_src)
        loaded = cache.retrieve(tokens, dst, table_dst)
    n = int(loaded.sum())
    equal = torch.equal(gather(layout, src, table_src, 0, n), gather(layout, dst, table_dst, 0, n))
    return {"stored_tokens": stored, "retrieved_tokens": n, "bit_exact": bool(equal)}


_RAW_VRAM = """
import json
from pdkv.bench.nixl_raw import RawNixl
out = {}
for size in (11796480, 94371840):  # bench transfer's 256- and 2048-token requests
    for memory in ("VRAM", "DRAM"):
        with RawNixl(size, memory=memory) as raw:  # both programs: NIXL's progress thread on and off
            for label, kw in raw.variants(size).items():
                out[f"{memory} {size} {label}"] = raw.gbps(size, 10, **kw)
print("RESULT " + json.dumps(out), flush=True)
"""


def nixl_vram_raw() -> dict[str, Any]:
    out: dict[str, Any] = {}
    pinned = "cuda_ipc,cuda_copy,tcp"
    for label, env in (("pdkv defaults", {}), (f"UCX_TLS={pinned}", {"UCX_TLS": pinned})):
        proc = subprocess.run(  # from another directory: the checkout's own pdkv/ must not shadow the installed one
            [sys.executable, "-c", _RAW_VRAM],
            cwd=tempfile.gettempdir(),
            env={**os.environ, **env, "UCX_PROTO_INFO": "y"},
            capture_output=True,
            text=True,
            timeout=150,
        )
        text = proc.stdout + proc.stderr
        result = next((json.loads(line[7:]) for line in text.splitlines() if line.startswith("RESULT ")), None)
        # UCX_PROTO_INFO's tables: which memory each operation moves and over which transport, de-duplicated.
        protocols = dict.fromkeys(
            line.split("]", 2)[-1].strip()
            for line in text.splitlines()
            if re.search(r"memory|zero-copy|copy-in|rndv|cuda_ipc|cuda_copy|get_|put_", line)
        )
        out[label] = {"rc": proc.returncode, "gbps": result, "ucx_protocols": list(protocols)[:80]}
        if proc.returncode or result is None:
            out[label]["tail"] = text[-2000:]
    return out


def faults() -> dict[str, Any]:
    from pdkv.testing.faults import run_faults

    out = run_faults("cuda")
    if not out["ok"]:  # counted as a failed part: the exit status says a fault did not end cleanly
        out.setdefault("error", "a fault did not end in a clean failure or recompute (see its fields)")
    return out


PARTS: dict[str, Callable[[], dict[str, Any]]] = {
    "gather_scatter": gather_scatter,
    "checksum": checksum,
    "checksums_batched": checksums_batched,
    "cache_engine": cache_engine,
    "transfer_tcp": lambda: _transfer("tcp"),
    "transfer_nixl": lambda: _transfer("nixl"),
    "nixl_vram_raw": nixl_vram_raw,
    "faults": faults,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="also write the JSON summary to this file")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {', '.join(PARTS)}")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no GPU: torch sees no CUDA device", "torch": torch.__version__}))
        return 2
    started = time.monotonic()
    summary: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0),
        "python": sys.version.split()[0],
        "parts": {},
    }
    for name in args.parts.split(","):
        if time.monotonic() - started > DEADLINE_S:
            summary["parts"][name] = {"skipped": f"not started: past the {DEADLINE_S}s budget"}
            continue
        t0 = time.monotonic()
        try:
            result = PARTS[name]()
        except Exception as exc:  # noqa: BLE001 - one part's failure is reported, the others still run
            result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=8)}
        result["seconds"] = round(time.monotonic() - t0, 1)
        summary["parts"][name] = result
        print(
            f"[gpu check] {name}: {result['seconds']}s{' ERROR ' + result['error'] if 'error' in result else ''}",
            file=sys.stderr,
            flush=True,
        )
    summary["seconds"] = round(time.monotonic() - started, 1)
    text = json.dumps(summary)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    failed = [n for n, r in summary["parts"].items() if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
