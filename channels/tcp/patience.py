"""How long one tcp connection waits for its peer, and the errors that say it waited too long.

A connection's sockets block with kernel timeouts that tick (``tick``): an idle socket between frames is normal,
``io_timeout`` without a byte inside a frame is a dead peer (``stalled``), and a bound on a whole exchange
(``limit``: the handshake, on either side) fails a receive however its bytes trickle in. ``Conn`` keeps one; the native
receive loops get ``max_idle_ticks`` to count the same ticks.
"""

from __future__ import annotations

import math
import time

from pdkv.channels.tcp.options import TcpOptions
from pdkv.errors import ProtocolError, TransferTimeout


class Patience:
    """One connection's timeouts (``io_timeout`` a tick at a time, and an optional deadline) and its errors."""

    def __init__(self, opts: TcpOptions, label: str) -> None:
        self.label = label
        self.io_timeout = opts.io_timeout
        self.tick = min(0.5, opts.io_timeout / 4)
        self.max_idle_ticks = max(1, round(opts.io_timeout / self.tick))
        # When every receive must be done by (time.monotonic()), however the bytes trickle in (``limit``).
        self.deadline = math.inf
        self._limit = (0.0, "")  # its seconds and what it bounds, for the error that cuts it

    def limit(self, seconds: float | None, what: str = "") -> None:
        """Fail every receive ``seconds`` from now, bytes arriving or not (None: no such bound, the default).

        Either side's whole handshake is bounded so: ``io_timeout`` holds per byte only, and a peer sending one byte
        every few seconds would hold its connection for ever. An authenticated peer's frames have none.
        """
        self.deadline = math.inf if seconds is None else time.monotonic() + seconds
        self._limit = (seconds or 0.0, what)

    def remaining(self) -> float:
        """Seconds left before ``deadline`` (0 once past; inf with none)."""
        return max(0.0, self.deadline - time.monotonic())

    def stalled(self, idle: int, got: int, n: int) -> int:
        """One more tick without a byte inside a frame: the new count, or TransferTimeout once ``io_timeout`` passed."""
        idle += 1
        if idle >= self.max_idle_ticks:
            raise self.stall(got, n) from None
        return idle

    def late(self) -> TransferTimeout:
        seconds, what = self._limit
        return TransferTimeout(
            f"tcp {self.label}: {what} not complete within {seconds:.3g}s, however its bytes trickled in"
        )

    def send_stall(self) -> TransferTimeout:
        return TransferTimeout(f"tcp {self.label}: peer accepted no data for {self.io_timeout:.3g}s")

    def stall(self, got: int, n: int) -> TransferTimeout:
        return TransferTimeout(
            f"tcp {self.label}: peer sent {got} of {n} bytes of a frame, then nothing for {self.io_timeout:.3g}s"
        )

    def cut(self, got: int, n: int) -> ProtocolError:
        return ProtocolError(f"tcp {self.label}: truncated frame, connection closed after {got} of {n} bytes")

    def truncated(self, got: int, nbytes: int) -> ProtocolError:
        return ProtocolError(
            f"tcp {self.label}: truncated frame, connection closed after {got} of {nbytes} payload bytes"
        )
