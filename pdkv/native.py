"""Native paged gather/scatter (csrc/kvcopy.cpp), falling back to the torch path.

With ``checksum=True`` they also return the chunk checksum's accumulator of
the chunk they wrote or read, computed in the same pass (csrc/kvsum.h);
``checksum_pieces`` and ``checksum_blocks`` compute it over bytes where they
are. ``pdkv.checksum`` owns the checksum's value and its torch fallback; this
module only makes the calls.

The same library carries the KV codec kernels (csrc/kvcodec.cpp), which
pdkv.codec.kernels calls through ``library()`` with the same fallback rule,
and the tcp channel's receive and send loops (csrc/kvnet.h), which
channels/tcp/native.py declares and calls through ``binder``: one loader,
one switch for every native path.

``gather``/``scatter`` here have exactly the signatures of
:func:`pdkv.layout.gather` / :func:`pdkv.layout.scatter` and produce the same
bytes; they are faster because each byte is copied once, with memcpy over the
longest contiguous runs, on up to ``torch.get_num_threads()`` threads, with
the GIL released (ctypes drops it for the call).

The kernels are plain shared libraries with a C ABI (no torch headers, no
Python API), built when the package is installed (setup.py: ``pip install``
and ``pip install -e`` both leave them inside the package) and loaded here
with ctypes: a process never compiles anything, never needs a compiler or a
build cache, and two environments on one machine each load their own
library. This module derives the geometry (sizes, strides, layer base
addresses) from the tensors after layout.py's checks; the library checks
again everything that decides an address (kvcopy.h).

- ``libpdkv_kernels.so``: the CPU copy and the codec kernels. Missing (an
  install that could not build it) or unloadable: one warning, and every
  call takes the torch path. ``PDKV_NATIVE=0`` never loads it.
- ``libpdkv_kernels_cuda.so``: the CUDA copy, built when nvcc was present
  at install time. Loaded at the first CUDA call; when it is missing or the
  CUDA runtime it carries cannot start (a driver older than its toolkit),
  one warning and CUDA tensors take the torch path.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import logging
import operator
import os
import struct
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from pdkv.errors import LayoutError
from pdkv.layout import BlockTable, KVLayout, check_chunk, used_blocks
from pdkv.layout import gather as torch_gather
from pdkv.layout import scatter as torch_scatter

log = logging.getLogger(__name__)

ENV_VAR = "PDKV_NATIVE"
"""Set to 0 (or false/off/no) to never load the kernels (every call takes the torch path)."""

LIBRARY = Path(__file__).with_name("libpdkv_kernels.so")
CUDA_LIBRARY = Path(__file__).with_name("libpdkv_kernels_cuda.so")

OK, EINDEX = 0, 1
"""The C ABI's return codes that this module tells apart (kvcopy.h); any other is a bad argument (ValueError)."""
ERR_LEN = 512

_i64 = ctypes.c_int64
_p = ctypes.c_void_p


class KVGeometry(ctypes.Structure):
    """csrc/kvcopy.h's KVGeometry, field by field: where each row of head_dim elements lives, in elements."""

    _fields_ = [
        (name, _i64)
        for name in (
            "layers",
            "kv",
            "tokens",
            "heads",
            "head_dim",
            "block_size",
            "start",
            "element_size",
            "block_stride",
            "kv_stride",
            "token_stride",
            "head_stride",
        )
    ]


