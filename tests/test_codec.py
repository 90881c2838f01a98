"""pdkv.codec: round trips within each codec's stated error bound, frame validation, the size bound, config.

Every codec is run over several shapes (odd head_dim, one token, partial
chunks, MLA) and every KV dtype it accepts. Exact codecs must give the same
bytes back, NaN patterns included; lossy ones must stay within the per-element
bound their docstring states. Malformed frames (truncated, a header field
changed, a section length that does not fit the shape, a corrupt zstd stream,
random byte flips) must raise CodecError and leave the caller's memory outside
the output chunk untouched. The native kernels (csrc/kvcodec.cpp) must give
the torch path's frames and decoded values exactly.
"""

from __future__ import annotations

import importlib.util
import struct
from collections.abc import Iterator

import pytest
import torch

from pdkv import native
from pdkv.codec import CODECS, available_codecs, codec_names, make_codec
from pdkv.codec.base import _HEADER, _SECTION, ALIGN, Codec, align
from pdkv.config import TransferConfig, load_config
from pdkv.errors import CodecError, ConfigError
from pdkv.layout import FP8_DTYPES, KVLayout

DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")
# (layers, kv heads, head_dim, tokens, mla): odd sizes, one token, a partial chunk, a full one, MLA's single latent
SHAPES = ((2, 3, 5, 7, False), (1, 1, 8, 1, False), (3, 2, 16, 33, False), (2, 1, 12, 5, True))
LOSSY = [n for n, c in CODECS.items() if not c.lossless]


def layout_for(dtype: str, layers: int, heads: int, dim: int, mla: bool = False) -> KVLayout:
    return KVLayout(num_layers=layers, num_kv_heads=heads, head_dim=dim, dtype=dtype, mla=mla)


def kv_like(layout: KVLayout, tokens: int, seed: int = 0) -> torch.Tensor:
    """KV-like values: per-channel scales over four octaves (outlier channels), a zero row and a constant row."""
    gen = torch.Generator().manual_seed(seed)
    shape = layout.chunk_shape(tokens)
    scale = torch.exp2(torch.randint(-2, 3, (1, 1, 1, shape[3], shape[4]), generator=gen).float())
    x = torch.randn(shape, generator=gen) * scale + torch.randn((1, 1, 1, shape[3], shape[4]), generator=gen)
    x[0, 0, 0, 0] = 0.0
    x[-1, -1, -1, -1] = 3.25
    if layout.dtype in FP8_DTYPES:  # the bytes vLLM's fp8 cache would hold for these values
        return x.to(getattr(torch, layout.dtype)).view(layout.torch_dtype)
    return x.to(layout.torch_dtype)


def combos() -> Iterator[tuple[str, str, tuple[int, int, int, int, bool]]]:
    for name, cls in CODECS.items():
        for dtype in DTYPES:
            for shape in SHAPES:
                if cls.unsupported(layout_for(dtype, *shape[:3], mla=shape[4])) is None:
                    yield name, dtype, shape


