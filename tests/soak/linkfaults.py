"""The two-host soak's faults: on the link between the hosts, and a decode worker that comes back on its address.

Each fault is in effect (``Counts.fault_window``) from its injection until
the router has every decode worker up again, which it must find by itself:
nothing tells it. ``RouterWatch`` samples the router's
``pdkv_router_worker_up`` gauges, so the report says, per fault kind, how
often the router marked a decode worker down meanwhile and how long it took
to have them all back; a fault after which the router does not mark them up
within ``UP_WAIT_S`` is an error that fails the run.
"""

from __future__ import annotations

import threading
import time

from pdkv.testing.http import request

from soak.hosts import LINK_RATE, TwoHostCluster
from soak.monitor import KVMonitor
from soak.report import Counts

CUT_RATE = "10mbit"
UP_WAIT_S = 60.0  # a fault ended: the router must have every decode worker up again within this
WATCH_S = 0.2  # how often the router's view is sampled


class RouterWatch:
    """The router's view of the decode workers over time, sampled from its /metrics."""

    def __init__(self, cluster: TwoHostCluster) -> None:
        self.cluster = cluster
        self.cond = threading.Condition()
        self.up: dict[str, bool] = {}
        self.downs: list[tuple[float, str]] = []  # (monotonic time, url) of each up -> down seen
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="soak-router-watch", daemon=True)

    def _read(self) -> dict[str, bool] | None:
        assert self.cluster.router is not None
        try:
            _, raw = request("GET", self.cluster.router.url + "/metrics", timeout=5)
        except OSError:
            return None
        out = {}
        for line in raw.decode().splitlines():
            if line.startswith("pdkv_router_worker_up{") and 'role="decode"' in line:
                url = line.split('worker="', 1)[1].split('"', 1)[0]
                out[url] = float(line.rpartition(" ")[2]) == 1.0
        return out

    def _run(self) -> None:
        while not self.stopped.wait(WATCH_S):
            now = self._read()
            if now is None:
                continue
            with self.cond:
                t = time.monotonic()
                self.downs += [(t, url) for url, ok in now.items() if not ok and self.up.get(url, True)]
                self.up = now
                self.cond.notify_all()

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(10)

    def downs_since(self, t: float) -> int:
        with self.cond:
            return sum(1 for when, _ in self.downs if when >= t)

    def wait_all_up(self, timeout: float, restarting: set[str] | None = None) -> bool:
        """Whether the router has every decode worker up within ``timeout``; those in ``restarting`` (a live set,
        the cluster's) are not waited for: a restart in the other lane is not this fault's doing."""
        skip = restarting if restarting is not None else set()
        with self.cond:
            return self.cond.wait_for(
                lambda: bool(self.up) and all(ok or url in skip for url, ok in self.up.items()), timeout
            )


def _recovered(
    watch: RouterWatch, counts: Counts, kind: str, since: float, what: str, restarting: set[str] | None = None
) -> None:
    """The fault is over: wait (bounded) for the router to have every decode worker (but those ``restarting``) up
    again, and count what it did."""
    restored = time.monotonic()
    if not watch.wait_all_up(UP_WAIT_S, restarting):
        counts.errors.append(
            f"fault {kind}: the router did not mark every decode worker up again within {UP_WAIT_S:g}s after {what}"
        )
        return
    marks = counts.router_marks[kind]
    marks["faults"] += 1
    marks["marked_down"] += int(watch.downs_since(since) > 0)
    marks["max_up_again_s"] = max(marks["max_up_again_s"], round(time.monotonic() - restored, 2))


def veth_down(cluster: TwoHostCluster, counts: Counts, watch: RouterWatch, seconds: float) -> None:
    """The cable pulled for ``seconds`` (1-10): the decode host's end of the veth down, then up again."""
    link, end = cluster.link, ("front" if cluster.reverse else "back")
    with counts.fault_window("veth_down"):
        t0 = time.monotonic()
        link.down()
        try:
            time.sleep(seconds)
        finally:
            link.up()
        counts.injected["veth_down"] += 1
        counts.faults.append(f"veth of the {end} host down for {seconds:g}s")
        _recovered(watch, counts, "veth_down", t0, "the veth came back up", cluster.restarting)


def rate_cut(cluster: TwoHostCluster, counts: Counts, watch: RouterWatch, seconds: float) -> None:
    """The link's rate cut from 10 Gbit to 10 Mbit in place (``tc qdisc change``) for ``seconds``, then restored."""
    with counts.fault_window("rate_cut"):
        t0 = time.monotonic()
        cluster.link.change_rate(CUT_RATE)
        try:
            time.sleep(seconds)
        finally:
            cluster.link.change_rate(LINK_RATE)
        counts.injected["rate_cut"] += 1
        counts.faults.append(f"link rate {LINK_RATE} -> {CUT_RATE} for {seconds:g}s")
        _recovered(watch, counts, "rate_cut", t0, "the rate was restored", cluster.restarting)


def unroute(cluster: TwoHostCluster, counts: Counts, watch: RouterWatch, seconds: float) -> None:
    """The decode host's address unreachable for ``seconds``: the routes between the hosts removed, then restored."""
    with counts.fault_window("route_removed"):
        t0 = time.monotonic()
        cluster.link.unroute()
        try:
            time.sleep(seconds)
        finally:
            cluster.link.reroute()
        counts.injected["route_removed"] += 1
        counts.faults.append(f"routes between the hosts removed for {seconds:g}s")
        _recovered(watch, counts, "route_removed", t0, "the routes were restored", cluster.restarting)


def restart_decode(cluster: TwoHostCluster, counts: Counts, monitor: KVMonitor, watch: RouterWatch) -> None:
    """SIGKILL decode worker 1 and start a new one on the same address; the router must take it back by itself."""
    with counts.fault_window("decode_restart"):
        with cluster.lock:
            victim = cluster.decode[1]
        monitor.sample(victim)  # its counts so far, before they die with it
        t0 = time.monotonic()
        with cluster.lock:
            cluster.restarting.add(victim.url)
        try:
            victim.kill()
            counts.injected["decode_restart"] += 1
            fresh = cluster.start_worker("decode", 1)
        finally:
            with cluster.lock:
                cluster.restarting.discard(victim.url)
        if fresh.url != victim.url:
            raise RuntimeError(f"the restarted decode worker is at {fresh.url}, not its old address {victim.url}")
        with cluster.lock:
            cluster.decode[1] = fresh
            cluster.dead.append(victim)
        counts.restart_s = max(counts.restart_s, round(time.monotonic() - t0, 1))
        counts.faults.append(f"SIGKILL decode {victim.url}, restarted on the same address")
        _recovered(watch, counts, "decode_restart", t0, "the decode worker restarted")


def durations(kind: str, k: int) -> float:
    """The ``k``-th fault of ``kind``'s length in seconds: veth downs cycle through 10, 3, 6, 9, 2, 5, 8, 1, 4, 7 s,
    the others through 4, 3, 2, 1 s.

    Deterministic (a run can be repeated) and spread, so short outages (under
    the router's probe timeout) and long ones (past the transfer timeouts)
    both happen, whatever the run's length. The first round has the longest
    of each: it is the warm-up of ``soak.procstats``, and thread pools grow
    to what the worst outage needs in it, not later.
    """
    if kind == "veth_down":
        return float(10 - (7 * k) % 10)
    return float(4 - k % 4)
