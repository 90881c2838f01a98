"""Which memory a buffer lives in, and zero-copy byte views of host memory.

Channels move bytes, not tensors. A channel that moves host memory (tcp, ucx,
mock) needs a writable ``memoryview`` over a tensor's storage, with no copy, so
that ``recv_into`` and ``memcpy`` land directly in the KV buffer; a channel
that addresses device memory (nixl) registers VRAM by address instead. What
kind of memory a buffer is in (``memory_kind``) is what decides between the
two (``in_reach`` of a buffer and a channel's ``memory``), and ``byte_view`` refuses memory that has no host
view with an error that says what to use instead.

Device emulation: the CPU test suite and ``pdkv bench transfer --device
emulated`` mark CPU KV buffers as device memory (``emulate_device``, or
``PDKV_EMULATE_DEVICE=1`` for every KV buffer a sender or receiver takes,
in every process that inherits it). Such a buffer is ordinary CPU memory for torch (kernels, copies,
the device checksum run on it), but ``byte_view`` refuses it as it would a
CUDA tensor, so code that reaches for a host view of the KV fails on CPU as it
would on a GPU, and a host-only channel must go through pinned staging.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Collection
from typing import Any, Literal

import torch

from pdkv.errors import DeviceMemoryError, LayoutError

EMULATE_ENV = "PDKV_EMULATE_DEVICE"
"""Set to 1 to treat every CPU KV buffer given to a sender or receiver as device memory."""

MemoryKind = Literal["host", "cuda", "emulated", "other"]

_lock = threading.Lock()
_emulated: dict[int, int] = {}  # storage address of a buffer marked as device memory -> live tensors that marked it


def emulation_requested() -> bool:
    """Whether ``PDKV_EMULATE_DEVICE`` asks for device emulation in this process."""
    return os.environ.get(EMULATE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def emulate_device(t: torch.Tensor) -> torch.Tensor:
    """Mark a CPU tensor's storage as emulated device memory (for as long as ``t`` lives); returns ``t``.

    Every view of the same storage is refused by ``byte_view`` from now on.
    """
    if t.device.type != "cpu":
        raise LayoutError(f"only a CPU tensor can emulate device memory, got one on {t.device}")
    ptr = t.untyped_storage().data_ptr()
    with _lock:
        _emulated[ptr] = _emulated.get(ptr, 0) + 1
    weakref.finalize(t, _forget, ptr)
    return t


def _forget(ptr: int) -> None:
    with _lock:
        left = _emulated.pop(ptr, 1) - 1
        if left:
            _emulated[ptr] = left


def adopt_kv(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """KV buffers as the transfer path takes them: marked as emulated device memory when ``PDKV_EMULATE_DEVICE`` is
    set."""
    if emulation_requested():
        for t in tensors:
            if t.device.type == "cpu":
                emulate_device(t)
    return tensors


def memory_kind(buf: Any) -> MemoryKind:
    """``host`` (CPU tensors, arrays, bytes), ``cuda``, ``emulated`` (a CPU tensor marked as device memory) or
    ``other`` (meta, mps, ...)."""
    if not isinstance(buf, torch.Tensor):
        return "host"
    kind = buf.device.type
    if kind == "cpu":
        if not _emulated:
            return "host"
        with _lock:
            return "emulated" if buf.untyped_storage().data_ptr() in _emulated else "host"
    return "cuda" if kind == "cuda" else "other"


def in_reach(buf: Any, memory: Collection[str]) -> bool:
    """Whether a channel that addresses ``memory`` (its ``Channel.memory``) can register ``buf`` where it is, with
    no copy through the host."""
    return memory_kind(buf) in memory


def byte_view(buf: Any) -> memoryview:
    """A flat, writable uint8 memoryview over ``buf``'s host memory (no copy).

    Accepts a contiguous CPU ``torch.Tensor``, a numpy array, a bytearray or a
    memoryview. Device memory (CUDA, meta, emulated) has no host view: raises
    ``DeviceMemoryError`` naming what to do instead.
    """
    if isinstance(buf, torch.Tensor):
        kind = memory_kind(buf)
        if kind != "host":
            where = "emulated device memory (PDKV_EMULATE_DEVICE)" if kind == "emulated" else f"{buf.device} memory"
            raise DeviceMemoryError(
                f"byte_view: a tensor in {where} has no host view, so a channel that moves host memory (tcp, ucx, "
                "mock) "
                "cannot address it. Use a channel that addresses device memory (nixl, for CUDA), let "
                "KVSender/KVReceiver "
                "stage it through pinned host memory (they do whenever the channel does not reach the KV's memory), "
                "and hash it on its device with pdkv.checksum.chunk_checksum"
            )
        if not buf.is_contiguous():
            raise LayoutError("byte_view needs a contiguous tensor; call .contiguous() first")
        flat = buf.reshape(-1)
        if flat.dtype != torch.uint8:
            flat = flat.view(torch.uint8)
        return memoryview(flat.numpy()).cast("B")
    mv = memoryview(buf)
    if not mv.c_contiguous:
        raise LayoutError("byte_view needs C-contiguous memory")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def nbytes(buf: Any) -> int:
    """Size in bytes of anything ``byte_view`` accepts."""
    if isinstance(buf, torch.Tensor):
        return buf.numel() * buf.element_size()
    return memoryview(buf).nbytes
