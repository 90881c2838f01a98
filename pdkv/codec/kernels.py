"""The codecs' inner loops: native (csrc/kvcodec.cpp) when the extension is built, else vectorized torch.

Both paths give identical results: the same float operations in the same
order (the native build turns off fused multiply-add), the same
round-half-to-even, the same float8 conversion (c10's). So a frame encoded by
either decodes to the same values with either, and the torch path is the
oracle the native kernels are tested against. Value tensors are ``[a, b, c]``
views whose last two dimensions are contiguous (a chunk's keys or values
alone need no copy); ``PDKV_NATIVE=0`` forces the torch path.
"""

from __future__ import annotations

from types import ModuleType

import torch

from pdkv import native
from pdkv.errors import CodecError

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
EXP_MIN, EXP_MAX = -126, 119
"""Row exponents an fp8 encoder writes: 2**e stays a normal float32 and 448 * 2**e finite."""
U8_LEVELS = 255


def _native(*tensors: torch.Tensor) -> ModuleType | None:
    if any(t.device.type != "cpu" for t in tensors):
        return None
    return native.extension()


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2**e as float32, exactly, built from the exponent bits (exp2 need not be exact)."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


# -- byte planes ----------------------------------------------------------------------


def split_planes(src: torch.Tensor, width: int, planes: list[int], dsts: list[torch.Tensor]) -> None:
    """``dsts[j][i] = src[i * width + planes[j]]``: chosen byte planes of a flat uint8 tensor."""
    ext = _native(src, *dsts)
    if ext is not None:
        ext.split_planes(src, width, planes, dsts)
        return
    grid = src.view(-1, width)
    for p, d in zip(planes, dsts, strict=True):
        d.copy_(grid[:, p])


def merge_planes(srcs: list[torch.Tensor], dst: torch.Tensor) -> None:
    """``dst[i * width + k] = srcs[k][i]``: byte planes back into elements."""
    ext = _native(dst, *srcs)
    if ext is not None:
        ext.merge_planes(srcs, dst)
        return
    grid = dst.view(-1, len(srcs))
    for k, s in enumerate(srcs):
        grid[:, k].copy_(s)


# -- fp8 --------------------------------------------------------------------------------


def fp8_encode(x: torch.Tensor, codes: torch.Tensor, exps: torch.Tensor) -> None:
    """Per row ``x[i, j, :]``: exponent e with max|row| / 2**e in (224, 448] into ``exps`` [a, b] (int8), e4m3 codes of row / 2**e."""
    ext = _native(x, codes, exps)
    if ext is not None:
        ext.fp8_encode(x, codes, exps)
        return
    amax = x.abs().amax(-1).float()
    mantissa, exponent = torch.frexp(amax)
    # amax = m * 2**k with m in [0.5, 1): amax / 2**(k-9) = 512 m fits under 448 iff m <= 0.875, else 2**(k-8) does
    e = (exponent - 9 + (mantissa > FP8_MAX / 512).to(exponent.dtype)).clamp_(EXP_MIN, EXP_MAX)
    exps.copy_(e)
    codes.view(FP8).copy_(x * _pow2(-e).unsqueeze(-1))


def fp8_decode(codes: torch.Tensor, exps: torch.Tensor, out: torch.Tensor) -> None:
    """``out[i, j, :] = e4m3(codes[i, j, :]) * 2**exps[i, j]``; exponents an encoder never writes are a CodecError."""
    if exps.numel():
        lo, hi = (int(v) for v in torch.aminmax(exps.reshape(-1).to(torch.int32)))
        if lo < EXP_MIN or hi > EXP_MAX:
            raise CodecError(f"fp8 row exponents span [{lo}, {hi}]; an encoder writes only [{EXP_MIN}, {EXP_MAX}]")
    ext = _native(codes, exps, out)
    if ext is not None:
        ext.fp8_decode(codes, exps, out)
        return
    out.copy_(codes.view(FP8).float().mul_(_pow2(exps).unsqueeze(-1)))


# -- uint8 with one (min, step) per group -------------------------------------------------------


def _bf16_outward(x: torch.Tensor, toward: float) -> torch.Tensor:
    """``x`` (float32) as bfloat16 rounded toward ``toward`` (-inf or +inf): never on the inner side of the value."""
    b = x.to(torch.bfloat16)
    wrong = b.float() > x if toward < 0 else b.float() < x
    return torch.where(wrong, torch.nextafter(b, torch.full_like(b, toward)), b)


def u8_params(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, step) as bfloat16 per group along ``dim`` (kept), rounded outward so the 256 levels always cover the group.

    The step is rounded up from (max - stored min) / 255, so every value maps
    to a level in [0, 255] and the error stays within half the stored step.
    """
    shape = list(x.shape)
    shape[dim] = 1
    ext = _native(x)
    if ext is not None:
        lo_f, hi_f = torch.empty(shape), torch.empty(shape)
        ext.group_minmax(x, lo_f, hi_f)
    else:
        xf = x.float()
        lo_f, hi_f = xf.amin(dim, keepdim=True), xf.amax(dim, keepdim=True)
    lo = _bf16_outward(lo_f, float("-inf"))
    step = _bf16_outward((hi_f - lo.float()) / U8_LEVELS, float("inf"))
    return lo, step


def u8_quantize(x: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, codes: torch.Tensor) -> None:
    """``codes = clamp(round((x - lo) / step), 0, 255)`` with ``lo``/``step`` bfloat16 broadcast over ``x`` [a, b, c]."""
    lo_f = lo.float().contiguous()
    step_f = step.float()
    inv = torch.where(step_f > 0, step_f.reciprocal(), torch.zeros_like(step_f)).contiguous()  # a constant group: every code 0
    ext = _native(x, codes)
    if ext is not None:
        ext.u8_quantize(x, lo_f, inv, codes)
        return
    codes.copy_((x.float() - lo_f).mul_(inv).round_().clamp_(0, U8_LEVELS))


def u8_dequantize(codes: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, out: torch.Tensor) -> None:
    """``out = codes * step + lo`` (a product, then a sum)."""
    lo_f = lo.float().contiguous()
    step_f = step.float().contiguous()
    ext = _native(codes, out)
    if ext is not None:
        ext.u8_dequantize(codes, lo_f, step_f, out)
        return
    out.copy_(codes.float().mul_(step_f).add_(lo_f))
