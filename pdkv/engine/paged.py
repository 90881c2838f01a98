"""The engine's view of its paged KV buffer: write new tokens' K/V, read a request's context.

The buffer is exactly what ``KVLayout.allocate`` made, so the transfer layer
can gather/scatter it by layout and block table without asking the engine.
This module is the engine's side of the same contract: token ``p`` of a
request lives in block ``block_table[p // block_size]`` at offset
``p % block_size``, in whichever order (NHD/HND) and kind (per-layer or
cross-layer) the layout says.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from pdkv.errors import EngineError
from pdkv.layout import KVLayout


class PagedKV:
    """Per-layer access to a paged K/V buffer in a ``KVLayout``."""

    def __init__(self, layout: KVLayout, tensors: Sequence[torch.Tensor]) -> None:
        if layout.mla:
            raise EngineError("the reference engine stores separate K and V; an MLA layout does not fit it")
        if layout.kind == "split_kv" or layout.order not in ("NHD", "HND"):
            raise EngineError(
                f"the reference engine keeps per-layer or cross-layer NHD/HND buffers, not {layout.kind} {layout.order}"
            )
        self.layout = layout
        self.tensors = list(tensors)
        self.num_blocks = layout.validate_buffer(self.tensors)

    def _layer(self, layer: int) -> torch.Tensor:
        """``[blocks, 2, block_size, heads, dim]`` (NHD) or ``[blocks, 2, heads, block_size, dim]`` (HND)."""
        return self.tensors[layer] if self.layout.kind == "per_layer" else self.tensors[0][:, layer]

    def write(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` ``[T, heads, dim]`` of T tokens at (block, offset) slots."""
        kv = torch.stack((k, v), dim=1)  # [T, 2, heads, dim]
        t = self._layer(layer)
        if self.layout.order == "NHD":
            t[blocks, :, offsets] = kv
        else:
            t[blocks, :, :, offsets] = kv

    def read(self, layer: int, block_ids: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[heads, length, dim]`` of a request's first ``length`` tokens (whole blocks, then trimmed)."""
        blocks = self._layer(layer)[block_ids]
        if self.layout.order == "NHD":  # [n, 2, bs, H, D] -> [2, H, n, bs, D]
            blocks = blocks.permute(1, 3, 0, 2, 4)
        else:  # [n, 2, H, bs, D] -> [2, H, n, bs, D]
            blocks = blocks.permute(1, 2, 0, 3, 4)
        kv = blocks.reshape(2, blocks.shape[1], -1, blocks.shape[-1])[:, :, :length]
        return kv[0], kv[1]


@dataclasses.dataclass
class Segment:
    """One request's share of a forward pass: ``length`` new tokens starting at position ``start``."""

    rows: slice  # its rows in the flattened batch
    start: int
    length: int
    block_ids: torch.Tensor  # the blocks holding positions [0, start + length)
    mask: torch.Tensor | None  # [length, start + length] causal mask, None for a single token (sees all)

    @property
    def context(self) -> int:
        return self.start + self.length


@dataclasses.dataclass
class Batch:
    """Tokens of one or more requests flattened into one forward pass.

    Projections and MLPs run once over all rows; attention runs per segment
    over that request's own paged context.
    """

    token_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_blocks: torch.Tensor  # [T] block of each new token
    slot_offsets: torch.Tensor  # [T] offset in that block
    segments: list[Segment]

    @property
    def last_rows(self) -> torch.Tensor:
        """Row of each segment's last token: the rows whose logits are wanted."""
        return torch.tensor([s.rows.stop - 1 for s in self.segments], dtype=torch.long)

    @classmethod
    def build(
        cls, block_size: int, items: Sequence[tuple[Sequence[int], int, Sequence[int]]], device: torch.device
    ) -> Batch:
        """From ``(block_table, start, new token ids)`` per request."""
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        slot_blocks: list[torch.Tensor] = []
        segments: list[Segment] = []
        for table, start, tokens in items:
            n = len(tokens)
            end = start + n
            needed = -(-end // block_size)
            if len(table) < needed:
                raise EngineError(f"block table has {len(table)} blocks, positions up to {end} need {needed}")
            block_ids = torch.tensor(list(table[:needed]), dtype=torch.long)
            pos = torch.arange(start, end, dtype=torch.long)
            mask = (torch.arange(end)[None, :] <= pos[:, None]).to(device) if n > 1 else None
            segments.append(Segment(slice(len(ids), len(ids) + n), start, n, block_ids.to(device), mask))
            ids.extend(tokens)
            positions.append(pos)
            slot_blocks.append(block_ids[pos // block_size])
        pos_all = torch.cat(positions)
        return cls(
            token_ids=torch.tensor(ids, dtype=torch.long, device=device),
            positions=pos_all.to(device),
            slot_blocks=torch.cat(slot_blocks).to(device),
            slot_offsets=(pos_all % block_size).to(device),
            segments=segments,
        )
