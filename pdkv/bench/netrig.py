"""Several hosts on one machine: network namespaces joined by veth pairs, links shaped with ``tc``.

Disaggregation moves KV between machines; on one test machine a second host
is a Linux network namespace, its own interfaces, addresses, routes and
ports, joined to the first by a veth pair, a virtual cable. Tests and
benchmarks start pdkv roles inside a host (``ip netns exec NS pdkv launch
...``) exactly as a user would start them on a machine, and the rig makes
the faults only a network shows: a link that goes down, a rate that drops,
a host that disappears.

Topology: a star. ``NetRig`` makes the hub host ``a``; ``add_host("b")``
makes host ``b`` with a veth pair to the hub, its own /24 with the hub at
``.1`` and the host at ``.2``. Every name is unique to the run (pid and
random bits) and every interface is created straight inside its namespace,
never in the caller's, so two rigs running at once never collide, and the
addresses never leave the rig's namespaces: nothing outside is ever
contacted. ``close`` kills whatever still runs in the rig's namespaces and
deletes them, which deletes their interfaces.

Shaping: a token bucket (``tbf``) on each end's egress, so each direction is
limited to the rate. This kernel has no ``netem``, so there is no delay or
loss qdisc here; added latency would take a user-space delaying proxy (not
needed so far). UCX-based channels (nixl, ucx) need ``UCX_TLS=tcp`` between
namespaces of one machine (``UCX_ENV``): UCX sees one machine and would
otherwise move the data through cma, around the shaped link.

Needs root, ``ip`` and ``tc`` (iproute2); ``unavailable()`` says why not.
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing
import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from pdkv.errors import ConfigError, PdkvError
from pdkv.testing.procs import WorkerProcess, start_worker

_CLONE_NEWNET, _CLONE_NEWNS = 0x40000000, 0x00020000  # setns/unshare flags
_MS_REC, _MS_SLAVE, _MNT_DETACH = 0x4000, 0x80000, 2  # mount/umount2 flags
_CMD_TIMEOUT_S = 30.0
UCX_ENV = {"UCX_TLS": "tcp"}  # UCX across namespaces of one machine: the network, not cma (see the module docstring)


class RigError(PdkvError):
    """A namespace, link or shaping command failed; the message has the command and what it said."""


def unavailable() -> str | None:
    """Why the rig cannot run here, or None if it can."""
    if os.geteuid() != 0:
        return "network namespaces need root (the rig runs as root in CI)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' is not installed (apt-get install iproute2)"
    return None


def parse_rate(rate: str) -> float | None:
    """Bits per second of ``100mbit``, ``1gbit``, ``2.5gbit``, ``500kbit``; None for ``unshaped``."""
    if rate == "unshaped":
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(k|m|g)bit", rate.strip().lower())
    if match is None:
        raise ConfigError(
            f"link rate {rate!r}: expected 'unshaped' or a number with kbit, mbit or gbit (e.g. 100mbit, 1gbit)"
        )
    value = float(match.group(1)) * {"k": 1e3, "m": 1e6, "g": 1e9}[match.group(2)]
    if value <= 0:
        raise ConfigError(f"link rate {rate!r} must be positive")
    return value


def _run(argv: Sequence[str], check: bool = True, timeout: float = _CMD_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RigError(f"{' '.join(argv)}: no answer within {timeout:.0f}s") from None
    if check and done.returncode != 0:
        raise RigError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}")
    return done


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RigError(f"{what}: {os.strerror(ctypes.get_errno())}")


def _setns(fd: int, kind: int = _CLONE_NEWNET) -> None:
    _check(_libc().setns(fd, kind), "setns")


def _move_process(netns: str) -> None:
    """Move this (fresh) process onto the host of ``netns`` for good, as ``ip netns exec`` does.

    The network namespace, and a mount namespace of its own whose ``/sys``
    shows that network namespace's devices: UCX looks for them in
    ``/sys/class/net``. Done on the main thread before any other work;
    threads started afterwards inherit both. Such a process must not create
    or delete namespaces (``ip netns add`` from a private mount namespace is
    not seen outside it).
    """
    libc = _libc()
    fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    try:
        _check(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
        _check(libc.mount(None, b"/", None, _MS_REC | _MS_SLAVE, None), "mount --make-rslave /")
        _setns(fd)
        _check(libc.umount2(b"/sys", _MNT_DETACH), "umount /sys")
        _check(libc.mount(b"sysfs", b"/sys", b"sysfs", 0, None), "mount sysfs")
    finally:
        os.close(fd)


@dataclass
class Host:
    """One host of the rig: a network namespace and the processes the rig started in it."""

    name: str
    netns: str
    procs: list[WorkerProcess | subprocess.Popen[Any]] = field(default_factory=list)

    def command(self, *argv: str) -> list[str]:
        """``argv`` as run on this host."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def run(self, *argv: str, check: bool = True, timeout: float = _CMD_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        """Run a command on this host and wait for it."""
        return _run(self.command(*argv), check, timeout)

    def popen(self, *argv: str, **kwargs: Any) -> subprocess.Popen[Any]:
        """Start a command on this host in its own process group; ``close`` stops it if nobody did."""
        proc = subprocess.Popen(self.command(*argv), start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc

    def start_worker(self, role: str, *args: str, **kwargs: Any) -> WorkerProcess:
        """``pdkv launch --role ROLE ARGS...`` on this host, once it printed its ready line (see ``start_worker``)."""
        worker = start_worker(role, *args, wrap=self.command(), **kwargs)
        self.procs.append(worker)
        return worker

    @contextmanager
    def entered(self) -> Iterator[None]:
        """Run the block on this host: the calling thread (and threads it starts) open sockets here.

        A network namespace is per thread, and a thread starts in its
        creator's, so an HTTP client used inside the block talks from this
        host; the thread is back in its own namespace afterwards, whatever
        happened. Only the network moves: ``/sys`` still shows the caller's
        devices, which UCX needs to see (run UCX with ``call_on``).
        """
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            target = os.open(f"/run/netns/{self.netns}", os.O_RDONLY)
            try:
                _setns(target)
            finally:
                os.close(target)
            try:
                yield
            finally:
                _setns(own)
        finally:
            os.close(own)


def stop(hosts: Sequence[Host], timeout: float = 10.0) -> None:
    """SIGTERM to every process the rig started on ``hosts`` at once, SIGKILL to those still there after ``timeout``.

    All are told first and waited for together: workers take a moment to
    wind down, and one after the other that adds up. Anything else still in
    a host's namespace (a child that outlived its parent) is killed too:
    everything in there was started through the rig.
    """
    procs = [p.proc if isinstance(p, WorkerProcess) else p for host in hosts for p in host.procs]
    for proc in procs:
        if proc.poll() is None:
            _kill_group(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid, signal.SIGKILL)
            proc.wait(timeout)
    for host in hosts:
        host.procs.clear()
        left = _run(["ip", "netns", "pids", host.netns], check=False)
        for pid in left.stdout.split():
            if pid.isdigit() and int(pid) != os.getpid():  # never this process (its thread may be on the host)
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _kill_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


@dataclass
class Link:
    """The veth pair between the hub and one host; ``hub_addr``/``addr`` are each end's IPv4 address."""

    hub: Host
    host: Host
    hub_dev: str
    dev: str
    hub_addr: str
    addr: str
    rate: str = "unshaped"

    def shape(self, rate: str) -> None:
        """Limit each direction to ``rate`` (``100mbit``, ``1gbit``, ...; ``unshaped`` removes the limit).

        A token bucket per end (``_tbf``), replaced if there was one. Can
        be called while traffic flows: the rate changes under it.
        """
        bits = parse_rate(rate)
        for host, dev in ((self.hub, self.hub_dev), (self.host, self.dev)):
            if bits is None:
                host.run("tc", "qdisc", "del", "dev", dev, "root", check=False)
            else:
                host.run("tc", "qdisc", "replace", "dev", dev, "root", *_tbf(bits))
        self.rate = rate

    def change_rate(self, rate: str) -> None:
        """Change a shaped link's rate in place (``tc qdisc change``), as a switch port renegotiating its speed.

        Unlike ``shape`` the token bucket stays: packets queued in it are
        kept and drain at the new rate, so a transfer in flight slows down
        (or speeds up) under it. The link must be shaped already.
        """
        bits = parse_rate(rate)
        if bits is None or parse_rate(self.rate) is None:
            raise ConfigError(
                f"change_rate({rate!r}) on a link at {self.rate!r}: both rates must be shaped (use shape)"
            )
        for host, dev in ((self.hub, self.hub_dev), (self.host, self.dev)):
            host.run("tc", "qdisc", "change", "dev", dev, "root", *_tbf(bits))
        self.rate = rate

    def unroute(self, end: Host | None = None) -> None:
        """Remove the routes between the hub and the host (both ends, or only ``end``'s towards the other).

        The link stays up, as a routing change upstream would leave it:
        packets to the other end fail at once with "network unreachable",
        and a connection already open just stops hearing from its peer.
        With ``end`` it is a one-way partition: nothing ``end`` sends crosses (TCP's acknowledgements neither),
        what the other end sends still arrives. (Routes, not a ``tc`` drop filter: kernels without tc's action
        modules have no such filter.)
        """
        for host, dev, addr in self._ends(end):
            host.run("ip", "route", "del", _subnet(addr), "dev", dev)

    def reroute(self, end: Host | None = None) -> None:
        """Put back the routes ``unroute`` removed (the kernel's own connected routes, as the address made them)."""
        for host, dev, addr in self._ends(end):
            host.run(
                "ip", "route", "replace", _subnet(addr), "dev", dev, "proto", "kernel", "scope", "link", "src", addr
            )

    def _ends(self, end: Host | None) -> list[tuple[Host, str, str]]:
        """(host, its device, its address) of both ends, or of ``end`` alone (which must be one of them)."""
        ends = [(self.hub, self.hub_dev, self.hub_addr), (self.host, self.dev, self.addr)]
        if end is None:
            return ends
        chosen = [e for e in ends if e[0] is end]
        if not chosen:
            raise RigError(f"host {end.name!r} is not an end of the link {self.hub_dev} <-> {self.dev}")
        return chosen

    def down(self) -> None:
        """Take the link down, as a pulled cable: the host's end goes down, the hub's loses its carrier."""
        self.host.run("ip", "link", "set", "dev", self.dev, "down")

    def up(self) -> None:
        """Bring the link back up; addresses and the hub's routes come back with it."""
        self.host.run("ip", "link", "set", "dev", self.dev, "up")


