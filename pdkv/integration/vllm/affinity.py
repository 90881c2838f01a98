"""Keep pdkv's threads off the core vLLM pins its forward pass to.

vLLM's CPU worker binds its OpenMP threads one per core, the worker's main
thread included, and Linux threads inherit the affinity of the thread that
creates them. Threads the connector started from vLLM's main thread (the
receiver, the sender, the channel's I/O, the loaders) would all share that
one core with the forward pass and with every other vLLM worker pinned to
it: on a small machine the receiver then answered a handshake or a
reservation only after 5-10 s and transfers timed out. Our threads are
instead created with every CPU the process may use, as vLLM's own
NixlConnector moves its transfer work off the compute cores.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

log = logging.getLogger(__name__)


def _every_cpu() -> set[int]:
    # The kernel intersects a mask with the process's cpuset, so naming every CPU is safe inside a container.
    return set(range(os.cpu_count() or 1))


def unpin_current_thread() -> None:
    """Let the calling thread run on any CPU (a thread pool's initializer)."""
    if not hasattr(os, "sched_setaffinity"):
        return
    try:
        os.sched_setaffinity(0, _every_cpu())
    except OSError as exc:
        log.debug("cannot widen this thread's CPU affinity: %s", exc)


@contextlib.contextmanager
def unpinned() -> Iterator[None]:
    """Threads started inside run on any CPU; the calling thread gets its own affinity back after."""
    if not hasattr(os, "sched_getaffinity"):
        yield
        return
    mine = os.sched_getaffinity(0)
    unpin_current_thread()
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, mine)
