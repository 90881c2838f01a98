"""``pdkv.bench.cpu``: another process's CPU clock as that process itself reads it, and the meter's arithmetic."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pdkv.bench.cpu import CpuMeter, process_cpu_s, ratios
from pdkv.errors import PdkvError

SPIN = (
    "import sys, time\nwhile time.process_time() < 0.3: pass\nprint(time.process_time(), flush=True)\nsys.stdin.read()"
)


def test_another_processs_cpu_clock_reads_what_it_spent_and_stops_while_it_waits() -> None:
    child = subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        own = float(child.stdout.readline())  # the child's own clock once it spun 0.3 s of CPU
        first = process_cpu_s(child.pid)
        assert own >= 0.3 and first >= own
        assert process_cpu_s(child.pid) - first < 0.05  # blocked on stdin: it spends (almost) nothing
    finally:
        child.communicate("", timeout=30)
    with pytest.raises(PdkvError, match=str(child.pid)):
        process_cpu_s(child.pid)  # reaped: no clock left to read
    assert process_cpu_s(os.getpid()) > 0


def test_the_meter_charges_each_side_per_gb_and_leaves_out_a_side_it_cannot_tell_apart() -> None:
    meter = CpuMeter({"sender": os.getpid(), "receiver": None})
    meter.add({"sender": 1.0}, {"sender": 1.5}, 1_000_000_000)
    meter.add({"sender": 2.0}, {"sender": 2.5}, 1_000_000_000)
    assert meter.per_gb() == {"sender": 0.5, "receiver": None}
    assert set(meter.read()) == {"sender"}
    assert ratios({"sender": 0.5, "receiver": 0.3}, {"sender": 0.25, "receiver": None}) == {
        "sender": 2.0,
        "receiver": None,
    }
