"""Chunk checksums computed where the bytes are: torch integer ops on the tensor's own device.

A chunk's KV may live in VRAM on the prefill side and in host memory on the
decode side (or the other way round), and copying it to the host only to hash
it would cost a transfer of its own. ``chunk_checksum`` therefore runs on the
device holding the bytes and gives the same value for the same bytes on CPU
and CUDA: it is integer arithmetic modulo 2**64 (sums and products of int64
words wrap identically on both, and their order does not change the result),
with nothing taken from floating point or from the order a reduction runs in.

The value: the bytes of a chunk, in wire order, are cut into *units* (a KV
block in direct mode, the whole frame in staging mode), each unit into words
(8 bytes, or the largest of 4, 2, 1 that divides the unit) and the words into
rows of up to 512. ``value = sum_u f(u) * (sum_r g(r) * rowsum(u, r))`` with
odd, distinct per-position weights ``f`` and ``g``, then the total byte count
is mixed in. Cut into units, not into the pieces the caller passes, so runs of
adjacent blocks that differ between the two sides (P's blocks 5, 6 and D's
blocks 1, 3) hash to the same value: only the byte stream matters.

What it catches: any single changed word (a flipped bit, a byte overwritten:
the odd weight times a non-zero difference is never 0 mod 2**64); a unit or a
row in another place (a block landed in the wrong slot, two blocks swapped:
different weights); a chunk of another length (the length is mixed in) or one
whose tail never arrived (the stale bytes differ). What it does not: it is no
MAC (anyone can forge a chunk with the same value), and changes that cancel
within one row do (two words of one 4 KiB row swapped, +d in one word and -d in
another); between rows two changes cancel only by a 2**-64-sized coincidence
of the data, not of the error's shape.

Two implementations give the same bits. The native kernels (through
``pdkv.native``: csrc/kvsum.cpp on CPU, on torch's thread count;
csrc/kvcopy_cuda.cu on CUDA) read every byte once with the weights computed
per row on the fly and hash pieces and a direct-mode chunk's blocks where
they are; and the staging gather and scatter hash the chunk in the pass that
copies it (``native.PagedBuffer.gather_summed`` and ``scatter_summed``, finished by
``frame_checksum``), where the checksum costs next to nothing. Where they do
not run (no native library, small or misaligned units on CUDA) torch ops
give the value: one read of the bytes (a row-sum reduction) plus work on
1/512 of them, and a few ops per piece: many small pieces (a fragmented block
table times per-layer tensors) are first copied together, and
``blocks_checksum`` gathers a direct-mode chunk's blocks with one op per
tensor. ``pdkv bench checksum`` measures both against ``copy_`` of the same
bytes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

import numpy as np
import torch
import xxhash

from pdkv import native
from pdkv.errors import LayoutError
from pdkv.layout import KVLayout, gather

_MASK = (1 << 64) - 1
_ROW_WORDS = 512  # 4 KiB rows of int64: the row-sum reduction runs at the speed of a plain sum
_UNIT_SALT, _ROW_SALT = 0x2545F4914F6CDD1D, 0x7F4A7C159E3779B9
_GOLDEN = 0x9E3779B97F4A7C15
_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _signed(x: int) -> int:
    """The int64 with the same 64 bits as ``x`` (torch has no uint64 arithmetic on every device)."""
    x &= _MASK
    return x - (1 << 64) if x >> 63 else x


def _mix64(x: int) -> int:
    """splitmix64's finaliser: spreads every input bit over the output."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


