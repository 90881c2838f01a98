"""The codecs' inner loops: native (csrc/kvcodec.cpp, in pdkv.native's library) when it is loaded, else vectorized
torch.

Both paths give identical results: the same float operations in the same
order (the native build turns off fused multiply-add), the same
round-half-to-even, the same float8 conversion (c10's). So a frame encoded by
either decodes to the same values with either, and the torch path is the
oracle the native kernels are tested against. Value tensors are ``[a, b, c]``
views whose last two dimensions are contiguous (a chunk's keys or values
alone need no copy); ``PDKV_NATIVE=0`` forces the torch path. The native
calls pass data pointers, sizes and strides after the checks here (the
library's C ABI takes no tensors).
"""

from __future__ import annotations

import ctypes

import torch

from pdkv import native
from pdkv.errors import CodecError

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
EXP_MIN, EXP_MAX = -126, 119
"""Row exponents an fp8 encoder writes: 2**e stays a normal float32 and 448 * 2**e finite."""
U8_LEVELS = 255


_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""Value dtypes the kernels take, by csrc/kvcodec.cpp's codes."""


class Rows(ctypes.Structure):
    """csrc/kvcodec.cpp's Rows: an [a, b, c] tensor whose last two dimensions are contiguous, with its stride over a."""

    _fields_ = [("a", ctypes.c_int64), ("b", ctypes.c_int64), ("c", ctypes.c_int64), ("stride_a", ctypes.c_int64)]


