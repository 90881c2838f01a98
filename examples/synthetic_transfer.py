"""Move a synthetic KV cache from a "prefill" process to a "decode" process and verify it.

The two processes know nothing of each other but the receiver's address.
The prefill side fills its paged buffer with seeded random KV and pushes
every request chunk by chunk; the decode side lands the chunks in a buffer
with a different block size and order (so gather/scatter convert), rebuilds
the expected KV from the same seed, and checks it bit for bit.

    python examples/synthetic_transfer.py [--channel tcp] [--requests 8] [--tokens 1000]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from multiprocessing.connection import Connection

import torch

from pdkv.blocks import BlockAllocator
from pdkv.channels import create_channel
from pdkv.config import TransferConfig
from pdkv.layout import KVLayout, gather, scatter

# a small Llama-shaped model: 8 layers, 4 KV heads of 64, bf16
P_LAYOUT = KVLayout(num_layers=8, num_kv_heads=4, head_dim=64, block_size=16, dtype="bfloat16", order="NHD")
D_LAYOUT = KVLayout(num_layers=8, num_kv_heads=4, head_dim=64, block_size=32, dtype="bfloat16", order="HND")
FINGERPRINT = "synthetic-llama-8l"


def expected_kv(seed: int, num_tokens: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(P_LAYOUT.chunk_shape(num_tokens), generator=gen).to(P_LAYOUT.torch_dtype)


def decode_side(channel: str, conn: Connection, args: argparse.Namespace) -> None:
    from pdkv.transfer.receiver import KVReceiver

    ch = create_channel(channel, "decode-0")
    blocks = args.requests * D_LAYOUT.blocks_for(args.tokens) + 8
    kv = D_LAYOUT.allocate(blocks)
    alloc = BlockAllocator(blocks)
    # waits for each request from the start, before the prefill side has even connected: a long announce window
    rx = KVReceiver(ch, D_LAYOUT, kv, alloc, FINGERPRINT, TransferConfig(announce_timeout_s=120))
    conn.send(rx.address)
    ok = 0
    for i in range(args.requests):
        got = rx.wait(f"req-{i}", timeout=60)
        landed = gather(D_LAYOUT, kv, got.blocks, 0, got.num_tokens)
        ok += int(torch.equal(landed, expected_kv(i, args.tokens)))
        alloc.free(got.blocks)
    conn.send({"verified": ok, "free_blocks": alloc.num_free, "total_blocks": blocks, **rx.stats()})
    rx.close()
    ch.close()


def prefill_side(channel: str, address: str, args: argparse.Namespace) -> dict[str, float]:
    from pdkv.transfer.sender import KVSender

    ch = create_channel(channel, "prefill-0")
    nblk = P_LAYOUT.blocks_for(args.tokens)
    kv = P_LAYOUT.allocate(args.requests * nblk)
    tables = [list(range(i * nblk, (i + 1) * nblk)) for i in range(args.requests)]
    for i, table in enumerate(tables):  # "prefill": write each request's KV into its blocks
        scatter(P_LAYOUT, kv, table, 0, expected_kv(i, args.tokens))
    tx = KVSender(ch, P_LAYOUT, kv, FINGERPRINT, TransferConfig())
    t0 = time.perf_counter()
    xfers = []
    for i, table in enumerate(tables):  # an open waits for room when the receiver is full
        xfers.append(tx.open(f"req-{i}", address, args.tokens, table))
        xfers[-1].send_all()
    for x in xfers:
        x.wait()
    elapsed = time.perf_counter() - t0
    moved = sum(x.bytes_sent for x in xfers)
    tx.close()
    ch.close()
    return {"bytes": moved, "seconds": elapsed, "gbps": moved / elapsed / 1e9}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--channel", default="tcp")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1000)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    decode = ctx.Process(target=decode_side, args=(args.channel, child, args), daemon=True)
    decode.start()
    if not parent.poll(60):
        print("decode process did not start", file=sys.stderr)
        return 1
    address = parent.recv()
    sent = prefill_side(args.channel, address, args)
    result = parent.recv() if parent.poll(60) else {}
    decode.join(10)
    summary = {
        "channel": args.channel,
        "requests": args.requests,
        "tokens_per_request": args.tokens,
        "prefill_layout": f"{P_LAYOUT.order}/block {P_LAYOUT.block_size}",
        "decode_layout": f"{D_LAYOUT.order}/block {D_LAYOUT.block_size}",
        "bytes_moved": sent["bytes"],
        "seconds": round(sent["seconds"], 4),
        "gbps": round(sent["gbps"], 3),
        "verified": result.get("verified", 0),
        "leaked_blocks": result.get("total_blocks", 0) - result.get("free_blocks", 0),
    }
    print(json.dumps(summary, indent=2))
    good = summary["verified"] == args.requests and summary["leaked_blocks"] == 0
    print("OK: every request's KV arrived bit-exact" if good else "FAILED", file=sys.stderr)
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
