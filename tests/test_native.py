"""pdkv.native gather/scatter against the torch oracle in pdkv.layout.

Bit identity is checked on raw bytes (buffers and chunks are filled with
random bytes, NaN patterns included), over every layout (kind x order x mla),
every dtype, token ranges with partial first and last blocks and starts that
are not block aligned, and between layouts with different block sizes. The
kernels are the library ``pip install`` built into the package: nothing here
builds anything (test_the_installed_library_loads_without_a_compiler).
"""

from __future__ import annotations

import ctypes
import itertools
import json
import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from pdkv import layout as torch_path
from pdkv import native
from pdkv.checksum import chunk_checksum, flat_bytes, frame_checksum
from pdkv.errors import LayoutError
from pdkv.layout import KVLayout

KINDS = ("per_layer", "cross_layer", "split_kv")
ORDERS = ("NHD", "HND", "NHKD", "HNKD")
DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3fn")  # fp8: 1-byte elements, odd rows of 5 bytes
NUM_BLOCKS = 12
# (start, num_tokens) with block size 4: whole block, one token, a range that
# straddles a boundary, partial first and last blocks, empty, many blocks.
RANGES = ((0, 4), (0, 1), (3, 2), (5, 11), (2, 0), (7, 17))
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# split_kv has no MLA form and no order that interleaves K and V (they are its two tensors per layer)
LAYOUT_PARAMS = [
    (k, o, mla)
    for k, o, mla in itertools.product(KINDS, ORDERS, (False, True))
    if k != "split_kv" or (o in ("NHD", "HND") and not mla)
]


@pytest.fixture(scope="module")
def ext() -> ctypes.CDLL:
    """The installed kernel library: the install builds it, so its absence is a failure, not a skip."""
    lib = native.library()
    assert lib is not None, f"pdkv's native kernels did not load: {native.reason()}"
    return lib


def make_layout(kind: str, order: str, mla: bool, dtype: str = "bfloat16", block_size: int = 4) -> KVLayout:
    # Odd head count and head_dim: the copy must not assume aligned or power-of-two rows.
    return KVLayout(
        num_layers=3,
        num_kv_heads=1 if mla else 3,
        head_dim=5,
        block_size=block_size,
        dtype=dtype,
        kind=kind,
        order=order,
        mla=mla,
    )  # type: ignore[arg-type]


def random_bytes(shape: Sequence[int], dtype: torch.dtype, gen: torch.Generator, device: str) -> torch.Tensor:
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(*shape).to(device)


def random_buffer(
    layout: KVLayout, gen: torch.Generator, device: str = "cpu", num_blocks: int = NUM_BLOCKS
) -> list[torch.Tensor]:
    return [
        random_bytes(layout.tensor_shape(num_blocks), layout.torch_dtype, gen, device)
        for _ in range(layout.num_tensors)
    ]


def random_table(layout: KVLayout, start: int, num_tokens: int, gen: torch.Generator) -> list[int]:
    """Distinct random block ids for the range, padded with ids that are out of range but never used."""
    needed = layout.blocks_for(start + num_tokens) if start + num_tokens else 0
    return torch.randperm(NUM_BLOCKS, generator=gen)[:needed].tolist() + [-1, NUM_BLOCKS]


def same_bytes(a: torch.Tensor | Sequence[torch.Tensor], b: torch.Tensor | Sequence[torch.Tensor]) -> bool:
    xs = [a] if isinstance(a, torch.Tensor) else list(a)
    ys = [b] if isinstance(b, torch.Tensor) else list(b)
    return len(xs) == len(ys) and all(
        x.shape == y.shape and torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
        for x, y in zip(xs, ys, strict=True)
    )


def clone(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone() for t in tensors]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("kind", "order", "mla"), LAYOUT_PARAMS)
def test_gather_and_scatter_match_torch(
    ext: ctypes.CDLL, kind: str, order: str, mla: bool, dtype: str, device: str
) -> None:
    if device == "cuda" and native.cuda_reason() is not None:
        pytest.skip("no CUDA kernel in the extension (built where nvcc or the CUDA toolkit was missing)")
    layout = make_layout(kind, order, mla, dtype)
    gen = torch.Generator().manual_seed(0)
    buffer = random_buffer(layout, gen, device)
    for start, num_tokens in RANGES:
        table = random_table(layout, start, num_tokens, gen)
        expected = torch_path.gather(layout, buffer, table, start, num_tokens)
        assert same_bytes(native.gather(layout, buffer, table, start, num_tokens), expected), (start, num_tokens)
        out = torch.empty(layout.chunk_shape(num_tokens), dtype=layout.torch_dtype, device=device)
        assert native.gather(layout, buffer, torch.tensor(table), start, num_tokens, out=out) is out
        assert same_bytes(out, expected)

        chunk = random_bytes(layout.chunk_shape(num_tokens), layout.torch_dtype, gen, device)
        ours, theirs = clone(buffer), clone(buffer)
        native.scatter(layout, ours, table, start, chunk)
        torch_path.scatter(layout, theirs, table, start, chunk)
        assert same_bytes(ours, theirs), (start, num_tokens)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mla", [False, True])
