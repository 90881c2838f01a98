"""The soak's processes: one prefill worker, two decode workers (one behind the corrupting proxy) and the router."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pdkv.auth import control_token
from pdkv.netaddr import free_port
from pdkv.testing.procs import WorkerProcess, start_configured

from soak.proxy import CorruptingProxy

PROXIED = 1  # the decode worker whose channel is reached through the corrupting proxy

WORKER_CONFIG: dict[str, Any] = {
    "channel": {"name": "tcp"},
    "secret": "soak-secret",
    "num_blocks": 256,
    "dtype": "float32",
    # short leases and timeouts: a dead peer is noticed within seconds, so the soak is short and nothing waits long
    "transfer": {
        "chunk_size": 32,
        "lease_s": 1,
        "heartbeat_s": 0.25,
        "transfer_timeout_s": 5,
        "handshake_timeout_s": 3,
        "reserve_timeout_s": 3,
        "chunk_timeout_s": 5,
        "claim_timeout_s": 10,
        "drain_timeout_s": 2,
        # nixl cannot cut a sender off: a failed reservation whose sender never said it stopped writing waits this
        # long (a write posted before an outage of up to 10 s may land when TCP retransmits after it).
        "unfenced_quarantine_s": 30,
    },
}
LEAK_WAIT_S = WORKER_CONFIG["transfer"]["unfenced_quarantine_s"] + 10.0
"""How long the leak gauges may take to reach zero after the traffic: a quarantine begun by the last fault ends."""

SETTLE_S = WORKER_CONFIG["transfer"]["transfer_timeout_s"] + WORKER_CONFIG["transfer"]["lease_s"] + 1.0
"""How long a fault's effects may outlast it: a transfer it stalled times out, or its lease expires, by then."""

ROUTER_CONFIG: dict[str, Any] = {
    "secret": WORKER_CONFIG["secret"],  # the router cancels transfers on the decode workers: their control token
    "router": {
        "connect_timeout_s": 2,
        "prefill_timeout_s": 15,
        "decode_timeout_s": 30,
        "read_timeout_s": 15,
        "health_timeout_s": 2,
        "health_interval_s": 1,
        "max_retries": 2,
    },
}

# The router's admin endpoints, with the secret and no admin_token, want the secret's control token.
ADMIN = {"Authorization": f"Bearer {control_token(WORKER_CONFIG['secret'])}"}


class Cluster:
    """The processes under test; ``decode`` entries are replaced when a worker is restarted.

    Decode worker ``PROXIED`` listens for chunks on a fixed port (a restart
    takes it again) behind ``proxy``, and advertises the proxy's port.
    """

    def __init__(self, workdir: Path, model: Path) -> None:
        self.workdir, self.model = workdir, model
        self.lock = threading.Lock()
        self.prefill: WorkerProcess | None = None
        self.decode: list[WorkerProcess] = []
        self.router: WorkerProcess | None = None
        self.dead: list[WorkerProcess] = []
        self.proxied_port = free_port()
        self.proxy = CorruptingProxy(self.proxied_port)

    def start_worker(self, role: str, index: int = 0) -> WorkerProcess:
        """The prefill worker, or decode worker ``index`` (``PROXIED`` behind the proxy)."""
        cfg = {**WORKER_CONFIG, "model": str(self.model)}
        if role == "decode" and index == PROXIED:
            options = {"port": self.proxied_port, "advertise_port": self.proxy.port}
            cfg["channel"] = {**cfg["channel"], "options": options}
        return start_configured(role, cfg, self.workdir / f"{role}{index}.yaml", timeout=120)

    def start(self) -> None:
        with ThreadPoolExecutor(3) as pool:  # start-up is mostly imports: overlap them
            futs = [
                pool.submit(self.start_worker, r, i) for r, i in (("prefill", 0), ("decode", 0), ("decode", PROXIED))
            ]
            self.prefill, *self.decode = [f.result() for f in futs]
        args = ["--prefill", self.prefill.url] + [a for d in self.decode for a in ("--decode", d.url)]
        self.router = start_configured("router", ROUTER_CONFIG, self.workdir / "router.yaml", *args, timeout=120)

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """Where the soak's threads talk from: here, this machine's own network (see ``TwoHostCluster.entered``)."""
        yield

    def processes(self) -> dict[str, int]:
        """The processes that live for the whole soak (the decode workers are killed in turn) by name: pids for
        /proc."""
        with self.lock:
            return {
                name: w.proc.pid
                for name, w in (("router", self.router), ("prefill", self.prefill))
                if w is not None and w.proc.poll() is None
            }

    def live_workers(self) -> list[WorkerProcess]:
        with self.lock:
            return [w for w in [self.prefill, *self.decode] if w is not None and w.proc.poll() is None]

    def stop(self) -> None:
        for w in [self.router, *self.decode, self.prefill, *self.dead]:
            if w is not None:
                w.stop(timeout=5)
        self.proxy.close()
