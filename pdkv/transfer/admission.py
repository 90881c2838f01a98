"""Whether a decode worker takes a Reserve: one pure function of the request and what the receiver holds.

Kept apart from the receiver so every refusal rule is stated once and unit-tested without sockets. The
blocks themselves are allocated by the receiver afterwards: the allocator is shared with the engine, so
only the allocation can say whether they are free at that moment.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

from pdkv.config import TransferConfig
from pdkv.errors import LayoutError
from pdkv.layout import HeadWindow, KVLayout
from pdkv.transfer.protocol import Refused, Reserve

Mode = Literal["direct", "staging"]


@dataclass(frozen=True, kw_only=True)
class ReceiverView:
    """What admission reads of the receiver, taken under its lock."""

    config: TransferConfig
    layout: KVLayout
    num_blocks: int
    codecs: Collection[str]
    free_slots: int
    reservations: int  # held by every peer
    id_used: bool  # the transfer id is open or was used before on this receiver
    peer_layout: KVLayout
    peer_blocks: tuple[int, ...]  # blocks held by each of this peer's reservations
    # Both sides' channels registered their KV (an empty kv_regions in a Hello: the KV is in memory that side's
    # channel cannot reach, e.g. VRAM and tcp): only then can a block be written in place.
    kv_in_reach: bool = True
    # The prompt's leading tokens we already hold for this transfer (the allocator's ``held_for``: a prefix cache hit):
    # only the tokens past them are reserved and moved.
    held_tokens: int = 0


@dataclass(frozen=True, kw_only=True)
class Admission:
    """What to allocate for an admitted transfer (the channel's grant of its memory to the sender follows the
    allocation: ``Channel.grant``)."""

    mode: Mode
    blocks: int
    slots: int
    chunks: int
    held: int = 0  # leading tokens we hold already: the transfer's chunks start there (``Reserved.held_tokens``)


def admit(req: Reserve, view: ReceiverView) -> Admission | Refused:
    """An admission, or the refusal that says why (``retryable`` when room may free up as other transfers finish)."""
    cfg = view.config
    tid = req.transfer_id
    if req.codec not in view.codecs:
        return Refused(tid, f"codec {req.codec!r} is not one this receiver decodes ({', '.join(view.codecs)})")
    if view.id_used:
        return Refused(tid, f"transfer id {tid!r} was already used on this receiver")
    if view.reservations >= cfg.max_reservations:
        return Refused(tid, f"receiver holds its maximum of {cfg.max_reservations} reservations", retryable=True)
    if len(view.peer_blocks) >= cfg.max_reservations_per_peer:
        return Refused(
            tid,
            f"you hold this receiver's per-peer maximum of {cfg.max_reservations_per_peer} reservations "
            "(max_reservations_per_peer)",
            retryable=True,
        )
    shape = _shape_refusal(req.heads, req.codec, view)
    if shape:
        return Refused(tid, shape)
    held, block_size = view.held_tokens, view.layout.block_size
    if held % block_size or held >= req.num_tokens:
        return Refused(
            tid,
            f"this receiver holds {held} of the transfer's {req.num_tokens} tokens: a transfer starts past a whole "
            f"number of its {block_size}-token blocks and moves at least one token (a full local hit moves nothing "
            "and reserves nothing)",
        )
    blocks = view.layout.blocks_for(req.num_tokens) - held // block_size
    peer_cap = int(cfg.max_peer_blocks_share * view.num_blocks)
    if cfg.max_peer_blocks_share < 1 and blocks + sum(view.peer_blocks) > peer_cap:
        return Refused(
            tid,
            f"{req.num_tokens} tokens would take you past your share of this receiver's blocks "
            f"({peer_cap} of {view.num_blocks}: max_peer_blocks_share={cfg.max_peer_blocks_share:g})",
            retryable=blocks <= peer_cap,
        )
    chunks = -(-(req.num_tokens - held) // cfg.chunk_size)
    direct = writes_in_place(view) and req.codec == "none" and req.heads is None
    slots = 0 if direct else min(cfg.slots_per_request, chunks)
    if slots > view.free_slots:
        return Refused(tid, f"no staging slots free ({view.free_slots} of {cfg.staging_slots})", retryable=True)
    return Admission(mode="direct" if direct else "staging", blocks=blocks, slots=slots, chunks=chunks, held=held)


def _shape_refusal(heads: HeadWindow | None, codec: str, view: ReceiverView) -> str:
    """Why the chunks cannot land here ("" when they can): all of our heads from a peer holding as many, or a
    window of ours (``Reserve.heads``) no wider than the peer's heads, raw (codecs work on whole layouts), from a
    layout the same as ours but for its heads, as a packed layout's chunks must be (``KVLayout.packed``)."""
    ours, theirs = view.layout, view.peer_layout
    if (ours.packed or theirs.packed or heads is not None) and not ours.same_but_heads(theirs):
        return (
            f"this decode's KV layout is {_form(ours)}, prefill's {_form(theirs)}: vLLM's CPU cache packs each "
            "block for its kernels and a head window moves whole blocks, so both move only between the same layout "
            "(block size, attention backend, dtype) on P and D"
        )
    if (ours.packed or heads is not None) and view.config.chunk_size % ours.block_size:
        return (
            f"transfer.chunk_size {view.config.chunk_size} is not a multiple of block_size {ours.block_size}: "
            "whole blocks (a packed cache, a head window) move in chunks of whole blocks"
        )
    if heads is None:
        if ours.num_kv_heads == theirs.num_kv_heads:
            return ""
        return (
            f"layout.num_kv_heads (this decode {ours.num_kv_heads}, prefill {theirs.num_kv_heads}): peers holding "
            "different numbers of KV heads (tensor parallel of different sizes) name the heads each transfer carries "
            "(Reserve.heads)"
        )
    try:
        heads.check(view.layout, "this receiver")
    except LayoutError as exc:
        return str(exc)
    if heads.count > theirs.num_kv_heads:
        return f"head window of {heads.count} heads: the sender holds {theirs.num_kv_heads}"
    if codec != "none":
        return f"codec {codec!r} encodes whole layouts; a head window moves raw (codec 'none')"
    return ""