def test_every_layout_pair_round_trips(ext: ctypes.CDLL, mla: bool, dtype: str) -> None:
    """P gathers in its layout (block size 4), D scatters into its own (block size 3): same bytes as torch."""
    gen = torch.Generator().manual_seed(7)
    pairs = [(k, o) for k, o, m in LAYOUT_PARAMS if m == mla]
    for (src_kind, src_order), (dst_kind, dst_order) in itertools.product(pairs, repeat=2):
        src = make_layout(src_kind, src_order, mla, dtype, block_size=4)
        dst = make_layout(dst_kind, dst_order, mla, dtype, block_size=3)
        src_buffer, dst_buffer = random_buffer(src, gen), random_buffer(dst, gen)
        src_table, dst_table = random_table(src, 5, 11, gen), random_table(dst, 2, 11, gen)
        chunk = native.gather(src, src_buffer, src_table, 5, 11)
        assert same_bytes(chunk, torch_path.gather(src, src_buffer, src_table, 5, 11))
        ours, theirs = clone(dst_buffer), clone(dst_buffer)
        native.scatter(dst, ours, dst_table, 2, chunk)
        torch_path.scatter(dst, theirs, dst_table, 2, chunk)
        assert same_bytes(ours, theirs), (src, dst)


def test_non_contiguous_out_and_chunk(ext: ctypes.CDLL) -> None:
    layout = make_layout("per_layer", "HND", False, "float16")
    gen = torch.Generator().manual_seed(3)
    buffer = random_buffer(layout, gen)
    table = random_table(layout, 3, 9, gen)
    L, kv, T, H, D = layout.chunk_shape(9)
    out = torch.empty((L, kv, T, D, H), dtype=layout.torch_dtype).transpose(3, 4)
    native.gather(layout, buffer, table, 3, 9, out=out)
    assert same_bytes(out, torch_path.gather(layout, buffer, table, 3, 9))

    chunk = random_bytes((L, kv, T, D, H), layout.torch_dtype, gen, "cpu").transpose(3, 4)
    ours, theirs = clone(buffer), clone(buffer)
    native.scatter(layout, ours, table, 3, chunk)
    torch_path.scatter(layout, theirs, table, 3, chunk)
    assert same_bytes(ours, theirs)


@pytest.mark.parametrize(("head_dim", "dtype"), [(128, "bfloat16"), (128, "float32"), (64, "float16")])
@pytest.mark.parametrize("kind", KINDS)
def test_hnd_fixed_row_sizes(ext: ctypes.CDLL, kind: str, head_dim: int, dtype: str) -> None:
    """HND rows of 256 and 512 bytes take the kernel's compile-time row-size paths."""
    layout = KVLayout(
        num_layers=2, num_kv_heads=2, head_dim=head_dim, block_size=4, dtype=dtype, kind=kind, order="HND"
    )  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(9)
    buffer = random_buffer(layout, gen)
    table = random_table(layout, 5, 11, gen)
    assert same_bytes(native.gather(layout, buffer, table, 5, 11), torch_path.gather(layout, buffer, table, 5, 11))
    chunk = random_bytes(layout.chunk_shape(11), layout.torch_dtype, gen, "cpu")
    ours, theirs = clone(buffer), clone(buffer)
    native.scatter(layout, ours, table, 5, chunk)
    torch_path.scatter(layout, theirs, table, 5, chunk)
    assert same_bytes(ours, theirs)


def test_concurrent_callers_with_helper_threads(ext: ctypes.CDLL) -> None:
    """Chunks big enough to be split over threads, from several Python threads at once (the GIL is released)."""
    layout = KVLayout(num_layers=4, num_kv_heads=8, head_dim=64, block_size=16, dtype="float32", order="HND")
    gen = torch.Generator().manual_seed(8)
    buffer = random_buffer(layout, gen, num_blocks=64)
    tables = [torch.randperm(64, generator=gen)[:17].tolist() for _ in range(8)]
    expected = [torch_path.gather(layout, buffer, table, 3, 260) for table in tables]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: native.gather(layout, buffer, tables[i % 8], 3, 260), range(48)))
    assert all(same_bytes(got, expected[i % 8]) for i, got in enumerate(results))


