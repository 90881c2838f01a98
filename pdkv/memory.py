"""Zero-copy byte views of host tensors and arrays.

Channels move bytes, not tensors. Every channel and the checksum code need the
same writable ``memoryview`` over a tensor's storage, with no copy, so that
``recv_into`` and ``memcpy`` land directly in the KV buffer.
"""

from __future__ import annotations

from typing import Any

import torch

from pdkv.errors import LayoutError


def byte_view(buf: Any) -> memoryview:
    """A flat, writable uint8 memoryview over ``buf``'s memory (no copy).

    Accepts a contiguous CPU ``torch.Tensor``, a numpy array, a bytearray or a
    memoryview. CUDA tensors have no host view; channels that support device
    memory (nixl) handle them before calling this.
    """
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu":
            raise LayoutError(f"byte_view needs a CPU tensor, got one on {buf.device}")
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
