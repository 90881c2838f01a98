"""An exclusive lock on a file, held across processes (flock).

P and D often start together and both want to build the same cache entry
(the default model's conversion, the native extension). flock is released by
the kernel when a process dies, so a killed build never leaves a stale lock.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """Hold an exclusive flock on ``path`` (created if missing) for the ``with`` body."""
    import fcntl  # POSIX only: elsewhere the ImportError reaches the caller, which treats it as a failed build

    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