def _tbf(bits: float) -> list[str]:
    """A token bucket at ``bits`` per second: burst 4 ms of the rate (at least 16 full frames, so TSO-sized packets
    pass), a queue of 50 ms beyond it."""
    burst = max(int(bits / 8 * 0.004), 16 * 1514)
    return ["tbf", "rate", f"{int(bits)}bit", "burst", str(burst), "latency", "50ms"]


def _subnet(addr: str) -> str:
    """The /24 an end's address is in (each link has its own, see ``NetRig.add_host``)."""
    return addr.rsplit(".", 1)[0] + ".0/24"


class NetRig:
    """A hub host ``a`` and the hosts joined to it; a context manager that always cleans up.

    ``subnet_base`` is the first two octets of the hosts' addresses
    (``10.X``); by default a random one in 10.200-10.254 per run. The rig's
    names start with ``prefix`` (default ``pdkvrig``) and carry the pid.
    """

    def __init__(self, prefix: str = "pdkvrig", subnet_base: str | None = None) -> None:
        why = unavailable()
        if why is not None:
            raise RigError(f"the network rig cannot run here: {why}")
        self.tag = f"{prefix}-{os.getpid()}-{secrets.token_hex(3)}"
        self.subnet_base = subnet_base or f"10.{200 + secrets.randbelow(55)}"
        self.hosts: dict[str, Host] = {}
        self.links: dict[str, Link] = {}
        self._closed = False
        try:
            self.hub = self._new_host("a")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> NetRig:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _new_host(self, name: str) -> Host:
        if not re.fullmatch(r"[a-z][a-z0-9]{0,7}", name) or name in self.hosts:
            raise ConfigError(f"rig host name {name!r}: expected a new name of 1-8 lowercase letters and digits")
        host = Host(name, f"{self.tag}-{name}")
        _run(["ip", "netns", "add", host.netns])
        self.hosts[name] = host
        host.run("ip", "link", "set", "dev", "lo", "up")
        return host

    def add_host(self, name: str, rate: str = "unshaped") -> Link:
        """A new host joined to the hub by its own veth pair (its own /24), shaped to ``rate``."""
        index = len(self.links) + 1
        if index > 254:
            raise ConfigError("a rig has at most 254 hosts besides the hub")
        host = self._new_host(name)
        link = Link(
            self.hub, host, f"to-{name}", "to-hub", f"{self.subnet_base}.{index}.1", f"{self.subnet_base}.{index}.2"
        )
        # both ends are born inside their namespaces: no name ever exists in the caller's namespace
        _run(
            [
                "ip",
                "link",
                "add",
                link.hub_dev,
                "netns",
                self.hub.netns,
                "type",
                "veth",
                "peer",
                "name",
                link.dev,
                "netns",
                host.netns,
            ]
        )
        for end, dev, addr in ((self.hub, link.hub_dev, link.hub_addr), (host, link.dev, link.addr)):
            end.run("ip", "addr", "add", f"{addr}/24", "dev", dev)
            end.run("ip", "link", "set", "dev", dev, "up")
        self.links[name] = link
        if rate != "unshaped":
            link.shape(rate)
        return link

    def remove_host(self, name: str) -> None:
        """The host disappears, as a machine losing power: its cable first (no goodbye packets), then its
        processes and namespace."""
        host = self.hosts.pop(name)
        link = self.links.pop(name, None)
        if link is not None:
            self.hub.run("ip", "link", "del", "dev", link.hub_dev, check=False)  # deletes both ends
        for proc in host.procs:
            if isinstance(proc, WorkerProcess):
                proc.kill()
            else:
                _kill_group(proc.pid, signal.SIGKILL)
                proc.wait(10)
        host.procs.clear()
        stop([host])
        _run(["ip", "netns", "del", host.netns], check=False)

    def close(self) -> None:
        """Stop every process started in the rig and delete its namespaces (and so its interfaces). Idempotent."""
        if self._closed:
            return
        self._closed = True
        stop(list(self.hosts.values()))
        for host in list(self.hosts.values()):
            _run(["ip", "netns", "del", host.netns], check=False)
        self.hosts.clear()
        self.links.clear()


