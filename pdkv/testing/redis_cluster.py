"""Start a private Redis (or Valkey) Cluster on loopback for tests and benchmarks: primaries, replicas, real failover.

The servers are the ones ``pdkv.testing.redis`` finds (``server_binary``),
each with ``--cluster-enabled yes``, a working directory and a free port of
its own, persistence off. The cluster is formed as a user would, with
``redis-cli --cluster create ... --cluster-replicas N`` (``valkey-cli``
for Valkey, looked for beside the server first), or, where no CLI is
installed, with the same steps over the protocol (``CLUSTER ADDSLOTS``,
``MEET``, ``REPLICATE``). Two settings matter for a cache and are what a
deployment should use too: ``cluster-require-full-coverage no`` (a
primary that is down takes only its own slots away, not the whole
cluster's) and a short ``cluster-node-timeout`` (how soon a replica takes
over). ``kill(node)`` SIGKILLs one server: a crash, not a shutdown.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pdkv.errors import ConfigError, PdkvError
from pdkv.netaddr import free_port
from pdkv.testing.redis import INSTALL_HINT, LocalRedis, answers, server_binary

SLOTS = 16384


def cli_binary(server: str) -> str | None:
    """The CLI that goes with ``server`` (beside it first, then on PATH), or None."""
    name = "valkey-cli" if "valkey" in Path(server).name else "redis-cli"
    beside = Path(server).with_name(name)
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else shutil.which(name)


@dataclass
class LocalCluster:
    nodes: list[LocalRedis]
    replicas: int

    @property
    def url(self) -> str:
        """``redis+cluster://`` with every node as a seed (pdkv's cluster URL form)."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def client(self, port: int):  # noqa: ANN201 - redis is an optional dependency
        import redis

        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)

    def live(self) -> list[LocalRedis]:
        return [n for n in self.nodes if n.proc.poll() is None]

    def primaries(self, with_replica: bool = False) -> list[LocalRedis]:
        """The live primaries now (failovers included); ``with_replica``: only those a replica follows."""
        out = []
        for node in self.live():
            info = self.client(node.port).info("replication")
            if info["role"] == "master" and (not with_replica or info.get("connected_slaves", 0) > 0):
                out.append(node)
        return out

    def primary_of(self, key: bytes) -> LocalRedis:
        """The node serving ``key``'s slot now (asks a live node)."""
        for node in self.live():
            slot = int(self.client(node.port).execute_command("CLUSTER", "KEYSLOT", key))
            for start, end, master, *_ in self.client(node.port).execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    return next(n for n in self.nodes if n.port == int(master[1]))
        raise PdkvError("no live cluster node")

    def kill(self, node: LocalRedis) -> None:
        node.proc.kill()
        node.proc.wait(10)

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every live node says ``cluster_state:ok`` and every slot has a live primary."""
        deadline = time.monotonic() + timeout
        while not self._ok():
            if time.monotonic() > deadline:
                raise PdkvError(f"the local cluster did not reach cluster_state:ok within {timeout:.0f}s")
            time.sleep(0.1)

    def _ok(self) -> bool:
        live = self.live()
        try:
            for node in live:
                info = self.client(node.port).execute_command("CLUSTER", "INFO").decode()
                if "cluster_state:ok" not in info:
                    return False
            covered = 0
            for start, end, master, *_ in self.client(live[0].port).execute_command("CLUSTER", "SLOTS"):
                if not any(n.port == int(master[1]) for n in live):
                    return False
                covered += end - start + 1
            return covered == SLOTS
        except Exception:  # noqa: BLE001 - a node still starting or failing over (any client error): not ok yet
            return False


# A cluster node also listens on its port + 10000 (the cluster bus) and exits at once when that is past 65535.
BUS_OFFSET = 10000
MAX_NODE_PORT = 65535 - BUS_OFFSET


def node_port() -> int:
    """A loopback port free right now whose cluster-bus port is free too and in range.

    The kernel's pick comes from the ephemeral range (32768-60999 by default), and about a fifth of it lies above
    ``MAX_NODE_PORT``: a node given one of those exits at start ("Redis port number too high").
    """
    for _ in range(200):
        port = free_port()
        if port > MAX_NODE_PORT:
            continue
        try:
            with socket.socket() as bus:
                bus.bind(("127.0.0.1", port + BUS_OFFSET))
        except OSError:
            continue
        return port
    raise PdkvError(f"no loopback port <= {MAX_NODE_PORT} with its cluster-bus port (+{BUS_OFFSET}) free")


def _start_node(binary: str, workdir: Path, node_timeout_ms: int, timeout: float) -> LocalRedis:
    for _attempt in range(3):  # another process may take the port between probe and bind
        port = node_port()
        # Its own directory even when a port comes back on a retry (a bind lost to another process frees it).
        home = Path(tempfile.mkdtemp(prefix=f"{port}-", dir=workdir))
        args = [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(home),
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            str(node_timeout_ms),
            "--cluster-require-full-coverage",
            "no",
            "--maxmemory",
            "256mb",
            "--maxmemory-policy",
            "allkeys-lru",
        ]
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline and not answers(port):
            time.sleep(0.05)
        if proc.poll() is None and answers(port):
            return LocalRedis(proc, port)
        LocalRedis(proc, port).stop()
    raise PdkvError(
        f"{binary} --cluster-enabled yes did not start on a free loopback port within {timeout:.0f}s (3 attempts)"
    )


def _create_with_cli(cli: str, cluster: LocalCluster, timeout: float) -> None:
    hosts = [f"127.0.0.1:{n.port}" for n in cluster.nodes]
    out = subprocess.run(
        [cli, "--cluster", "create", *hosts, "--cluster-replicas", str(cluster.replicas), "--cluster-yes"],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if out.returncode != 0:
        raise PdkvError(f"{cli} --cluster create failed (exit {out.returncode}): {(out.stdout + out.stderr)[-1000:]}")


def _create_with_commands(cluster: LocalCluster, primaries: int) -> None:
    """What ``redis-cli --cluster create`` does: slots split evenly over the primaries, everyone met, replicas
    attached."""
    heads, tails = cluster.nodes[:primaries], cluster.nodes[primaries:]
    for i, node in enumerate(heads):
        cluster.client(node.port).execute_command(
            "CLUSTER", "ADDSLOTS", *range(i * SLOTS // primaries, (i + 1) * SLOTS // primaries)
        )
    first = cluster.client(heads[0].port)
    for node in cluster.nodes[1:]:
        first.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)
    ids = {n.port: cluster.client(n.port).execute_command("CLUSTER", "MYID").decode() for n in heads}
    deadline = time.monotonic() + 30
    for i, node in enumerate(tails):
        primary = ids[heads[i % primaries].port]
        while True:  # a node can replicate a primary only once it has heard of it
            try:
                cluster.client(node.port).execute_command("CLUSTER", "REPLICATE", primary)
                break
            except Exception:  # re-raised past the deadline
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


@contextlib.contextmanager
def local_redis_cluster(
    primaries: int = 3, replicas: int = 1, node_timeout_ms: int = 1000, timeout: float = 30.0, use_cli: bool = True
) -> Iterator[LocalCluster]:
    """``primaries`` primaries with ``replicas`` replicas each, formed and ``cluster_state:ok``, for the ``with``
    block."""
    binary = server_binary()
    if binary is None:
        raise ConfigError(f"no redis-server or valkey-server on PATH; install one: {INSTALL_HINT}")
    cli = cli_binary(binary) if use_cli else None
    with tempfile.TemporaryDirectory(prefix="pdkv-redis-cluster-") as workdir:
        cluster = LocalCluster([], replicas)
        try:
            for _ in range(primaries * (1 + replicas)):
                cluster.nodes.append(_start_node(binary, Path(workdir), node_timeout_ms, timeout))
            if cli is not None:
                _create_with_cli(cli, cluster, timeout)
            else:
                _create_with_commands(cluster, primaries)
            cluster.wait_ok(timeout)
            _wait_replicas_in_sync(cluster, timeout)
            yield cluster
        finally:
            for node in cluster.nodes:
                node.stop()


def _wait_replicas_in_sync(cluster: LocalCluster, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for node in cluster.nodes:
        while cluster.client(node.port).info("replication").get("master_link_status", "up") != "up":
            if time.monotonic() > deadline:
                raise PdkvError(f"replica on port {node.port} did not sync with its primary within {timeout:.0f}s")
            time.sleep(0.1)
