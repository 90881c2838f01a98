"""Transfers that carry a window of the KV heads: tensor-parallel ranks of different sizes on P and D.

A P rank at TP 2 holds half of a model's KV heads and lands them in half of a D rank's at TP 1; a P rank at TP 1
sends each half of its heads to a D rank at TP 2. Each such transfer names the receiver's window
(``Reserve.heads``), is staged, and writes that window's heads only.
"""

from __future__ import annotations

import pytest
import torch

from pdkv.config import TransferConfig
from pdkv.errors import LayoutError, ReservationError
from pdkv.layout import HeadWindow, KVLayout, gather
from pdkv.transfer import protocol

from tests.conftest import TCP_AND_NIXL, MakePair, Pair

pytestmark = pytest.mark.device_emulation  # also with the KV in emulated device memory (staged through the host)

SHAPE = dict(num_layers=3, head_dim=8, block_size=16, dtype="float32")
ORDERS = ["HKND", "HNKD", "NHKD", "NHD"]  # vLLM CPU, vLLM GPU LBHNC and LBNHC, pdkv's default


def window_kv(pair: Pair, side: str, heads: HeadWindow, table: list[int], num_tokens: int) -> torch.Tensor:
    """The canonical chunk of ``heads`` of the tokens in ``table`` on P (``side="p"``) or D."""
    layout, kv = (pair.p_layout, pair.p_kv) if side == "p" else (pair.d_layout, pair.d_kv)
    sub, views = heads.view(layout, kv)
    return gather(sub, views, table, 0, num_tokens)


def push(pair: Pair, tid: str, num_tokens: int, table: list[int], heads: tuple[HeadWindow, HeadWindow]) -> list[int]:
    xfer = pair.sender.open(tid, pair.receiver.address, num_tokens, table, heads=heads)
    assert xfer.mode == "staging"  # a window is never written in place
    xfer.send_all()
    xfer.wait(10)
    return pair.receiver.wait(tid, 10).blocks


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("channel", ["mock", *TCP_AND_NIXL])
def test_two_prefill_ranks_fill_the_two_halves_of_one_decode_ranks_heads(
    make_pair: MakePair, channel: str, order: str
) -> None:
    """P at TP 2 -> D at TP 1: each P rank's 2 heads land in their half of D's 4, the other half untouched."""
    pair = make_pair(
        p_layout=KVLayout(**SHAPE, num_kv_heads=2, order=order),
        d_layout=KVLayout(**SHAPE, num_kv_heads=4, order=order),
        channel=channel,
    )
    table, n, held = list(range(10, 17)), 100, []
    for tid, first in (("r/h0", 0), ("r/h2", 2)):
        blocks = push(pair, tid, n, table, (HeadWindow(0, 2), HeadWindow(first, 2)))
        assert torch.equal(
            window_kv(pair, "d", HeadWindow(first, 2), blocks, n), window_kv(pair, "p", HeadWindow(0, 2), table, n)
        )
        other = HeadWindow(2 - first, 2)
        assert not window_kv(pair, "d", other, blocks, n).any()  # the window wrote its own heads only
        held.append(blocks)  # kept until the end: the next transfer gets blocks nothing was written in
    for blocks in held:
        pair.allocator.free(blocks)
    stats = pair.receiver.stats()
    moved = pair.p_layout.blocks_for(n) * pair.p_layout.block_size  # whole blocks: 112 tokens' bytes
    assert stats["chunks_landed"] == 8 and stats["bytes_landed"] == 2 * moved * pair.p_layout.token_bytes


@pytest.mark.parametrize("order", ["HKND", "NHKD"])
def test_one_prefill_rank_sends_each_half_of_its_heads_to_a_decode_rank(make_pair: MakePair, order: str) -> None:
    """P at TP 1 -> D at TP 2: P reads a window of its own heads; D's window is all of its heads."""
    pair = make_pair(
        p_layout=KVLayout(**SHAPE, num_kv_heads=4, order=order),
        d_layout=KVLayout(**SHAPE, num_kv_heads=2, order=order),
        channel="tcp",
    )
    table, n = [3, 9, 4, 20], 50
    for tid, first in (("q/d0", 0), ("q/d1", 2)):
        blocks = push(pair, tid, n, table, (HeadWindow(first, 2), HeadWindow(0, 2)))
        got = gather(pair.d_layout, pair.d_kv, blocks, 0, n)
        assert torch.equal(got, window_kv(pair, "p", HeadWindow(first, 2), table, n))
        pair.allocator.free(blocks)


