"""What each long-lived process holds, read from ``/proc``: open file descriptors, threads, resident memory.

The gauges on /metrics count what pdkv tracks (reservations, transfers);
``/proc`` counts what the kernel sees, so a socket, file or thread pdkv lost
track of shows here too. A baseline is taken after the warm-up (every lazily
made pool and connection exists by then); after the run each process must be
back to it: no more fds in all, no more threads than an on-demand pool may
keep (``POOL_THREADS``; polled, bounded: connections the faults broke take a
moment to close), and RSS within ``RSS_GROWTH`` of it.
"""

from __future__ import annotations

import collections
import os
import time
from dataclasses import dataclass
from pathlib import Path

RSS_GROWTH = 0.10  # end RSS may exceed the post-warm-up RSS by this fraction
POOL_THREADS = min(32, (os.cpu_count() or 1) + 4)
"""Threads a worker may start on demand and keep: asyncio's default executor (``asyncio.to_thread``, where a decode
worker waits for a prompt's KV) grows up to this many threads when waits overlap, as they do when a link is dead,
and never shrinks. Growth beyond it is a leak; up to it, it is reported (``threads_grown``)."""

DEAD_SOCKET = "socket (in no table)"
"""The kind of an fd of a TCP socket whose connection the kernel already took out of its tables (reset or closed
under the process), which the process never closed. Counted like any other fd; named apart so that a leak report
says what it is. Issue 31 found decode workers keeping one per few rounds of link faults: redis-py's pooled
connections reset under the pool (``pdkv.tier.redis_pool``)."""

SETTLE_S = 90.0  # how long the counts may take to come back: past a worker's 75 s idle_timeout_s for a connection


@dataclass(frozen=True)
class ProcStats:
    fds: collections.Counter[str]  # by kind: a TCP socket by what it connects, "pipe", "anon_inode:[eventfd]", a path
    threads: collections.Counter[str]  # by name (/proc/PID/task/TID/comm)
    rss_kib: int


TCP_STATES = {
    "01": "ESTABLISHED",
    "02": "SYN_SENT",
    "03": "SYN_RECV",
    "04": "FIN_WAIT1",
    "05": "FIN_WAIT2",
    "06": "TIME_WAIT",
    "07": "CLOSE",
    "08": "CLOSE_WAIT",
    "09": "LAST_ACK",
    "0A": "LISTEN",
    "0B": "CLOSING",
}


def _addr(hex_addr: str) -> tuple[str, int]:
    ip, port = hex_addr.split(":")
    return ".".join(str(b) for b in reversed(bytes.fromhex(ip))), int(port, 16)


def _tcp_sockets(pid: int) -> dict[str, str]:
    """The process's TCP sockets (its network namespace's table) by inode: what each connects, the ephemeral side's
    port left out so that a connection replaced by a new one to the same place counts as the same kind."""
    rows = []
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        cols = line.split()
        rows.append((cols[9], _addr(cols[1]), _addr(cols[2]), TCP_STATES.get(cols[3], cols[3])))
    listening = {local[1] for _, local, _, state in rows if state == "LISTEN"}
    out = {}
    for inode, (lip, lport), (rip, rport), state in rows:
        if state == "LISTEN":
            out[inode] = f"tcp listening on {lip}:{lport}"
        elif lport in listening:
            out[inode] = f"tcp {state} into :{lport} from {rip}"
        else:
            out[inode] = f"tcp {state} to {rip}:{rport}"
    return out


def _other_sockets(pid: int) -> dict[str, str]:
    """The process's non-TCP-v4 sockets by inode, named by their table (tcp6, udp, udp6, unix, netlink)."""
    out = {}
    for table, col in (("tcp6", 9), ("udp", 9), ("udp6", 9), ("unix", 6), ("netlink", 8)):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > col:
                out[cols[col]] = f"socket ({table})"
    return out


def _fd_kind(link: str, tcp: dict[str, str], other: dict[str, str]) -> str:
    if link.startswith("socket:["):
        inode = link[8:-1]
        return tcp.get(inode) or other.get(inode, DEAD_SOCKET)
    return link.split(":", 1)[0] if link.startswith("pipe:") else link


