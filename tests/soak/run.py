"""The soak itself: the cluster up, traffic from a thread pool, the faults on a schedule, then the counts."""

from __future__ import annotations

import functools
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from pdkv.testing.http import request
from pdkv.testing.model import write_tiny_model

from soak import linkfaults, procstats
from soak.cluster import LEAK_WAIT_S, Cluster
from soak.faults import corrupt_chunk, kill_and_restart_decode, kv_events, stall_prefill
from soak.hosts import START_TIMEOUT_S, TwoHostCluster
from soak.monitor import KVMonitor, read_leaks
from soak.report import RETRY_S, Counts
from soak.traffic import DropGate, TrafficGate, body, fault_free, one_request, prompts


@dataclass(frozen=True)
class Fault:
    """One fault of a block: injected once ``at`` (a fraction of the block) of the block's requests are done.

    ``gate``: the block's second half waits (bounded) for it to finish, so
    that a restarted worker really serves traffic.
    """

    at: float
    inject: Callable[[int], None]  # called with the block's number
    name: str
    gate: bool = False
    every: int = 1  # injected in every ``every``-th block only (the first included)
    holds_drops: bool = False  # no client hangs up from the block's start until it is done (traffic.DropGate)
    holds_traffic: bool = False  # the block's requests from ``at`` on wait until it is armed (traffic.TrafficGate)


def _one_host_lanes(
    cluster: Cluster, counts: Counts, monitor: KVMonitor, drops: DropGate, traffic: TrafficGate
) -> list[list[Fault]]:
    return [
        [
            Fault(
                1 / 8,
                lambda _k: corrupt_chunk(cluster, counts, drops, traffic),
                "corrupt_chunk",
                holds_drops=True,
                holds_traffic=True,
            ),
            Fault(
                1 / 4,
                functools.partial(kill_and_restart_decode, cluster, counts, monitor),
                "kill_and_restart_decode",
                gate=True,
            ),
            Fault(3 / 4, lambda _k: stall_prefill(cluster, counts), "stall_prefill"),
        ]
    ]


def _two_host_lanes(
    cluster: TwoHostCluster, counts: Counts, monitor: KVMonitor, watch: linkfaults.RouterWatch, restart_every: int
) -> list[list[Fault]]:
    """The link's faults in one lane, the processes' in another: they overlap, as they would in production."""
    link = [
        Fault(at, lambda k, f=f, kind=kind: f(cluster, counts, watch, linkfaults.durations(kind, k)), kind)
        for at, f, kind in (
            (1 / 8, linkfaults.veth_down, "veth_down"),
            (3 / 8, linkfaults.rate_cut, "rate_cut"),
            (5 / 8, linkfaults.unroute, "route_removed"),
        )
    ]
    process = [
        Fault(
            1 / 4,
            lambda _k: linkfaults.restart_decode(cluster, counts, monitor, watch),
            "decode_restart",
            gate=True,
            every=restart_every,
        ),
        Fault(3 / 4, lambda _k: stall_prefill(cluster, counts), "stall_prefill"),
    ]
    return [link, process]


def soak(
    n: int,
    concurrency: int = 4,
    timeout: float = 60.0,
    drop_every: int = 8,
    workdir: Path | None = None,
    hosts: int = 1,
    channel: str = "tcp",
    reverse: bool = False,
    block: int = 100,
    restart_every: int = 1,
) -> Counts:
    """Run the soak and return its counts; the processes (and for two hosts, the rig) are always removed.

    Faults cycle every ``block`` requests (each kind once per block, but a
    decode restart in every ``restart_every``-th block: a worker's start-up
    takes a while); ``hosts=2`` runs the two-host scenario (``soak.hosts``)
    over ``channel``, ``reverse`` with the roles' hosts swapped.

    The first ``WARM_ROUNDS`` rounds are the warm-up of what ``/proc``
    shows: the processes' fds, threads and RSS are read once they ended
    (every fault kind has been through, so pools have grown to what faults
    make them), and again after the run, where they must be back to it.
    With fewer rounds, the baseline is the last round but one's end, or,
    with one, after the warm-up requests.
    """
    tmp = tempfile.TemporaryDirectory(prefix="pdkv-soak-") if workdir is None else None
    root = Path(tmp.name) if tmp else workdir
    assert root is not None
    counts = Counts(requests=n, concurrency=concurrency)
    cluster: Cluster | TwoHostCluster | None = None
    try:
        model = write_tiny_model(root / "model")
        cluster = Cluster(root, model) if hosts == 1 else TwoHostCluster(root, model, channel, reverse)
        with cluster.entered():
            _soak(cluster, counts, n, concurrency, timeout, drop_every, block, restart_every)
        return counts
    finally:
        if cluster is not None:
            cluster.stop()
        if tmp:
            tmp.cleanup()