@pytest.mark.parametrize(
    ("heads", "codec", "refused"),
    [
        (None, "none", r"layout.num_kv_heads \(this decode 4, prefill 2\): peers holding different numbers"),
        ((HeadWindow(0, 2), HeadWindow(3, 2)), "none", r"head window \[3, 5\) does not fit this receiver's 4"),
        ((HeadWindow(0, 1), HeadWindow(0, 2)), "none", "a head window moves as many heads as it lands in"),
        ((HeadWindow(0, 2), HeadWindow(0, 2)), "zstd", "a head window moves as many heads as it lands in, raw"),
        ((HeadWindow(1, 2), HeadWindow(0, 2)), "none", r"head window \[1, 3\) does not fit this buffer's 2"),
    ],
    ids=["no-window", "past-d-heads", "counts-differ", "codec", "past-p-heads"],
)
def test_a_window_that_does_not_fit_is_refused_before_a_byte_moves(
    make_pair: MakePair, heads: tuple[HeadWindow, HeadWindow] | None, codec: str, refused: str
) -> None:
    pair = make_pair(p_layout=KVLayout(**SHAPE, num_kv_heads=2), d_layout=KVLayout(**SHAPE, num_kv_heads=4))
    with pytest.raises(ReservationError, match=refused):
        pair.sender.open("x", pair.receiver.address, 20, [0, 1], codec=codec, heads=heads)
    assert pair.receiver.stats().get("bytes_landed", 0) == 0


@pytest.mark.parametrize(
    ("p_layout", "d_layout", "heads"),
    [
        (KVLayout(**SHAPE, num_kv_heads=2), KVLayout(**SHAPE, num_kv_heads=4, order="HND"), True),
        (KVLayout(**SHAPE, num_kv_heads=2, order="NHKD"), KVLayout(**SHAPE, num_kv_heads=2, order="HKND"), False),
        (
            KVLayout(**SHAPE, num_kv_heads=2, order="HKND"),
            KVLayout(**{**SHAPE, "block_size": 32}, num_kv_heads=2, order="HKND"),
            False,
        ),
    ],
    ids=["window-across-orders", "gpu-into-vllm-cpu", "vllm-cpu-other-block-size"],
)
def test_whole_block_moves_between_layouts_that_differ_are_refused(
    make_pair: MakePair, p_layout: KVLayout, d_layout: KVLayout, heads: bool
) -> None:
    """A head window moves whole blocks, and vLLM's CPU cache packs its blocks for its kernels (not token rows):
    neither converts between layouts, where a token-wise copy would land bytes that are not that token's KV."""
    pair = make_pair(p_layout=p_layout, d_layout=d_layout)
    window = (HeadWindow(0, 2), HeadWindow(0, 2)) if heads else None
    with pytest.raises(ReservationError, match="both move only between the same layout"):
        pair.sender.open("x", pair.receiver.address, 20, [0, 1], heads=window)


def test_a_packed_cache_staged_through_a_codec_moves_whole_blocks(make_pair: MakePair) -> None:
    """vLLM's CPU cache, zstd-coded: staged, its last block moved whole, bit-exact block for block."""
    layout = KVLayout(**SHAPE, num_kv_heads=2, order="HKND")
    config = TransferConfig(chunk_size=32, lease_s=5, drain_timeout_s=2, codec="zstd")
    pair = make_pair(p_layout=layout, config=config, channel="tcp")
    table, n = [5, 6, 7], 40
    xfer = pair.sender.open("z", pair.receiver.address, n, table, codec="zstd")
    assert xfer.mode == "staging"
    xfer.send_all()
    xfer.wait(10)
    blocks = pair.receiver.wait("z", 10).blocks
    for p_t, d_t in zip(pair.p_kv, pair.d_kv, strict=True):  # every byte of each block, past token 40 too
        assert torch.equal(d_t[blocks], p_t[table])
    pair.allocator.free(blocks)


def test_the_receiver_refuses_a_window_wider_than_the_senders_heads(make_pair: MakePair) -> None:
    """A sender that claims more heads than its Hello said is refused by D, whatever it asks."""
    pair = make_pair(p_layout=KVLayout(**SHAPE, num_kv_heads=2), d_layout=KVLayout(**SHAPE, num_kv_heads=4))
    pair.sender.open("ok", pair.receiver.address, 16, [0], heads=(HeadWindow(0, 2), HeadWindow(0, 2))).cancel("t")
    peer = pair.sender.handshake.connect(pair.receiver.address)
    reply = pair.sender.reserves._ask(peer, protocol.Reserve("wide", 16, heads=HeadWindow(0, 4)))
    assert isinstance(reply, protocol.Refused) and "the sender holds 2" in reply.reason and not reply.retryable


def test_mla_has_no_head_window() -> None:
    mla = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, mla=True)
    with pytest.raises(LayoutError, match="one MLA latent"):
        HeadWindow(0, 1).check(mla, "D")
