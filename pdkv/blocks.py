"""Block allocator for a paged KV buffer.

All-or-nothing allocation (a request gets every block it needs or none, so
two requests can never deadlock each other half-allocated) and exactly-once
free (freeing a block twice is a bug that would let two requests share KV,
so it raises instead of corrupting the free list).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from pdkv.errors import LayoutError, OutOfBlocksError


class BlockAllocator:
    """Thread-safe free list over block ids ``[0, num_blocks)``."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise LayoutError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._used: set[int] = set()
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free)

    @property
    def num_used(self) -> int:
        with self._lock:
            return len(self._used)

    def allocate(self, n: int) -> list[int]:
        """``n`` block ids, or ``OutOfBlocksError`` with nothing taken."""
        if n < 0:
            raise LayoutError(f"cannot allocate a negative number of blocks ({n})")
        with self._lock:
            if n > len(self._free):
                raise OutOfBlocksError(f"need {n} KV blocks, only {len(self._free)} of {self.num_blocks} free")
            taken = [self._free.pop() for _ in range(n)]
            self._used.update(taken)
        return taken

    def held_for(self, transfer_id: str) -> int:
        """The leading tokens of ``transfer_id``'s prompt this side already holds (none here): the sender pushes only
        the rest. An allocator over a prefix cache (the vLLM connector's) says its local hit."""
        return 0

    def allocate_for(self, transfer_id: str, n: int, held: int = 0) -> list[int]:
        """The blocks a receiver grants ``transfer_id`` past the ``held`` tokens (``held_for``'s answer, asked
        first): any ``n`` free ones here; an allocator that knows which blocks each transfer must land in (the vLLM
        connector's, over vLLM's own cache) overrides it."""
        return self.allocate(n)

    def free(self, blocks: Iterable[int]) -> None:
        """Return blocks; raises ``LayoutError`` (freeing none) on a double free or unknown id."""
        blocks = list(blocks)
        with self._lock:
            bad = [b for b in blocks if b not in self._used]
            if bad or len(set(blocks)) != len(blocks):
                raise LayoutError(f"free of blocks not in use (double free?): {bad or blocks}")
            self._used.difference_update(blocks)
            self._free.extend(reversed(blocks))