class _Weights:
    """Weights of a flat row index ``i`` of units of ``rows`` rows: ``f(i // rows) * g(i % rows)``, grown on demand
    and cached.

    ``f`` and ``g`` are ``(j * golden + salt) | 1`` (odd), built with the same int64 ops on every device, so
    CPU and CUDA weights are the same bits; ``f * g`` is odd too, which is what makes any single changed
    word change the value.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cache: dict[tuple[torch.device, int], torch.Tensor] = {}

    def get(self, device: torch.device, rows: int, n: int) -> torch.Tensor:
        key = (device, rows)
        with self._lock:
            w = self._cache.get(key)
            if w is None or w.numel() < n:
                size = -(-max(n, 1024, 2 * (w.numel() if w is not None else 0)) // rows) * rows
                i = torch.arange(size, dtype=torch.int64, device=device)
                f = (i // rows).mul_(_signed(_GOLDEN)).add_(_signed(_UNIT_SALT)).bitwise_or_(1)
                g = (i % rows).mul_(_signed(_GOLDEN)).add_(_signed(_ROW_SALT)).bitwise_or_(1)
                w = f.mul_(g)
                if device.type == "cuda":  # built on this thread's stream; another thread's stream may read it next
                    torch.cuda.current_stream(device).synchronize()
                self._cache[key] = w
        return w[:n]


_weights = _Weights()
_scratch = (
    threading.local()
)  # per thread and device: where many small pieces are copied together, reused (a fresh allocation faults its pages in)


def _scratch_bytes(device: torch.device, total: int) -> torch.Tensor:
    """``total`` bytes of this thread's scratch buffer on ``device``, grown on demand."""
    buffers: dict[torch.device, torch.Tensor] = _scratch.__dict__.setdefault("buffers", {})
    buf = buffers.get(device)
    if buf is None or buf.numel() < total:
        buf = buffers[device] = torch.empty(total, dtype=torch.uint8, device=device)
    return buf[:total]


def _joined(pieces: list[torch.Tensor], total: int) -> torch.Tensor:
    """``pieces`` copied end to end into this thread's scratch buffer on their device."""
    return torch.cat(pieces, out=_scratch_bytes(pieces[0].device, total))


# The CUDA kernel takes one address a unit (8 bytes) and a warp a row: for smaller units torch ops do better.
_CUDA_MIN_UNIT = 512

# Pieces smaller than this on average (a fragmented block table times per-layer tensors) are hashed as one copy:
# three torch ops per piece (~10 us) cost more than copying 256 KiB.
_CONCAT_BELOW = 256 << 10


