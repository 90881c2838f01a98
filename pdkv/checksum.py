"""Chunk checksums: xxh3-64 over the bytes that moved, in wire order.

Both sides hash the same byte ranges in the same order, so a chunk that
landed corrupted, truncated or in the wrong blocks fails verification.
"""

from __future__ import annotations

from collections.abc import Iterable

import xxhash


def checksum(views: Iterable[memoryview]) -> int:
    h = xxhash.xxh3_64()
    for v in views:
        h.update(v)
    return h.intdigest()
