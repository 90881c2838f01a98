"""Lossy codecs, opt-in: fewer bytes for a bounded error per element.

- ``bf16`` / ``fp16``: a float32 cache cast to 16 bits (2x). bf16 keeps the
  range (relative error <= 2^-8); fp16 keeps 3 more mantissa bits (<= 2^-11)
  but saturates at +-65504, so values are clamped there first.
- ``fp8``: e4m3 (torch.float8_e4m3fn) with one power-of-two scale per
  (layer, K/V, token, head), stored as a signed exponent byte. The scale only
  moves the row into e4m3's range (max 448), and a power of two does that
  exactly, so the error is e4m3's own: <= 2^-4 of the value, plus a floor of
  ~amax_row * 2^-17 where the row's small values fall into subnormals. One
  byte per head_dim elements of overhead (1.6% at head_dim 64).
- ``k16v8``: keys in 16 bits (bf16; a 16-bit cache's keys go as they are),
  values as ``fp8``. Attention scores are products with keys, so key error is
  amplified by the softmax while value error is only averaged; LMCache's
  asymmetric K/V scheme spends the bits the same way.
- ``int8``: asymmetric 8-bit (min and step per group, as bfloat16) with one
  group per (layer, K/V, token, head), as KIVI does for values. Error <= half
  a step. ``int8-kivi``: the same for values, but keys grouped per channel
  across the chunk's tokens (KIVI): a few key channels carry outliers of one
  sign along every token, which a per-token group has to span and a
  per-channel group isolates. benchmarks/history/2026-11-23-kv-codecs.md has which wins
  on the default model and by how much.

The group parameters are stored rounded outwards (min toward -inf, step
toward +inf) in bfloat16, so the stored grid always covers the group and the
half-step bound holds with the stored step; bfloat16 keeps float32's range,
so no value can overflow them.
"""

from __future__ import annotations

import torch

from pdkv.codec.base import Codec, SectionSpec, _Writer
from pdkv.codec.kernels import fp8_decode, fp8_encode, u8_dequantize, u8_params, u8_quantize