def read(pid: int) -> ProcStats | None:
    """``pid``'s counts now, or None once it is gone."""
    try:
        tcp, other = _tcp_sockets(pid), _other_sockets(pid)
        fds: collections.Counter[str] = collections.Counter()
        for entry in os.scandir(f"/proc/{pid}/fd"):
            try:
                fds[_fd_kind(os.readlink(entry.path), tcp, other)] += 1
            except FileNotFoundError:
                continue  # closed while we looked
        threads: collections.Counter[str] = collections.Counter()
        for task in os.scandir(f"/proc/{pid}/task"):
            try:
                threads[Path(task.path, "comm").read_text().strip()] += 1
            except (FileNotFoundError, ProcessLookupError):
                continue  # exited while we looked
        text = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    status = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return ProcStats(fds, threads, int(status["VmRSS"].split()[0]))


def baseline(processes: dict[str, int]) -> dict[str, ProcStats]:
    return {name: s for name, pid in processes.items() if (s := read(pid)) is not None}


def _pooled(kind: str, http_ports: set[int]) -> bool:
    """An HTTP connection between the router and a worker (either end): the router's keep-alive pool."""
    port = (
        kind.rsplit(":", 1)[-1]
        if kind.startswith("tcp ESTABLISHED to ")
        else kind.split(" from ")[0].rsplit(":", 1)[-1]
    )
    return kind.startswith("tcp ESTABLISHED") and port.isdigit() and int(port) in http_ports


def leaks(
    processes: dict[str, int], start: dict[str, ProcStats], wait_s: float, http_ports: set[int]
) -> tuple[dict[str, float], dict[str, float], dict[str, str]]:
    """(fds above their baseline, and threads more than ``POOL_THREADS`` above it, by process; RSS growth in % by
    process; the router's HTTP keep-alive connections to the workers and grown thread counts, before -> after),
    polled until nothing is above the baseline or ``wait_s`` passed. A process that died is a leak of its own (it
    should live for the whole run).

    The keep-alive connections between the router and the workers (``http_ports``: theirs) are counted apart:
    the router probes each worker every second through its pool, which hands out the connection idle longest
    (aiohttp's FIFO), so every pooled connection is reused before its keep-alive runs out and the pool stays at
    the most that were open at once. That is bounded by the traffic's peak, not by the faults (the
    10,000-request run's /proc series is flat), so it is reported, not counted as a leak. The same goes for the
    Redis server's connections from the workers (its port is in ``http_ports`` then): each worker's redis-py pool
    keeps the connections its threads (tier reads, the write-behind writer) opened at once, and a connection a
    fault cut is replaced by a new one before the server's keep-alive drops the old. What a worker itself holds is
    counted in that worker's own total.
    """
    deadline = time.monotonic() + wait_s
    while True:
        out: dict[str, float] = {}
        growth: dict[str, float] = {}
        pooled: dict[str, str] = {}
        for name, before in start.items():
            now = read(processes[name])
            if now is None:
                out[f"{name} exited"] = 1.0
                continue
            was_pool = sum(n for kind, n in before.fds.items() if _pooled(kind, http_ports))
            is_pool = sum(n for kind, n in now.fds.items() if _pooled(kind, http_ports))
            if was_pool or is_pool:
                pooled[name] = f"{was_pool} -> {is_pool}"
            if now.threads.total() > before.threads.total():
                pooled[f"{name} threads"] = f"{before.threads.total()} -> {now.threads.total()}"
            for what, was, is_, excluded, allowed in (
                ("fds", before.fds, now.fds, (was_pool, is_pool), 0),
                ("threads", before.threads, now.threads, (0, 0), POOL_THREADS),
            ):
                # the totals decide: a restarted peer's connections come back to a new port (another kind), and
                # replacing the old ones is no leak; the kinds that grew say where to look when the total did
                was_n, is_n = was.total() - excluded[0], is_.total() - excluded[1]
                if is_n > was_n + allowed:
                    grew = ", ".join(f"{kind} +{n}" for kind, n in (is_ - was).items() if not _pooled(kind, http_ports))
                    out[f"{name} {what} {was_n} -> {is_n} ({grew})"] = float(is_n - was_n)
            growth[name] = round(100.0 * (now.rss_kib - before.rss_kib) / before.rss_kib, 1)
        if not out or time.monotonic() > deadline:
            return out, growth, pooled
        time.sleep(0.5)