@pytest.mark.parametrize("bad", [-1, NUM_BLOCKS, 10**12])
@pytest.mark.parametrize("kind", KINDS)
def test_bad_block_ids_raise_layout_error(ext: ctypes.CDLL, kind: str, bad: int) -> None:
    layout = make_layout(kind, "NHD", False)
    buffer = random_buffer(layout, torch.Generator().manual_seed(1))
    before = clone(buffer)
    table = [0, bad, 2]
    with pytest.raises(LayoutError, match="out of range"):
        native.gather(layout, buffer, table, 2, 5)
    with pytest.raises(LayoutError, match="out of range"):
        native.scatter(layout, buffer, table, 2, torch.zeros(layout.chunk_shape(5), dtype=layout.torch_dtype))
    assert same_bytes(buffer, before)


@pytest.mark.parametrize("bad", [-1, NUM_BLOCKS])
def test_cpp_refuses_bad_block_ids_itself(ext: ctypes.CDLL, bad: int) -> None:
    """The library's guard, called through the C ABI without the Python checks in front of it."""
    layout = make_layout("cross_layer", "HND", False)
    buffer = random_buffer(layout, torch.Generator().manual_seed(2))
    before = clone(buffer)
    chunk = torch.zeros(layout.chunk_shape(6), dtype=layout.torch_dtype)
    geo, bases = native.chunk_geometry(layout, chunk, 2), native.layer_bases(layout, buffer)
    table = torch.tensor([1, bad], dtype=torch.long)
    for to_chunk in (True, False):
        with pytest.raises(IndexError, match="out of range"):
            native.copy_cpu(geo, bases, table, NUM_BLOCKS, chunk.data_ptr(), to_chunk)
    with pytest.raises(IndexError, match="block table has 1 blocks"):
        native.copy_cpu(geo, bases, table[:1], NUM_BLOCKS, chunk.data_ptr(), True)
    assert same_bytes(buffer, before)


BAD_GEOMETRY = [
    ("heads", 0, "empty layers"),
    ("kv", 3, "kv must be 1"),
    ("block_size", 0, "block_size must be positive"),
    ("start", -1, "start must be non-negative"),
    ("token_stride", 0, "strides"),
]


@pytest.mark.parametrize(("field", "value", "message"), BAD_GEOMETRY)
def test_cpp_refuses_a_bad_geometry(ext: ctypes.CDLL, field: str, value: int, message: str) -> None:
    layout = make_layout("per_layer", "NHD", False)
    buffer = random_buffer(layout, torch.Generator().manual_seed(4))
    chunk = torch.zeros(layout.chunk_shape(4), dtype=layout.torch_dtype)
    geo, bases = native.chunk_geometry(layout, chunk, 0), native.layer_bases(layout, buffer)
    setattr(geo, field, value)
    with pytest.raises(ValueError, match=message):
        native.copy_cpu(geo, bases, torch.tensor([0], dtype=torch.long), NUM_BLOCKS, chunk.data_ptr(), True)


def test_buffers_on_several_devices_are_refused_before_the_kernel(ext: ctypes.CDLL) -> None:
    layout = make_layout("per_layer", "NHD", False)
    buffer = random_buffer(layout, torch.Generator().manual_seed(4))
    buffer[1] = buffer[1].to("meta")
    with pytest.raises(LayoutError, match="several devices"):
        native.gather(layout, buffer, [0], 0, 4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("kind", "order"), [("per_layer", "NHD"), ("cross_layer", "HND"), ("split_kv", "NHD")])