# Argument types of each exported function this module and pdkv.codec call (channels/tcp/native.py declares the tcp
# channel's own): a wrong count or type is a TypeError here, never a bad call.
_SIGNATURES: dict[str, list[type]] = {
    "pdkv_kvcopy_cpu": [
        ctypes.POINTER(KVGeometry),
        _p,
        _p,
        _i64,
        _i64,
        _p,
        ctypes.c_int,
        _i64,
        ctypes.c_char_p,
        ctypes.c_size_t,
    ],
    "pdkv_kvcopy_sum_cpu": [
        ctypes.POINTER(KVGeometry),
        _p,
        _p,
        _i64,
        _i64,
        _p,
        ctypes.c_int,
        _i64,
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.c_char_p,
        ctypes.c_size_t,
    ],
    "pdkv_checksum_cpu": [
        _p,
        _p,
        _i64,
        _i64,
        ctypes.c_uint64,
        _i64,
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.c_char_p,
        ctypes.c_size_t,
    ],
    "pdkv_checksum_blocks_cpu": [
        _p,
        _i64,
        _p,
        _i64,
        _i64,
        _i64,
        _i64,
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.c_char_p,
        ctypes.c_size_t,
    ],
    "pdkv_landed_blocks": [
        _p,
        _p,
        _i64,
        _p,
        _i64,
        _i64,
        _i64,
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.POINTER(_i64),
        ctypes.c_char_p,
        ctypes.c_size_t,
    ],
    "pdkv_landing_reset": [_p, _i64, _p, _i64],
    "pdkv_grid_ranges": [_p, _i64, _p, _i64, _p],
    "pdkv_kvcopy_check": [ctypes.POINTER(KVGeometry), _p, _i64, _i64, ctypes.c_char_p, ctypes.c_size_t],
    "pdkv_split_planes": [_p, _i64, _i64, _p, _p, _i64, _i64, ctypes.c_char_p, ctypes.c_size_t],
    "pdkv_merge_planes": [_p, _i64, _p, _i64, _i64, ctypes.c_char_p, ctypes.c_size_t],
    "pdkv_fp8_encode": [ctypes.c_int, _p, _p, _p, _p, _p, _i64, ctypes.c_char_p, ctypes.c_size_t],
    "pdkv_fp8_decode": [_p, _p, _p, _p, ctypes.c_int, _p, _p, _i64, ctypes.c_char_p, ctypes.c_size_t],
    "pdkv_group_minmax": [ctypes.c_int, _p, _p, _p, _p, _i64, _i64, _i64, ctypes.c_char_p, ctypes.c_size_t],
    "pdkv_u8_quantize": [ctypes.c_int, _p, _p, _p, _p, _i64, _i64, _p, _p, _i64, ctypes.c_char_p, ctypes.c_size_t],
    "pdkv_u8_dequantize": [_p, _p, _p, _p, _i64, _i64, ctypes.c_int, _p, _p, _i64, ctypes.c_char_p, ctypes.c_size_t],
}
# Return types other than int: a pointer (ctypes' default int would cut it to 32 bits) or a string.
_RESTYPES: dict[str, type] = {
    "pdkv_cuda_error_string": ctypes.c_char_p,
}
_CUDA_SIGNATURES: dict[str, list[type]] = {
    "pdkv_kvcopy_cuda": [ctypes.POINTER(KVGeometry), _p, _p, _i64, _p, ctypes.c_int, ctypes.c_int, _p],
    "pdkv_kvcopy_sum_cuda": [ctypes.POINTER(KVGeometry), _p, _p, _i64, _p, ctypes.c_int, ctypes.c_int, _p, _p],
    "pdkv_checksum_cuda": [_p, _i64, _i64, ctypes.c_uint64, _p, _p],
    "pdkv_cuda_error_string": [ctypes.c_int],
    "pdkv_cuda_device_count": [],
}

Accumulator = int | torch.Tensor | None
"""A copy's checksum accumulator: an int (CPU), a device int64 scalar (CUDA, filled on the stream), None: not hashed."""

_lock = threading.Lock()
# (library, reason it is None) once a load was attempted in this process; the same for the CUDA library.
_loaded: tuple[ctypes.CDLL | None, str | None] | None = None
_cuda_loaded: tuple[ctypes.CDLL | None, str | None] | None = None


def available() -> bool:
    """Whether calls use the native kernels (loads the library on the first call; never compiles)."""
    return _state()[0] is not None


def library() -> ctypes.CDLL | None:
    """The loaded kernel library (argument types set), or None when calls take the torch path."""
    return _state()[0]


def reason() -> str | None:
    """Why the native kernels are not used, or None when they are."""
    return _state()[1]


def cuda_reason() -> str | None:
    """Why CUDA tensors take the torch path, or None when the CUDA kernels are in use (loads them)."""
    return _cuda_state()[1]


def call(fn: Callable[..., int], *args: object) -> None:
    """Call a kernel that takes (..., err, err_len) last; its error code becomes IndexError (EINDEX) or ValueError."""
    err = ctypes.create_string_buffer(ERR_LEN)
    code = fn(*args, err, ERR_LEN)
    if code != OK:
        raise (IndexError if code == EINDEX else ValueError)(err.value.decode(errors="replace"))


