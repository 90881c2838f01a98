"""L1: canonical chunks in this process's memory, byte-bounded, LRU, S3-FIFO or prefix-aware (``pdkv.tier.policy``).

The embedded default: a put keeps the caller's tensor (no copy, no header,
no checksum: the bytes never leave this process), a get is one copy into the
caller's buffer. Copies run outside the lock, so a reader never stalls the
engine thread's puts for longer than a dict update.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from pdkv.layout import KVLayout
from pdkv.tier.base import LeafTier
from pdkv.tier.policy import EvictionPolicy, make_policy


class MemoryTier(LeafTier):
    def __init__(self, layout: KVLayout, capacity_bytes: int, policy: str = "lru", name: str = "memory") -> None:
        super().__init__(layout, name, capacity_bytes)
        self._policy: EvictionPolicy = make_policy(policy, capacity_bytes)
        self._chunks: dict[bytes, torch.Tensor] = {}
        self._lock = threading.Lock()

    def has(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [k in self._chunks for k in keys]

    def _get(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor]) -> int:
        found: list[torch.Tensor] = []
        with self._lock:
            for key, out in zip(keys, outs, strict=True):
                chunk = self._chunks.get(key)
                if chunk is None or chunk.shape != out.shape:
                    break
                self._policy.touch(key)
                found.append(chunk)
        for chunk, out in zip(found, outs, strict=False):
            out.copy_(chunk)  # an evicted chunk stays alive while we hold it
        return len(found)

    def _put(self, keys: Sequence[bytes], chunks: Sequence[torch.Tensor], parents: Sequence[bytes | None]) -> None:
        written = evicted = 0
        with self._lock:
            for key, chunk, parent in zip(keys, chunks, parents, strict=True):
                if key in self._chunks:
                    continue
                nbytes = chunk.numel() * chunk.element_size()
                victims = self._policy.admit(key, nbytes, parent)
                if victims is None:  # larger than the whole tier
                    continue
                for victim in victims:
                    del self._chunks[victim]
                self._chunks[key] = chunk
                written += nbytes
                evicted += len(victims)
        self._count(written_bytes=written, evictions=evicted)

    def remove(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            removed = [k for k in keys if self._chunks.pop(k, None) is not None]
            for key in removed:
                self._policy.discard(key)
        return len(removed)

    def _resident(self) -> tuple[int | None, int | None]:
        with self._lock:
            return len(self._policy), self._policy.used
