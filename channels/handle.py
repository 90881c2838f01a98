"""What a posted transfer is: its byte ranges (``TransferOp``), its handle, and the notification that follows it."""

from __future__ import annotations

import enum
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from pdkv.errors import ChannelError

log = logging.getLogger(__name__)


# Tables at least this long find their runs with numpy: below it numpy's fixed cost (about 10 us a call here) is more
# than a Python pass (about 0.07 us a block); at 1024 blocks numpy took 62 us and Python 94.
NUMPY_FROM_BLOCKS = 512


def _id_bounds(ids: np.ndarray) -> tuple[int, int]:
    """The lowest and highest of ``ids`` ((0, -1) if none): a short array's in Python, which two numpy reductions of
    about 10 us each cost on a request's path here (``NUMPY_FROM_BLOCKS``)."""
    if not len(ids):
        return 0, -1
    if len(ids) < NUMPY_FROM_BLOCKS:
        listed = ids.tolist()
        return min(listed), max(listed)
    return int(ids.min()), int(ids.max())


def run_starts(ours: list[int], theirs: list[int]) -> list[int]:
    """Indices (past 0) where a run starts: our id or theirs does not step by one from the previous block."""
    if len(ours) < NUMPY_FROM_BLOCKS:
        return [i for i in range(1, len(ours)) if ours[i] != ours[i - 1] + 1 or theirs[i] != theirs[i - 1] + 1]
    a, b = np.asarray(ours, dtype=np.int64), np.asarray(theirs, dtype=np.int64)
    starts: list[int] = (np.flatnonzero((np.diff(a) != 1) | (np.diff(b) != 1)) + 1).tolist()
    return starts


class TransferOp(NamedTuple):
    """One contiguous byte range: ``length`` bytes between a local and a remote region."""

    local_region: int
    local_offset: int
    remote_region: int
    remote_offset: int
    length: int


def merge_ops(ops: Sequence[TransferOp]) -> list[TransferOp]:
    """Coalesce ops whose local and remote ranges both continue the previous one.

    Adjacent blocks on both sides become one descriptor: per-block descriptors
    cost vLLM's NIXL path twice the TTFT.
    """
    merged: list[TransferOp] = []
    for op in ops:
        if merged:
            last = merged[-1]
            if (
                op.local_region == last.local_region
                and op.remote_region == last.remote_region
                and op.local_offset == last.local_offset + last.length
                and op.remote_offset == last.remote_offset + last.length
            ):
                merged[-1] = last._replace(length=last.length + op.length)
                continue
        merged.append(op)
    return merged


