"""Exact codecs: ``none`` and ``zstd`` (byte planes + zstd).

Why byte planes: a float's bytes are not alike. In KV the byte holding the
sign and the top exponent bits takes a few dozen values (activations span a
few octaves), while the mantissa bytes are close to uniformly random. Stored
interleaved, a compressor sees noise; split into planes (the "shuffle" filter
of Blosc/HDF5) the exponent plane compresses about 2.6x and the rest do not
compress at all. On SmolLM2-135M's KV that is 1.19x for float32 and 1.45x for
bfloat16 (benchmarks/history/2026-11-23-kv-codecs.md).

So each plane is probed (a 64 KiB sample) and only a plane that compresses is
compressed; the others are split straight into the frame. zstd runs with the
"fast" strategy, a tiny hash table and 7-byte minimum matches: on exponent
planes the gain is all in zstd's entropy stage (repeats are rare), and those
settings compress them twice as fast as zstd level 1, slightly smaller
(SmolLM2's exponent plane, one core: 2.68x at 0.86 GB/s against 2.62x at
0.39 GB/s). lz4 was measured too and left out: it has no entropy stage, so on
the same plane it gains 1.43x, at 0.41 GB/s.
"""

from __future__ import annotations

from typing import Any

import torch

from pdkv.codec.base import METHOD_ZSTD, Codec, Decompressor, SectionSpec, _Writer
from pdkv.codec.kernels import merge_planes, split_planes
from pdkv.errors import CodecError

PROBE_BYTES = 64 << 10
MIN_GAIN = 1.05
"""A plane whose sample shrinks less than this is stored raw without compressing the rest of it."""


class NoneCodec(Codec):
    """The chunk's bytes as they are, in a checked frame (the transfer path sends them without one)."""

    name = "none"
    codec_id = 0
    lossless = True
    passthrough = True
    bytes_only = True
    summary = "raw bytes (default)"

    def _sections(self, num_tokens: int) -> list[SectionSpec]:
        return [SectionSpec(self.layout.chunk_bytes(num_tokens))]

    def _encode(self, chunk: torch.Tensor, writer: _Writer) -> None:
        writer.raw().copy_(chunk.view(-1).view(torch.uint8))

    def _decode(self, sections: list[torch.Tensor], out: torch.Tensor) -> None:
        out.view(-1).view(torch.uint8).copy_(sections[0])


class ZstdCodec(Codec):
    """Byte planes, each compressed with zstd when that pays; exact."""

    name = "zstd"
    codec_id = 1
    lossless = True
    bytes_only = True
    summary = "byte planes + zstd, exact (extra: pdkv[zstd])"
    requires = ("zstandard", "zstd")

    def __init__(self, layout: Any) -> None:
        super().__init__(layout)
        import zstandard  # checked by make_codec; imported here so the base install never needs it

        self._zstd = zstandard
        self._params = zstandard.ZstdCompressionParameters(
            strategy=zstandard.STRATEGY_FAST,
            window_log=17,
            hash_log=8,
            chain_log=8,
            search_log=1,
            min_match=7,
            target_length=0,
        )

    def _sections(self, num_tokens: int) -> list[SectionSpec]:
        numel = self.layout.chunk_bytes(num_tokens) // self.layout.element_size
        return [SectionSpec(numel, compressible=True) for _ in range(self.layout.element_size)]

    def _compressor(self) -> Any:
        # zstandard's (de)compressor objects are not safe to share between threads: one of each per thread
        comp = getattr(self._local, "compressor", None)
        if comp is None:
            comp = self._local.compressor = self._zstd.ZstdCompressor(compression_params=self._params)
        return comp

    def _encode(self, chunk: torch.Tensor, writer: _Writer) -> None:
        width = self.layout.element_size
        flat = chunk.view(-1).view(torch.uint8)
        grid = flat.view(-1, width)  # [elements, bytes of one element]
        numel = grid.shape[0]
        comp = self._compressor()
        # Planes worth compressing are split into scratch and compressed first: the frame's
        # offsets depend on their sizes. The others are then split straight into the frame.
        probe = [k for k in range(width) if numel and _worth_compressing(comp, grid[:PROBE_BYTES, k].contiguous())]
        scratch = [self.scratch(f"plane{k}", (numel,), torch.uint8) for k in probe]
        split_planes(flat, width, probe, scratch)
        packed = {k: comp.compress(plane.numpy()) for k, plane in zip(probe, scratch, strict=True)}
        raw_planes, raw_views = [], []
        for k in range(width):
            data = packed.get(k)
            if data is not None and len(data) < numel:
                writer.compressed(METHOD_ZSTD, data)
            elif data is not None:  # the probe was wrong: the plane is already split, copy it in
                writer.raw().copy_(scratch[probe.index(k)])
            else:
                raw_planes.append(k)
                raw_views.append(writer.raw())
        split_planes(flat, width, raw_planes, raw_views)

    def _decode(self, sections: list[torch.Tensor], out: torch.Tensor) -> None:
        merge_planes(sections, out.view(-1).view(torch.uint8))

    def _decompressor(self, method: int) -> Decompressor | None:
        return self._unzstd if method == METHOD_ZSTD else None

    def _unzstd(self, payload: torch.Tensor, nbytes: int) -> bytes:
        data = payload.numpy()
        zstd = self._zstd
        try:
            declared = zstd.frame_content_size(data)  # checked before anything is allocated for it
        except zstd.ZstdError as exc:
            raise CodecError(f"compressed plane is not a zstd frame: {exc}") from None
        if declared != nbytes:
            raise CodecError(f"compressed plane declares {declared} bytes, the shape needs exactly {nbytes}")
        dec = getattr(self._local, "decompressor", None)
        if dec is None:
            dec = self._local.decompressor = zstd.ZstdDecompressor()
        try:
            plain = dec.decompress(data, max_output_size=nbytes)
        except zstd.ZstdError as exc:
            raise CodecError(f"compressed plane does not decompress: {exc}") from None
        if len(plain) != nbytes:
            raise CodecError(f"compressed plane decompressed to {len(plain)} bytes, the shape needs exactly {nbytes}")
        return plain


def _worth_compressing(comp: Any, sample: torch.Tensor) -> bool:
    return len(comp.compress(sample.numpy())) * MIN_GAIN <= sample.numel()