def _cut(unit: int) -> tuple[int, int, int]:
    """How a unit of ``unit`` bytes is cut: (bytes a word, words, words a row).

    Words of 8 bytes, or the largest of 4, 2, 1 that divides the unit; rows of
    ``min(512, max(1, words // 16))`` words, a unit's last row shorter when they do not divide.
    """
    word = next((size for size in (8, 4, 2) if unit % size == 0), 1)
    n_words = unit // word
    return word, n_words, min(_ROW_WORDS, max(1, n_words // 16))


def _rows_per_unit(unit: int) -> int:
    _, n_words, row = _cut(unit)
    return -(-n_words // row)


def _row_sums(piece: torch.Tensor, unit: int) -> torch.Tensor:
    """Every row's sum of a flat uint8 piece of whole units, in stream order, as int64 on the piece's device."""
    word, n_words, row = _cut(unit)
    if piece.data_ptr() % word:
        piece = piece.clone()  # a view at an odd offset: a fresh allocation is aligned
    words = piece.view(_WORD_DTYPES[word])
    if n_words % row == 0:
        return words.view(-1, row).sum(1, dtype=torch.int64)
    full = n_words // row
    per_unit = words.view(-1, n_words)
    sums = torch.cat(
        [
            per_unit[:, : full * row].reshape(-1, full, row).sum(2, dtype=torch.int64),
            per_unit[:, full * row :].sum(1, dtype=torch.int64, keepdim=True),
        ],
        1,
    )
    return sums.view(-1)


def chunk_checksum(pieces: Iterable[torch.Tensor], unit: int | None = None) -> int:
    """The checksum of the bytes of ``pieces`` (flat uint8 tensors, wire order), computed on their device.

    ``unit``: every piece is whole units of this many bytes (a KV block); the
    value depends on the byte stream only, not on how it is cut into pieces.
    ``None``: the pieces are one unit each (a staged frame). Syncs with the
    device once (to read the value), not once per piece.
    """
    todo: list[torch.Tensor] = []
    total = 0
    for piece in pieces:
        if piece.dtype != torch.uint8 or piece.dim() != 1:
            raise LayoutError(
                f"chunk_checksum takes flat uint8 tensors, got {piece.dtype} of shape {tuple(piece.shape)}"
            )
        if piece.device.type == "meta":
            raise LayoutError("chunk_checksum: a meta tensor holds no bytes to hash; the KV must be on cpu or cuda")
        if todo and piece.device != todo[0].device:
            raise LayoutError(
                f"chunk_checksum: pieces on {todo[0].device} and {piece.device}; hash each device's bytes where they "
                "are"
            )
        n = piece.numel()
        if unit is not None and n % unit:
            raise LayoutError(f"chunk_checksum: a piece of {n} bytes is not whole units of {unit} bytes")
        if n:
            todo.append(piece)
            total += n
    if not todo:
        return _mix64(_GOLDEN)
    acc = _native_acc(todo, unit)
    return finish(_torch_acc(todo, unit, total) if acc is None else acc, total)


def frame_checksum(frame: torch.Tensor, acc: native.Accumulator = None) -> int:
    """``chunk_checksum([frame])`` (one unit: a staged frame), from ``acc`` where a copy kernel already computed
    its accumulator in the pass that moved ``frame`` (``native.PagedBuffer``'s ``gather_summed``/``scatter_summed``;
    a CUDA one is read here, which waits for that copy), else hashed here."""
    if acc is None or not frame.numel():
        return chunk_checksum([frame])
    return finish(int(acc.item()) if isinstance(acc, torch.Tensor) else acc, frame.numel())


def finish(acc: int, total: int) -> int:
    """The value from the accumulator of ``total`` bytes: the byte count mixed in (public for accumulators summed
    elsewhere: a channel that hashed them as they landed, channels/landing.py)."""
    return _mix64((acc & _MASK) ^ _mix64(total))


def _native_acc(todo: list[torch.Tensor], unit: int | None) -> int | None:
    """The accumulator from the native kernels where they run (library loaded, pieces without strides; on CUDA
    pieces aligned to their words and units of at least a row), else None (the torch path)."""
    device = todo[0].device
    if any(p.stride(0) != 1 for p in todo):
        return None
    if device.type == "cpu" and native.available():
        if unit is None:  # each piece its own unit: unit index = piece index
            return sum(native.checksum_pieces([p.data_ptr()], [p.numel()], p.numel(), i) for i, p in enumerate(todo))
        return native.checksum_pieces([p.data_ptr() for p in todo], [p.numel() for p in todo], unit)
    if device.type != "cuda" or not native.cuda_checksum_available():
        return None
    units = [(p.numel() if unit is None else unit) for p in todo]
    if any(u < _CUDA_MIN_UNIT or p.data_ptr() % _cut(u)[0] for p, u in zip(todo, units, strict=True)):
        return None
    acc = torch.zeros((), dtype=torch.int64, device=device)
    if unit is None:  # one launch a piece, all adding into one scalar: one sync to read it
        for i, p in enumerate(todo):
            native.checksum_cuda(torch.tensor([p.data_ptr()], dtype=torch.int64).to(device), p.numel(), i, acc)
    else:
        # Every unit's address, with a fixed number of ops however many pieces (a fragmented block table gives
        # one piece per block): each piece's start, repeated once per unit in it, plus the unit's offset in it.
        starts = torch.tensor([p.data_ptr() for p in todo], dtype=torch.int64)
        counts = torch.tensor([p.numel() // unit for p in todo], dtype=torch.int64)
        firsts = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        ptrs = torch.repeat_interleave(starts, counts) + (torch.arange(int(counts.sum())) - firsts) * unit
        native.checksum_cuda(ptrs.to(device), unit, 0, acc)
    return int(acc.item())


def _torch_acc(todo: list[torch.Tensor], unit: int | None, total: int) -> int:
    """The accumulator with torch ops on the pieces' device (CUDA, and the fallback on CPU)."""
    device = todo[0].device
    if unit is None:  # each piece its own unit, of its own rows: weighted piece by piece
        acc = torch.zeros((), dtype=torch.int64, device=device)
        for index, piece in enumerate(todo):
            rows = _rows_per_unit(piece.numel())
            acc += (
                _row_sums(piece, piece.numel()) * _weights.get(device, rows, (index + 1) * rows)[index * rows :]
            ).sum()
    else:
        if len(todo) > 1 and total < _CONCAT_BELOW * len(todo):
            todo = [_joined(todo, total)]
        parts = [_row_sums(piece, unit) for piece in todo]
        sums = torch.cat(parts) if len(parts) > 1 else parts[0]
        acc = (sums * _weights.get(device, _rows_per_unit(unit), sums.numel())).sum()
    return int(acc.item())


def blocks_checksum(kv_bytes: Sequence[torch.Tensor], blocks: Sequence[int], block_bytes: int) -> int:
    """``chunk_checksum`` of ``blocks`` of every KV tensor (flat bytes), tensor by tensor: direct mode's wire order.

    Equal to hashing the runs of adjacent blocks each side writes or lands
    (the stream is the same). The one-chunk case of ``blocks_checksums``.
    """
    return blocks_checksums(kv_bytes, [blocks], block_bytes)[0]


def blocks_checksums(kv_bytes: Sequence[torch.Tensor], chunks: Sequence[Sequence[int]], block_bytes: int) -> list[int]:
    """``blocks_checksum`` of each chunk's blocks, in order: every chunk a side has to hash at once, in one go.

    Why one call: on a GPU each read-back of a value waits for the device, and
    one per chunk was most of a chunk's fixed cost; here all chunks share one
    address table, one copy of it and one read-back (``_CudaUnits``). On CPU
    the native kernel hashes chunk by chunk in place, as the one-chunk call
    does (no change in cost). Where the native kernels do not run, the torch
    path hashes each chunk with one op per tensor, not one per run: blocks
    that are not one run are first gathered (``index_select``) into this
    thread's scratch buffer. Block ids are checked against every tensor's
    length (``LayoutError``). A side that hashes the same tensors every chunk
    keeps a ``BlockSums`` of them instead.
    """
    return BlockSums(kv_bytes, block_bytes)(chunks)


class BlockSums:
    """``blocks_checksums`` over one set of KV tensors, for a side that hashes their blocks every chunk (a sender's
    memory, a receiver's): what the call reads of the tensors (their device, dtype and layout, their addresses and
    how many blocks they hold) is read once here, not on every chunk. Read per call, those 30-80 tensors' attributes
    cost a 40-token chunk's verification over nixl about as much Python as the rest of its landing."""

    def __init__(self, kv_bytes: Sequence[torch.Tensor], block_bytes: int) -> None:
        self.kv_bytes, self.block_bytes = list(kv_bytes), block_bytes
        self._empty = chunk_checksum([], unit=block_bytes)
        # where a native kernel may read the tensors in place (whether it is loaded is asked per call: the
        # environment's switch, PDKV_NATIVE, holds from the call it is set): "cpu", "cuda" or "" (the torch path)
        self._kernel = _native_kernel(self.kv_bytes, block_bytes)
        self._bases = [b.data_ptr() for b in self.kv_bytes] if self._kernel else []
        self._packed = native.int64s(self._bases) if self._kernel == "cpu" else None
        self.num_blocks = min(b.numel() for b in self.kv_bytes) // block_bytes if self._kernel else 0

    def __call__(self, chunks: Sequence[Sequence[int]]) -> list[int]:
        """Each chunk's checksum of its blocks of every tensor (an empty chunk's: that of no bytes)."""
        lists = [list(ids) for ids in chunks]
        if not self.kv_bytes:
            return [self._empty] * len(lists)
        full = [ids for ids in lists if ids]
        accs = self._native_accs(full) if full else []
        if accs is None:
            values = iter([_torch_blocks_checksum(self.kv_bytes, ids, self.block_bytes) for ids in full])
        else:
            size = len(self.kv_bytes) * self.block_bytes
            values = iter([finish(acc, size * len(ids)) for acc, ids in zip(accs, full, strict=True)])
        return [next(values) if ids else self._empty for ids in lists]

    def _native_accs(self, chunks: list[list[int]]) -> list[int] | None:
        """The accumulator of each chunk's blocks (non-empty) of every tensor, read in place by the native kernels
        where they run, else None."""
        if self._packed is not None and native.available():
            try:
                return [native.checksum_blocks(self._packed, ids, self.num_blocks, self.block_bytes) for ids in chunks]
            except IndexError as exc:
                raise LayoutError(f"blocks_checksum: {exc}") from exc
        if self._kernel != "cuda" or not native.cuda_checksum_available():
            return None
        for ids in chunks:
            if min(ids) < 0 or max(ids) >= self.num_blocks:
                raise LayoutError(f"blocks_checksum: block ids {ids} are not all in [0, {self.num_blocks})")
        return _cuda_units_accs(self._bases, chunks, self.block_bytes, self.kv_bytes[0].device)


def _native_kernel(kv_bytes: list[torch.Tensor], block_bytes: int) -> str:
    """Where a native kernel may read the blocks of ``kv_bytes`` in place: "cpu" or "cuda" for flat uint8 tensors
    on one device (on CUDA aligned to the block's words, blocks of at least a row), else ""."""
    if not kv_bytes or block_bytes <= 0:
        return ""
    device = kv_bytes[0].device
    if not all(b.device == device and b.dtype == torch.uint8 and b.dim() == 1 and b.is_contiguous() for b in kv_bytes):
        return ""
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda" and block_bytes >= _CUDA_MIN_UNIT:
        word = _cut(block_bytes)[0]
        return "cuda" if all(b.data_ptr() % word == 0 for b in kv_bytes) else ""
    return ""


def read_back_shared(kv_bytes: Sequence[torch.Tensor]) -> bool:
    """Whether hashing many chunks in one ``blocks_checksums`` call costs less than one call each: on CUDA, where a
    chunk's cost is the wait to read its value back, which the call's chunks share; not on CPU, where it is reading
    the bytes (the same either way), so a sender that hashes each chunk as it posts it overlaps that with the
    previous chunk's write instead of delaying the first."""
    return bool(kv_bytes) and kv_bytes[0].device.type == "cuda"


def _torch_blocks_checksum(kv_bytes: Sequence[torch.Tensor], ids: list[int], block_bytes: int) -> int:
    """``blocks_checksum`` of non-empty ``ids`` with torch ops: one run sliced, else gathered into scratch."""
    first, n = ids[0], len(ids)
    if ids == list(range(first, first + n)):
        return chunk_checksum([b[first * block_bytes : (first + n) * block_bytes] for b in kv_bytes], unit=block_bytes)
    device = kv_bytes[0].device
    index = torch.tensor(ids, dtype=torch.long, device=device)
    out = _scratch_bytes(device, len(kv_bytes) * n * block_bytes).view(len(kv_bytes), n, block_bytes)
    for t, b in enumerate(kv_bytes):
        torch.index_select(b.view(-1, block_bytes), 0, index, out=out[t])
    return chunk_checksum([out.view(-1)], unit=block_bytes)


class _CudaUnits:
    """One thread's means of hashing blocks on a CUDA device: a stream of pdkv's own, the units' addresses in
    page-locked host memory and on the device, and one accumulator a chunk (on the device and pinned on the host).

    A chunk's checksum runs on both sides of every direct chunk, and on a GPU its kernel takes microseconds: what
    costs is the host's part and the wait to read the value. The table is one numpy op a chunk into pinned memory,
    copied asynchronously ahead of the kernels; every chunk of a call adds into its own slot of one zeroed vector,
    which is copied back once and read after one synchronize, so a pass's chunks share one wait. That wait is for
    pdkv's stream, which first waits for the caller's stream (the forward step that wrote the blocks): not for
    work the caller queues after the call (on a vLLM P, the model's next forward), as a read-back on the caller's
    stream (``item``) would. The stream is idle again when a call returns or fails, so the buffers are free.

    Not run on a GPU yet (written on a machine without one): tests/gpu/check.py's ``checksums_batched`` part checks
    it against the per-chunk and CPU values.
    """

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)
        self.host = torch.empty(0, dtype=torch.int64)
        self.dev = torch.empty(0, dtype=torch.int64, device=device)
        self.accs = torch.empty(0, dtype=torch.int64, device=device)
        self.sums = torch.empty(0, dtype=torch.int64)

    def _fit(self, units: int, chunks: int) -> None:
        """Grow the buffers (doubling, never shrinking) to ``units`` addresses and ``chunks`` accumulators."""
        device = self.dev.device
        with torch.cuda.stream(self.stream):  # allocated for the stream that uses them
            if self.host.numel() < units:
                n = max(units, 1024, 2 * self.host.numel())
                self.host = torch.empty(n, dtype=torch.int64, pin_memory=True)
                self.dev = torch.empty(n, dtype=torch.int64, device=device)
            if self.sums.numel() < chunks:
                k = max(chunks, 64, 2 * self.sums.numel())
                self.sums = torch.empty(k, dtype=torch.int64, pin_memory=True)
                self.accs = torch.empty(k, dtype=torch.int64, device=device)

    def accumulate(self, bases: list[int], chunks: list[list[int]], block_bytes: int) -> list[int]:
        """Each chunk's accumulator of blocks ``chunks[i]`` (checked, non-empty) of the tensors at ``bases``."""
        counts = [len(bases) * len(ids) for ids in chunks]
        n, k = sum(counts), len(chunks)
        self._fit(n, k)
        table, base_col, offset = self.host.numpy(), np.asarray(bases, dtype=np.int64), 0
        for ids, count in zip(chunks, counts, strict=True):  # each chunk's units in wire order: tensor by tensor
            out = table[offset : offset + count].reshape(len(bases), len(ids))
            np.add.outer(base_col, np.asarray(ids, dtype=np.int64) * block_bytes, out=out)
            offset += count
        caller = torch.cuda.current_stream(self.dev.device)
        try:
            with torch.cuda.stream(self.stream):
                self.stream.wait_stream(caller)
                self.dev[:n].copy_(self.host[:n], non_blocking=True)
                accs = self.accs[:k]
                accs.zero_()
                offset = 0
                for i, count in enumerate(counts):
                    native.checksum_cuda(self.dev[offset : offset + count], block_bytes, 0, accs[i])
                    offset += count
                self.sums[:k].copy_(accs, non_blocking=True)
        finally:
            self.stream.synchronize()
        return self.sums[:k].tolist()


def _cuda_units_accs(bases: list[int], chunks: list[list[int]], block_bytes: int, device: torch.device) -> list[int]:
    """Each chunk's accumulator of blocks ``chunks[i]`` (checked) of the tensors at device addresses ``bases``, with
    this thread's ``_CudaUnits`` for ``device``."""
    units: dict[torch.device, _CudaUnits] = _scratch.__dict__.setdefault("cuda_units", {})
    entry = units.get(device)
    if entry is None:
        entry = units[device] = _CudaUnits(device)
    return entry.accumulate(bases, chunks, block_bytes)


def checksum(views: Iterable[memoryview]) -> int:
    """xxh3-64 of host bytes: the tiers' files and values (``pdkv.tier``), whose format keeps it; not the transfer
    path."""
    h = xxhash.xxh3_64()
    for v in views:
        h.update(v)
    return h.intdigest()


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 tensor on its own device (a torch view, never a host one)."""
    if not t.is_contiguous():
        raise LayoutError("flat_bytes needs a contiguous tensor; call .contiguous() first")
    flat = t.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def layer_digests(
    layout: KVLayout, tensors: Sequence[torch.Tensor], block_table: Sequence[int], num_tokens: int
) -> list[str]:
    """The checksum of each layer's canonical KV for tokens ``[0, num_tokens)``, as hex, computed on the KV's device.

    Layout-independent, so P and D can compare what was computed with what
    landed whatever their block sizes, orders and devices; per layer, so a
    chunk or a layer that landed in the wrong place is caught even when the
    tokens generated from it happen to agree.
    """
    chunk = gather(layout, tensors, block_table, 0, num_tokens)
    return [f"{chunk_checksum([flat_bytes(chunk[i].contiguous())]):016x}" for i in range(layout.num_layers)]