def _form(layout: KVLayout) -> str:
    return f"{layout.kind}/{layout.order} block_size {layout.block_size} {layout.dtype}"


def writes_in_place(view: ReceiverView) -> bool:
    """Whether this peer's chunks can land straight in our blocks (direct mode): what a pool needs too."""
    return view.kv_in_reach and view.peer_layout == view.layout and view.config.chunk_size % view.layout.block_size == 0


def pool_mode(view: ReceiverView) -> Mode | None:
    """How a one-chunk raw request of this peer's lands, hence what its pool holds: blocks written in place
    (direct), or a staging slot its chunk is written into and the blocks we scatter it into (staging: a layout of
    another block size or order, KV its channel cannot reach); None where such a request is always refused."""
    if writes_in_place(view):
        return "direct"
    return None if _shape_refusal(None, "none", view) else "staging"


def admit_pooled(req: Reserve, view: ReceiverView, pool_blocks: int, mode: Mode) -> Admission | Refused:
    """A Reserve that came with its chunk, written into the sender's pool of ``pool_blocks`` blocks (and, in
    ``mode`` staging, its one staging slot, counted free in ``view``): the rules of ``admit``, and it must be one
    chunk landing as the pool holds it, within the pool (refused, its bytes are discarded; nothing retries it, so
    none of these refusals is retryable)."""
    admitted = admit(req, view)
    if isinstance(admitted, Refused):
        return Refused(req.transfer_id, f"pooled request refused: {admitted.reason}")
    if admitted.mode != mode or admitted.chunks != 1 or admitted.blocks > pool_blocks:
        how = "written in place" if mode == "direct" else "staged"
        return Refused(
            req.transfer_id,
            f"pooled request of {req.num_tokens} tokens ({admitted.mode}, {admitted.chunks} chunks, {admitted.blocks} "
            f"blocks) does not fit a pool: one chunk {how} into at most {pool_blocks} blocks",
        )
    return admitted