WARM_ROUNDS = 2
"""Rounds of faults before /proc is read for the baseline (when the run has more): a worker starts some threads
only the first time a fault needs them (one more in a decode worker, once, in the 10,000-request run), which is no
leak; what a fault leaks each time shows in the rounds after."""

WARM_UP_S = 30.0
"""How long the warm-up before a /proc read may take to find every channel link open again. A fault's effects can
outlast it: a decode worker that the prefill worker dialled while the routes were gone is tried again only
``unreachable_retry_s`` later (``soak.hosts.CHANNEL_OPTIONS``), so a read taken meanwhile misses that link and the other
read counts it as a leak (the two-host soak failed so now and then: the prefill worker's 4 fds of one link)."""

WARM_UP_RETRY_S = 1.0  # between warm-up passes that still recomputed

WARM_UP_CONCURRENCY = 16
"""Warm-up requests at once: more than any thread pool a worker grows on demand holds (asyncio's default executor,
where a decode worker waits for a prompt's KV: min(32, cpus + 4) threads), so those pools are full before /proc is
read."""


def _warm_up(cluster: Cluster | TwoHostCluster, ps: list[list[int]], timeout: float) -> None:
    """Each prompt twice through the router, ``WARM_UP_CONCURRENCY`` at a time, before anything is measured:
    connection pools and thread pools have grown to what the load needs by then. Again (bounded by ``WARM_UP_S``)
    until a pass in which no decode worker recomputed a prompt: every channel link is open then, at either read."""
    assert cluster.router is not None
    router_url = cluster.router.url

    def one(p: list[int]) -> None:
        status, raw = request("POST", router_url + "/v1/completions", body(p), timeout=timeout)
        if status != 200:
            raise RuntimeError(f"warm-up request failed: HTTP {status}: {raw[:300]!r}")

    deadline = time.monotonic() + WARM_UP_S
    while True:
        before = _fallbacks(cluster)
        with ThreadPoolExecutor(WARM_UP_CONCURRENCY) as pool:
            list(pool.map(one, ps + ps))
        recomputed = _fallbacks(cluster) - before
        if not recomputed:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"warm-up: the decode workers still recomputed {recomputed:g} prompts of the last pass "
                f"{WARM_UP_S:g}s on (a channel link that stays down after the faults ended?)"
            )
        time.sleep(WARM_UP_RETRY_S)


def _fallbacks(cluster: Cluster | TwoHostCluster) -> float:
    """The decode workers' recomputed prompts so far (``pdkv_fallbacks_total``)."""
    with cluster.lock:
        workers = list(cluster.decode)
    return sum(kv_events(w)[1] for w in workers)


