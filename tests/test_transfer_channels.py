"""The whole data path over real channels: concurrent requests, sender here, receiver in another process.

test_transfer.py proves the sender/receiver guarantees over the mock channel;
these run the same path over the tcp channel (real sockets) and the nixl
channel (real NIXL agents, UCX between two processes), as a prefill and a
decode worker use them: many requests at once, fragmented block tables,
chunks split over streams, too few staging slots and too little send credit
for all of them, so backpressure and refused-then-retried reservations happen.
Every request's KV must land bit for bit, and afterwards neither side may
hold a block, a slot, a byte of credit or a reservation.
"""

from __future__ import annotations

import random

import pytest

from pdkv.bench.transfer import TransferRig
from pdkv.config import TransferConfig
from pdkv.layout import KVLayout

from tests.conftest import TCP_AND_NIXL, held_blocks, held_slots, wait_until

SENDER = KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, block_size=16, dtype="bfloat16")
STAGING = KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, block_size=32, dtype="bfloat16", order="HND")
# a single token, a partial chunk, exactly a chunk, a chunk and one, and longer prompts; 64-token chunks
TOKENS = [1, 40, 64, 65, 200, 333, 500, 17, 129, 256]
CONFIG = TransferConfig(
    chunk_size=64,
    staging_slots=6,
    slots_per_request=2,
    max_inflight_bytes=64 << 10,
    lease_s=10,
    drain_timeout_s=2,
    max_peer_blocks_share=1.0,
)
SENDER_BLOCKS = 256


@pytest.mark.parametrize("device", ["cpu", "emulated"])
@pytest.mark.parametrize("mode", ["direct", "staging"])
@pytest.mark.parametrize("channel", TCP_AND_NIXL)
def test_concurrent_requests_land_bit_exact_and_nothing_is_held(channel: str, mode: str, device: str) -> None:
    """``device`` emulated: both sides' KV is device memory; tcp stages it through host slots, nixl writes it in
    place."""
    receiver_layout = SENDER if mode == "direct" else STAGING
    receiver_blocks = sum(receiver_layout.blocks_for(t) for t in TOKENS) + 4
    order = list(range(SENDER_BLOCKS))
    random.Random(7).shuffle(order)  # fragmented tables: no two neighbouring blocks are adjacent in memory
    tables, at = [], 0
    for tokens in TOKENS:
        n = SENDER.blocks_for(tokens)
        tables.append(order[at : at + n])
        at += n
    with TransferRig(
        channel, receiver_layout, SENDER_BLOCKS, receiver_blocks, CONFIG, sender_layout=SENDER, device=device
    ) as rig:
        for round_ in range(2):  # the second round reuses what the first freed, on the links the first opened
            requests = [(f"r{round_}-{i}", tokens) for i, tokens in enumerate(TOKENS)]
            rig.push(requests, tables)  # raises unless every request's KV landed bit for bit
        wait_until(lambda: rig.sender.stats()["open_transfers"] == 0, 10, "the sender to settle every transfer")
        sent = rig.sender.stats()
        got = rig.receiver_stats()
        staged = rig.sender.source.stager
        granted = rig.modes
    chunks = 2 * sum(-(-t // CONFIG.chunk_size) for t in TOKENS)
    # tcp cannot reach device memory: every chunk goes through host slots; nixl writes device blocks in place
    assert granted == ({"staging"} if device == "emulated" and channel == "tcp" else {mode})
    if device == "emulated":  # staged chunks were gathered on the device and copied out by the stager
        assert staged is not None and staged.chunks_out == (chunks if granted == {"staging"} else 0)
    else:
        assert staged is None
    assert sent["inflight_bytes"] == 0 and sent.get("transfers_failed", 0) == 0
    assert sent["transfers_ok"] == 2 * len(TOKENS) and sent["chunks_landed"] == chunks
    assert got["transfers_ready"] == got["claimed"] == 2 * len(TOKENS) and got["chunks_landed"] == chunks
    assert got["reservations"] == 0 and held_blocks(got, receiver_blocks) == 0
    assert held_slots(got, CONFIG.staging_slots) == 0
    if mode == "staging":
        assert got.get("refused", 0) > 0 and sent["reservations_retried"] > 0, (
            "the test meant to run out of staging slots"
        )
