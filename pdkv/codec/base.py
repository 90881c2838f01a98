"""The codec interface and the self-describing frame every encoded chunk travels in.

A codec turns one canonical chunk ``[layers, kv, tokens, kv_heads, head_dim]``
(pdkv/layout.py) into a frame of bytes and back. The frame is what the wire
carries, so the receiver trusts nothing in it: ``decode`` checks the magic,
the format version, the codec, the dtype, every dimension against the chunk
it was asked to fill, the section count, and every section's length against
the length that codec must produce for that shape, before it reads a byte of
payload. Every write goes through a torch op on a tensor whose shape was
checked, so a malformed frame raises ``CodecError``; it never writes outside
the caller's chunk.

Frame layout (little endian)::

    header   magic "PKVC", version, codec id, dtype code, flags,
             layers, kv, tokens, kv_heads, head_dim (u32 each),
             section count (u16), reserved (u16), total frame bytes (u64)
    table    per section: method (u8: raw / zstd), 7 reserved bytes, stored length (u64)
    sections each starting on a 16-byte boundary of the frame

A section's decoded length is not on the wire: it follows from the codec and
the shape (``Codec._sections``), which is what makes every length checkable.
Encoding writes into a caller-provided buffer of at least
``max_encoded_bytes(tokens)``: a compressed section is kept only when it is
shorter than its raw form, so that bound holds for any input and a staging
slot sized for it can never overflow.
"""

from __future__ import annotations

import abc
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from pdkv.errors import CodecError, ConfigError
from pdkv.layout import DTYPE_CODES, FP8_DTYPES, KVLayout, check_chunk

MAGIC = b"PKVC"
FORMAT_VERSION = 1
ALIGN = 16
"""Every section, and ``max_encoded_bytes``, is a multiple of this: slots packed back to back stay aligned."""

# Wire codes, fixed by the format (never derived from a dict's order); the dtype's are pdkv.layout.DTYPE_CODES.
METHOD_RAW = 0
METHOD_ZSTD = 1
METHOD_NAMES = {METHOD_RAW: "raw", METHOD_ZSTD: "zstd"}

_HEADER = struct.Struct("<4sBBBB5IHHQ")
_SECTION = struct.Struct("<B7xQ")


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class SectionSpec:
    """One section a codec writes: its decoded length and whether it may be stored compressed."""

    nbytes: int
    compressible: bool = False


Decompressor = Callable[[torch.Tensor, int], bytes]
"""(stored bytes, exact decoded length) -> decoded bytes, raising CodecError on anything else."""