def roundtrip(codec: Codec, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(frame, decoded) of ``x``, the frame encoded into a buffer exactly ``max_encoded_bytes`` long."""
    buf = torch.full((codec.max_encoded_bytes(x.shape[2]),), 0xAB, dtype=torch.uint8)
    n = codec.encode(x, buf)
    assert 0 < n <= buf.numel()
    out = torch.empty_like(x)
    codec.decode(buf[:n], out)
    return buf[:n].clone(), out


# -- round trips -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "dtype", "shape"), list(combos()))
def test_roundtrip_within_bound(name: str, dtype: str, shape: tuple[int, int, int, int, bool]) -> None:
    layers, heads, dim, tokens, mla = shape
    codec = make_codec(name, layout_for(dtype, layers, heads, dim, mla))
    x = kv_like(codec.layout, tokens)
    frame, out = roundtrip(codec, x)
    assert out.dtype == x.dtype and out.shape == x.shape
    xf, of = x.float(), out.float()
    err = (of - xf).abs()
    if codec.lossless:
        assert torch.equal(out, x)
        return
    if tokens > 1:  # one token is all overhead: padding and per-channel parameters cost more than a 16-bit row
        head = align(_HEADER.size + header_fields(frame)[10] * _SECTION.size)
        assert frame.numel() - head < x.nbytes
    assert bool(torch.isfinite(of).all())
    amax = xf.abs().amax(-1, keepdim=True)
    fp8_bound = xf.abs() / 16 + amax * 2.0**-17  # e4m3: half an ulp (3 mantissa bits) + the subnormal floor of the row
    if name == "bf16":
        bound = xf.abs() * 2.0**-8
    elif name == "fp16":
        bound = xf.abs() * 2.0**-11 + 2.0**-25
    elif name == "fp8":
        bound = fp8_bound
    elif name == "k16v8":
        key_rel = 0.0 if x.element_size() == 2 else 2.0**-8  # a 16-bit cache's keys go as they are
        bound = torch.cat([xf[:, :1].abs() * key_rel, fp8_bound[:, 1:]], dim=1)
    # int8, int8-kivi: half a step; the stored step covers the range widened by one bf16 ulp of the min, rounded
    # up
    else:
        groups = [(slice(None), -1)] if name == "int8" else [(slice(0, 1), 2), (slice(1, 2), -1)]
        bound = torch.empty_like(xf)
        for part, dim_ in groups:
            v = xf[:, part]
            lo, hi = v.amin(dim_, keepdim=True), v.amax(dim_, keepdim=True)
            step = ((hi - lo) + lo.abs() * 2.0**-7) / 255 * (1 + 2.0**-7)
            bound[:, part] = (step / 2).expand_as(v)
    # the output dtype's own rounding of the decoded value comes on top
    out_ulp = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[x.dtype]
    slack = of.abs() * out_ulp + 1e-6
    assert bool((err <= bound + slack).all()), (
        f"{name} {dtype} {shape}: worst excess {float((err - bound - slack).max())}"
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["none", "zstd"])
def test_lossless_exact_on_any_bits(name: str, dtype: str) -> None:
    """Random bytes: NaNs, infinities, subnormals, negative zeros all come back bit for bit."""
    layout = layout_for(dtype, 2, 3, 8)
    raw = torch.randint(0, 256, (layout.chunk_bytes(9),), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    x = raw.view(layout.torch_dtype).view(layout.chunk_shape(9))
    frame, out = roundtrip(make_codec(name, layout), x)
    assert torch.equal(out.view(-1).view(torch.uint8), raw)


def test_zstd_compresses_kv_and_stores_noise_raw() -> None:
    """Exponent planes of KV-like data compress; random planes are stored raw, so noise costs only the header."""
    layout = layout_for("bfloat16", 4, 3, 64)
    codec = make_codec("zstd", layout)
    frame, _ = roundtrip(codec, kv_like(layout, 64))
    assert frame.numel() < 0.8 * layout.chunk_bytes(64)
    noise = (
        torch.randint(0, 256, (layout.chunk_bytes(64),), dtype=torch.uint8)
        .view(torch.bfloat16)
        .view(layout.chunk_shape(64))
    )
    frame, _ = roundtrip(codec, noise)
    assert layout.chunk_bytes(64) < frame.numel() <= codec.max_encoded_bytes(64)
    assert frame.numel() - layout.chunk_bytes(64) < 128


def test_fp16_clamps_instead_of_overflowing() -> None:
    layout = layout_for("float32", 1, 1, 2)
    x = torch.tensor([1e6, -1e6, 70000.0, 1.0]).view(layout.chunk_shape(1))
    _, out = roundtrip(make_codec("fp16", layout), x)
    assert out.view(-1).tolist() == [65504.0, -65504.0, 65504.0, 1.0]


def test_fp8_keeps_tiny_and_huge_rows() -> None:
    """A power-of-two scale per row: rows near float32's ends keep e4m3's relative precision."""
    layout = layout_for("float32", 1, 2, 4, mla=False)
    x = torch.tensor([[1e-30, -3e-30, 2e-30, 5e-31], [1e30, -2e30, 3e29, 7e30]] * 2).view(layout.chunk_shape(1))
    _, out = roundtrip(make_codec("fp8", layout), x)
    assert bool(((out - x).abs() <= x.abs() / 16).all())


def test_int8_constant_group_is_exact() -> None:
    layout = layout_for("float32", 1, 1, 8)
    x = torch.full(layout.chunk_shape(3), 2.5)
    for name in ("int8", "int8-kivi"):
        _, out = roundtrip(make_codec(name, layout), x)
        assert torch.equal(out, x)


def test_decode_into_strided_output_and_from_bytes() -> None:
    layout = layout_for("float32", 2, 2, 8)
    codec = make_codec("int8-kivi", layout)
    x = kv_like(layout, 4)
    frame, expected = roundtrip(codec, x)
    wide = torch.zeros(layout.chunk_shape(8))
    codec.decode(bytes(frame.numpy()), wide[:, :, ::2])  # a read-only bytes object, a non-contiguous output
    assert torch.equal(wide[:, :, ::2], expected)
    assert not bool(wide[:, :, 1::2].any())


def test_encode_into_unaligned_and_python_buffers() -> None:
    layout = layout_for("bfloat16", 2, 2, 8)
    codec = make_codec("fp8", layout)
    x = kv_like(layout, 5)
    frame, _ = roundtrip(codec, x)
    bound = codec.max_encoded_bytes(5)
    assert bound % ALIGN == 0
    big = torch.zeros(bound + 1, dtype=torch.uint8)
    n = codec.encode(x, big[1:])  # one byte off alignment: encoded beside, then copied in
    assert torch.equal(big[1 : 1 + n], frame)
    target = bytearray(bound)
    n = codec.encode(x, target)
    assert bytes(target[:n]) == bytes(frame.numpy())
    with pytest.raises(CodecError, match="read-only"):
        codec.encode(x, bytes(bound))


# -- the size bound -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", codec_names())
def test_output_smaller_than_bound_is_refused(name: str) -> None:
    layout = layout_for("float32", 2, 2, 8)
    codec = make_codec(name, layout)
    x = kv_like(layout, 3)
    bound = codec.max_encoded_bytes(3)
    assert bound == align(bound) and bound >= codec.max_encoded_bytes(1)
    sentinel = torch.full((bound + 64,), 0x5A, dtype=torch.uint8)
    with pytest.raises(CodecError, match=f"smaller than max_encoded_bytes\\(3\\) = {bound}"):
        codec.encode(x, sentinel[: bound - 1])
    assert bool((sentinel == 0x5A).all())  # nothing was written
    n = codec.encode(x, sentinel[:bound])
    assert n <= bound and bool((sentinel[bound:] == 0x5A).all())


# -- malformed frames -----------------------------------------------------------------------------------


def header_fields(frame: torch.Tensor) -> list[object]:
    return list(_HEADER.unpack(bytes(frame[: _HEADER.size].numpy())))


def with_header(frame: torch.Tensor, **changes: object) -> torch.Tensor:
    names = [
        "magic",
        "version",
        "codec",
        "dtype",
        "flags",
        "layers",
        "kv",
        "tokens",
        "heads",
        "dim",
        "sections",
        "reserved",
        "total",
    ]
    fields = dict(zip(names, header_fields(frame), strict=True))
    fields.update(changes)
    out = frame.clone()
    out[: _HEADER.size] = torch.frombuffer(bytearray(_HEADER.pack(*fields.values())), dtype=torch.uint8)
    return out


def with_section(frame: torch.Tensor, index: int, method: int, length: int) -> torch.Tensor:
    out = frame.clone()
    at = _HEADER.size + index * _SECTION.size
    out[at : at + _SECTION.size] = torch.frombuffer(bytearray(_SECTION.pack(method, length)), dtype=torch.uint8)
    return out


@pytest.fixture(params=["none", "zstd", "fp8", "int8-kivi"])
def encoded(request: pytest.FixtureRequest) -> tuple[Codec, torch.Tensor, torch.Tensor]:
    layout = layout_for("bfloat16", 2, 2, 16)
    codec = make_codec(request.param, layout)
    x = kv_like(layout, 6)
    frame, _ = roundtrip(codec, x)
    return codec, frame, x


def decode_guarded(codec: Codec, frame: object, tokens: int = 6) -> torch.Tensor:
    """Decode into a chunk inside a larger sentinel-filled buffer; assert nothing outside the chunk changed."""
    numel = torch.Size(codec.layout.chunk_shape(tokens)).numel()
    arena = torch.full((numel + 64,), 7.0, dtype=codec.layout.torch_dtype)
    out = arena[32 : 32 + numel].view(codec.layout.chunk_shape(tokens))
    try:
        codec.decode(frame, out)
    finally:
        assert bool((arena[:32] == 7.0).all()) and bool((arena[32 + numel :] == 7.0).all())
    return out


def test_truncated_frames_are_refused(encoded: tuple[Codec, torch.Tensor, torch.Tensor]) -> None:
    codec, frame, _ = encoded
    for cut in sorted({0, 1, _HEADER.size - 1, _HEADER.size, _HEADER.size + 5, frame.numel() // 2, frame.numel() - 1}):
        with pytest.raises(CodecError):
            decode_guarded(codec, frame[:cut])


def test_extended_frame_is_refused(encoded: tuple[Codec, torch.Tensor, torch.Tensor]) -> None:
    codec, frame, _ = encoded
    longer = torch.cat([frame, torch.zeros(3, dtype=torch.uint8)])
    with pytest.raises(CodecError, match="header says"):
        decode_guarded(codec, longer)
    with pytest.raises(CodecError, match="past its last section"):
        decode_guarded(codec, with_header(longer, total=longer.numel()))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"magic": b"XKVC"}, "not a pdkv codec frame"),
        ({"version": 9}, "format version 9"),
        ({"codec": 4}, "codec id 4 \\(fp8\\)"),
        ({"codec": 200}, "codec id 200 \\(unknown\\)"),
        ({"dtype": 1}, "dtype code 1"),
        ({"tokens": 7}, "shaped"),
        ({"heads": 1 << 30}, "shaped"),
        ({"sections": 9}, "9 sections"),
        ({"total": 1 << 40}, "header says"),
    ],
)
def test_header_fields_are_checked(
    encoded: tuple[Codec, torch.Tensor, torch.Tensor], change: dict[str, object], message: str
) -> None:
    codec, frame, _ = encoded
    if change.get("codec") == codec.codec_id:
        change = {"codec": 0}
        message = "codec id 0 \\(none\\)"
    with pytest.raises(CodecError, match=message):
        decode_guarded(codec, with_header(frame, **change))


def test_section_lengths_are_checked(encoded: tuple[Codec, torch.Tensor, torch.Tensor]) -> None:
    codec, frame, _ = encoded
    method, length = _SECTION.unpack_from(bytes(frame.numpy()), _HEADER.size)
    with pytest.raises(CodecError):
        decode_guarded(codec, with_section(frame, 0, method, length + 1))
    with pytest.raises(CodecError):
        decode_guarded(codec, with_section(frame, 0, method, length - 1))
    with pytest.raises(CodecError, match="method 9"):
        decode_guarded(codec, with_section(frame, 0, 9, length))
    with pytest.raises(CodecError):
        decode_guarded(codec, with_section(frame, 0, method, 1 << 60))


def test_zstd_section_only_where_the_codec_writes_one() -> None:
    layout = layout_for("float32", 2, 2, 16)
    codec = make_codec("fp8", layout)
    frame, _ = roundtrip(codec, kv_like(layout, 6))
    _, length = _SECTION.unpack_from(bytes(frame.numpy()), _HEADER.size)
    with pytest.raises(CodecError, match="'zstd', which codec fp8 never writes there"):
        decode_guarded(codec, with_section(frame, 0, 1, length - 1))


def compressed_sections(frame: torch.Tensor) -> list[tuple[int, int, int]]:
    """(index, offset, stored length) of each zstd section."""
    count = header_fields(frame)[10]
    offset, found = align(_HEADER.size + count * _SECTION.size), []
    for i in range(count):
        method, stored = _SECTION.unpack_from(bytes(frame.numpy()), _HEADER.size + i * _SECTION.size)
        if method == 1:
            found.append((i, offset, stored))
        offset = align(offset + stored)
    return found


def test_corrupt_zstd_stream_is_refused() -> None:
    layout = layout_for("bfloat16", 4, 3, 64)
    codec = make_codec("zstd", layout)
    frame, _ = roundtrip(codec, kv_like(layout, 64))
    sections = compressed_sections(frame)
    assert sections, "KV-like data should have a compressed exponent plane"
    _, offset, stored = sections[0]
    garbled = frame.clone()
    garbled[offset + 8 : offset + stored - 8] = torch.randint(0, 256, (stored - 16,), dtype=torch.uint8)
    with pytest.raises(CodecError, match="does not decompress|declares|decompressed to"):
        decode_guarded(codec, garbled, tokens=64)
    not_zstd = frame.clone()
    not_zstd[offset : offset + 4] = 0
    with pytest.raises(CodecError, match="not a zstd frame"):
        decode_guarded(codec, not_zstd, tokens=64)


@pytest.mark.skipif(importlib.util.find_spec("zstandard") is None, reason="the zstd extra is part of the dev install")
def test_zstd_declared_size_is_checked_before_allocating() -> None:
    """A stream that claims a huge decoded size is refused by its header, before anything is allocated for it."""
    import zstandard

    layout = layout_for("bfloat16", 1, 1, 64)
    codec = make_codec("zstd", layout)
    frame, _ = roundtrip(codec, torch.zeros(layout.chunk_shape(64), dtype=torch.bfloat16))
    (index, offset, stored), *_ = compressed_sections(frame)
    bomb = zstandard.ZstdCompressor().compress(
        bytes(1 << 20)
    )  # a 1 MiB plane in a few dozen bytes, declared in its header
    assert len(bomb) < layout.chunk_bytes(64) // 2  # a plane's length: a stored zstd section must be shorter
    forged = frame[: offset + len(bomb)].clone()
    forged[offset:] = torch.frombuffer(bytearray(bomb), dtype=torch.uint8)
    forged = with_header(with_section(forged, index, 1, len(bomb)), total=forged.numel())
    with pytest.raises(CodecError, match="declares 1048576 bytes"):
        decode_guarded(codec, forged, tokens=64)


def test_fp8_exponent_out_of_range_is_refused() -> None:
    layout = layout_for("float32", 1, 1, 16)
    codec = make_codec("fp8", layout)
    frame, _ = roundtrip(codec, kv_like(layout, 2))
    count = header_fields(frame)[10]
    _, codes_len = _SECTION.unpack_from(bytes(frame.numpy()), _HEADER.size)
    exps_at = align(align(_HEADER.size + count * _SECTION.size) + codes_len)
    forged = frame.clone()
    forged[exps_at] = 127
    with pytest.raises(CodecError, match="exponents span"):
        decode_guarded(codec, forged, tokens=2)


@pytest.mark.parametrize("name", codec_names())
def test_random_byte_flips_never_escape(name: str) -> None:
    """Any single corrupted byte decodes to something or raises CodecError: no other exception, no stray write."""
    layout = layout_for("float32", 2, 2, 8)
    codec = make_codec(name, layout)
    frame, _ = roundtrip(codec, kv_like(layout, 6))
    gen = torch.Generator().manual_seed(3)
    positions = (
        list(range(min(frame.numel(), _HEADER.size + 3 * _SECTION.size)))
        + torch.randint(0, frame.numel(), (40,), generator=gen).tolist()
    )
    for pos in positions:
        bad = frame.clone()
        bad[pos] ^= 1 << int(torch.randint(0, 8, (1,), generator=gen))
        try:
            decode_guarded(codec, bad)
        except CodecError:
            pass


def test_chunk_without_tokens_is_refused() -> None:
    codec = make_codec("fp8", layout_for("float32", 1, 1, 8))
    with pytest.raises(CodecError, match="at least one token"):
        codec.encode(torch.zeros(codec.layout.chunk_shape(0)), torch.zeros(4096, dtype=torch.uint8))


def test_wrong_chunk_shape_is_refused() -> None:
    codec = make_codec("int8", layout_for("float32", 2, 2, 8))
    with pytest.raises(ValueError, match="layout expects"):
        codec.encode(torch.zeros(2, 2, 3, 2, 9), torch.zeros(4096, dtype=torch.uint8))


# -- native kernels match the torch path ----------------------------------------------------------------


@pytest.fixture(scope="module")
def native_built() -> None:
    if not native.available():
        pytest.skip(f"native extension unavailable: {native.reason()}")


@pytest.mark.parametrize(("name", "dtype", "shape"), list(combos()))
def test_native_matches_torch(
    native_built: None, monkeypatch: pytest.MonkeyPatch, name: str, dtype: str, shape: tuple[int, int, int, int, bool]
) -> None:
    layers, heads, dim, tokens, mla = shape
    codec = make_codec(name, layout_for(dtype, layers, heads, dim, mla))
    x = kv_like(codec.layout, tokens, seed=5)
    x.view(-1)[:3] = torch.tensor([1e-40, -(2.0**-130), 449.0]).to(
        x.dtype
    )  # subnormals, and a value past e4m3's max before scaling
    frame_native, out_native = roundtrip(codec, x)
    monkeypatch.setenv(native.ENV_VAR, "0")
    frame_torch, out_torch = roundtrip(codec, x)
    assert torch.equal(frame_native, frame_torch)
    assert torch.equal(out_native.view(-1).view(torch.uint8), out_torch.view(-1).view(torch.uint8))


# -- registry and configuration -----------------------------------------------------------------------


def test_registry_ids_are_unique_and_names_listed() -> None:
    assert codec_names()[0] == "none"
    assert len({c.codec_id for c in CODECS.values()}) == len(CODECS)
    assert available_codecs(layout_for("bfloat16", 1, 1, 8)) == [n for n in codec_names() if n not in ("bf16", "fp16")]
    assert available_codecs(layout_for("float32", 1, 1, 8, mla=True)) == [
        n for n in codec_names() if n not in ("k16v8", "int8-kivi")
    ]


@pytest.mark.parametrize("dtype", sorted(FP8_DTYPES))
def test_an_fp8_cache_goes_only_through_codecs_that_move_bytes(dtype: str) -> None:
    """fp8 values need scales pdkv does not hold: a codec that computes on them refuses, naming the setting."""
    layout = layout_for(dtype, 2, 2, 8)
    byte_codecs = [n for n, c in CODECS.items() if c.bytes_only]
    assert "none" in byte_codecs and not set(byte_codecs) & set(LOSSY)
    assert available_codecs(layout) == [n for n in available_codecs(layout_for("float32", 2, 2, 8)) if n in byte_codecs]
    for name in CODECS:
        if name not in byte_codecs:
            with pytest.raises(ConfigError, match=f"this cache is {dtype}.*set transfer.codec to 'none' or 'zstd'"):
                make_codec(name, layout)


def test_config_codec_default_and_valid() -> None:
    assert TransferConfig().codec == "none"
    assert load_config(overrides={"transfer.codec": "int8-kivi"}).transfer.codec == "int8-kivi"


def test_config_unknown_codec_names_field_value_and_choices() -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(overrides={"transfer.codec": "gzip"})
    text = str(exc.value)
    assert "'transfer.codec'" in text and "'gzip'" in text and "none|zstd|bf16|fp16|fp8|k16v8|int8|int8-kivi" in text


def test_config_codec_needs_its_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "zstandard" else real(name, *a))
    with pytest.raises(ConfigError, match=r"zstandard, which is not installed: pip install 'pdkv\[zstd\]'"):
        load_config(overrides={"transfer.codec": "zstd"})
    assert "zstd" not in available_codecs(layout_for("float32", 1, 1, 8))


def test_config_codec_must_fit_the_engine_dtype() -> None:
    with pytest.raises(ConfigError, match="'transfer.codec' = 'bf16' does not fit dtype 'bfloat16'"):
        load_config(overrides={"transfer.codec": "bf16", "dtype": "bfloat16"})
    assert load_config(overrides={"transfer.codec": "bf16", "dtype": "float32"}).transfer.codec == "bf16"


def test_make_codec_refuses_a_layout_it_cannot_encode() -> None:
    with pytest.raises(ConfigError, match="encodes a float32 KV cache; this one is float16"):
        make_codec("fp16", layout_for("float16", 1, 1, 8))
    with pytest.raises(ConfigError, match="MLA cache has one latent tensor"):
        make_codec("k16v8", layout_for("float32", 1, 1, 8, mla=True))
    with pytest.raises(ConfigError, match="expected one of none, zstd"):
        make_codec("lz4", layout_for("float32", 1, 1, 8))


def test_codec_ids_are_part_of_the_frame() -> None:
    """A frame from one codec is refused by another, by id, even when the sizes would fit."""
    layout = layout_for("float32", 1, 2, 8)
    frame, _ = roundtrip(make_codec("int8", layout), kv_like(layout, 4))
    with pytest.raises(CodecError, match="codec id 6 \\(int8\\), expected 4 \\(fp8\\)"):
        make_codec("fp8", layout).decode(frame, torch.empty(layout.chunk_shape(4)))
    assert struct.unpack_from("<4s", bytes(frame.numpy()))[0] == b"PKVC"


# -- the fidelity harness of `pdkv bench codec` -------------------------------------------------------------


def test_bench_fidelity_harness_on_a_tiny_model(tmp_path: pytest.TempPathFactory) -> None:
    """The reference row is exact by construction, an exact codec changes nothing, a lossy one measurably does."""
    from pdkv.bench.codec import format_table, measure
    from pdkv.testing.model import single_thread, write_tiny_model

    model = write_tiny_model(tmp_path / "tiny")  # type: ignore[operator]
    prompts = ("The quick brown fox jumps over the lazy dog, chunk by chunk.", "Paris is the capital of France. " * 6)
    with single_thread():
        report = measure(
            model=str(model),
            dtypes=("float32",),
            codecs=["fp8", "zstd"],
            decode_tokens=4,
            repeats=1,
            prompts=prompts,
            chunk_size=16,
        )
    rows = {r["codec"]: r for r in report["results"]}
    assert list(rows) == ["none", "fp8", "zstd"]
    assert (
        rows["none"]["token_agreement"] == 1.0
        and rows["none"]["mean_kl"] == 0
        and rows["none"]["first_divergence"] == [None, None]
    )
    assert rows["zstd"]["max_abs_error"] == 0 and rows["zstd"]["mean_kl"] == 0 and rows["zstd"]["bytes_ratio"] > 1
    assert rows["fp8"]["max_abs_error"] > 0 and rows["fp8"]["mean_kl"] > 0 and rows["fp8"]["bytes_ratio"] > 3
    assert all(
        r["raw_bytes"] == rows["none"]["raw_bytes"] and r["ratio"] > 0 and r["baseline_gbps"] > 0 for r in rows.values()
    )
    links = [g for g in report["links"] if g["codec"] == "fp8"]
    assert [g["link_gbit"] for g in links] == [0.1, 1.0, 10.0]
    for g in links:  # the slowest of encode, wire (link x bytes ratio) and decode
        fp8 = rows["fp8"]
        assert g["kv_tokens_per_s"] == pytest.approx(
            g["effective_gbps"] * 1e9 / (fp8["raw_bytes"] / report["prefill"]["float32"]["tokens"]), rel=1e-3, abs=1
        )
        assert g["effective_gbps"] == pytest.approx(
            min(fp8["encode_gbps"], fp8["decode_gbps"], g["link_gbit"] / 8 * fp8["bytes_ratio"]), rel=1e-3, abs=1e-4
        )
    assert "fp8" in format_table(report)
