"""The faults the soak injects mid-traffic: a corrupted chunk, a SIGKILLed decode worker, a stalled prefill worker."""

from __future__ import annotations

import signal
import time

from pdkv.testing.http import metric, request
from pdkv.testing.procs import WorkerProcess

from soak.cluster import ADMIN, PROXIED, Cluster
from soak.monitor import KVMonitor
from soak.report import Counts
from soak.traffic import DropGate, TrafficGate


def kill_and_restart_decode(cluster: Cluster, counts: Counts, monitor: KVMonitor, cycle: int = 0) -> None:
    """SIGKILL a decode worker (alternating between the two), start a new one, swap it in through the admin API."""
    with counts.fault_window("decode_sigkill"):
        _kill_and_restart_decode(cluster, counts, monitor, cycle)


def _kill_and_restart_decode(cluster: Cluster, counts: Counts, monitor: KVMonitor, cycle: int) -> None:
    assert cluster.router is not None
    index = cycle % len(cluster.decode)
    with cluster.lock:
        victim = cluster.decode[index]
    monitor.sample(victim)  # its counts so far, before they die with it
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(10)
    counts.injected["decode_sigkill"] += 1
    counts.faults.append(f"SIGKILL decode {victim.url}")
    request(
        "DELETE",
        cluster.router.url + "/pdkv/workers",
        {"role": "decode", "url": victim.url},
        timeout=10,
        headers=ADMIN,
    )
    fresh = cluster.start_worker("decode", index)
    status, raw = request(
        "POST",
        cluster.router.url + "/pdkv/workers",
        {"role": "decode", "url": fresh.url},
        timeout=10,
        headers=ADMIN,
    )
    if status not in (200, 201):
        raise RuntimeError(f"registering the restarted decode worker failed: HTTP {status}: {raw[:300]!r}")
    with cluster.lock:
        cluster.decode[index] = fresh
        cluster.dead.append(victim)
    counts.faults.append(f"restarted decode as {fresh.url} and registered it")


def stall_prefill(cluster: Cluster, counts: Counts, seconds: float = 2.0) -> None:
    """A slow peer: the prefill worker freezes (SIGSTOP) mid-traffic, then resumes."""
    assert cluster.prefill is not None
    with counts.fault_window("prefill_stall"):
        cluster.prefill.proc.send_signal(signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            cluster.prefill.proc.send_signal(signal.SIGCONT)
    counts.injected["prefill_stall"] += 1
    counts.faults.append(f"SIGSTOP prefill for {seconds}s")


def kv_events(worker: WorkerProcess) -> tuple[float, float]:
    """A decode worker's (checksum failures, fallbacks) so far, from its /metrics."""
    _, raw = request("GET", worker.url + "/metrics", timeout=5)
    text = raw.decode()
    return metric(text, "pdkv_transfer_events_total", event="checksum_failures"), metric(text, "pdkv_fallbacks_total")


def corrupt_chunk(
    cluster: Cluster, counts: Counts, drops: DropGate, traffic: TrafficGate, wait_s: float = 30.0
) -> None:
    """Flip one byte of the next chunk on its way to the proxied decode worker; it must notice and recompute.

    Noticing is its checksum failure counter going up, and not noticing
    within ``wait_s`` is an error in the report; recomputing is its fallback
    counter going up (the request may also fail cleanly: its output is
    checked like every other's). No client hangs up meanwhile (the lane
    holds ``drops`` for it, ``Fault.holds_drops``), and none that did is still
    in flight: the router would cancel that request's transfer, and a byte
    flipped in a cancelled transfer is never checked, rightly. The block's
    requests from the trigger on wait until the proxy is armed (``traffic``,
    ``Fault.holds_traffic``): the chunk it flips is one of theirs.
    """
    with counts.fault_window("corrupt_chunk"):
        drops.quiet(wait_s)
        _corrupt_chunk(cluster, counts, traffic, wait_s)


def _corrupt_chunk(cluster: Cluster, counts: Counts, traffic: TrafficGate, wait_s: float) -> None:
    with cluster.lock:
        victim = cluster.decode[PROXIED]
    checksum_failures, fallbacks = kv_events(victim)
    target = cluster.proxy.arm()
    traffic.release()
    if not cluster.proxy.wait_flipped(target, wait_s):
        raise RuntimeError(f"no chunk went to decode {victim.url} within {wait_s}s")
    counts.injected["corrupt_chunk"] += 1
    counts.faults.append(f"flipped a byte of a chunk on its way to decode {victim.url}")
    deadline = time.monotonic() + wait_s
    while (now := kv_events(victim))[0] <= checksum_failures or now[1] <= fallbacks:
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    counts.corrupt_detected += int(now[0] - checksum_failures)
    counts.corrupt_recomputed += int(now[1] - fallbacks)
    if now[0] <= checksum_failures:
        counts.errors.append(
            f"fault corrupt_chunk went undetected: decode {victim.url} counted no checksum failure within {wait_s}s"
        )