# -- what benchmarks use ------------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """Where the two processes of a two-sided benchmark run, and the addresses each listens on.

    ``LOOPBACK`` by default; inside ``bench_link`` the sender runs on the
    hub and the receiver on host ``b``, across a link shaped to ``rate``. A
    benchmark runs its sender side with ``call_on(placement.sender_netns,
    ...)``, starts its receiver with ``run_in_netns(placement.receiver_netns,
    ...)`` as a spawned process's target, and gives each side's channel its
    ``*_addr`` as ``host``.
    """

    sender_addr: str = "127.0.0.1"
    receiver_addr: str = "127.0.0.1"
    sender_netns: str | None = None
    receiver_netns: str | None = None
    link: Link | None = None

    @property
    def rate_bps(self) -> float | None:
        """The link's rate in bits/s; None on loopback or an unshaped link."""
        return None if self.link is None else parse_rate(self.link.rate)

    @property
    def label(self) -> str:
        return "loopback" if self.link is None else f"veth {self.link.rate}"


LOOPBACK = Placement()


def run_in_netns(netns: str | None, target: Any, *args: Any) -> None:
    """Move onto the host of ``netns`` (None: stay), then run ``target(*args)``: the entry point of a process
    spawned onto a host."""
    if netns is not None:
        _move_process(netns)
    target(*args)