FP16_MAX = 65504.0


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A chunk ``[L, 2, T, H, D]`` as ``[1, rows, D]``, or its keys/values ``[L, T, H, D]`` as ``[L, T*H, D]``: one
    row per head."""
    return t.reshape(1, -1, t.shape[-1]) if t.dim() == 5 else t.view(t.shape[0], -1, t.shape[-1])


class CastCodec(Codec):
    """A float32 cache cast to a 16-bit float."""

    target: torch.dtype
    source_dtypes = ("float32",)
    lossless = False

    def _sections(self, num_tokens: int) -> list[SectionSpec]:
        return [SectionSpec(self.layout.chunk_bytes(num_tokens) // 2)]

    def _encode(self, chunk: torch.Tensor, writer: _Writer) -> None:
        value = chunk.clamp(-FP16_MAX, FP16_MAX) if self.target == torch.float16 else chunk
        writer.raw().view(self.target).view(chunk.shape).copy_(value)

    def _decode(self, sections: list[torch.Tensor], out: torch.Tensor) -> None:
        out.copy_(sections[0].view(self.target).view(out.shape))


class Bf16Codec(CastCodec):
    name = "bf16"
    codec_id = 2
    target = torch.bfloat16
    summary = "float32 -> bfloat16 (2x, rel. error <= 2^-8)"


class Fp16Codec(CastCodec):
    name = "fp16"
    codec_id = 3
    target = torch.float16
    summary = "float32 -> float16, clamped to +-65504 (2x, rel. error <= 2^-11)"


class Fp8Codec(Codec):
    """e4m3 with a power-of-two scale per (layer, K/V, token, head)."""

    name = "fp8"
    codec_id = 4
    lossless = False
    summary = "e4m3 + a power-of-two scale per token and head (~3.9x from float32, ~2x from 16 bits)"

    def _sections(self, num_tokens: int) -> list[SectionSpec]:
        numel = self.layout.chunk_bytes(num_tokens) // self.layout.element_size
        return [SectionSpec(numel), SectionSpec(numel // self.layout.head_dim)]

    def _encode(self, chunk: torch.Tensor, writer: _Writer) -> None:
        x = _rows(chunk)
        codes, exps = writer.raw(), writer.raw()
        fp8_encode(x, codes.view(x.shape), exps.view(torch.int8).view(x.shape[:-1]))

    def _decode(self, sections: list[torch.Tensor], out: torch.Tensor) -> None:
        x = _rows(out)
        codes, exps = sections
        fp8_decode(codes.view(x.shape), exps.view(torch.int8).view(x.shape[:-1]), x)


class K16V8Codec(Codec):
    """Keys in 16 bits, values as fp8."""

    name = "k16v8"
    codec_id = 5
    lossless = False
    split_kv = True
    summary = "keys 16-bit, values fp8 (LMCache-style asymmetric K/V)"

    @property
    def key_dtype(self) -> torch.dtype:
        dtype = self.layout.torch_dtype
        return dtype if dtype.itemsize == 2 else torch.bfloat16

    def _sections(self, num_tokens: int) -> list[SectionSpec]:
        half = self.layout.chunk_bytes(num_tokens) // self.layout.element_size // 2
        return [SectionSpec(half * 2), SectionSpec(half), SectionSpec(half // self.layout.head_dim)]

    def _encode(self, chunk: torch.Tensor, writer: _Writer) -> None:
        keys, values = chunk[:, 0], _rows(chunk[:, 1])
        writer.raw().view(self.key_dtype).view(keys.shape).copy_(keys)
        codes, exps = writer.raw(), writer.raw()
        fp8_encode(values, codes.view(values.shape), exps.view(torch.int8).view(values.shape[:-1]))

    def _decode(self, sections: list[torch.Tensor], out: torch.Tensor) -> None:
        keys, codes, exps = sections
        out[:, 0].copy_(keys.view(self.key_dtype).view(out[:, 0].shape))
        values = _rows(out[:, 1])
        fp8_decode(codes.view(values.shape), exps.view(torch.int8).view(values.shape[:-1]), values)


class Int8Codec(Codec):
    """Asymmetric uint8, one (min, step) per (layer, K/V, token, head)."""

    name = "int8"
    codec_id = 6
    lossless = False
    summary = "uint8 + (min, step) per token and head, for K and V"

    def _sections(self, num_tokens: int) -> list[SectionSpec]:
        numel = self.layout.chunk_bytes(num_tokens) // self.layout.element_size
        return [SectionSpec(numel), SectionSpec(numel // self.layout.head_dim * 2 * 2)]

    def _encode(self, chunk: torch.Tensor, writer: _Writer) -> None:
        x = _rows(chunk)
        codes, params = writer.raw().view(x.shape), writer.raw().view(torch.bfloat16).view(2, *x.shape[:-1], 1)
        lo, step = u8_params(x, -1)
        params[0].copy_(lo)
        params[1].copy_(step)
        u8_quantize(x, lo, step, codes)

    def _decode(self, sections: list[torch.Tensor], out: torch.Tensor) -> None:
        x = _rows(out)
        params = sections[1].view(torch.bfloat16).view(2, *x.shape[:-1], 1)
        u8_dequantize(sections[0].view(x.shape), params[0], params[1], x)


class Int8KiviCodec(Codec):
    """Asymmetric uint8; keys grouped per channel over the chunk's tokens, values per token and head (KIVI)."""

    name = "int8-kivi"
    codec_id = 7
    lossless = False
    split_kv = True
    summary = "uint8; keys per channel over the chunk's tokens, values per token and head (KIVI)"

    def _sections(self, num_tokens: int) -> list[SectionSpec]:
        layers, _, tokens, heads, dim = self.layout.chunk_shape(num_tokens)
        numel = layers * 2 * tokens * heads * dim
        return [
            SectionSpec(numel),
            SectionSpec(2 * layers * heads * dim * 2),
            SectionSpec(2 * layers * tokens * heads * 2),
        ]

    @staticmethod
    def _views(chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys as ``[L, T, H*D]`` (a group is a column) and values as ``[L, T*H, D]`` (a group is a row)."""
        layers, _, tokens, heads, dim = chunk.shape
        return chunk[:, 0].view(layers, tokens, heads * dim), chunk[:, 1].view(layers, tokens * heads, dim)

    def _param_shapes(self, chunk: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
        layers, _, tokens, heads, dim = chunk.shape
        return (2, layers, 1, heads * dim), (2, layers, tokens * heads, 1)

    def _encode(self, chunk: torch.Tensor, writer: _Writer) -> None:
        keys, values = self._views(chunk)
        codes_k, codes_v = self._views(writer.raw().view(chunk.shape))
        kshape, vshape = self._param_shapes(chunk)
        for x, codes, shape, dim in ((keys, codes_k, kshape, 1), (values, codes_v, vshape, -1)):
            params = writer.raw().view(torch.bfloat16).view(shape)
            lo, step = u8_params(x, dim)
            params[0].copy_(lo)
            params[1].copy_(step)
            u8_quantize(x, lo, step, codes)

    def _decode(self, sections: list[torch.Tensor], out: torch.Tensor) -> None:
        keys, values = self._views(out)
        codes_k, codes_v = self._views(sections[0].view(out.shape))
        kshape, vshape = self._param_shapes(out)
        for x, codes, params in (
            (keys, codes_k, sections[1].view(torch.bfloat16).view(kshape)),
            (values, codes_v, sections[2].view(torch.bfloat16).view(vshape)),
        ):
            u8_dequantize(codes, params[0], params[1], x)
