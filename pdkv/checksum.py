"""Chunk checksums: xxh3-64 over the bytes that moved, in wire order.

Both sides hash the same byte ranges in the same order, so a chunk that
landed corrupted, truncated or in the wrong blocks fails verification.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import xxhash

from pdkv.layout import KVLayout, gather
from pdkv.memory import byte_view


def checksum(views: Iterable[memoryview]) -> int:
    h = xxhash.xxh3_64()
    for v in views:
        h.update(v)
    return h.intdigest()


def layer_digests(layout: KVLayout, tensors: Sequence[torch.Tensor], block_table: Sequence[int], num_tokens: int) -> list[str]:
    """xxh3-64 of each layer's canonical KV for tokens ``[0, num_tokens)``.

    Layout-independent, so P and D can compare what was computed with what
    landed whatever their block sizes and orders; per layer, so a chunk or a
    layer that landed in the wrong place is caught even when the tokens
    generated from it happen to agree.
    """
    chunk = gather(layout, tensors, block_table, 0, num_tokens)
    return [xxhash.xxh3_64_hexdigest(byte_view(chunk[i].contiguous())) for i in range(layout.num_layers)]