def _answer(conn: Connection, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        conn.send(("ok", fn(*args)))
    except BaseException as exc:  # noqa: BLE001 - handed to the caller of ``call_on``, which raises it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


def call_on(netns: str | None, fn: Callable[..., Any], *args: Any, timeout: float = 3600.0) -> Any:
    """``fn(*args)`` on the host of ``netns`` (a spawned process), its result returned; None: called here.

    ``fn`` and its arguments and result must pickle. The process may start
    processes of its own (a benchmark's receiver); it is killed if it is
    still there after ``timeout`` or once it answered and did not exit.
    """
    if netns is None:
        return fn(*args)
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=run_in_netns, args=(netns, _answer, theirs, fn, args), name=f"on-{netns}")
    proc.start()
    try:
        deadline = time.monotonic() + timeout
        while not ours.poll(1.0):
            if not proc.is_alive():
                raise RigError(f"the process on {netns} exited ({proc.exitcode}) without an answer")
            if time.monotonic() > deadline:
                raise RigError(f"the process on {netns} gave no answer within {timeout:.0f}s")
        status, value = ours.recv()
    except BaseException:  # interrupted, or it died: what it started on the hosts goes with the rig
        proc.kill()
        raise
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(10)
        ours.close()
        if not proc.is_alive():
            proc.close()  # its sentinel fd: a caller may run many
    if status != "ok":
        raise RigError(f"on {netns}: {value}")
    return value


