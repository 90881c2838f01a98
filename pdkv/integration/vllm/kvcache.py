"""vLLM's paged KV cache described as a pdkv ``KVLayout``.

The connector hands pdkv vLLM's own tensors (views, no copy), so the sender
writes straight out of vLLM's blocks. Only layouts we have seen are mapped;
anything else is refused by name rather than guessed, because a wrong guess
moves bytes that look fine and decode garbage.

Mapped (run here): vLLM's CPU attention backend, one tensor per layer shaped
``[blocks, kv_heads, block_size, 2 * head_dim]`` and read as
``[blocks, kv_heads, 2 * block_size, head_dim]``: per block and head, the
block's K rows then its V rows: pdkv's ``HKND`` order.

Not mapped (not run: no GPU here): the GPU backends' ``[2, blocks,
block_size, kv_heads, head_dim]`` (FlashAttention, K and V planes first) and
``[blocks, 2, kv_heads, block_size, head_dim]`` (FlashInfer HND). The second
is pdkv's per-layer ``HND`` and would only need its shape check here; the
first needs K and V registered as separate regions.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from pdkv.errors import LayoutError
from pdkv.layout import DTYPES, KVLayout

_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def cpu_cache_layout(kv_caches: Mapping[str, torch.Tensor], block_size: int) -> tuple[KVLayout, list[torch.Tensor]]:
    """The layout of vLLM's CPU-backend cache and its tensors as pdkv buffer views, layer order kept."""
    if not kv_caches:
        raise LayoutError("vLLM registered no KV cache tensors (is this an attention-free model?)")
    tensors = list(kv_caches.values())
    first = tensors[0]
    if first.dim() != 4 or first.shape[2] != block_size or first.shape[3] % 2:
        raise LayoutError(
            f"vLLM KV cache tensor {next(iter(kv_caches))!r} is {tuple(first.shape)}; pdkv maps only the CPU backend's "
            f"[blocks, kv_heads, block_size={block_size}, 2*head_dim] (see pdkv/integration/vllm/kvcache.py)"
        )
    if first.dtype not in _DTYPE_NAMES:
        raise LayoutError(
            f"vLLM KV cache dtype {first.dtype} is not one pdkv moves ({sorted(DTYPES)}); fp8 KV caches are not mapped"
        )
    num_blocks, heads, _, two_d = first.shape
    layout = KVLayout(
        num_layers=len(tensors),
        num_kv_heads=heads,
        head_dim=two_d // 2,
        block_size=block_size,
        dtype=_DTYPE_NAMES[first.dtype],
        kind="per_layer",
        order="HKND",
    )
    views = []
    for name, t in kv_caches.items():
        if t.shape != first.shape or t.dtype != first.dtype or not t.is_contiguous():
            raise LayoutError(
                f"vLLM KV cache tensor {name!r} is {tuple(t.shape)} {t.dtype} (contiguous={t.is_contiguous()}); "
                f"expected every layer like the first, {tuple(first.shape)} {first.dtype}"
            )
        views.append(t.view(layout.tensor_shape(num_blocks)))
    return layout, views


def copy_blocks(src: list[torch.Tensor], dst: list[torch.Tensor], src_ids: list[int], dst_ids: list[int]) -> None:
    """Copy whole blocks ``src_ids`` of one buffer into blocks ``dst_ids`` of another of the same layout."""
    if len(src_ids) != len(dst_ids):
        raise LayoutError(f"copy of {len(src_ids)} blocks into {len(dst_ids)}")
    if not src_ids:
        return
    device = dst[0].device
    s = torch.tensor(src_ids, dtype=torch.long, device=src[0].device)
    d = torch.tensor(dst_ids, dtype=torch.long, device=device)
    for a, b in zip(src, dst, strict=True):
        b.index_copy_(0, d, a.index_select(0, s).to(device, non_blocking=True))
