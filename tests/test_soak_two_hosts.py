"""The short two-host soak: prefill and decode on two network namespaces while the link between them misbehaves.

The scenario is ``tests/soak/`` with ``hosts=2`` (``soak.hosts``,
``soak.linkfaults``); the long version is ``python benchmarks/soak.py --hosts 2
--requests 10000``. Router and prefill worker on one host, two decode workers
on the other, a shared Redis tier on the hub, the tcp channel. Three rounds of
100 requests; in each the veth is taken down (10 s, 3 s, 6 s), the link's rate
is cut from 10 Gbit to 10 Mbit in place, the routes between the hosts are
removed, and the prefill worker is stalled; in the first a decode worker is
SIGKILLed and restarted on the same address; every 8th client hangs up
mid-stream. Every request must match the fault-free output or fail with an
error while a fault is in effect; the router must mark the decode workers up
again by itself after every fault; nothing may be recomputed without a fault;
no gauge, fd or thread may stay above its count after the second round, RSS
within 10% of it (an fd of a TCP socket whose connection is gone counts too:
``soak.procstats.DEAD_SOCKET``); and the rig's namespaces are gone afterwards. Outcomes,
not timings, are asserted.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from pdkv.bench.netrig import unavailable

from soak.report import summary
from soak.run import soak

LINK_KINDS = {"veth_down", "rate_cut", "route_removed"}


@pytest.mark.timeout(600)  # a backstop: every wait inside is bounded already
def test_two_host_soak_with_link_faults_nothing_hangs_nothing_leaks(tmp_path: Path) -> None:
    why = unavailable()
    if why is not None:
        pytest.skip(f"two-host soak: {why}")
    counts = soak(300, concurrency=4, timeout=60.0, drop_every=8, workdir=tmp_path, hosts=2, block=100, restart_every=3)
    report = summary(counts)
    assert not report["problems"], (report["problems"], report["errors"])
    assert counts.hung == 0 and counts.mismatched == 0 and counts.leaked == 0, report
    assert counts.recovered + counts.failed_cleanly + counts.dropped == counts.requests, report
    # every kind injected (a fault that could not be injected is an error, so problems would not be empty)
    assert all(counts.injected[kind] == 3 for kind in LINK_KINDS), report
    assert counts.injected["decode_restart"] == 1 and counts.injected["prefill_stall"] == 3, report
    assert counts.injected["client_drop"] > 0, report
    # the router took every worker back by itself after every fault (a fault it did not recover from is an error),
    # having marked them down meanwhile (a restart that overlaps a link fault may find its worker down already)
    assert all(counts.router_marks[kind]["faults"] == 3 for kind in LINK_KINDS), report
    assert counts.router_marks["decode_restart"]["faults"] == 1, report
    assert sum(marks["marked_down"] for marks in counts.router_marks.values()) > 0, report
    # the KV crossed the link, and was recomputed only around faults
    assert counts.transferred_tokens > 0 and not counts.fallbacks_without_fault, report
    assert not counts.proc_leaks and all(pct <= 10 for pct in counts.rss_growth_pct.values()), report
    assert {"router", "prefill", "decode0", "redis"} <= counts.rss_growth_pct.keys(), report
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert f"pdkvsoak-{os.getpid()}-" not in left