@dataclass(frozen=True)
class BlockWrite:
    """Whole blocks of several regions gridded alike, as arrays: for every tensor ``t`` and every ``i``, block
    ``local_blocks[i]`` of ``local_regions[t]`` goes to block ``remote_blocks[i]`` of ``remote_regions[t]``.

    A direct-mode chunk is this: the same blocks of each of a KV buffer's ~30 tensors. Handed to a channel whole
    (``Channel.write_blocks``), it is checked on its ids' bounds and posted as index arrays (nixl), where the same
    write as ``TransferOp``s costs a Python pass per op per check; ``ops`` is that write for the channels that take
    ops.
    """

    local_regions: tuple[int, ...]
    remote_regions: tuple[int, ...]
    local_blocks: np.ndarray  # integers, one id per block moved; fixed once the write is made (see bounds)
    remote_blocks: np.ndarray  # integers, as long as local_blocks
    block_bytes: int
    # each array's (lowest, highest) id, worked out as the write is made (a plan makes a request's at open), so that
    # checking it as it is posted reads no array: a NumPy call on a small array costs ~5 us right after I/O
    bounds: tuple[tuple[int, int], tuple[int, int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        """Refuse a malformed write when it is made, so every channel may take its shape as given; the regions as
        tuples (a channel keys what it worked out for them by them)."""
        object.__setattr__(self, "local_regions", tuple(self.local_regions))
        object.__setattr__(self, "remote_regions", tuple(self.remote_regions))
        arrays = (self.local_blocks, self.remote_blocks)
        if (
            len(self.local_regions) != len(self.remote_regions)
            or any(a.ndim != 1 or a.dtype.kind not in "iu" for a in arrays)
            or len(self.local_blocks) != len(self.remote_blocks)
            or self.block_bytes <= 0
        ):
            raise ChannelError(
                f"a block write needs as many remote regions as local ({len(self.remote_regions)} vs "
                f"{len(self.local_regions)}), two 1-D integer arrays of block ids of one length (shapes "
                f"{[a.shape for a in arrays]}, dtypes {[str(a.dtype) for a in arrays]}) and block_bytes > 0 "
                f"(got {self.block_bytes})"
            )
        for name, a in zip(("local_blocks", "remote_blocks"), arrays, strict=True):
            view = a.view()  # read-only through this write; the caller must not change the ids under it either
            view.flags.writeable = False
            object.__setattr__(self, name, view)
        object.__setattr__(self, "bounds", (_id_bounds(self.local_blocks), _id_bounds(self.remote_blocks)))

    @property
    def nbytes(self) -> int:
        return len(self.local_regions) * len(self.local_blocks) * self.block_bytes

    def runs(self) -> list[tuple[int, int, int]]:
        """Each run of blocks adjacent on both sides: (our first block, their first block, count)."""
        ours, theirs = self.local_blocks.tolist(), self.remote_blocks.tolist()
        if not ours:
            return []
        starts = [0, *run_starts(ours, theirs)]
        ends = [*starts[1:], len(ours)]
        return [(ours[s], theirs[s], e - s) for s, e in zip(starts, ends, strict=True)]

    def ops(self) -> list[TransferOp]:
        """The same write as ops, tensor by tensor and run by run (adjacent blocks merged): the wire order."""
        size = self.block_bytes
        runs = [(a * size, b * size, n * size) for a, b, n in self.runs()]
        return [
            TransferOp(here, a, there, b, n)
            for here, there in zip(self.local_regions, self.remote_regions, strict=True)
            for a, b, n in runs
        ]


class Notification(NamedTuple):
    """A notification delivered after its transfer's payload landed."""

    peer: str
    payload: bytes


class XferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    ERROR = "error"


class TransferHandle:
    """The state of one posted WRITE or READ.

    Channels complete or fail it from whatever thread does their I/O;
    ``Channel.wait`` blocks on it with a timeout.
    """

    _ids = itertools.count(1)

    def __init__(self, peer: str, op: str, nbytes: int) -> None:
        self.id = next(self._ids)
        self.peer = peer
        self.op = op
        self.nbytes = nbytes
        self.state = XferState.PENDING
        self.error: str | None = None
        self.posted_at = time.monotonic()
        # Given up on while the channel could not tell whether its bytes will still land (nixl: a peer forgotten
        # with the request in flight, whose bytes may sit in a socket until a link comes back).
        self.may_still_land = False
        # What the peer answered about the notification, with the completion, where the channel carries answers
        # (``Channel.answer_notifications``): set before the handle completes, so its done callbacks read it.
        self.answer = b""
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[TransferHandle], None]] = []

    def add_done_callback(self, fn: Callable[[TransferHandle], None]) -> None:
        """Call ``fn(self)`` once the handle finishes, on the thread that finishes it (now, if it has).

        ``fn`` must be quick and must not call back into the channel: it may
        run on the channel's I/O thread, or under the channel's lock. A write
        the peer answered (``answer`` set) completes holding none of the
        channel's locks, so its callback may ``release`` the handle
        (``pdkv.transfer.completion`` applies the verdict there).
        """
        with self._lock:
            if self.state is XferState.PENDING:
                self._callbacks.append(fn)
                return
        fn(self)

    def sleep(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the handle to finish; whether it has."""
        return self._event.wait(timeout)

    def complete(self) -> bool:
        """Mark done; returns False if the handle had already finished (first outcome wins)."""
        return self._finish(XferState.DONE, None)

    def fail(self, error: str) -> bool:
        """Mark failed with a message a user can act on; first outcome wins."""
        return self._finish(XferState.ERROR, error)

    def abandon(self, error: str) -> bool:
        """Fail a write whose bytes may still land in the peer's memory later (see ``may_still_land``)."""
        self.may_still_land = True
        return self.fail(error)

    def _finish(self, state: XferState, error: str | None) -> bool:
        with self._lock:
            if self.state is not XferState.PENDING:
                return False
            self.state, self.error = state, error
            callbacks, self._callbacks = self._callbacks, []
        self._event.set()
        for fn in callbacks:
            try:
                fn(self)
            except Exception:  # a caller's bug must not kill the channel's I/O thread
                log.exception("done callback of %r failed", self)
        return True

    def __repr__(self) -> str:
        return f"TransferHandle(id={self.id}, {self.op} {self.nbytes}B to {self.peer!r}, {self.state.value})"
