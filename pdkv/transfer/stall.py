"""When a posted write counts as stalled: ``transfer.stall_timeout_s``, or a bound derived from the link.

A channel's write may neither complete nor fail: a NIXL transfer whose peer froze stays in progress for ever
(NIXL itself added a stall timeout for it, and SGLang users waited 300 s for a failure nothing announced), and
the same holds for the ucx channel's wait for its ACK. While such a write is pending its transfer cannot settle,
so its send credit, the prefill blocks it reads and the decode blocks it writes stay held. The sender therefore
gives up on every write past its bound (``StallWatch.check_timeout``): the handle is abandoned (its bytes may still
land), and the receiver quarantines the blocks as it does any write that may still land.

The bound is the sender's policy, the same for every channel. ``stall_timeout_s`` set: that many seconds. Unset
(the default): what the bytes need at the slowest rate this sender's writes were seen to move, times
``stall_multiple``, and never less than ``stall_floor_s``. "The bytes" are those in flight when the write was
posted, itself included: a write waits behind the ones posted before it. "Seen" is over the last
``RATE_WINDOW`` completed writes, so one write slowed by a passing hiccup does not stretch the bound for good.
Before any write completed, the floor alone is the bound.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Protocol

from pdkv.channels.handle import TransferHandle, XferState
from pdkv.config import TransferConfig
from pdkv.errors import TransferError, TransferTimeout
from pdkv.transfer.parts import SenderParts
from pdkv.transfer.peers import ReceiverPeer

RATE_WINDOW = 256  # completed writes whose rates the slowest is taken over


class StallBound:
    """The stall bound of a write, from the rates of the sender's completed writes (thread-safe)."""

    def __init__(self, config: TransferConfig) -> None:
        self.config = config
        self._rates: collections.deque[float] = collections.deque(maxlen=RATE_WINDOW)
        self._lock = threading.Lock()

    def observe(self, need: int, seconds: float) -> None:
        """A write completed: ``need`` bytes (those in flight when it was posted) moved in ``seconds``."""
        if need > 0 and seconds > 0:
            with self._lock:
                self._rates.append(need / seconds)

    def slowest_rate(self) -> float | None:
        """Bytes per second of the slowest write in the window; None before any completed."""
        with self._lock:
            return min(self._rates) if self._rates else None

    def limit(self, need: int) -> float:
        """Seconds a write may stay pending when ``need`` bytes were in flight at its post (itself included)."""
        cfg = self.config
        if cfg.stall_timeout_s is not None:
            return cfg.stall_timeout_s
        rate = self.slowest_rate()
        derived = cfg.stall_multiple * need / rate if rate else 0.0
        return max(cfg.stall_floor_s, derived)

    def describe(self) -> str:
        """Where the bound comes from, for the error a stalled write fails with."""
        cfg = self.config
        if cfg.stall_timeout_s is not None:
            return "transfer.stall_timeout_s"
        rate = self.slowest_rate()
        seen = f"the slowest rate seen, {rate / 1e6:.3g} MB/s" if rate else "no rate seen yet"
        return (
            f"stall_multiple={cfg.stall_multiple:.3g} x the bytes in flight at {seen}, at least "
            f"stall_floor_s={cfg.stall_floor_s:.3g}s; transfer.stall_timeout_s sets it outright"
        )


@dataclass(kw_only=True)
class PostedWrite:
    """A write of ours the channel has not finished: what it needs and by when it must finish."""

    nbytes: int
    need: int  # bytes in flight when it was posted, itself included: what has to move before it is done
    limit: float  # seconds it may stay pending


class Watched(Protocol):
    """What the stall watch reads of its transfer (``outgoing.OutgoingTransfer``): its writes in flight, whether it
    is over, and failing and settling it."""

    transfer_id: str
    peer: ReceiverPeer
    cond: threading.Condition
    error: TransferError | None
    opened: float  # reservation granted: transfer_timeout_s counts from here
    posted: dict[TransferHandle, PostedWrite]

    @property
    def complete(self) -> bool: ...

    @property
    def num_chunks(self) -> int: ...

    def fail(self, err: TransferError) -> None: ...

    def settle_if_over(self) -> None: ...


class StallWatch:
    """One transfer's time bounds, checked on the sender's I/O thread every tick (``KVSender``): each posted
    write's stall bound, and the transfer's own ``transfer_timeout_s``."""

    def __init__(self, xfer: Watched, parts: SenderParts, bound: StallBound) -> None:
        self.xfer, self.parts, self.bound = xfer, parts, bound

    def check_timeout(self, now: float) -> None:
        """Nobody may be waiting on this transfer (the worker never calls wait): if its receiver died after
        our writes completed, neither Landed nor Cancel ever comes, so bound it here or it stays open forever.
        A write of ours that neither completed nor failed within its stall bound is given up on here too."""
        xfer, timeout_s = self.xfer, self.parts.config.transfer_timeout_s
        self._abandon_stalled(now)
        with xfer.cond:
            if xfer.error is None and not xfer.complete and now > xfer.opened + timeout_s:
                xfer.fail(
                    TransferTimeout(
                        f"transfer {xfer.transfer_id!r}: receiver {xfer.peer.address} did not confirm all "
                        f"{xfer.num_chunks} chunks within transfer_timeout_s={timeout_s:.3g}s"
                    )
                )
        xfer.settle_if_over()

    def _abandon_stalled(self, now: float) -> None:
        """Fail the transfer for each write past its stall bound and abandon the write: its handle fails as one
        whose bytes may still land, so the Cancel says so and the receiver quarantines its blocks as it does a late
        write; settling no longer waits for it, and its credit comes back."""
        xfer, channel = self.xfer, self.parts.channel
        with xfer.cond:
            overdue = [(h, w) for h, w in xfer.posted.items() if now > h.posted_at + w.limit]
        for handle, write in overdue:
            # One last look: a write that finished just now is not a stall (nixl learns of completions by polling).
            if channel.poll(handle) is not XferState.PENDING:
                continue
            err = TransferTimeout(
                f"transfer {xfer.transfer_id!r}: a {channel.name} write of {write.nbytes} bytes to "
                f"{handle.peer!r} neither completed nor failed within {write.limit:.3g}s "
                f"({self.bound.describe()}); given up on, its blocks at the receiver held as a write that may "
                "still land"
            )
            with xfer.cond:
                xfer.fail(err)
            if handle.abandon(str(err)):
                with xfer.cond:
                    self.parts.counters["stalled_writes"] += 1