class Codec(abc.ABC):
    """Encodes canonical chunks of one KV layout into frames and back.

    A codec instance is bound to a layout (both sides know it after Hello), is
    safe to share between threads, and keeps no state between chunks: any
    chunk can be decoded alone, in any order, so a lost or refused chunk costs
    only itself.
    """

    name: ClassVar[str]
    codec_id: ClassVar[int]
    lossless: ClassVar[bool]
    summary: ClassVar[str]
    passthrough: ClassVar[bool] = False
    """True only for ``none``: the transfer path skips encode/decode and the slot carries the gathered chunk as is."""
    requires: ClassVar[tuple[str, str] | None] = None
    """(module, pdkv extra) an optional codec needs; ``make_codec`` names the extra when the module is missing."""
    source_dtypes: ClassVar[tuple[str, ...] | None] = None
    """KV dtypes the codec accepts; None: every dtype a KVLayout allows."""
    split_kv: ClassVar[bool] = False
    """Treats keys and values differently, so it needs both (not MLA's single latent)."""
    bytes_only: ClassVar[bool] = False
    """Moves or compresses the chunk's bytes without reading them as numbers (``none``, ``zstd``): the only kind
    that takes an fp8 cache, whose values need scales pdkv does not hold."""

    def __init__(self, layout: KVLayout) -> None:
        why = self.unsupported(layout)
        if why:
            raise ConfigError(why)
        self.layout = layout
        self._dtype_code = DTYPE_CODES[layout.dtype]
        self._local = threading.local()

    @classmethod
    def unsupported_dtype(cls, dtype: str) -> str | None:
        """Why this codec cannot encode a ``dtype`` KV cache, or None when it can."""
        if dtype in FP8_DTYPES and not cls.bytes_only:
            return (
                f"transfer.codec {cls.name!r} does arithmetic on KV values; this cache is {dtype}, an fp8 cache "
                "whose bytes pdkv moves as they are: set transfer.codec to 'none' or 'zstd'"
            )
        if cls.source_dtypes is not None and dtype not in cls.source_dtypes:
            return (
                f"transfer.codec {cls.name!r} encodes a {' or '.join(cls.source_dtypes)} KV cache; this one is "
                f"{dtype}. Pick another codec (see pdkv.codec.codec_names())"
            )
        return None

    @classmethod
    def unsupported(cls, layout: KVLayout) -> str | None:
        """Why this codec cannot encode ``layout``'s chunks, or None when it can."""
        if cls.split_kv and layout.mla:
            return (
                f"transfer.codec {cls.name!r} treats keys and values apart; an MLA cache has one latent tensor. "
                "Pick another codec (see pdkv.codec.codec_names())"
            )
        return cls.unsupported_dtype(layout.dtype)

    # -- sizes -------------------------------------------------------------------
    def max_encoded_bytes(self, num_tokens: int) -> int:
        """Largest frame ``encode`` writes for a chunk of ``num_tokens`` tokens; a multiple of 16."""
        specs = self._sections(num_tokens)
        return align(_HEADER.size + len(specs) * _SECTION.size) + sum(align(s.nbytes) for s in specs)

    # -- encode ------------------------------------------------------------------
    def encode(self, chunk: torch.Tensor, out: Any) -> int:
        """Write ``chunk`` as a frame at the start of ``out``; return the frame's length in bytes.

        ``out``: a CPU uint8 tensor, bytearray or writable memoryview of at
        least ``max_encoded_bytes(tokens)`` bytes (a staging slot).
        """
        tokens = _tokens(check_chunk(self.layout, chunk, "chunk to encode"))
        if chunk.device.type != "cpu":
            raise CodecError(f"codecs run on CPU chunks (the staging copy); got one on {chunk.device}")
        buf = _as_bytes(out, writable=True)
        bound = self.max_encoded_bytes(tokens)
        if buf.numel() < bound:
            raise CodecError(
                f"output buffer of {buf.numel()} bytes is smaller than max_encoded_bytes({tokens}) = {bound}"
            )
        if buf.data_ptr() % ALIGN:  # typed section views need aligned storage: encode beside, then copy
            frame = torch.empty(bound, dtype=torch.uint8)
            n = self.encode(chunk, frame)
            buf[:n].copy_(frame[:n])
            return n
        specs = self._sections(tokens)
        writer = _Writer(buf, specs)
        self._encode(chunk.contiguous(), writer)
        return writer.finish(self.codec_id, self._dtype_code, chunk.shape)

    @abc.abstractmethod
    def _sections(self, num_tokens: int) -> list[SectionSpec]:
        """The sections a chunk of ``num_tokens`` tokens is written as, in order."""

    @abc.abstractmethod
    def _encode(self, chunk: torch.Tensor, writer: _Writer) -> None:
        """Write every section of the contiguous ``chunk`` through ``writer``, in order."""

    # -- decode ------------------------------------------------------------------
    def decode(self, data: Any, out: torch.Tensor) -> torch.Tensor:
        """Check the frame ``data`` (exactly the bytes ``encode`` returned) and decode it into ``out``.

        ``out`` is the canonical chunk the frame must describe (its shape and
        dtype are what the receiver expects for that chunk index); returns it.
        Raises ``CodecError`` naming the first thing that does not fit.
        """
        tokens = _tokens(check_chunk(self.layout, out, "decode output"))
        if out.device.type != "cpu":
            raise CodecError(f"codecs run on CPU chunks (the staging copy); got an output on {out.device}")
        buf = _as_bytes(data, writable=False)
        if buf.data_ptr() % ALIGN:
            buf = buf.clone()  # fresh storage is aligned; typed views of sections need it
        sections = self._read_frame(buf, tokens)
        target = out if out.is_contiguous() else torch.empty_like(out)
        self._decode(sections, target)
        if target is not out:
            out.copy_(target)
        return out

    @abc.abstractmethod
    def _decode(self, sections: list[torch.Tensor], out: torch.Tensor) -> None:
        """Fill the contiguous ``out`` from the sections (uint8 tensors of exactly their spec's length)."""

    def _decompressor(self, method: int) -> Decompressor | None:
        """How to undo a compressed section stored with ``method``; None: the codec never writes it."""
        return None

    def _read_frame(self, buf: torch.Tensor, tokens: int) -> list[torch.Tensor]:
        size = buf.numel()
        if size < _HEADER.size:
            raise CodecError(f"encoded chunk of {size} bytes is shorter than the {_HEADER.size}-byte header")
        magic, version, codec_id, dtype_code, _flags, *dims, count, _reserved, total = _HEADER.unpack(
            _raw(buf[: _HEADER.size])
        )
        if magic != MAGIC:
            raise CodecError(f"encoded chunk does not start with {MAGIC!r} (got {magic!r}): not a pdkv codec frame")
        if version != FORMAT_VERSION:
            raise CodecError(
                f"encoded chunk has frame format version {version}, this build reads version {FORMAT_VERSION}"
            )
        if codec_id != self.codec_id:
            raise CodecError(
                f"encoded chunk was written by codec id {codec_id} ({_codec_name(codec_id)}), expected {self.codec_id} "
                f"({self.name})"
            )
        if dtype_code != self._dtype_code:
            raise CodecError(
                f"encoded chunk has dtype code {dtype_code}, the layout's {self.layout.dtype} is {self._dtype_code}"
            )
        expected_dims = self.layout.chunk_shape(tokens)
        if tuple(dims) != expected_dims:
            raise CodecError(f"encoded chunk is shaped {tuple(dims)}, expected {expected_dims}")
        specs = self._sections(tokens)
        if count != len(specs):
            raise CodecError(
                f"encoded chunk has {count} sections, codec {self.name} writes {len(specs)} for this shape"
            )
        if total != size:
            raise CodecError(f"encoded chunk is {size} bytes but its header says {total}")
        offset = align(_HEADER.size + count * _SECTION.size)
        if offset > size:
            raise CodecError(f"encoded chunk of {size} bytes is truncated inside its section table")
        table = _raw(buf[_HEADER.size : _HEADER.size + count * _SECTION.size])
        sections, end = [], offset
        for i, spec in enumerate(specs):
            method, stored = _SECTION.unpack_from(table, i * _SECTION.size)
            where = f"section {i} of an encoded {self.name} chunk"
            undo = None
            if method == METHOD_RAW:
                if stored != spec.nbytes:
                    raise CodecError(f"{where} stores {stored} raw bytes, the shape needs exactly {spec.nbytes}")
            else:
                undo = self._decompressor(method) if spec.compressible else None
                if undo is None:
                    raise CodecError(
                        f"{where} uses method {METHOD_NAMES.get(method, method)!r}, which codec {self.name} never "
                        "writes there"
                    )
                if not 0 < stored < spec.nbytes:
                    raise CodecError(
                        f"{where} stores {stored} compressed bytes; that must be between 1 and {spec.nbytes - 1} (else "
                        "it is stored raw)"
                    )
            end = offset + stored
            if end > size:
                raise CodecError(f"{where} runs to byte {end}, past the end of the {size}-byte chunk")
            payload = buf[offset:end]
            if undo is not None:
                payload = torch.frombuffer(bytearray(undo(payload, spec.nbytes)), dtype=torch.uint8)
            sections.append(payload)
            offset = align(end)
        if end != size:
            raise CodecError(f"encoded chunk has {size - end} bytes past its last section")
        return sections

    def scratch(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A per-thread reusable buffer: no allocation (and page faults) per chunk on the hot path."""
        cache: dict[str, torch.Tensor] = self._local.__dict__.setdefault("scratch", {})
        numel = torch.Size(shape).numel()
        t = cache.get(key)
        if t is None or t.dtype != dtype or t.numel() < numel:
            t = cache[key] = torch.empty(numel, dtype=dtype)
        return t[:numel].view(shape)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, layout dtype {self.layout.dtype})"


class _Writer:
    """Lays sections out in a frame as a codec produces them, enforcing each one's spec."""

    def __init__(self, buf: torch.Tensor, specs: list[SectionSpec]) -> None:
        self.buf = buf
        self.specs = specs
        self.entries: list[tuple[int, int]] = []
        self.end = self.offset = align(_HEADER.size + len(specs) * _SECTION.size)

    def _add(self, method: int, nbytes: int) -> torch.Tensor:
        if len(self.entries) >= len(self.specs):
            raise CodecError(f"codec wrote more than its {len(self.specs)} sections")  # a bug in a codec, not bad input
        view = self.buf[self.offset : self.offset + nbytes]
        self.entries.append((method, nbytes))
        self.end = self.offset + nbytes
        self.offset = align(self.end)
        self.buf[self.end : self.offset].zero_()  # padding too: the same chunk always encodes to the same bytes
        return view

    def next_spec(self) -> SectionSpec:
        return self.specs[len(self.entries)]

    def raw(self) -> torch.Tensor:
        """The next section's bytes, stored raw: a uint8 view to fill completely (16-byte aligned)."""
        return self._add(METHOD_RAW, self.next_spec().nbytes)

    def compressed(self, method: int, data: bytes) -> None:
        """The next section, stored as ``data`` (shorter than the raw section, or the codec must use ``raw``)."""
        spec = self.next_spec()
        if not spec.compressible or not 0 < len(data) < spec.nbytes:
            raise CodecError(
                f"section {len(self.entries)} cannot be stored compressed ({len(data)} bytes for {spec.nbytes} raw)"
            )
        self._add(method, len(data)).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def finish(self, codec_id: int, dtype_code: int, shape: torch.Size) -> int:
        """Write the header and table in front; the frame's length (it ends where its last section does)."""
        if len(self.entries) != len(self.specs):
            raise CodecError(f"codec wrote {len(self.entries)} of its {len(self.specs)} sections")
        header = _HEADER.pack(MAGIC, FORMAT_VERSION, codec_id, dtype_code, 0, *shape, len(self.specs), 0, self.end)
        head = header + b"".join(_SECTION.pack(m, n) for m, n in self.entries)
        start = align(len(head))
        self.buf[:start].zero_()
        self.buf[: len(head)].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
        return self.end


def _tokens(n: int) -> int:
    if n < 1:
        raise CodecError("a chunk to encode or decode has at least one token")
    return n


def _as_bytes(data: Any, writable: bool) -> torch.Tensor:
    """A flat uint8 CPU tensor over ``data``'s memory (no copy), or a copy of read-only bytes for decoding."""
    if isinstance(data, torch.Tensor):
        if data.device.type != "cpu" or data.dtype != torch.uint8 or data.dim() != 1 or not data.is_contiguous():
            raise CodecError(
                f"codec buffers are flat contiguous CPU uint8 tensors; got {tuple(data.shape)} {data.dtype} on "
                f"{data.device}"
            )
        return data
    mv = memoryview(data)
    if mv.readonly:
        if writable:
            raise CodecError("the output buffer is read-only")
        mv = memoryview(bytearray(mv))
    if mv.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(mv.cast("B"), dtype=torch.uint8)


def _raw(t: torch.Tensor) -> bytes:
    return t.numpy().tobytes()


_names_by_id: dict[int, str] = {}


def register_id(codec_id: int, name: str) -> None:
    """Record a codec's wire id (so an error about a foreign frame can name its codec)."""
    if _names_by_id.get(codec_id, name) != name:
        raise ValueError(f"codec id {codec_id} is taken by {_names_by_id[codec_id]!r}")
    _names_by_id[codec_id] = name


def _codec_name(codec_id: int) -> str:
    return _names_by_id.get(codec_id, "unknown")
