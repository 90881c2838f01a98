"""Levels composed into one cache: read down, promote up, write behind.

Reads try each level in order (memory, disk, remote) at the first chunk not
yet served and take the longest run the level has; what a lower level
served is copied into the levels above it, so the next read is a memory hit.
Writes go to the memory level at once (it keeps the tensors: no copy) and to
the levels below through one bounded write-behind queue and its thread, so
prefill never waits on a disk or a network. When the queue holds
``write_behind_bytes`` a new write is dropped and counted, never waited for:
a cache that misses a chunk costs a recompute later, a prefill that blocks
costs every request now.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from collections.abc import Sequence

import torch

from pdkv.errors import ConfigError
from pdkv.tier.base import CacheTier, LeafTier, Parents, TierStats, leading
from pdkv.tier.memory import MemoryTier

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Write:
    levels: list[CacheTier]
    keys: list[bytes]
    chunks: list[torch.Tensor]
    parents: list[bytes | None]
    nbytes: int


class TieredCache(CacheTier):
    """``levels`` fastest first; a leading ``MemoryTier`` is written synchronously, the rest behind."""

    def __init__(
        self, levels: Sequence[CacheTier], write_behind_bytes: int = 256 << 20, flush_timeout_s: float = 10.0
    ) -> None:
        if not levels:
            raise ConfigError("a tiered cache needs at least one level (memory, disk or redis)")
        self.levels = list(levels)
        self._sync = self.levels[0] if isinstance(self.levels[0], MemoryTier) else None
        # checks every call's arguments up front, so a malformed write fails its caller, not the writer thread
        self._checker = next((level for level in self.levels if isinstance(level, LeafTier)), None)
        self.write_behind_bytes = write_behind_bytes
        self.flush_timeout_s = flush_timeout_s
        self.pending_bytes = 0
        self.dropped_chunks = 0
        self._queue: collections.deque[_Write] = collections.deque()
        self._busy = False
        self._closing = False
        self._cond = threading.Condition()
        self._writer = threading.Thread(target=self._write_behind, name="pdkv-tier-writer", daemon=True)
        self._writer.start()

    def has(self, keys: Sequence[bytes]) -> list[bool]:
        held = [False] * len(keys)
        for level in self.levels:
            missing = [i for i, h in enumerate(held) if not h]
            if not missing:
                break
            for i, h in zip(missing, level.has([keys[i] for i in missing]), strict=True):
                held[i] = h
        return held

    def has_local(self, keys: Sequence[bytes]) -> list[bool]:
        held = [False] * len(keys)
        for level in self.levels:
            held = [a or b for a, b in zip(held, level.has_local(keys), strict=True)]
        return held

    def get(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor], parent: bytes | None = None) -> int:
        if self._checker is not None:
            self._checker.check(keys, outs, "get buffer")
        pos, skip = 0, -1  # ``skip`` already missed at ``pos``: its miss is counted, do not ask it again
        while pos < len(keys):
            for index, level in enumerate(self.levels):
                if index == skip:
                    continue
                # a lower level is asked only up to the next chunk a level above it holds
                stop = pos + 1 + leading([not h for h in self._held_above(index, keys[pos + 1 :])])
                got = level.get(keys[pos:stop], outs[pos:stop])
                if got:
                    self._promote(index, keys, pos, outs[pos : pos + got], parent)
                    pos, skip = pos + got, (index if got < stop - pos else -1)
                    break
            else:
                break
        return pos

    def put(self, keys: Sequence[bytes], chunks: Sequence[torch.Tensor], parents: Parents = None) -> None:
        if self._checker is not None:
            self._checker.check(keys, chunks, "chunk to store")
        below = self.levels
        parents = [None] * len(keys) if parents is None else parents
        if self._sync is not None:
            fresh = [
                i for i, held in enumerate(self._sync.has(keys)) if not held
            ]  # held ones were written behind before
            keys, chunks, parents = [keys[i] for i in fresh], [chunks[i] for i in fresh], [parents[i] for i in fresh]
            self._sync.put(keys, chunks, parents)
            below = self.levels[1:]
        self._enqueue(below, list(keys), list(chunks), list(parents))

    def remove(self, keys: Sequence[bytes]) -> int:
        """Drop the keys from every level; returns the most any one level held."""
        return max(level.remove(keys) for level in self.levels)

    def stats(self) -> dict[str, TierStats]:
        merged: dict[str, TierStats] = {}
        for level in self.levels:
            merged.update(level.stats())
        return merged

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write reached its levels; False if ``timeout`` (default ``flush_timeout_s``)
        ran out first."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not self._queue and not self._busy, self.flush_timeout_s if timeout is None else timeout
            )

    def close(self) -> None:
        """Finish queued writes (up to ``flush_timeout_s``; the rest are dropped), stop the writer, close every
        level."""
        if not self.flush():
            log.warning(
                "tier: %d bytes of queued writes not written within %.0fs; dropped",
                self.pending_bytes,
                self.flush_timeout_s,
            )
        with self._cond:
            self._closing = True
            self._queue.clear()
            self._cond.notify_all()
        self._writer.join(self.flush_timeout_s)
        for level in self.levels:
            level.close()

    # -- internals ------------------------------------------------------------------
    def _held_above(self, index: int, keys: Sequence[bytes]) -> list[bool]:
        """Whether any level faster than ``levels[index]`` holds each key (local levels: no round trip)."""
        held = [False] * len(keys)
        for level in self.levels[:index]:
            held = [a or b for a, b in zip(held, level.has(keys), strict=True)]
        return held

    def _promote(
        self, served_by: int, keys: Sequence[bytes], pos: int, outs: Sequence[torch.Tensor], parent: bytes | None
    ) -> None:
        """Copy the chunks a lower level served for ``keys[pos:]`` into the levels above it (the caller keeps ``outs``),
        each under the key before it (``parent`` before ``keys[0]``)."""
        if served_by == 0:
            return
        copies = [o.clone() for o in outs]
        served = list(keys[pos : pos + len(outs)])
        parents = [keys[pos - 1] if pos else parent, *served[:-1]]
        above = self.levels[:served_by]
        if above[0] is self._sync:
            self._sync.put(served, copies, parents)
            above = above[1:]
        self._enqueue(above, served, copies, parents)

    def _enqueue(
        self, levels: list[CacheTier], keys: list[bytes], chunks: list[torch.Tensor], parents: list[bytes | None]
    ) -> None:
        if not levels or not keys:
            return
        nbytes = sum(c.numel() * c.element_size() for c in chunks)
        with self._cond:
            if self._closing or self.pending_bytes + nbytes > self.write_behind_bytes:
                self.dropped_chunks += len(keys)
                return
            self._queue.append(_Write(levels, keys, chunks, parents, nbytes))
            self.pending_bytes += nbytes
            self._cond.notify_all()

    def _write_behind(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closing)
                if self._closing:
                    return
                write = self._queue.popleft()
                self._busy = True
            try:
                for level in write.levels:
                    level.put(write.keys, write.chunks, write.parents)
            except Exception:  # a bug in one level must not stop every later write
                log.exception("tier: a write-behind put failed")
            finally:
                with self._cond:
                    self.pending_bytes -= write.nbytes
                    self._busy = False
                    self._cond.notify_all()