def gather(
    layout: KVLayout,
    tensors: Sequence[torch.Tensor],
    block_table: BlockTable,
    start: int,
    num_tokens: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Native :func:`pdkv.layout.gather`: tokens ``[start, start+num_tokens)`` of the paged buffer as a canonical
    chunk."""
    return PagedBuffer(layout, tensors).gather_summed(block_table, start, num_tokens, out)[0]


def scatter(
    layout: KVLayout, tensors: Sequence[torch.Tensor], block_table: BlockTable, start: int, chunk: torch.Tensor
) -> None:
    """Native :func:`pdkv.layout.scatter`: write a canonical chunk into tokens ``[start, start+T)``."""
    PagedBuffer(layout, tensors).scatter_summed(block_table, start, chunk)


class PagedBuffer:
    """The kernels' gather and scatter over one KV buffer (the torch path's where they do not run), each able to
    hash the chunk in the same pass. Kept by whoever copies its chunks every request (a sender's memory, a
    receiver's, a device stager): what a copy reads of the buffer (the layout's checks on every tensor, one device,
    each layer's address) is read at its first copy and kept, not read again each chunk: per chunk, 30-80 tensors'
    attributes cost 32-74 us of Python ahead of a ~200 us copy of 40 tokens. The tensors must keep their storage
    while this is used, as a KV cache does; the library's switch (``PDKV_NATIVE``) is read at every copy."""

    def __init__(self, layout: KVLayout, tensors: Sequence[torch.Tensor]) -> None:
        self.layout, self.tensors = layout, list(tensors)
        # the kernels take raw addresses of contiguous tensors (a head window's views are strided: the torch path);
        # HKND (vLLM's CPU cache) has no kernel: it moves whole blocks between vLLM workers
        self._fits = (
            bool(self.tensors)
            and (layout.order != "HKND" or layout.mla)
            and all(t.is_contiguous() for t in self.tensors)
        )
        self._device = self.tensors[0].device if self.tensors else torch.device("cpu")
        self._prepared: _Prepared | None = None

    def gather_summed(
        self,
        block_table: BlockTable,
        start: int,
        num_tokens: int,
        out: torch.Tensor | None = None,
        checksum: bool = False,
    ) -> tuple[torch.Tensor, Accumulator]:
        """``gather``, and with ``checksum`` the chunk's checksum accumulator from the same pass.

        The accumulator is an int (CPU), a device scalar the kernel adds into on
        the current stream (CUDA: reading it waits for the copy), or None where
        the kernel did not hash (the torch path, a CUDA chunk whose words it
        cannot sum in its vectors): the caller hashes the chunk itself then. The
        value is that of the chunk's bytes in canonical order, whatever ``out``'s
        strides.
        """
        layout = self.layout
        if not self._native():
            return torch_gather(layout, self.tensors, block_table, start, num_tokens, out), None
        prepared = self._prepare()
        table = used_blocks(layout, prepared.num_blocks, block_table, start, num_tokens)
        if out is None:
            out = torch.empty(layout.chunk_shape(num_tokens), dtype=layout.torch_dtype, device=self._device)
        else:
            check_chunk(layout, out, "gather output", num_tokens)
        # The kernel writes a contiguous chunk on the buffer's device; any other
        # `out` (a strided view, another device) is filled through one copy.
        direct = out.is_contiguous() and out.device == self._device
        dst = out if direct else torch.empty(out.shape, dtype=out.dtype, device=self._device)
        acc = _copy(layout, prepared, table, start, dst, to_chunk=True, checksum=checksum)
        if not direct:
            out.copy_(dst)
        return out, acc

    def scatter_summed(
        self, block_table: BlockTable, start: int, chunk: torch.Tensor, checksum: bool = False
    ) -> Accumulator:
        """``scatter``, and with ``checksum`` the chunk's checksum accumulator from the same pass (or None, as in
        ``gather_summed``)."""
        layout = self.layout
        if not self._native():
            torch_scatter(layout, self.tensors, block_table, start, chunk)
            return None
        prepared = self._prepare()
        num_tokens = check_chunk(layout, chunk, "chunk")
        table = used_blocks(layout, prepared.num_blocks, block_table, start, num_tokens)
        src = chunk.to(self._device).contiguous()  # the chunk's bytes in canonical order, hashed as it lands
        return _copy(layout, prepared, table, start, src, to_chunk=False, checksum=checksum)

    def _native(self) -> bool:
        """Whether the kernels copy this buffer now (else: the torch path)."""
        if not self._fits:
            return False
        if self._device.type == "cpu":
            return available()
        return self._device.type == "cuda" and available() and _cuda_state()[0] is not None

    def _prepare(self) -> _Prepared:
        if self._prepared is None:
            self._prepared = _Prepared.of(self.layout, self.tensors)
        return self._prepared


class _Prepared:
    """What the kernels read of a buffer for every copy: its block count (its tensors checked), each layer's address
    as the CPU and CUDA kernels take them, and the addresses' alignment bits."""

    def __init__(self, num_blocks: int, bases: list[int]) -> None:
        self.num_blocks = num_blocks
        self.pointers = (_p * len(bases))(*bases)
        self.int64s = (_i64 * len(bases))(*bases)
        self.bits = functools.reduce(operator.or_, bases, 0)

    @classmethod
    def of(cls, layout: KVLayout, tensors: Sequence[torch.Tensor]) -> _Prepared:
        num_blocks = _checked_buffer(layout, tensors)
        return cls(num_blocks, layer_bases(layout, tensors))


def layer_bases(layout: KVLayout, tensors: Sequence[torch.Tensor]) -> list[int]:
    """Each kernel layer's base address: a tensor's, or in a cross-layer buffer (one tensor) each layer's place in
    its blocks."""
    if layout.kind != "cross_layer":
        return [t.data_ptr() for t in tensors]
    layers, kv, _, heads, head_dim = layout.chunk_shape(0)
    per_layer = kv * layout.block_size * heads * head_dim * layout.element_size  # bytes of a block's one layer
    return [tensors[0].data_ptr() + layer * per_layer for layer in range(layers)]


def chunk_geometry(layout: KVLayout, chunk: torch.Tensor, start: int) -> KVGeometry:
    """Where each row of a copy of ``chunk`` (from token ``start``) lives, in elements.

    A split_kv buffer (one tensor per K or V plane) is ``2 * layers`` layers
    of kv = 1: the kernel's row order (layer', 0, token) is then the canonical
    chunk's (layer, kv, token), so the same kernels copy it.
    """
    layers, kv, tokens, heads, head_dim = chunk.shape
    if layout.kind == "split_kv":
        layers, kv = layers * kv, 1
    bs = layout.block_size
    per_layer = kv * bs * heads * head_dim  # elements of one block of one layer
    # (kv, token, head) strides inside a block; MLA has no heads axis: always token-major
    kv_stride, token_stride, head_stride = {
        "NHD": (bs * heads * head_dim, heads * head_dim, head_dim),
        "HND": (bs * heads * head_dim, head_dim, bs * head_dim),
        "NHKD": (head_dim, heads * kv * head_dim, kv * head_dim),
        "HNKD": (head_dim, kv * head_dim, bs * kv * head_dim),
    }["NHD" if layout.mla else layout.order]
    size = chunk.element_size()
    cross = layout.kind == "cross_layer"
    return KVGeometry(
        layers=layers,
        kv=kv,
        tokens=tokens,
        heads=heads,
        head_dim=head_dim,
        block_size=bs,
        start=start,
        element_size=size,
        block_stride=layers * per_layer if cross else per_layer,
        kv_stride=kv_stride,
        token_stride=token_stride,
        head_stride=head_stride,
    )


def _copy(
    layout: KVLayout,
    prepared: _Prepared,
    table: torch.Tensor,
    start: int,
    chunk: torch.Tensor,
    to_chunk: bool,
    checksum: bool = False,
) -> Accumulator:
    """Run one kernel copy (and its checksum accumulator when asked); the library's own argument checks surface as
    LayoutError like the torch path's."""
    geo = chunk_geometry(layout, chunk, start)
    table = table.cpu().contiguous()
    try:
        if chunk.device.type == "cuda":
            return _copy_cuda(geo, prepared, table, chunk, to_chunk, checksum)
        return _copy_cpu(geo, prepared.pointers, table, prepared.num_blocks, chunk.data_ptr(), to_chunk, checksum)
    except (IndexError, ValueError) as exc:
        raise LayoutError(str(exc)) from exc


def copy_cpu(
    geo: KVGeometry,
    bases: Sequence[int],
    table: torch.Tensor,
    num_blocks: int,
    chunk_ptr: int,
    to_chunk: bool,
    checksum: bool = False,
) -> int | None:
    """The C ABI's CPU copy as it is, with no Python check in front (tests call it to reach the library's guard);
    with ``checksum``, returns the chunk's checksum accumulator from the same pass."""
    return _copy_cpu(geo, (_p * len(bases))(*bases), table, num_blocks, chunk_ptr, to_chunk, checksum)


def _copy_cpu(
    geo: KVGeometry,
    bases: ctypes.Array[ctypes.c_void_p],
    table: torch.Tensor,
    num_blocks: int,
    chunk_ptr: int,
    to_chunk: bool,
    checksum: bool,
) -> int | None:
    lib = _lib()
    args = (ctypes.byref(geo), bases, table.data_ptr(), table.numel(), num_blocks, chunk_ptr, int(to_chunk))
    if not checksum:
        call(lib.pdkv_kvcopy_cpu, *args, torch.get_num_threads())
        return None
    acc = ctypes.c_uint64(0)
    call(lib.pdkv_kvcopy_sum_cpu, *args, torch.get_num_threads(), ctypes.byref(acc))
    return acc.value


def checksum_pieces(ptrs: Sequence[int], lens: Sequence[int], unit: int, first_unit: int = 0) -> int:
    """The checksum accumulator of host bytes at ``ptrs`` (``lens`` bytes each, whole units of ``unit``) hashed
    as one stream whose first unit has index ``first_unit``; on up to ``torch.get_num_threads()`` threads."""
    lib, acc = _lib(), ctypes.c_uint64(0)
    n = len(ptrs)
    call(
        lib.pdkv_checksum_cpu,
        int64s(ptrs),
        int64s(lens),
        n,
        unit,
        first_unit,
        torch.get_num_threads(),
        ctypes.byref(acc),
    )
    return acc.value


def checksum_blocks(bases: Int64s, ids: Sequence[int], num_blocks: int, block_bytes: int) -> int:
    """The checksum accumulator of blocks ``ids`` (each checked against ``[0, num_blocks)``: IndexError) of every
    host buffer at ``bases`` (``int64s``, made once for the buffers) in turn, read where they are; units of
    ``block_bytes``."""
    lib, acc = _lib(), ctypes.c_uint64(0)
    call(
        lib.pdkv_checksum_blocks_cpu,
        bases,
        len(bases),
        int64s(ids),
        len(ids),
        num_blocks,
        block_bytes,
        torch.get_num_threads(),
        ctypes.byref(acc),
    )
    return acc.value


Int64s = ctypes.Array[ctypes.c_int64]
"""A native array of int64 (``int64s``): made once where a kernel is called often with the same addresses."""


def int64s(values: Sequence[int]) -> Int64s:
    return (_i64 * len(values))(*values)


def landed_blocks(
    bases: Int64s, tables: Int64s, ids: Sequence[int], num_blocks: int, block_bytes: int
) -> tuple[int, int]:
    """The checksum accumulator of blocks ``ids`` (IndexError outside ``[0, num_blocks)``) of every region at
    ``bases`` in turn, from their landing ``tables`` where a block landed whole in hashed pieces, else read where it
    is; returns (accumulator, blocks read)."""
    lib, acc, reread = _lib(), ctypes.c_uint64(0), _i64(0)
    n = len(bases)
    call(
        lib.pdkv_landed_blocks,
        bases,
        tables,
        n,
        int64s(ids),
        len(ids),
        num_blocks,
        block_bytes,
        ctypes.byref(acc),
        ctypes.byref(reread),
    )
    return acc.value, reread.value


def pack_ranges(ranges: Sequence[tuple[int, int, int]]) -> bytes:
    """(region, offset, length) triples as one flat native int64 array (struct: ten times faster than a ctypes
    array for a reservation's hundreds of ranges)."""
    return struct.pack(f"={3 * len(ranges)}q", *itertools.chain.from_iterable(ranges))


def grid_ranges(regions: bytes, n_regions: int, spans: Sequence[tuple[int, int]]) -> tuple[bytes, int]:
    """The (region, offset, length) ranges of ``spans`` (offset, length) in each of the ``n_regions`` regions packed
    in ``regions``, packed as ``pack_ranges`` packs them, and their count (csrc/kvland.cpp ``pdkv_grid_ranges``): a
    grant of blocks over every tensor of a KV buffer built in one call, however many tensors it has."""
    n = n_regions * len(spans)
    out = (_i64 * (3 * n))()
    packed_spans = struct.pack(f"={2 * len(spans)}q", *itertools.chain.from_iterable(spans))
    _lib().pdkv_grid_ranges(regions, n_regions, packed_spans, len(spans), out)
    return bytes(out), n


def landing_reset(desc: int, n_desc: int, packed: bytes, n: int) -> None:
    """Zero the landing table entries of every unit the ``n`` ranges ``packed`` (``pack_ranges``, ``grid_ranges``)
    touch, in the regions of the descriptor at ``desc`` (``n_desc`` rows, csrc/kvland.cpp) that are hashed as they
    land: one call for a grant's ranges."""
    _lib().pdkv_landing_reset(desc, n_desc, packed, n)


def _lib() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise ValueError(f"pdkv native kernels unavailable: {reason()}")
    return lib


def binder(signatures: dict[str, list[type]], restypes: dict[str, type]) -> Callable[[], ctypes.CDLL]:
    """A getter of the kernel library with ``signatures``' argument types (``restypes``' return types, else int)
    set on those functions: how a module that calls functions of its own in the library (channels/tcp/native.py)
    declares them without a second loader. The getter raises ValueError where calls take the torch path."""
    declared: ctypes.CDLL | None = None

    def lib() -> ctypes.CDLL:
        nonlocal declared
        loaded = _lib()
        if loaded is not declared:  # the first call, or a library loaded again (tests do)
            _declare(loaded, signatures, restypes)
            declared = loaded
        return loaded

    return lib


def _declare(lib: ctypes.CDLL, signatures: dict[str, list[type]], restypes: dict[str, type]) -> None:
    """Set each function's argument types (a wrong count or type is a TypeError, never a bad call) and return type."""
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = restypes.get(name, ctypes.c_int)


def _copy_cuda(
    geo: KVGeometry,
    prepared: _Prepared,
    table: torch.Tensor,
    chunk: torch.Tensor,
    to_chunk: bool,
    checksum: bool = False,
) -> torch.Tensor | None:
    """The CUDA copy on the current stream of the chunk's device (block ids checked on the host first); with
    ``checksum``, the device scalar it adds the chunk's checksum accumulator into, or None where it cannot."""
    lib, cuda = library(), _cuda_state()[0]
    assert lib is not None and cuda is not None  # PagedBuffer._native checked both
    call(lib.pdkv_kvcopy_check, ctypes.byref(geo), table.data_ptr(), table.numel(), prepared.num_blocks)
    device = chunk.device
    args = (
        ctypes.byref(geo),
        ctypes.addressof(prepared.int64s),  # host arrays: the kernel takes them in its parameters
        table.data_ptr(),
        table.numel(),
        chunk.data_ptr(),
        int(to_chunk),
        _vector_bytes(geo, prepared.bits, chunk.data_ptr()),
    )
    acc = torch.zeros((), dtype=torch.int64, device=device) if checksum else None
    with torch.cuda.device(device):  # the kernel launches on the current device's context
        stream = torch.cuda.current_stream(device).cuda_stream
        code = -1 if acc is None else cuda.pdkv_kvcopy_sum_cuda(*args, stream, acc.data_ptr())
        if code == -1:  # not asked, or the chunk's words do not fit its vectors: the plain copy
            acc = None
            code = cuda.pdkv_kvcopy_cuda(*args, stream)
    if code != 0:
        raise ValueError(f"pdkv kvcopy: CUDA launch failed: {cuda.pdkv_cuda_error_string(code).decode()}")
    return acc


def cuda_checksum_available() -> bool:
    """Whether CUDA tensors are hashed by the CUDA checksum kernel (else torch ops)."""
    return available() and _cuda_state()[0] is not None


def checksum_cuda(unit_ptrs: torch.Tensor, unit: int, first_unit: int, acc: torch.Tensor) -> None:
    """Add the checksum accumulator of the units of ``unit`` bytes at the device addresses ``unit_ptrs`` (int64, on
    the units' device; each aligned to the unit's word size), unit index ``first_unit`` + position, into ``acc`` (a
    zeroed int64 scalar there) on the current stream."""
    cuda = _cuda_state()[0]
    if cuda is None:
        raise ValueError(f"pdkv native CUDA kernels unavailable: {cuda_reason()}")
    with torch.cuda.device(acc.device):
        stream = torch.cuda.current_stream(acc.device).cuda_stream
        code = cuda.pdkv_checksum_cuda(
            unit_ptrs.data_ptr(), unit_ptrs.numel(), unit, first_unit, acc.data_ptr(), stream
        )
    if code != 0:
        raise ValueError(f"pdkv checksum: CUDA launch failed: {cuda.pdkv_cuda_error_string(code).decode()}")


def _vector_bytes(geo: KVGeometry, base_bits: int, chunk_ptr: int) -> int:
    """Widest vector (<= 16 bytes) that every row start is aligned to (``base_bits``: the layers' addresses OR-ed)."""
    bits = geo.head_dim * geo.element_size | chunk_ptr | base_bits
    width = 16
    while width > 1 and bits % width:
        width //= 2
    return width


def _checked_buffer(layout: KVLayout, tensors: Sequence[torch.Tensor]) -> int:
    """layout.py's buffer checks, and one device for every tensor (the kernel takes raw addresses)."""
    num_blocks = layout.validate_buffer(tensors)
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise LayoutError(f"buffer tensors are on several devices: {sorted(map(str, devices))}")
    return num_blocks


def switched_off(var: str) -> bool:
    """Whether the environment turns ``var`` off (0, false, off, no): how every native path's switch reads."""
    return os.environ.get(var, "1").strip().lower() in ("0", "false", "off", "no")


def _state() -> tuple[ctypes.CDLL | None, str | None]:
    """(library, None) or (None, why not); loads once per process unless disabled.

    The environment is read on every call so ``PDKV_NATIVE=0`` takes effect
    even after the library was loaded.
    """
    global _loaded
    if switched_off(ENV_VAR):
        return None, f"disabled by {ENV_VAR}={os.environ[ENV_VAR]}"
    if _loaded is None:
        with _lock:
            if _loaded is None:
                _loaded = _load(LIBRARY, _SIGNATURES, "native kernels", "CPU tensors")
    return _loaded


def _cuda_state() -> tuple[ctypes.CDLL | None, str | None]:
    """Like ``_state`` for the CUDA library, which also needs a CUDA runtime that starts on this driver."""
    global _cuda_loaded
    if _state()[0] is None:
        return None, reason()
    if _cuda_loaded is None:
        with _lock:
            if _cuda_loaded is None:
                _cuda_loaded = _load(CUDA_LIBRARY, _CUDA_SIGNATURES, "native CUDA kernels", "CUDA tensors")
    return _cuda_loaded


def _load(
    path: Path, signatures: dict[str, list[type]], what: str, scope: str
) -> tuple[ctypes.CDLL | None, str | None]:
    if not path.is_file():
        why = (
            f"{path.name} is not in {path.parent}: it is built when pdkv is installed (pip install, with a C++ "
            f"compiler{', and nvcc' if 'cuda' in path.name else ''})"
        )
    else:
        try:
            lib = ctypes.CDLL(str(path))
            _declare(lib, signatures, _RESTYPES)
            count = lib.pdkv_cuda_device_count() if "pdkv_cuda_device_count" in signatures else 1
            if count < 0:
                why = f"its CUDA runtime does not start here: {lib.pdkv_cuda_error_string(-count).decode()}"
            else:
                return lib, None
        except (OSError, AttributeError) as exc:
            why = f"{path.name} does not load: {exc}"
    log.warning(
        "pdkv %s unavailable, %s take the torch path (same bytes, slower): %s. Reinstall pdkv to rebuild them; set "
        "%s=0 to not use them.",
        what,
        scope,
        why,
        ENV_VAR,
    )
    return None, why
