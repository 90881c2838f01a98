"""A buffer seen through a head window: what a transfer between tensor-parallel ranks of different sizes reads
from (P) or lands in (D).

Both sides keep one memory object for every transfer (``posting.SendSource``, ``incoming.ReceiveMemory``);
a transfer that names a window (``protocol.Reserve.heads``) uses a copy of it whose layout has the window's heads
and whose tensors are strided views of the window (``layout.HeadWindow.view``). Such a transfer is always staged:
its chunk is gathered from, or scattered into, the views (the torch path: the kernels take contiguous tensors),
and its registered regions are not the window's, so the copy has none.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Protocol, TypeVar

import torch

from pdkv.layout import HeadWindow, KVLayout
from pdkv.staging import DeviceStager


class _Memory(Protocol):
    layout: KVLayout
    kv: list[torch.Tensor]
    kv_bytes: list[torch.Tensor]
    kv_regions: list[int]
    stager: DeviceStager | None


M = TypeVar("M", bound=_Memory)


class Windows:
    """The windows of one memory object made so far (each made once: a device window holds a stager)."""

    def __init__(self) -> None:
        self._made: dict[HeadWindow, object] = {}
        self._lock = threading.Lock()

    def of(self, memory: M, heads: HeadWindow | None, chunk_size: int) -> M:
        """``memory`` as a transfer of ``heads`` sees it; ``memory`` itself for None (all heads)."""
        if heads is None:
            return memory
        with self._lock:
            made = self._made.get(heads)
            if made is None:
                layout, views = heads.view(memory.layout, memory.kv)
                stager = DeviceStager(layout, views, chunk_size) if memory.stager is not None else None
                made = self._made[heads] = dataclasses.replace(
                    memory, layout=layout, kv=views, kv_bytes=[], kv_regions=[], stager=stager
                )
        return made  # type: ignore[return-value]