def _soak(
    cluster: Cluster | TwoHostCluster,
    counts: Counts,
    n: int,
    concurrency: int,
    timeout: float,
    drop_every: int,
    block: int,
    restart_every: int,
) -> None:
    cluster.start()
    assert cluster.router is not None
    router_url = cluster.router.url
    ps = prompts(min(n, 16))
    expected = fault_free(cluster, ps)
    _warm_up(cluster, ps, timeout)
    processes = cluster.processes()
    start_stats = procstats.baseline(processes)  # replaced after the first block if there is a second
    monitor = KVMonitor(cluster, counts)
    watch = linkfaults.RouterWatch(cluster) if isinstance(cluster, TwoHostCluster) else None
    drops = DropGate()
    traffic = TrafficGate()
    if isinstance(cluster, TwoHostCluster):
        assert watch is not None
        lanes = _two_host_lanes(cluster, counts, monitor, watch, restart_every)
    else:
        lanes = _one_host_lanes(cluster, counts, monitor, drops, traffic)
    done = 0
    done_lock = threading.Condition()
    # Triggers count finished requests, not seconds, so a slow machine sees the same interleaving. A block's
    # requests wait (bounded) until every fault of the block before it ended, so each kind is injected once per
    # block however long the faults take, and the faults always meet traffic.
    block = min(n, block)
    starts = range(0, n - block + 1, block)
    gate_s = START_TIMEOUT_S + linkfaults.UP_WAIT_S + 4 * timeout  # a restart, the router noticing, a request
    gated = [threading.Event() for _ in starts]
    finished = [threading.Event() for _ in starts]
    lanes_left = [len(lanes) for _ in starts]
    lanes_lock = threading.Lock()

    def wait_done(at: int) -> bool:
        with done_lock:
            return done_lock.wait_for(lambda: done >= at, timeout=gate_s)

    def trigger(b: int, fault: Fault) -> int:
        """The request count at which ``fault`` is injected in the block starting at request ``b``."""
        return b + max(1, int(block * fault.at))

    def hold(k: int, faults: list[Fault]) -> None:
        """What block ``k``'s faults need held, held before any of its requests can start (they wait for the block
        before to finish, or for the lanes to start): drops, and the requests from a fault's trigger on."""
        due = [f for f in faults if not k % f.every]
        if any(f.holds_drops for f in due):
            drops.hold()  # released once that fault is done
        if held := [f for f in due if f.holds_traffic]:
            traffic.hold_from(trigger(starts[k], held[0]))  # released once that fault is armed, or done

    def lane(faults: list[Fault]) -> None:
        try:
            for k, b in enumerate(starts):
                for fault in faults:
                    if k % fault.every:
                        if fault.gate:
                            gated[k].set()
                        continue
                    at = trigger(b, fault)
                    if not wait_done(at):
                        counts.errors.append(f"fault {fault.name} never triggered: traffic stalled before request {at}")
                        return
                    try:
                        fault.inject(k)
                    except Exception as exc:  # noqa: BLE001 - a fault that could not be injected is reported, never skipped
                        counts.errors.append(f"fault {fault.name} failed: {exc}")
                    finally:
                        if fault.gate:
                            gated[k].set()
                        if fault.holds_drops:
                            drops.release()
                        if fault.holds_traffic:
                            traffic.release()
                if k + 1 < len(starts):
                    hold(k + 1, faults)
                with lanes_lock:
                    lanes_left[k] -= 1
                    if not lanes_left[k]:
                        finished[k].set()
        finally:  # a lane that gave up releases every request still waiting on it
            drops.release()
            traffic.release()
            for k in range(len(starts)):
                gated[k].set()
                finished[k].set()

    measured = threading.Event()
    warm = min(WARM_ROUNDS, len(starts) - 1)  # rounds before the /proc baseline (0: it was taken after the warm-up)

    def measure() -> None:
        """The /proc baseline once the warm rounds' requests and faults are all done, before the next round starts."""
        nonlocal start_stats
        try:
            if finished[warm - 1].wait(gate_s) and wait_done(warm * block):
                _warm_up(cluster, ps, timeout)  # every link a fault broke is open again, as at the end
                start_stats = procstats.baseline(processes)
        except RuntimeError as exc:
            counts.errors.append(f"fault: the /proc baseline could not be taken: {exc}")
        finally:
            measured.set()

    def task(i: int) -> tuple[str, str, float, float]:
        nonlocal done
        due = drop_every > 0 and i % drop_every == drop_every - 1
        k = min(i // block, len(starts))
        if k and not finished[k - 1].wait(gate_s):
            counts.errors.append(f"fault: the faults of block {k - 1} did not end before request {i}")
        if warm and k >= warm and not measured.wait(gate_s):
            counts.errors.append(f"fault: the /proc baseline was not taken before request {i}")
        if k < len(starts) and i >= starts[k] + block // 2 and not gated[k].wait(gate_s):
            counts.errors.append(f"fault: the gating fault of block {k} did not finish before request {i}")
        if not traffic.wait(i, gate_s):
            counts.errors.append(f"fault: the fault holding request {i} was not armed in time")
        start = time.monotonic()
        drop = drops.begin(due)
        try:
            outcome, detail = one_request(router_url, ps[i % len(ps)], expected[i % len(ps)], drop, timeout)
            if outcome == "failed_cleanly":
                time.sleep(RETRY_S)  # a client backs off after an error before its next request
            return outcome, detail, start, time.monotonic()
        finally:
            drops.end(drop)
            with done_lock:
                done += 1
                done_lock.notify_all()

    counts.t0 = time.monotonic()
    monitor.start()
    if watch is not None:
        watch.start()
    injectors = [
        threading.Thread(target=lane, args=(faults,), name=f"soak-faults-{j}", daemon=True)
        for j, faults in enumerate(lanes)
    ]
    for faults in lanes:
        hold(0, faults)
    for t in injectors:
        t.start()
    if warm:
        threading.Thread(target=measure, name="soak-proc-baseline", daemon=True).start()
    else:
        measured.set()
    pool = ThreadPoolExecutor(concurrency)
    try:
        results = list(pool.map(task, range(n)))
    except BaseException:  # Ctrl-C or SIGTERM: run no more requests, release the waiting ones, let the caller clean up
        pool.shutdown(wait=False, cancel_futures=True)
        for event in (*gated, *finished, measured):
            event.set()
        traffic.release()
        raise
    pool.shutdown()
    for t in injectors:
        t.join(gate_s)
    counts.seconds = round(time.monotonic() - counts.t0, 1)
    for outcome, detail, start, end in results:
        setattr(counts, outcome, getattr(counts, outcome) + 1)
        counts.timeline.append((start - counts.t0, end - counts.t0, outcome))
        counts.longest_wait_s = max(counts.longest_wait_s, round(end - start, 2))
        if outcome == "failed_cleanly":
            counts.failures[detail.split(":", 1)[0]] += 1
            if not counts.during_fault(start, end):
                counts.failed_without_fault += 1
        if outcome == "dropped":
            counts.injected["client_drop"] += 1
            counts.faults.append("client dropped its connection mid-stream")
        elif detail and (len(counts.errors) < 20 or outcome == "mismatched"):  # a wrong answer is always kept
            counts.errors.append(f"{outcome}: {detail} (at {start - counts.t0:.1f} s)")
    counts.leaks = read_leaks(cluster, wait_s=LEAK_WAIT_S)
    counts.leaked = int(sum(counts.leaks.values()))
    # The same traffic as before the baseline: links and connections opened on demand (a channel link a fault
    # broke is made again by the next transfer over it) are open at both reads, so only what should be gone counts.
    _warm_up(cluster, ps, timeout)
    pool_ports = {
        urllib.parse.urlsplit(w.url).port or 80
        for w in [cluster.router, cluster.prefill, *cluster.decode, *cluster.dead]
        if w is not None
    }
    redis = getattr(cluster, "redis", None)
    if redis is not None:  # the workers' Redis pools, as the server sees them (procstats.leaks says why)
        pool_ports.add(redis.port)
    counts.proc_leaks, counts.rss_growth_pct, counts.http_pool = procstats.leaks(
        processes, start_stats, procstats.SETTLE_S, pool_ports
    )
    counts.leaked += int(sum(counts.proc_leaks.values()))
    monitor.stop()
    if watch is not None:
        watch.stop()
