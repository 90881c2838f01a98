"""The two-host soak's processes: router and prefill worker on one host, two decode workers on another, a shared Redis.

The hosts are network namespaces of ``pdkv.bench.netrig`` joined by one veth
pair shaped to ``LINK_RATE``: the hub ``a`` and ``b``. By default the front
host (router, prefill worker) is the hub and the back host (decode workers)
is ``b``; ``reverse`` swaps them, so the end whose interface goes down in a
``veth_down`` fault is the front's. The Redis tier (a real ``redis-server``)
listens on the hub's link address: both hosts reach it, the back host across
the link, so the link's faults hit the tier's traffic too.

The rig's names start with ``pdkvsoak`` and carry the pid and random bits,
and its addresses are in 10.100-10.199 (``pdkv bench --link`` and the
two-host tests draw from 10.200-10.254): several soaks and two-host tests
run at once without colliding. The soak's own threads talk from the front
host (``entered``); nothing outside the rig's namespaces is contacted.

Decode workers listen on fixed ports of the back host, so a killed one comes
back on the same address and the router, which knows it by that URL, must
notice both by itself (its health probes).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from pdkv.bench.netrig import UCX_ENV, Host, Link, NetRig
from pdkv.testing.procs import WorkerProcess
from pdkv.testing.redis import LocalRedis, local_redis

from soak.cluster import ROUTER_CONFIG, WORKER_CONFIG

LINK_RATE = "10gbit"
DECODE_PORTS = (8100, 8101)  # on the back host, a namespace of the rig's own: nothing else listens there
START_TIMEOUT_S = 240.0  # a worker's start-up (imports, the model) on a loaded 2-core machine
ENV = {"OMP_NUM_THREADS": "1"}  # tiny models gain nothing from threads; every process shares two cores
TCP_OPTIONS = {"io_timeout": 2.0, "connect_timeout": 2.0}  # a dead link fails a stream in seconds, not the default 10
CHANNEL_OPTIONS = {"unreachable_retry_s": 2.0}
"""Every channel's: a decode worker dialled while the routes were gone is found unreachable, and tried again after at
most this long (backing off from 0.5 s while the routes stay gone), not the default 10 s, which outlasts the fault's
window (``soak.cluster.SETTLE_S`` after it): its recomputes would count as without a fault."""


class TwoHostCluster:
    """The soak's processes on a two-host rig; the same attributes as ``soak.cluster.Cluster``.

    ``decode`` entries are replaced when a worker is restarted (on the same
    address). ``close`` (also on failure or Ctrl-C, from ``soak.run``) stops
    every process and deletes the rig's namespaces.
    """

    def __init__(self, workdir: Path, model: Path, channel: str = "tcp", reverse: bool = False) -> None:
        self.workdir, self.model, self.channel, self.reverse = workdir, model, channel, reverse
        self.lock = threading.Lock()
        self.prefill: WorkerProcess | None = None
        self.decode: list[WorkerProcess] = []
        self.router: WorkerProcess | None = None
        self.dead: list[WorkerProcess] = []
        self.restarting: set[str] = set()  # URLs of decode workers being restarted (under ``lock``)
        self.redis: LocalRedis | None = None
        self._stack = contextlib.ExitStack()
        self.rig = self._stack.enter_context(NetRig(prefix="pdkvsoak", subnet_base=f"10.{100 + os.getpid() % 100}"))
        try:
            self.link: Link = self.rig.add_host("b", LINK_RATE)
        except BaseException:
            self._stack.close()
            raise
        hub, b = self.rig.hub, self.link.host
        self.front, self.back = (b, hub) if reverse else (hub, b)
        self.front_addr, self.back_addr = (
            (self.link.addr, self.link.hub_addr) if reverse else (self.link.hub_addr, self.link.addr)
        )
        self.env = {**ENV, **(UCX_ENV if channel != "tcp" else {})}

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """The calling thread, and every thread it starts meanwhile, talks from the front host (the router's)."""
        with self.front.entered():
            yield

    def config(self) -> Path:
        """The one YAML every role reads: channel, secret, short timeouts, the shared Redis tier."""
        assert self.redis is not None
        options = {**CHANNEL_OPTIONS, **(TCP_OPTIONS if self.channel == "tcp" else {})}
        channel: dict[str, Any] = {"name": self.channel, "options": options}
        cfg = {
            **WORKER_CONFIG,
            **ROUTER_CONFIG,
            "model": str(self.model),
            "channel": channel,
            "tier": {"redis_url": self.redis.url},
        }
        path = self.workdir / f"soak-{self.channel}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path

    def start_worker(self, role: str, index: int = 0) -> WorkerProcess:
        """The prefill worker on the front host, or decode worker ``index`` on the back host at its fixed port."""
        host, addr, port = (
            (self.back, self.back_addr, DECODE_PORTS[index]) if role == "decode" else (self.front, self.front_addr, 0)
        )
        return self._start(host, role, "--host", addr, "--port", str(port))

    def _start(self, host: Host, role: str, *args: str) -> WorkerProcess:
        return host.start_worker(role, "--config", str(self.config()), *args, timeout=START_TIMEOUT_S, env=self.env)

    def start(self) -> None:
        # the thread that starts redis is on the hub, so it binds the hub's end of the link
        with self.rig.hub.entered():
            # a client whose link died mid-command reconnects, and its old connection's FIN may never arrive:
            # the server drops it after a few keep-alive probes, not Redis's default 300 s (the /proc check waits 90 s)
            self.redis = self._stack.enter_context(local_redis(host=self.link.hub_addr, tcp_keepalive_s=5))
        with ThreadPoolExecutor(3) as pool:  # start-up is mostly imports: overlap them
            futs = [pool.submit(self.start_worker, r, i) for r, i in (("prefill", 0), ("decode", 0), ("decode", 1))]
            self.prefill, *self.decode = [f.result() for f in futs]
        args = ["--host", self.front_addr, "--port", "0", "--prefill", self.prefill.url] + [
            a for d in self.decode for a in ("--decode", d.url)
        ]
        self.router = self._start(self.front, "router", *args)

    def processes(self) -> dict[str, int]:
        """Each process that lives for the whole soak (not a restarted decode worker) by name: its pid, for /proc."""
        assert self.redis is not None
        out = {"redis": self.redis.proc.pid}
        with self.lock:
            for name, w in (
                ("router", self.router),
                ("prefill", self.prefill),
                ("decode0", self.decode[0] if self.decode else None),
            ):
                if w is not None and w.proc.poll() is None:
                    out[name] = w.proc.pid
        return out

    def live_workers(self) -> list[WorkerProcess]:
        with self.lock:
            return [w for w in [self.prefill, *self.decode] if w is not None and w.proc.poll() is None]

    def stop(self) -> None:
        """Every process stopped, the Redis server too, and the rig's namespaces deleted (idempotent)."""
        try:
            for w in [self.router, *self.decode, self.prefill, *self.dead]:
                if w is not None:
                    w.stop(timeout=5)
        finally:
            self._stack.close()
