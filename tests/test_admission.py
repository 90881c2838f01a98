"""D's admission rules as the pure function they are: a Reserve and what the receiver holds -> an admission or a
refusal."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from pdkv.config import TransferConfig
from pdkv.layout import KVLayout
from pdkv.transfer.admission import Admission, ReceiverView, admit, admit_pooled, pool_mode, writes_in_place
from pdkv.transfer.protocol import Refused, Reserve

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, dtype="float32")
OTHER = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=32, dtype="float32", order="HND")
CFG = TransferConfig(
    chunk_size=32,
    staging_slots=4,
    slots_per_request=2,
    max_reservations=8,
    max_reservations_per_peer=3,
    max_peer_blocks_share=0.5,
)


def view(**changes: object) -> ReceiverView:
    base = ReceiverView(
        config=CFG,
        layout=LAYOUT,
        num_blocks=100,
        codecs=("none", "zstd"),
        free_slots=4,
        reservations=0,
        id_used=False,
        peer_layout=LAYOUT,
        peer_blocks=(),
    )
    return dataclasses.replace(base, **changes)


def test_same_layout_is_admitted_direct_with_every_block_and_no_slot() -> None:
    assert admit(Reserve("t", 100), view()) == Admission(mode="direct", blocks=7, slots=0, chunks=4)


@pytest.mark.parametrize("mode", ["direct", "staging"])
def test_a_transfer_past_our_prefix_hit_takes_the_blocks_and_chunks_past_it_only(mode: str) -> None:
    """100 tokens, 48 held (three 16-token blocks): 52 move, in two 32-token chunks, into four blocks."""
    changes: dict[str, object] = {"held_tokens": 48} | ({"peer_layout": OTHER} if mode == "staging" else {})
    admitted = admit(Reserve("t", 100), view(**changes))
    assert isinstance(admitted, Admission) and admitted.mode == mode
    assert (admitted.blocks, admitted.chunks, admitted.held) == (4, 2, 48)


@pytest.mark.parametrize(("held", "num_tokens"), [(8, 100), (96, 96), (112, 100)], ids=["mid-block", "all", "past"])
def test_a_hit_inside_a_block_or_of_the_whole_prompt_is_no_transfer_to_admit(held: int, num_tokens: int) -> None:
    refused = admit(Reserve("t", num_tokens), view(held_tokens=held))
    assert isinstance(refused, Refused) and not refused.retryable
    assert f"holds {held} of the transfer's {num_tokens} tokens" in refused.reason


@pytest.mark.parametrize(
    ("why", "reserve", "changes"),
    [
        ("another layout", Reserve("t", 100), {"peer_layout": OTHER}),
        ("a codec", Reserve("t", 100, codec="zstd"), {}),
        ("a side whose channel cannot reach its KV", Reserve("t", 100), {"kv_in_reach": False}),
    ],
)
def test_staging_when_blocks_cannot_be_written_in_place(why: str, reserve: Reserve, changes: dict[str, object]) -> None:
    admitted = admit(reserve, view(**changes))
    assert isinstance(admitted, Admission) and admitted.mode == "staging", why
    assert admitted.slots == CFG.slots_per_request and admitted.blocks == 7


@pytest.mark.parametrize(
    ("reserve", "changes", "reason", "retryable"),
    [
        (Reserve("t", 16, codec="fp8"), {}, "codec 'fp8' is not one this receiver decodes", False),
        (Reserve("t", 16), {"id_used": True}, "transfer id 't' was already used", False),
        (Reserve("t", 16), {"reservations": 8}, "maximum of 8 reservations", True),
        (Reserve("t", 16), {"peer_blocks": (1, 1, 1)}, "per-peer maximum of 3", True),
        (Reserve("t", 16 * 45), {"peer_blocks": (10,)}, "past your share of this receiver's blocks (50 of 100", True),
        (Reserve("t", 16 * 51), {}, "past your share", False),  # more than the share even alone: never fits
        (Reserve("t", 100), {"peer_layout": OTHER, "free_slots": 1}, "no staging slots free (1 of 4)", True),
    ],
)
def test_each_rule_refuses_with_its_reason(
    reserve: Reserve, changes: dict[str, object], reason: str, retryable: bool
) -> None:
    got = admit(reserve, view(**changes))
    assert isinstance(got, Refused) and got.transfer_id == "t"
    assert reason in got.reason and got.retryable is retryable


def test_a_pooled_request_of_one_chunk_in_place_is_admitted_into_the_pools_blocks() -> None:
    assert admit_pooled(Reserve("t", 30), view(), pool_blocks=2, mode="direct") == Admission(
        mode="direct", blocks=2, slots=0, chunks=1
    )
    assert writes_in_place(view()) and not writes_in_place(view(peer_layout=OTHER))


def test_a_pool_holds_what_a_one_chunk_request_of_its_peer_lands_in() -> None:
    """In place: blocks; another block size or order, or KV out of the channel's reach: blocks and a staging slot;
    a pair no raw request of whole heads can move between (other head counts): no pool."""
    assert pool_mode(view()) == "direct"
    assert pool_mode(view(peer_layout=OTHER)) == "staging" and pool_mode(view(kv_in_reach=False)) == "staging"
    assert pool_mode(view(peer_layout=msgspec.structs.replace(LAYOUT, num_kv_heads=4))) is None


def test_a_staged_pooled_request_is_admitted_into_the_pools_blocks_and_its_slot() -> None:
    """The pool's slot is the request's (the caller counts it free); a request that would land in place is not
    one a staged pool holds, nor a staged one a direct pool holds."""
    got = admit_pooled(Reserve("t", 30), view(layout=OTHER, free_slots=1), pool_blocks=1, mode="staging")
    assert got == Admission(mode="staging", blocks=1, slots=1, chunks=1)
    refused = admit_pooled(Reserve("t", 30), view(), pool_blocks=2, mode="staging")
    assert isinstance(refused, Refused) and "one chunk staged" in refused.reason and not refused.retryable


@pytest.mark.parametrize(
    ("reserve", "changes", "pool_blocks", "reason"),
    [
        (Reserve("t", 16), {"id_used": True}, 2, "pooled request refused: transfer id 't' was already used"),
        (Reserve("t", 16), {"peer_blocks": (1, 1, 1)}, 2, "per-peer maximum of 3"),
        (Reserve("t", 40), {}, 4, "2 chunks"),  # more than one chunk: its other notices would carry no Reserve
        (Reserve("t", 32), {}, 1, "at most 1 blocks"),  # more than the pool
        (Reserve("t", 16), {"peer_layout": OTHER}, 2, "staging"),  # not in place: the pool is blocks, not slots
        (Reserve("t", 16, codec="zstd"), {}, 2, "staging"),
    ],
)
def test_each_pool_rule_refuses_and_none_is_retryable(
    reserve: Reserve, changes: dict[str, object], pool_blocks: int, reason: str
) -> None:
    """A pooled Reserve came with its bytes: refused, they are discarded and the sender's transfer fails, so a
    refusal that says 'retry' would mislead."""
    got = admit_pooled(reserve, view(**changes), pool_blocks, "direct")
    assert isinstance(got, Refused) and reason in got.reason and not got.retryable
