"""Byte-bounded eviction policies: which keys to drop to make room.

A policy holds only keys and sizes; the tier that uses it holds the values
and does the dropping, so one policy serves memory and disk alike.

* ``lru``: least recently used first. The right default for prefix reuse,
  where a hot system prompt is read by every request.
* ``s3fifo``: S3-FIFO (Yang et al., SOSP'23). New keys enter a small FIFO
  (10% of the bytes); a key read again while there moves to the main FIFO
  on its way out, the others are evicted and remembered in a ghost list, so a
  key that comes back soon goes straight to main. Main is a FIFO with
  reinsertion (up to 3 reads). One long prompt that is never reused (a scan)
  can then evict only other newcomers, never the shared prefixes in main,
  which LRU would flush.
"""

from __future__ import annotations

import abc
from collections import OrderedDict
from typing import Literal

from pdkv.errors import ConfigError

PolicyName = Literal["lru", "s3fifo"]
POLICIES: tuple[PolicyName, ...] = ("lru", "s3fifo")


class EvictionPolicy(abc.ABC):
    """Tracks keys and their sizes under a byte bound. Not thread-safe: the tier locks around it."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ConfigError(f"a cache tier's capacity must be a positive number of bytes, got {capacity_bytes!r}")
        self.capacity = capacity_bytes
        self.used = 0

    @abc.abstractmethod
    def __contains__(self, key: bytes) -> bool: ...

    @abc.abstractmethod
    def __len__(self) -> int: ...

    def admit(self, key: bytes, nbytes: int) -> list[bytes] | None:
        """Add ``key`` (not present); return the keys evicted to make room, or None (nothing changed) when it can never fit."""
        if nbytes > self.capacity:
            return None
        victims = []
        while self.used + nbytes > self.capacity:
            victims.append(self._evict())
        self._insert(key, nbytes)
        self.used += nbytes
        return victims

    @abc.abstractmethod
    def touch(self, key: bytes) -> None:
        """``key`` (present) was read."""

    @abc.abstractmethod
    def discard(self, key: bytes) -> None:
        """Forget ``key`` if present (removed by the tier, not evicted)."""

    @abc.abstractmethod
    def _insert(self, key: bytes, nbytes: int) -> None: ...

    @abc.abstractmethod
    def _evict(self) -> bytes:
        """Drop one key (the policy's choice), update ``used``, return it."""


class LRU(EvictionPolicy):
    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self._order: OrderedDict[bytes, int] = OrderedDict()  # oldest first

    def __contains__(self, key: bytes) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)

    def touch(self, key: bytes) -> None:
        self._order.move_to_end(key)

    def discard(self, key: bytes) -> None:
        self.used -= self._order.pop(key, 0)

    def _insert(self, key: bytes, nbytes: int) -> None:
        self._order[key] = nbytes

    def _evict(self) -> bytes:
        key, nbytes = self._order.popitem(last=False)
        self.used -= nbytes
        return key


class S3FIFO(EvictionPolicy):
    SMALL_SHARE = 0.1
    MAX_FREQ = 3

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self._small: OrderedDict[bytes, int] = OrderedDict()  # FIFO, oldest first
        self._main: OrderedDict[bytes, int] = OrderedDict()
        self._small_bytes = 0
        self._freq: dict[bytes, int] = {}
        self._ghost: OrderedDict[bytes, None] = OrderedDict()  # recently evicted from small; keys only

    def __contains__(self, key: bytes) -> bool:
        return key in self._freq

    def __len__(self) -> int:
        return len(self._freq)

    def touch(self, key: bytes) -> None:
        self._freq[key] = min(self._freq[key] + 1, self.MAX_FREQ)

    def discard(self, key: bytes) -> None:
        if key not in self._freq:
            return
        del self._freq[key]
        if key in self._small:
            nbytes = self._small.pop(key)
            self._small_bytes -= nbytes
        else:
            nbytes = self._main.pop(key)
        self.used -= nbytes

    def _insert(self, key: bytes, nbytes: int) -> None:
        self._freq[key] = 0
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = nbytes
        else:
            self._small[key] = nbytes
            self._small_bytes += nbytes

    def _evict(self) -> bytes:
        if self._small and (self._small_bytes >= self.SMALL_SHARE * self.capacity or not self._main):
            victim = self._evict_small()
            if victim is not None:
                return victim
        return self._evict_main()

    def _evict_small(self) -> bytes | None:
        """Move read-again keys to main; evict the first one never read again (None if all moved)."""
        while self._small:
            key, nbytes = self._small.popitem(last=False)
            self._small_bytes -= nbytes
            if self._freq[key] > 0:
                self._freq[key] = 0
                self._main[key] = nbytes
                continue
            del self._freq[key]
            self.used -= nbytes
            self._ghost[key] = None
            while len(self._ghost) > max(len(self._freq), 1):
                self._ghost.popitem(last=False)
            return key
        return None

    def _evict_main(self) -> bytes:
        while True:  # ends: each pass over a key lowers its frequency
            key, nbytes = self._main.popitem(last=False)
            if self._freq[key] > 0:
                self._freq[key] -= 1
                self._main[key] = nbytes
                continue
            del self._freq[key]
            self.used -= nbytes
            return key


def make_policy(name: str, capacity_bytes: int) -> EvictionPolicy:
    """The policy called ``name`` (``lru`` or ``s3fifo``) bounded to ``capacity_bytes``."""
    if name == "lru":
        return LRU(capacity_bytes)
    if name == "s3fifo":
        return S3FIFO(capacity_bytes)
    raise ConfigError(f"unknown eviction policy {name!r}; expected one of {', '.join(POLICIES)}")