def _native(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The kernel library when every tensor is on the CPU and it is loaded, else None (torch path)."""
    if any(t.device.type != "cpu" for t in tensors):
        return None
    return native.library()


def _flat(t: torch.Tensor, what: str, dtype: torch.dtype) -> int:
    """Data pointer of a contiguous tensor of ``dtype``, after checking it is one."""
    if not t.is_contiguous() or t.dtype != dtype:
        raise CodecError(f"{what} must be a contiguous {dtype} tensor, got {t.dtype} with strides {t.stride()}")
    return t.data_ptr()


def _rows(t: torch.Tensor, what: str) -> Rows:
    """``t`` as Rows, after checking the kernels can read it that way."""
    if t.dim() != 3 or t.stride(2) != 1 or (t.size(1) > 1 and t.stride(1) != t.size(2)) or t.stride(0) < 0:
        raise CodecError(
            f"{what} must be a 3-d tensor contiguous in its last two dimensions, got shape {tuple(t.shape)} strides "
            f"{t.stride()}"
        )
    return Rows(t.size(0), t.size(1), t.size(2), 0 if t.size(0) <= 1 else t.stride(0))


def _values(t: torch.Tensor, what: str) -> tuple[int, Rows]:
    """(dtype code, Rows) of a value tensor."""
    if t.dtype not in _DTYPES:
        raise CodecError(f"{what} must be float32, bfloat16 or float16, got {t.dtype}")
    return _DTYPES[t.dtype], _rows(t, what)


def _params(lo: torch.Tensor, hi: torch.Tensor, rows: Rows, what: str) -> tuple[int, int]:
    """(pb, pc) of parameters [a, 1 or b, 1 or c] (contiguous float32) over values ``rows``."""
    _flat(lo, what, torch.float32)
    _flat(hi, what, torch.float32)
    if (
        lo.shape != hi.shape
        or lo.dim() != 3
        or lo.size(0) != rows.a
        or lo.size(1) not in (1, rows.b)
        or lo.size(2) not in (1, rows.c)
    ):
        raise CodecError(f"{what} {tuple(lo.shape)} do not broadcast over [{rows.a}, {rows.b}, {rows.c}]")
    return lo.size(1), lo.size(2)


def _of(t: torch.Tensor, dtype: torch.dtype, what: str) -> torch.Tensor:
    """``t`` after checking its dtype (codes are uint8)."""
    if t.dtype != dtype:
        raise CodecError(f"{what} must be {dtype}, got {t.dtype}")
    return t


def _exponents(exps: torch.Tensor, rows: Rows, call: str) -> None:
    """One contiguous int8 exponent per row."""
    _flat(exps, f"{call} exponents", torch.int8)
    if exps.numel() != rows.a * rows.b:
        raise CodecError(f"{call} needs one exponent per row ({rows.a * rows.b}), got {exps.numel()}")


def _e4m3_table() -> torch.Tensor:
    """The 256 e4m3fn values as float32, from torch's own conversion (the native decode looks codes up here)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()


_E4M3 = _e4m3_table()


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2**e as float32, exactly, built from the exponent bits (exp2 need not be exact)."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


# -- byte planes ----------------------------------------------------------------------


def split_planes(src: torch.Tensor, width: int, planes: list[int], dsts: list[torch.Tensor]) -> None:
    """``dsts[j][i] = src[i * width + planes[j]]``: chosen byte planes of a flat uint8 tensor."""
    lib = _native(src, *dsts)
    if lib is not None:
        n = src.numel() // width
        if src.numel() % width or any(d.numel() != n for d in dsts) or len(planes) != len(dsts):
            raise CodecError(
                f"split_planes: {src.numel()} bytes in {width}-byte elements into {[d.numel() for d in dsts]}-byte "
                f"planes {planes}"
            )
        ptrs = [_flat(d, "split_planes destination", torch.uint8) for d in dsts]
        chosen = (ctypes.c_int64 * len(planes))(*planes)
        native.call(
            lib.pdkv_split_planes,
            _flat(src, "split_planes source", torch.uint8),
            n,
            width,
            chosen,
            (ctypes.c_void_p * len(ptrs))(*ptrs),
            len(planes),
            torch.get_num_threads(),
        )
        return
    grid = src.view(-1, width)
    for p, d in zip(planes, dsts, strict=True):
        d.copy_(grid[:, p])


def merge_planes(srcs: list[torch.Tensor], dst: torch.Tensor) -> None:
    """``dst[i * width + k] = srcs[k][i]``: byte planes back into elements."""
    lib = _native(dst, *srcs)
    if lib is not None:
        n = dst.numel() // max(len(srcs), 1)
        if not srcs or dst.numel() % len(srcs) or any(s.numel() != n for s in srcs):
            raise CodecError(
                f"merge_planes: {len(srcs)} planes of {[s.numel() for s in srcs]} bytes into {dst.numel()} bytes"
            )
        ptrs = [_flat(s, "merge_planes source", torch.uint8) for s in srcs]
        native.call(
            lib.pdkv_merge_planes,
            (ctypes.c_void_p * len(ptrs))(*ptrs),
            len(ptrs),
            _flat(dst, "merge_planes destination", torch.uint8),
            n,
            torch.get_num_threads(),
        )
        return
    grid = dst.view(-1, len(srcs))
    for k, s in enumerate(srcs):
        grid[:, k].copy_(s)


# -- fp8 --------------------------------------------------------------------------------


def fp8_encode(x: torch.Tensor, codes: torch.Tensor, exps: torch.Tensor) -> None:
    """Per row ``x[i, j, :]``: exponent e with max|row| / 2**e in (224, 448] into ``exps`` [a, b] (int8), e4m3 codes
    of row / 2**e."""
    lib = _native(x, codes, exps)
    if lib is not None:
        dtype, rows = _values(x, "fp8_encode input")
        code_rows = _rows(_of(codes, torch.uint8, "fp8_encode codes"), "fp8_encode codes")
        _exponents(exps, rows, "fp8_encode")
        native.call(
            lib.pdkv_fp8_encode,
            dtype,
            x.data_ptr(),
            ctypes.byref(rows),
            codes.data_ptr(),
            ctypes.byref(code_rows),
            exps.data_ptr(),
            torch.get_num_threads(),
        )
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
    lib = _native(codes, exps, out)
    if lib is not None:
        dtype, rows = _values(out, "fp8_decode output")
        code_rows = _rows(_of(codes, torch.uint8, "fp8_decode codes"), "fp8_decode codes")
        _exponents(exps, rows, "fp8_decode")
        native.call(
            lib.pdkv_fp8_decode,
            codes.data_ptr(),
            ctypes.byref(code_rows),
            exps.data_ptr(),
            _E4M3.data_ptr(),
            dtype,
            out.data_ptr(),
            ctypes.byref(rows),
            torch.get_num_threads(),
        )
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
    lib = _native(x)
    if lib is not None:
        lo_f, hi_f = torch.empty(shape), torch.empty(shape)
        dtype, rows = _values(x, "group_minmax input")
        pb, pc = _params(lo_f, hi_f, rows, "group_minmax outputs")
        native.call(
            lib.pdkv_group_minmax,
            dtype,
            x.data_ptr(),
            ctypes.byref(rows),
            lo_f.data_ptr(),
            hi_f.data_ptr(),
            pb,
            pc,
            torch.get_num_threads(),
        )
    else:
        xf = x.float()
        lo_f, hi_f = xf.amin(dim, keepdim=True), xf.amax(dim, keepdim=True)
    lo = _bf16_outward(lo_f, float("-inf"))
    step = _bf16_outward((hi_f - lo.float()) / U8_LEVELS, float("inf"))
    return lo, step


def u8_quantize(x: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, codes: torch.Tensor) -> None:
    """``codes = clamp(round((x - lo) / step), 0, 255)`` with ``lo``/``step`` bfloat16 broadcast over ``x`` [a, b,
    c]."""
    lo_f = lo.float().contiguous()
    step_f = step.float()
    inv = torch.where(
        step_f > 0, step_f.reciprocal(), torch.zeros_like(step_f)
    ).contiguous()  # a constant group: every code 0
    lib = _native(x, codes)
    if lib is not None:
        dtype, rows = _values(x, "u8_quantize input")
        code_rows = _rows(_of(codes, torch.uint8, "u8_quantize codes"), "u8_quantize codes")
        pb, pc = _params(lo_f, inv, rows, "u8_quantize parameters")
        native.call(
            lib.pdkv_u8_quantize,
            dtype,
            x.data_ptr(),
            ctypes.byref(rows),
            lo_f.data_ptr(),
            inv.data_ptr(),
            pb,
            pc,
            codes.data_ptr(),
            ctypes.byref(code_rows),
            torch.get_num_threads(),
        )
        return
    codes.copy_((x.float() - lo_f).mul_(inv).round_().clamp_(0, U8_LEVELS))


def u8_dequantize(codes: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, out: torch.Tensor) -> None:
    """``out = codes * step + lo`` (a product, then a sum)."""
    lo_f = lo.float().contiguous()
    step_f = step.float().contiguous()
    lib = _native(codes, out)
    if lib is not None:
        dtype, rows = _values(out, "u8_dequantize output")
        code_rows = _rows(_of(codes, torch.uint8, "u8_dequantize codes"), "u8_dequantize codes")
        pb, pc = _params(lo_f, step_f, rows, "u8_dequantize parameters")
        native.call(
            lib.pdkv_u8_dequantize,
            codes.data_ptr(),
            ctypes.byref(code_rows),
            lo_f.data_ptr(),
            step_f.data_ptr(),
            pb,
            pc,
            dtype,
            out.data_ptr(),
            ctypes.byref(rows),
            torch.get_num_threads(),
        )
        return
    out.copy_(codes.float().mul_(step_f).add_(lo_f))