@contextmanager
def bench_link(rate: str | None) -> Iterator[Placement]:
    """``LOOPBACK`` for None; else a fresh two-host rig whose link runs at ``rate``.

    UCX-based channels get ``UCX_ENV`` (unless the user set it) for as long
    as the link lives, so their data crosses the shaped link.
    """
    if rate is None:
        yield LOOPBACK
        return
    parse_rate(rate)  # a bad rate fails before anything is made
    with terminate_cleanly(), NetRig() as rig:
        link = rig.add_host("b", rate)
        added = {k: v for k, v in UCX_ENV.items() if k not in os.environ}
        os.environ.update(added)
        try:
            yield Placement(link.hub_addr, link.addr, rig.hub.netns, link.host.netns, link)
        finally:
            for k in added:
                os.environ.pop(k, None)


@contextmanager
def terminate_cleanly() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C while a benchmark's rig lives, so the rig is taken down, not left behind."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop_here(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop_here)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def iperf3_gbps(link: Link, streams: int = 1, seconds: float = 2.0, port: int = 5201) -> float | None:
    """iperf3's throughput from the hub to the host over ``link`` in GB/s (1e9 bytes/s), or None if iperf3 is not
    installed.

    What network engineers measure a link with: the tcp channel's target is
    0.9x of it. The server runs on the host for one test (``-1``); the
    client retries while the server is still starting.
    """
    if shutil.which("iperf3") is None:
        return None
    server = link.host.popen(
        "iperf3", "-s", "-1", "-B", link.addr, "-p", str(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + _CMD_TIMEOUT_S
        while True:
            done = link.hub.run(
                "iperf3",
                "-c",
                link.addr,
                "-p",
                str(port),
                "-P",
                str(streams),
                "-t",
                f"{seconds:g}",
                "-J",
                check=False,
                timeout=seconds + _CMD_TIMEOUT_S,
            )
            try:
                report = json.loads(done.stdout)
            except ValueError:
                report = {"error": done.stderr.strip() or done.stdout.strip()}
            if "error" not in report:
                return float(report["end"]["sum_received"]["bits_per_second"]) / 8 / 1e9
            if time.monotonic() > deadline or "refused" not in str(report["error"]):
                raise RigError(f"iperf3 to {link.addr}:{port} failed: {report['error']}")
            time.sleep(0.05)
    finally:
        if server.poll() is None:
            _kill_group(server.pid, signal.SIGKILL)
        server.wait(10)
        link.host.procs.remove(server)
