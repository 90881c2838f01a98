"""CPU seconds per GB of the processes doing a transfer: the bench number that a shared machine does not blur.

Wall time on a 2-core VM shared with other work swings from run to run; the
CPU a process spends moving a byte does not. Each side (the sender's
process, the receiver's) is read from the kernel's CPU clock of that process
(user + system time of all its threads, exited ones included, in ns):
``clock_gettime`` on the clock ``clock_getcpuclockid(pid)`` names, which
Linux lets any process read. A meter adds up what each process spent inside
the timed windows and the bytes those windows moved.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pdkv.errors import PdkvError

T = TypeVar("T")
SIDES = ("sender", "receiver")
_CPUCLOCK_SCHED = 2  # the process-wide, scheduler-precise CPU clock (linux/posix-timers.h: CPUCLOCK_SCHED)


def process_cpu_s(pid: int) -> float:
    """CPU seconds process ``pid`` has used so far, all its threads (exited ones too).

    For this process, ``time.process_time``; for another, the clock id
    glibc's ``clock_getcpuclockid`` computes: ``(~pid << 3) | CPUCLOCK_SCHED``.
    """
    if pid == os.getpid():
        return time.process_time()
    try:
        return time.clock_gettime((~pid << 3) | _CPUCLOCK_SCHED)
    except OSError as exc:
        raise PdkvError(f"bench: cannot read the CPU clock of process {pid}: {exc}") from None


@dataclass
class CpuMeter:
    """CPU seconds per side, summed over timed windows, and the bytes those windows moved.

    ``pids``: the process doing each side's work (``SIDES``); None where it
    shares a process with the other side (an in-process channel), which
    cannot be told apart and is reported as None.
    """

    pids: dict[str, int | None]
    spent: dict[str, float] = field(default_factory=dict)
    nbytes: int = 0

    def read(self) -> dict[str, float]:
        """Each measurable side's CPU clock now."""
        return {side: process_cpu_s(pid) for side, pid in self.pids.items() if pid is not None}

    def add(self, start: dict[str, float], end: dict[str, float], nbytes: int) -> None:
        """One window: CPU clocks read at its start and end (``read``, or a process's own report), bytes moved."""
        for side, t in start.items():
            self.spent[side] = self.spent.get(side, 0.0) + end[side] - t
        self.nbytes += nbytes

    def per_gb(self) -> dict[str, float | None]:
        """CPU seconds per GB (1e9 bytes) moved, per side; None for a side that could not be measured."""
        return {
            side: (self.spent[side] / (self.nbytes / 1e9) if side in self.spent and self.nbytes else None)
            for side in SIDES
        }


def ratios(ours: dict[str, float | None], theirs: dict[str, float | None]) -> dict[str, float | None]:
    """Per side, our CPU per GB over the baseline's (above 1: we spend more per byte)."""
    return {side: (o / t if (o := ours.get(side)) and (t := theirs.get(side)) else None) for side in SIDES}


def charge(meter: CpuMeter, side: Any, call: Callable[[], T]) -> T:
    """Run ``call`` as one window of ``meter``: ``side`` (a bench side or baseline) counts its ``bytes_moved``."""
    before, start = side.bytes_moved, meter.read()
    value = call()
    meter.add(start, meter.read(), side.bytes_moved - before)
    return value