def test_a_paged_buffer_copies_every_chunk_as_torch_does_and_reads_the_switch_at_each_copy(
    ext: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch, kind: str, order: str, device: str
) -> None:
    """One ``PagedBuffer`` for many chunks, as a sender's or receiver's memory keeps it: what it read of the tensors
    at its first copy (each layer's address, a cross-layer buffer's places in its blocks) still copies every later
    chunk bit for bit as the torch path does, hashed as it goes; and ``PDKV_NATIVE=0``, set after it was made, sends
    its next copy down the torch path, as the module's functions do."""
    if device == "cuda" and native.cuda_reason() is not None:
        pytest.skip("no CUDA kernel in the extension (built where nvcc or the CUDA toolkit was missing)")
    layout = make_layout(kind, order, False)
    gen = torch.Generator().manual_seed(11)
    buffer = random_buffer(layout, gen, device)
    shadow = clone(buffer)
    paged = native.PagedBuffer(layout, buffer)
    for start, num_tokens in RANGES:
        table = random_table(layout, start, num_tokens, gen)
        out, acc = paged.gather_summed(table, start, num_tokens, checksum=True)
        assert same_bytes(out, torch_path.gather(layout, shadow, table, start, num_tokens)), (start, num_tokens)
        assert acc is not None
        assert frame_checksum(flat_bytes(out), acc) == chunk_checksum([flat_bytes(out)])
        chunk = random_bytes(layout.chunk_shape(num_tokens), layout.torch_dtype, gen, device)
        paged.scatter_summed(table, start, chunk)
        torch_path.scatter(layout, shadow, table, start, chunk)
        assert same_bytes(buffer, shadow), (start, num_tokens)
    calls: list[int] = []
    monkeypatch.setattr(native, "torch_gather", lambda *a, **k: calls.append(1) or torch_path.gather(*a, **k))
    monkeypatch.setenv(native.ENV_VAR, "0")
    table = random_table(layout, 1, 6, gen)
    out, acc = paged.gather_summed(table, 1, 6, checksum=True)
    assert (calls, acc) == ([1], None) and same_bytes(out, torch_path.gather(layout, shadow, table, 1, 6))
    monkeypatch.delenv(native.ENV_VAR)
    assert paged.gather_summed(table, 1, 6, checksum=True)[1] is not None and calls == [1]


def test_disabled_by_env_uses_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native.ENV_VAR, "0")
    assert not native.available()
    assert native.ENV_VAR in (native.reason() or "")
    layout = make_layout("cross_layer", "NHD", False)
    gen = torch.Generator().manual_seed(5)
    buffer = random_buffer(layout, gen)
    table = random_table(layout, 1, 6, gen)
    assert same_bytes(native.gather(layout, buffer, table, 1, 6), torch_path.gather(layout, buffer, table, 1, 6))
    chunk = random_bytes(layout.chunk_shape(6), layout.torch_dtype, gen, "cpu")
    ours, theirs = clone(buffer), clone(buffer)
    native.scatter(layout, ours, table, 1, chunk)
    torch_path.scatter(layout, theirs, table, 1, chunk)
    assert same_bytes(ours, theirs)


def test_a_missing_library_warns_once_and_falls_back(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    monkeypatch.delenv(native.ENV_VAR, raising=False)
    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setattr(native, "LIBRARY", tmp_path / "libpdkv_kernels.so")
    layout = make_layout("per_layer", "NHD", True)
    buffer = random_buffer(layout, torch.Generator().manual_seed(6))
    with caplog.at_level(logging.WARNING, logger="pdkv.native"):
        assert not native.available()
        chunk = native.gather(layout, buffer, [3, 4], 1, 5)
        assert not native.available()
    assert same_bytes(chunk, torch_path.gather(layout, buffer, [3, 4], 1, 5))
    assert "built when pdkv is installed" in (native.reason() or "")
    assert len([r for r in caplog.records if r.name == "pdkv.native"]) == 1


def test_a_file_that_is_not_a_library_falls_back(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    broken = tmp_path / "libpdkv_kernels.so"
    broken.write_bytes(b"not an ELF file")
    monkeypatch.delenv(native.ENV_VAR, raising=False)
    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setattr(native, "LIBRARY", broken)
    assert not native.available()
    assert "does not load" in (native.reason() or "")


def test_the_installed_library_loads_without_a_compiler(tmp_path: Path) -> None:
    """The install left the kernels in the package: a fresh process with no compiler reachable and an empty
    home uses them at once, imports nothing that builds, and creates no build cache."""
    probe = (
        "import json, sys\n"
        "from pdkv import native\n"
        "from pdkv.codec import kernels\n"
        "print(json.dumps({'available': native.available(), 'reason': native.reason(), "
        "'library': str(native.LIBRARY),\n"
        "                  'builders': sorted(m for m in sys.modules if m.startswith(('torch.utils.cpp_extension', "
        "'setuptools', 'distutils')))}))\n"
    )
    env = {
        **os.environ,
        "PATH": str(tmp_path / "empty-path"),
        "HOME": str(tmp_path / "home"),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "CC": "false",
        "CXX": "false",
    }
    env.pop(native.ENV_VAR, None)
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["available"], report["reason"]
    assert Path(report["library"]).parent == Path(native.__file__).parent
    assert report["builders"] == []
    assert not (tmp_path / "home").exists() and not (tmp_path / "cache").exists()
