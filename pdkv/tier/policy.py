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
* ``prefix``: leaves first over the prefix tree of chained keys, recency
  stretched by reuse (``PrefixAware``). A chunk is only worth its bytes while
  every chunk before it is cached too (a lookup stops at the first miss), so
  a parent never leaves before its cached children; and a chunk read by many
  prompts (a shared system prompt, a conversation several turns deep) stays
  longer than one read once.

``admit`` takes the key's parent (the key of the chunk before it in its
prompt, None for a first chunk or when unknown); only ``prefix`` uses it.
"""

from __future__ import annotations

import abc
import heapq
import math
from collections import OrderedDict
from typing import Literal

from pdkv.errors import ConfigError

PolicyName = Literal["lru", "s3fifo", "prefix"]
POLICIES: tuple[PolicyName, ...] = ("lru", "s3fifo", "prefix")


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

    def admit(self, key: bytes, nbytes: int, parent: bytes | None = None) -> list[bytes] | None:
        """Add ``key`` (not present) whose prompt's previous chunk is ``parent``; return the keys evicted to
        make room, or None (nothing changed) when it can never fit."""
        if nbytes > self.capacity:
            return None
        victims = []
        while self.used + nbytes > self.capacity:
            victims.append(self._evict())
        self._insert(key, nbytes, parent)
        self.used += nbytes
        return victims

    @abc.abstractmethod
    def touch(self, key: bytes) -> None:
        """``key`` (present) was read."""

    @abc.abstractmethod
    def discard(self, key: bytes) -> None:
        """Forget ``key`` if present (removed by the tier, not evicted)."""

    @abc.abstractmethod
    def _insert(self, key: bytes, nbytes: int, parent: bytes | None) -> None: ...

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

    def _insert(self, key: bytes, nbytes: int, parent: bytes | None) -> None:
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

    def _insert(self, key: bytes, nbytes: int, parent: bytes | None) -> None:
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


class PrefixAware(EvictionPolicy):
    """Evict the leaf of the prefix tree with the lowest ``last access + stretch * log2(uses)``.

    Why leaves: a cached chunk whose parent is gone can serve no lookup (they
    stop at the first miss), so evicting a parent before its children wastes
    the children's bytes too. The tree is built from the parents given to
    ``admit``; a key admitted without one (the first chunk of a prompt, or a
    caller that does not know), or whose parent is no longer cached, is a
    root. Each leaf is in a heap keyed by its priority: a read of a chunk
    with cached children is O(1), of a leaf O(log n); an admission or an
    eviction is O(log n), the evicted leaf's parent entering the heap in the
    same step when it became a leaf. Nothing walks the tree, so a request of
    c chunks costs O(c log n) whatever the depth of its prompt. The state is
    flat dicts of bytes and numbers, which Python's garbage collector never
    scans: a cache of millions of chunks adds nothing to a worker's GC pauses.

    Why the stretch: on a prefix workload a chunk's reads are a prompt's
    reads, so ``uses`` (stores plus reads) counts how many prompts ran
    through it: a shared system prompt or an early turn of a long
    conversation has many, a one-off prompt's tail has one. A key evicted
    recently is remembered in a ghost list (``GHOST_FACTOR`` times the
    resident count; its uses and last access, no value) so a prefix stored
    again soon after eviction comes back with its count. The stretch is
    learned, not configured: the ``STRETCH_QUANTILE`` of the reuse gaps this
    cache has seen (reads and ghost returns, on a clock of chunk accesses,
    in a log-scale histogram halved each time it has taken in as many gaps
    as the cache holds chunks). A chunk used twice thus outlives one used
    once by about one typical reuse gap, four uses by two, whatever the
    workload's pace. Until the first gaps are counted the stretch is zero:
    leaves-first LRU.

    Forced removals (``discard``: ``remove`` on the tier, a damaged disk
    file) are the one way a parent leaves before its children: the key is
    detached, its children stay cached and linked to it (unreachable by
    lookups), and when the key is stored again it takes them back; a
    detached key is forgotten with its last child.
    """

    GHOST_FACTOR = 4
    STRETCH_QUANTILE = 0.75
    _REFRESH = 1024  # gap samples between two computations of the stretch, once warmed up (first at 64, 128, 256, 512)
    _LOG2 = [0.0, *(math.log2(n) for n in range(1, 64))]  # log2 of small use counts, looked up

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self._size: dict[bytes, int] = {}  # the cached keys
        self._parent: dict[bytes, bytes] = {}  # cached or detached key -> the key it is linked under
        self._children: dict[
            bytes, int
        ] = {}  # cached or detached key -> how many keys are linked under it (absent: none)
        self._uses: dict[bytes, int] = {}  # cached or detached key -> stores and reads
        self._last: dict[bytes, int] = {}  # cached or detached key -> clock of its last store or read
        self._priority: dict[bytes, float] = {}  # cached key -> its rank: the lowest leaf goes first
        self._detached: set[bytes] = set()  # removed by the tier with children still cached
        self._leaves: list[tuple[float, bytes]] = []  # heap with stale entries, skipped when popped
        self._ghost: OrderedDict[bytes, tuple[int, int]] = OrderedDict()  # evicted key -> (uses, last access)
        self._clock = 0
        self._gaps = [0.0] * 256  # gap histogram: 4 buckets per doubling, [2^o * (1 + q/4), 2^o * (1 + (q+1)/4)) - 1
        self._samples = 0
        self._next_refresh = 64
        self._since_decay = 0
        self.stretch = 0.0

    def __contains__(self, key: bytes) -> bool:
        return key in self._size

    def __len__(self) -> int:
        return len(self._size)

    def touch(self, key: bytes) -> None:
        self._clock += 1
        self._sample(self._clock - self._last[key])
        self._uses[key] += 1
        self._last[key] = self._clock
        self._rank(key)

    def discard(self, key: bytes) -> None:
        nbytes = self._size.pop(key, None)
        if nbytes is None:
            return
        self.used -= nbytes
        del self._priority[key]
        if key in self._children:
            self._detached.add(key)
        else:
            self._forget(key)

    def _insert(self, key: bytes, nbytes: int, parent: bytes | None) -> None:
        self._clock += 1
        if key in self._detached:  # stored again: it keeps its place in the tree and its count
            self._detached.remove(key)
            self._uses[key] += 1
        else:
            if parent is not None and (parent in self._size or parent in self._detached):
                self._parent[key] = parent
                self._children[parent] = self._children.get(parent, 0) + 1
            uses, seen = self._ghost.pop(key, (0, 0))
            if seen:
                self._sample(self._clock - seen)
            self._uses[key] = uses + 1
        self._size[key] = nbytes
        self._last[key] = self._clock
        self._rank(key)

    def _evict(self) -> bytes:
        while True:  # ends: a non-empty forest has a leaf, and every leaf has a current heap entry
            priority, key = heapq.heappop(self._leaves)
            if key in self._size and key not in self._children and self._priority[key] == priority:
                break
        self.used -= self._size.pop(key)
        del self._priority[key]
        self._ghost[key] = (self._uses[key], self._last[key])
        while len(self._ghost) > self.GHOST_FACTOR * max(len(self._size), 1):
            self._ghost.popitem(last=False)
        self._forget(key)
        return key

    def _rank(self, key: bytes) -> None:
        """Set ``key``'s priority; a leaf enters the heap with it (its older entries go stale)."""
        uses = self._uses[key]
        priority = self._priority[key] = self._last[key] + self.stretch * (
            self._LOG2[uses] if uses < 64 else math.log2(uses)
        )
        if key not in self._children:
            heapq.heappush(self._leaves, (priority, key))
            if len(self._leaves) > 2 * len(self._size) + 64:  # drop stale entries; amortized O(1)
                self._leaves = [(self._priority[k], k) for k in self._size if k not in self._children]
                heapq.heapify(self._leaves)

    def _forget(self, key: bytes) -> None:
        """``key`` left the tree childless: its parent may become a leaf; a detached parent left childless goes too."""
        del self._uses[key], self._last[key]
        parent = self._parent.pop(key, None)
        while parent is not None:
            left = self._children[parent] - 1
            if left:
                self._children[parent] = left
                return
            del self._children[parent]
            if parent in self._size:
                heapq.heappush(self._leaves, (self._priority[parent], parent))
                return
            self._detached.remove(parent)
            del self._uses[parent], self._last[parent]
            parent = self._parent.pop(parent, None)

    def _sample(self, gap: int) -> None:
        """Count one reuse gap; now and then recompute the stretch, and halve the history once it covers the cache."""
        g = gap + 1
        octave = g.bit_length() - 1
        bucket = 4 * octave + (((g << 2) >> octave) & 3)
        self._gaps[bucket if bucket < 256 else 255] += 1
        self._samples += 1
        self._since_decay += 1
        if self._samples == self._next_refresh:
            self._next_refresh += min(self._samples, self._REFRESH)
            target, seen = self.STRETCH_QUANTILE * sum(self._gaps), 0.0
            for bucket, count in enumerate(self._gaps):
                seen += count
                if seen >= target:
                    self.stretch = (1 << (bucket >> 2)) * (1 + (bucket & 3) / 4) - 1
                    break
        if self._since_decay >= max(len(self._size), self._REFRESH):
            self._gaps = [count / 2 for count in self._gaps]
            self._since_decay = 0


def make_policy(name: str, capacity_bytes: int) -> EvictionPolicy:
    """The policy called ``name`` (``lru``, ``s3fifo`` or ``prefix``) bounded to ``capacity_bytes``."""
    if name == "lru":
        return LRU(capacity_bytes)
    if name == "s3fifo":
        return S3FIFO(capacity_bytes)
    if name == "prefix":
        return PrefixAware(capacity_bytes)
    raise ConfigError(f"unknown eviction policy {name!r}; expected one of {', '.join(POLICIES)}")
