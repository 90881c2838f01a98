"""How a worker's paged KV cache sits in memory, and the canonical wire chunk.

P and D may run different engines or settings (block size, NHD vs HND,
per-layer vs cross-layer tensors). The wire format is one canonical
contiguous tensor per chunk, ``[layers, kv, tokens, kv_heads, head_dim]``
(kv = 2 for K and V, 1 for MLA's single latent tensor with kv_heads = 1), so
any layout can talk to any other. ``gather``/``scatter`` here are the pure
torch path: the fallback and the oracle for the native kernels in csrc/.
When both sides have the same layout, whole blocks move as byte ranges
(``block_ranges``) with no conversion at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal

import msgspec
import torch
from msgspec import Meta

from pdkv.errors import LayoutError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    # fp8 caches are held as bytes, as vLLM holds them (torch.uint8 under --kv-cache-dtype fp8): pdkv only moves
    # and checksums them, unconverted, and torch's CPU kernels lack float8 index_copy_. The name says what the
    # bytes are, so P and D agree on it at the handshake.
    "float8_e4m3fn": torch.uint8,
    "float8_e5m2": torch.uint8,
}
"""A KV dtype's name -> the torch dtype its buffers and chunks are stored as."""

FP8_DTYPES = frozenset({"float8_e4m3fn", "float8_e5m2"})
"""KV dtypes stored as raw bytes: codecs that do arithmetic on the values refuse them."""

DTYPE_CODES: dict[str, int] = {"float32": 1, "float16": 2, "bfloat16": 3, "float8_e4m3fn": 4, "float8_e5m2": 5}
"""A KV dtype's code in stored and encoded chunk headers (codec frames, tier values): fixed by those formats."""

BlockTable = Sequence[int] | torch.Tensor


class KVLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Shape of one worker's paged KV buffer; travels in Hello.

    ``kind``: ``per_layer`` keeps one tensor per layer shaped
    ``[blocks, kv, block_size, heads, head_dim]`` (NHD),
    ``[blocks, kv, heads, block_size, head_dim]`` (HND) or
    ``[blocks, heads, kv, block_size, head_dim]`` (HKND: vLLM's CPU attention
    backend, whose ``[blocks, heads, block_size, 2 * head_dim]`` cache keeps a
    head's K then its V, packed by its kernels: ``packed``), ``[blocks, block_size, heads, kv,
    head_dim]`` (NHKD) or ``[blocks, heads, block_size, kv, head_dim]``
    (HNKD): vLLM's GPU backends (FlashAttention, FlashInfer, Triton), whose
    ``[blocks, heads, block_size, 2 * head_dim]`` rows hold a token's K then
    its V, stored token-major (vLLM's default ``LBNHC``) or head-major
    (``LBHNC``). One block of one layer is one contiguous range.
    ``cross_layer`` keeps a single tensor ``[blocks, layers, kv, ...]`` so one
    block of all layers is one range: fewest descriptors per transfer.
    ``split_kv`` keeps two tensors per layer, its K plane then its V plane
    (tensor ``2 * l + kv``), each ``[blocks, block_size, heads, head_dim]``
    (NHD) or ``[blocks, heads, block_size, head_dim]`` (HND), for engines that
    keep K and V apart (vLLM before 0.32: FlashAttention's ``[2, blocks,
    ...]`` per layer, registered as its two planes, "split K and V" in
    NixlConnector); a block of one layer is two ranges. ``mla`` drops the kv
    and heads axes: ``[blocks, block_size, latent_dim]`` (per layer) with
    ``head_dim`` the latent size.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    dtype: str = "bfloat16"
    kind: Literal["per_layer", "cross_layer", "split_kv"] = "per_layer"
    order: Literal["NHD", "HND", "HKND", "NHKD", "HNKD"] = "NHD"
    mla: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if value <= 0:
                raise LayoutError(f"KVLayout.{name} must be a positive integer, got {value!r}")
        if self.dtype not in DTYPES:
            raise LayoutError(f"KVLayout.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.mla and self.num_kv_heads != 1:
            raise LayoutError(
                f"KVLayout with mla=True has one latent head; num_kv_heads must be 1, got {self.num_kv_heads}"
            )
        if self.kind == "split_kv" and (self.mla or self.order not in ("NHD", "HND")):
            raise LayoutError(
                "KVLayout kind 'split_kv' keeps K and V in separate tensors: it has no MLA latent form and only the "
                f"NHD and HND orders (the others interleave K and V), got mla={self.mla} order={self.order!r}"
            )

    # -- sizes -------------------------------------------------------------
    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def kv_factor(self) -> int:
        return 1 if self.mla else 2

    @property
    def element_size(self) -> int:
        return self.torch_dtype.itemsize  # read per chunk: no tensor made for it

    @property
    def token_bytes(self) -> int:
        """Bytes of KV per token over all layers."""
        return self.num_layers * self.kv_factor * self.num_kv_heads * self.head_dim * self.element_size

    def chunk_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        return (self.num_layers, self.kv_factor, num_tokens, self.num_kv_heads, self.head_dim)

    def chunk_bytes(self, num_tokens: int) -> int:
        return num_tokens * self.token_bytes

    @property
    def num_tensors(self) -> int:
        return {"per_layer": self.num_layers, "cross_layer": 1, "split_kv": 2 * self.num_layers}[self.kind]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in one of the buffer's tensors."""
        plane = self.block_size * self.num_kv_heads * self.head_dim * self.element_size
        return {
            "per_layer": plane * self.kv_factor,
            "cross_layer": plane * self.kv_factor * self.num_layers,
            "split_kv": plane,
        }[self.kind]

    def tensor_shape(self, num_blocks: int) -> tuple[int, ...]:
        inner: tuple[int, ...]
        if self.kind == "split_kv":
            token_major = self.order == "NHD"
            inner = (self.block_size, self.num_kv_heads) if token_major else (self.num_kv_heads, self.block_size)
            return (num_blocks, *inner, self.head_dim)
        if self.mla:
            inner = (self.block_size, self.head_dim)
        elif self.order == "NHD":
            inner = (2, self.block_size, self.num_kv_heads, self.head_dim)
        elif self.order == "HKND":
            inner = (self.num_kv_heads, 2, self.block_size, self.head_dim)
        elif self.order == "NHKD":
            inner = (self.block_size, self.num_kv_heads, 2, self.head_dim)
        elif self.order == "HNKD":
            inner = (self.num_kv_heads, self.block_size, 2, self.head_dim)
        else:
            inner = (2, self.num_kv_heads, self.block_size, self.head_dim)
        if self.kind == "cross_layer":
            return (num_blocks, self.num_layers, *inner)
        return (num_blocks, *inner)

    def allocate(self, num_blocks: int, device: str | torch.device = "cpu") -> list[torch.Tensor]:
        """Zeroed buffer tensors for ``num_blocks`` blocks, in this layout."""
        if num_blocks <= 0:
            raise LayoutError(f"num_blocks must be positive, got {num_blocks}")
        shape = self.tensor_shape(num_blocks)
        return [torch.zeros(shape, dtype=self.torch_dtype, device=device) for _ in range(self.num_tensors)]

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- compatibility -----------------------------------------------------
    def wire_mismatches(self, other: KVLayout, us: str = "ours", them: str = "peer", heads: bool = True) -> list[str]:
        """What makes the two layouts' canonical chunks differ, ``us`` and ``them`` naming the two sides.

        Block size, order and kind may differ between P and D: gather and
        scatter convert. These may not: they change what a token's KV is.
        The KV dtype and MLA are never converted (an fp8 cache would have to
        be dequantized with scales pdkv does not hold): they are named with
        the setting that makes both sides agree. ``heads=False`` leaves the
        head count out: peers that hold different shares of a model's heads
        (tensor parallel of different sizes) agree per transfer on a window of
        them (``HeadWindow``).
        """
        fields = ("num_layers", "num_kv_heads", "head_dim") if heads else ("num_layers", "head_dim")
        out = [
            f"layout.{f} ({us} {getattr(self, f)!r}, {them} {getattr(other, f)!r})"
            for f in fields
            if getattr(self, f) != getattr(other, f)
        ]
        if self.dtype != other.dtype:
            out.append(
                f"{them}'s KV cache is {other.dtype}, {us}'s is {self.dtype}: start both with the same KV cache "
                "dtype (vLLM: the same --kv-cache-dtype; pdkv workers: the same dtype)"
            )
        if self.mla != other.mla:
            form = {True: "MLA (one latent per layer)", False: "K and V per layer"}
            out.append(
                f"{them}'s KV cache is {form[other.mla]}, {us}'s is {form[self.mla]}: serve the same model with the "
                "same attention backend kind (MLA or not) on both"
            )
        return out

    def validate_buffer(self, tensors: Sequence[torch.Tensor], contiguous: bool = True) -> int:
        """Check ``tensors`` are a buffer in this layout; return its block count. ``contiguous=False`` takes views
        with any strides (a head window's: the torch path indexes them; nothing registers their bytes)."""
        if len(tensors) != self.num_tensors:
            raise LayoutError(f"{self.kind} layout needs {self.num_tensors} tensors, got {len(tensors)}")
        num_blocks = tensors[0].shape[0] if tensors[0].dim() else 0
        expected = self.tensor_shape(num_blocks)
        for i, t in enumerate(tensors):
            if tuple(t.shape) != expected or t.dtype != self.torch_dtype:
                raise LayoutError(
                    f"buffer tensor {i} is {tuple(t.shape)} {t.dtype}, layout expects {expected} {self.torch_dtype}"
                )
            if contiguous and not t.is_contiguous():
                raise LayoutError(f"buffer tensor {i} is not contiguous")
        return num_blocks

    @property
    def packed(self) -> bool:
        """Whether a block's token rows are the attention kernels' own format rather than rows pdkv can address:
        vLLM's CPU cache (``HKND``), whose ``cpu_attn_reshape_and_cache`` writes each head's K and V of a block
        transposed and tiled for its ISA (vec, vec16, amx). Such blocks move only whole, between identical layouts
        (``whole_blocks``): a token range of one is not that token's KV."""
        return self.order == "HKND" and not self.mla

    def same_but_heads(self, other: KVLayout) -> bool:
        """Whether ``other`` is this layout but for its number of KV heads (tensor parallel of another size)."""
        return msgspec.structs.replace(other, num_kv_heads=self.num_kv_heads) == self

    def whole_blocks(self, start: int, num_tokens: int) -> int:
        """The tokens a chunk of ``num_tokens`` from ``start`` (a block's first) moves when it moves whole blocks:
        up to the end of its last block."""
        return -(-(start + num_tokens) // self.block_size) * self.block_size - start

    def head_axis(self) -> int:
        """The heads axis of this layout's buffer tensors (``tensor_shape``)."""
        if self.mla:
            raise LayoutError("an MLA cache has one latent per layer, no heads to take a window of")
        if self.kind == "split_kv":
            return 2 if self.order == "NHD" else 1
        axis = {"NHD": 3, "HND": 2, "HKND": 1, "NHKD": 2, "HNKD": 1}[self.order]
        return axis + (self.kind == "cross_layer")


class HeadWindow(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """Heads ``[first, first + count)`` of a buffer: the part of its KV one transfer moves.

    Tensor parallel of different sizes splits a model's KV heads differently on P and D (P at TP 2 holds
    half of them per rank, D at TP 1 all of them): a P rank's heads land in a window of a D rank's, or a D
    rank's heads are a window of a P rank's. The wire chunk is the window's canonical chunk, ``count`` heads.
    """

    first: Annotated[int, Meta(ge=0, le=1 << 16)]
    count: Annotated[int, Meta(ge=1, le=1 << 16)]

    def check(self, layout: KVLayout, whose: str) -> None:
        """Raise ``LayoutError`` unless this window lies inside ``layout``'s heads (``whose``: named in it)."""
        if layout.mla or self.first < 0 or self.count < 1 or self.first + self.count > layout.num_kv_heads:
            held = "one MLA latent (no head windows)" if layout.mla else f"{layout.num_kv_heads} KV heads"
            raise LayoutError(f"head window [{self.first}, {self.first + self.count}) does not fit {whose}'s {held}")

    def view(self, layout: KVLayout, tensors: Sequence[torch.Tensor]) -> tuple[KVLayout, list[torch.Tensor]]:
        """The window's layout (``count`` heads) and its views of ``tensors`` (strided: the torch path only)."""
        self.check(layout, "this buffer")
        axis = layout.head_axis()
        sub = msgspec.structs.replace(layout, num_kv_heads=self.count)
        return sub, [t.narrow(axis, self.first, self.count) for t in tensors]


def used_blocks(
    layout: KVLayout, num_blocks: int, block_table: BlockTable, start: int, num_tokens: int
) -> torch.Tensor:
    """The block table entries that tokens ``[start, start+num_tokens)`` touch, as int64, bounds checked.

    Shared by the torch path and pdkv.native so both refuse the same inputs
    with the same messages.
    """
    if start < 0 or num_tokens < 0:
        raise LayoutError(f"token range must be non-negative, got start={start} num_tokens={num_tokens}")
    table = torch.as_tensor(block_table, dtype=torch.long)
    end = start + num_tokens
    needed = layout.blocks_for(end) if end else 0
    if table.numel() < needed:
        raise LayoutError(
            f"block table has {table.numel()} blocks, tokens up to {end} need {needed} (block size {layout.block_size})"
        )
    used = table[:needed]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_blocks):
        raise LayoutError(f"block id out of range [0, {num_blocks}) in block table {used.tolist()}")
    return used


def check_chunk(layout: KVLayout, chunk: torch.Tensor, what: str, num_tokens: int | None = None) -> int:
    """Check ``chunk`` is a canonical chunk of this layout (of ``num_tokens`` tokens if given); return its token
    count."""
    tokens = chunk.shape[2] if chunk.dim() == 5 else -1
    shape = layout.chunk_shape(max(tokens, 0) if num_tokens is None else num_tokens)
    if tuple(chunk.shape) != shape or chunk.dtype != layout.torch_dtype:
        raise LayoutError(f"{what} is {tuple(chunk.shape)} {chunk.dtype}, layout expects {shape} {layout.torch_dtype}")
    return shape[2]


def _positions(
    layout: KVLayout, num_blocks: int, block_table: BlockTable, start: int, num_tokens: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(block index, in-block offset) of each token in ``[start, start+num_tokens)``, bounds checked."""
    table = used_blocks(layout, num_blocks, block_table, start, num_tokens)
    pos = torch.arange(start, start + num_tokens, dtype=torch.long)
    blk = table[pos // layout.block_size].to(device)
    off = (pos % layout.block_size).to(device)
    return blk, off


def gather(
    layout: KVLayout,
    tensors: Sequence[torch.Tensor],
    block_table: BlockTable,
    start: int,
    num_tokens: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Copy tokens ``[start, start+num_tokens)`` of a request out of the paged buffer into a canonical chunk."""
    num_blocks = layout.validate_buffer(tensors, contiguous=False)
    blk, off = _positions(layout, num_blocks, block_table, start, num_tokens, tensors[0].device)
    shape = layout.chunk_shape(num_tokens)
    if out is None:
        out = torch.empty(shape, dtype=layout.torch_dtype, device=tensors[0].device)
    else:
        check_chunk(layout, out, "gather output", num_tokens)
    if layout.kind == "per_layer":
        for layer, t in enumerate(tensors):
            out[layer].copy_(_read(layout, t, blk, off).permute(1, 0, 2, 3))
    elif layout.kind == "split_kv":  # tensor 2*l + kv is chunk[l, kv]: [T, heads, dim] as read
        for i, t in enumerate(tensors):
            out[i // 2, i % 2].copy_(_read(layout, t, blk, off))
    else:
        out.copy_(_read(layout, tensors[0], blk, off).permute(1, 2, 0, 3, 4))
    return out


def scatter(
    layout: KVLayout, tensors: Sequence[torch.Tensor], block_table: BlockTable, start: int, chunk: torch.Tensor
) -> None:
    """Write a canonical chunk into tokens ``[start, start+T)`` of a request's blocks."""
    num_blocks = layout.validate_buffer(tensors, contiguous=False)
    num_tokens = check_chunk(layout, chunk, "chunk")
    blk, off = _positions(layout, num_blocks, block_table, start, num_tokens, tensors[0].device)
    if layout.kind == "per_layer":
        for layer, t in enumerate(tensors):
            _write(layout, t, blk, off, chunk[layer].permute(1, 0, 2, 3))
    elif layout.kind == "split_kv":
        for i, t in enumerate(tensors):
            _write(layout, t, blk, off, chunk[i // 2, i % 2])
    else:
        _write(layout, tensors[0], blk, off, chunk.permute(2, 0, 1, 3, 4))


def _index(layout: KVLayout, blk: torch.Tensor, off: torch.Tensor) -> tuple[object, ...]:
    """Advanced index selecting (block, offset) per token.

    The index arrays are placed so the token axis comes first in the result:
    ``[T, kv, heads, dim]`` per layer, ``[T, layers, kv, heads, dim]`` cross
    layer, ``[T, heads, dim]`` per K or V plane (split_kv).
    """
    s = slice(None)
    lead = (blk, s) if layout.kind == "cross_layer" else (blk,)
    if layout.mla:
        return (*lead, off)
    # axes of a block before its token axis: kv and/or heads
    before = {"NHD": 1, "HND": 2, "HKND": 2, "NHKD": 0, "HNKD": 1}[layout.order]
    if layout.kind == "split_kv":
        before -= 1  # no kv axis
    return (*lead, *(s,) * before, off)


_KV_AFTER_HEADS = ("HKND", "NHKD", "HNKD")  # orders whose kv axis follows the heads axis


def _read(layout: KVLayout, t: torch.Tensor, blk: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
    x = t[_index(layout, blk, off)]
    if layout.mla:  # [T, (L,) D] -> [T, (L,) 1, 1, D]
        x = x.unsqueeze(-2).unsqueeze(-3)
    elif layout.order in _KV_AFTER_HEADS:  # [T, (L,) heads, kv, D] -> [T, (L,) kv, heads, D]
        x = x.transpose(-3, -2)
    return x


def _write(layout: KVLayout, t: torch.Tensor, blk: torch.Tensor, off: torch.Tensor, value: torch.Tensor) -> None:
    if layout.mla:
        value = value.squeeze(-2).squeeze(-2)
    elif layout.order in _KV_AFTER_HEADS:
        value = value.transpose(-3, -2)
    t[_index(layout, blk, off)] = value


def block_runs(ours: Sequence[int], theirs: Sequence[int] | None = None) -> list[tuple[int, int, int]]:
    """``(our first block, their first block, count)`` of the maximal runs where both block id lists go up by one.

    A run of adjacent blocks is one byte range per buffer tensor on each side,
    so a chunk's descriptors and checksum cost O(tensors x runs) instead of
    O(tensors x blocks); with ``theirs`` None only our own ids must be adjacent.
    The bytes of a run are those of its blocks in order: checksums over runs
    equal checksums over ``block_ranges``.
    """
    theirs = ours if theirs is None else theirs
    if len(theirs) != len(ours):
        raise LayoutError(f"block lists of different lengths: {len(ours)} and {len(theirs)}")
    runs: list[tuple[int, int, int]] = []
    for a, b in zip(ours, theirs, strict=True):
        if runs:
            ra, rb, n = runs[-1]
            if a == ra + n and b == rb + n:
                runs[-1] = (ra, rb, n + 1)
                continue
        runs.append((a, b, 1))
    return runs


def block_ranges(
    layout: KVLayout, block_ids: Sequence[int], num_blocks: int | None = None
) -> list[tuple[int, int, int]]:
    """Byte ranges ``(tensor index, offset, length)`` of whole blocks, in wire order.

    Used when P and D share a layout: the sender lists its own ranges and the
    receiver's in this same order, pairs them, and both checksum the bytes in
    this order, so a block moved to the wrong place fails verification.
    ``num_blocks=None`` skips the bounds check for a peer's blocks, whose
    ranges the channel checks against the peer's registered region sizes.
    """
    for b in block_ids:
        if num_blocks is not None and not 0 <= b < num_blocks:
            raise LayoutError(f"block id {b} out of range [0, {num_blocks})")
    size = layout.block_bytes
    return [(ti, b * size, size) for ti in range(layout.num_tensors) for b in block_ids]
