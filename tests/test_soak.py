"""The short soak: real processes, faults injected mid-traffic, nothing hangs, nothing leaks.

The scenario is ``tests/soak/``; the long version is ``python benchmarks/soak.py
--requests 200 --json``. This one sends 16 requests through the router while a byte of a chunk is flipped on
its way to a decode worker (a proxy in front of its tcp channel), one decode
worker is SIGKILLed, restarted and re-registered through the admin API, the
prefill worker is stalled with SIGSTOP/SIGCONT and two clients hang up
mid-stream. Every request must match the fault-free output or fail with a
clear error, and fail only while a fault is in effect, no more than were in
flight then; the corrupted chunk must be caught by the decode worker's
checksum and its prompt recomputed; no prompt may be recomputed while no fault
is in effect (a silent fallback answers with the same tokens: only the decode
workers' counters tell); no request may outlive its timeout and every worker's
reservations and in-flight gauges must return to zero. Outcomes, not timings,
are asserted.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import pytest

from pdkv.config import TransferConfig
from pdkv.errors import TransferError

from soak.report import summary
from soak.run import soak
from soak.traffic import TrafficGate
from tests.conftest import MakePair, wait_until


@pytest.mark.timeout(240)  # a backstop: every wait inside is bounded already
def test_short_soak_nothing_hangs_nothing_leaks(tmp_path: Path) -> None:
    counts = soak(16, concurrency=4, timeout=60.0, drop_every=8, workdir=tmp_path)
    report = summary(counts)
    assert report["problems"] == [], report
    assert counts.hung == 0, report
    assert counts.leaked == 0, report
    assert counts.mismatched == 0, report
    assert not [e for e in counts.errors if e.startswith("fault")], report  # every fault was really injected
    assert counts.recovered + counts.failed_cleanly + counts.dropped == counts.requests, report
    assert counts.injected.keys() >= {
        "corrupt_chunk",
        "decode_sigkill",
        "prefill_stall",
        "client_drop",
    }, report
    # the flipped byte was caught by the checksum on the decode side, which computed that prompt itself
    assert counts.corrupt_detected == counts.injected["corrupt_chunk"] == 1, report
    assert counts.corrupt_recomputed >= 1, report
    assert counts.recovered > 0, report
    # where the KV came from: over the channel, but for prompts recomputed while a fault was in effect
    assert not counts.fallbacks_without_fault, report
    assert sum(counts.fallbacks_after_fault.values()) >= counts.corrupt_recomputed, report
    assert counts.transferred_tokens > 0 and counts.recomputed_tokens > 0, report
    assert counts.failed_without_fault == 0 and counts.failed_cleanly <= counts.failed_cleanly_bound, report


def test_traffic_gate_holds_the_requests_from_the_trigger_until_released() -> None:
    """The corrupt-chunk fault's hold: the requests before its trigger run (so the trigger is reached), the ones from
    it wait until the proxy is armed, and then run (the chunk it flips is one of theirs)."""
    gate = TrafficGate()
    assert gate.wait(7, 0)  # nothing held
    gate.hold_from(5)
    assert gate.wait(4, 0)
    assert not gate.wait(5, 0.01) and not gate.wait(6, 0.01)
    ran = threading.Event()
    waiter = threading.Thread(target=lambda: gate.wait(6, 10) and ran.set())
    waiter.start()
    gate.release()
    waiter.join(10)
    assert ran.is_set()


def test_sender_settles_a_transfer_whose_receiver_died_after_the_writes(
    make_pair: MakePair,
) -> None:
    """Regression for the soak's one leak: prefill pdkv_open_transfers stuck at 1 after a decode worker was SIGKILLed.

    The worker never calls ``wait`` on a transfer, so when the receiver dies
    after the writes completed (no Landed, no Cancel will ever come) the
    sender must settle it itself: when it sees the control connection drop,
    or at the latest after its own transfer_timeout_s.
    """
    cfg = TransferConfig(
        chunk_size=32,
        lease_s=0.5,
        heartbeat_s=0.1,
        transfer_timeout_s=0.5,
        drain_timeout_s=0.5,
    )
    pair = make_pair(config=cfg)
    xfer = pair.sender.open("r1", pair.receiver.address, 100, list(range(40, 47)))
    pair.receiver.close()  # the decode side dies holding the reservation
    # The writes may post before the sender notices (the case the soak hit) or
    # fail because it already saw the control connection drop: settled either way.
    with contextlib.suppress(TransferError):
        xfer.send_all()
    settled: list[bool] = []
    xfer.on_settled(lambda _x: settled.append(True))
    wait_until(
        lambda: pair.sender.stats()["open_transfers"] == 0,
        10,
        "the sender to give up on the dead receiver",
    )
    assert settled == [True]
    # a TransferTimeout, or the error of the lost control connection
    assert isinstance(xfer.error, TransferError)
