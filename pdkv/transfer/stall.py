"""When a posted write counts as stalled: ``transfer.stall_timeout_s``, or a bound derived from the link.

A channel's write may neither complete nor fail: a NIXL transfer whose peer froze stays in progress for ever
(NIXL itself added a stall timeout for it, and SGLang users waited 300 s for a failure nothing announced), and
the same holds for the ucx channel's wait for its ACK. While such a write is pending its transfer cannot settle,
so its send credit, the prefill blocks it reads and the decode blocks it writes stay held. The sender therefore
gives up on every write past its bound (``OutgoingTransfer.check_timeout``): the handle is abandoned (its bytes
may still land), and the receiver quarantines the blocks as it does any write that may still land.

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

from pdkv.config import TransferConfig

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
