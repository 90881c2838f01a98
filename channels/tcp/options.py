"""The tcp channel's options and their checks, and the agent they configure as both sides of the channel see it.

The initiator side, the target side and every connection read them; they
live apart from ``TcpChannel`` so that none of those imports the channel.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from pdkv.channels.base import ChannelOptions
from pdkv.channels.tcp.tls import TlsContexts, TlsOptions
from pdkv.channels.tcp.wire import MAX_STREAMS
from pdkv.errors import ConfigError
from pdkv.netaddr import is_loopback, is_wildcard


@functools.cache
def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask, which taskset and container cpusets narrow), once."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no affinity call on this platform (macOS)
        return max(1, os.cpu_count() or 1)


def default_streams() -> int:
    """Connections per peer when ``streams`` is not set: 4, but no more than this process has cores.

    A share of a split transfer keeps a core busy copying (its sender's
    ``sendmsg``; on one host its receiver's copy out of the kernel too), so
    shares beyond the cores only add threads taking turns: on the 2-core VM
    four shares cost the sender up to 1.5x the CPU per GB of one or two and
    moved no byte faster (benchmarks/history/2026-11-26-cost-of-a-byte-and-a-request-issue-28.md,
    "What a byte and a request cost (issue 28)"). Set ``streams`` to split wider anyway.
    """
    return min(4, usable_cores())


class TcpOptions(ChannelOptions):
    """Options of the tcp channel; both peers should use the same limits."""

    # host (ChannelOptions): where to listen; the worker's host unless set here
    port: int = 0  # 0: an ephemeral port, published through metadata()
    # host peers dial: needed when ``host`` is a wildcard like 0.0.0.0, or behind a NAT
    advertise_host: str | None = None
    advertise_port: int = 0  # port peers dial, when a port forward, NAT or proxy sits in front of ``port``; 0: ``port``
    streams: int = msgspec.field(default_factory=default_streams)  # connections per peer: 4, at most one a core
    stream_min_bytes: int = 4 << 20  # a transfer is split only into shares at least this big
    # a transfer to a peer on this host (a loopback address) is cut into at most this many shares; 0: half this
    # process's cores. On one host a share keeps two cores busy, the sender's copy into the kernel and the
    # receiver's out of it, so more shares than half the cores only take turns on them: on the 2-core VM a lone
    # 256-token chunk took 4.1-4.9 ms in two shares and 3.3-3.6 in one, and a request of many chunks moves as fast
    # with each chunk whole on the next stream (benchmarks/history/2026-11-29-request-round-trip-issue-46.md)
    one_host_shares: int = 0
    inline_max_bytes: int = 1 << 20  # writes up to this size go out on the caller's thread when possible
    # each share of a write hashed as it is sent (a direct block write) sends then hashes this many payload bytes at
    # a time: still in cache from the kernel's copy, the receiver landing them meanwhile; on loopback
    # 32-48 KiB sends beat both 64-256 KiB ones and one big send, and 128 KiB or 1 MiB windows did not move 256- and
    # 2048-token requests (benchmarks/history/2026-11-29-request-round-trip-issue-46.md)
    sum_window_bytes: int = 32 << 10
    sndbuf: int = 0  # SO_SNDBUF in bytes; 0 leaves the kernel's autotuning
    rcvbuf: int = 0  # SO_RCVBUF in bytes; 0 leaves the kernel's autotuning
    # seconds for connect + handshake; on the target, the whole handshake (TLS, HELLO, proof) of an accepted
    # connection, however its bytes trickle in
    connect_timeout: float = 5.0
    io_timeout: float = 10.0  # seconds without progress before a stream (and its link) is failed
    max_frame_bytes: int = 64 << 20  # largest DATA/READ frame sent or accepted
    max_notif_bytes: int = 64 << 10  # largest notification sent or accepted
    max_inflight: int = 1024  # transfers in flight per peer (initiator waits, target refuses beyond)
    max_connections: int = 256  # authenticated connections (handshake complete), all peers together
    # connections still in their handshake (anyone can open one), apart from max_connections: beyond either bound
    # the oldest handshake of the same address (or of the address holding the most) is dropped (pdkv.channels.tcp.slots)
    max_handshakes: int = 64
    max_handshakes_per_host: int = 16
    tls: TlsOptions | None = None  # mutual TLS on every connection (pdkv.channels.tcp.tls); None: clear, as before
    # the target's threads that serve every proven connection (pdkv.channels.tcp.parking; at most max_connections):
    # one a core by default; a connection idle between frames holds none
    serve_threads: int = msgspec.field(default_factory=usable_cores)
    # a connection that waited this long for a serve thread, every one busy inside a frame, starts one more (up to
    # max_connections); so a peer that trickles its frames cannot hold the others back
    serve_wait_s: float = 0.05
    # the initiator's worker threads (pdkv.channels.tcp.workers), which send queued shares and read answers nobody
    # waits for, are ``streams`` for all its peers together; a stream or link that waited this long, every worker
    # busy, starts one more: so a peer that stops reading, or trickles an answer, cannot hold the others back
    send_wait_s: float = 0.05

    def streams_for(self, nbytes: int) -> int:
        """How many streams a transfer of ``nbytes`` is split over: shares of at least ``stream_min_bytes``."""
        return min(self.streams, max(1, nbytes // self.stream_min_bytes))

    def shares_to(self, host: str) -> int:
        """The most shares a transfer to a peer at ``host`` is cut into: ``streams``, or ``one_host_shares`` (half
        the cores when 0) where ``host`` is this one."""
        if not is_loopback(host):
            return self.streams
        return min(self.streams, self.one_host_shares or max(1, usable_cores() // 2))

    def __post_init__(self) -> None:
        checks: list[tuple[str, bool, str]] = [
            ("port", 0 <= self.port <= 65535, "0..65535"),
            ("advertise_port", 0 <= self.advertise_port <= 65535, "0..65535 (0: the listening port)"),
            (
                "advertise_host",
                not is_wildcard(self.advertise_host or self.host),
                f"an address peers can dial when host is {self.host!r}, which listens everywhere",
            ),
            ("streams", 1 <= self.streams <= MAX_STREAMS, f"1..{MAX_STREAMS}"),
            ("stream_min_bytes", self.stream_min_bytes >= 1, ">= 1"),
            ("one_host_shares", 0 <= self.one_host_shares <= MAX_STREAMS, f"0..{MAX_STREAMS} (0: half the cores)"),
            ("inline_max_bytes", self.inline_max_bytes >= 0, ">= 0"),
            ("sum_window_bytes", 8 <= self.sum_window_bytes <= 1 << 30, "8..2**30"),
            ("sndbuf", self.sndbuf >= 0, ">= 0 (0: kernel default)"),
            ("rcvbuf", self.rcvbuf >= 0, ">= 0 (0: kernel default)"),
            ("connect_timeout", self.connect_timeout > 0, "> 0 seconds"),
            ("io_timeout", self.io_timeout > 0, "> 0 seconds"),
            ("max_frame_bytes", 1 <= self.max_frame_bytes <= 1 << 40, "1..2**40"),
            ("max_notif_bytes", 0 <= self.max_notif_bytes <= 1 << 24, "0..16 MiB"),
            ("max_inflight", self.max_inflight >= 1, ">= 1"),
            ("max_connections", self.max_connections >= 1, ">= 1"),
            ("max_handshakes", self.max_handshakes >= 1, ">= 1"),
            ("serve_threads", self.serve_threads >= 1, ">= 1"),
            (
                "serve_wait_s",
                0 < self.serve_wait_s <= self.io_timeout,
                f"> 0 seconds, at most io_timeout ({self.io_timeout})",
            ),
            (
                "send_wait_s",
                0 < self.send_wait_s <= self.io_timeout,
                f"> 0 seconds, at most io_timeout ({self.io_timeout})",
            ),
            (
                "max_handshakes_per_host",
                1 <= self.max_handshakes_per_host <= self.max_handshakes,
                f"1..max_handshakes ({self.max_handshakes})",
            ),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise ConfigError(f"tcp channel option {name}={getattr(self, name)!r}: expected {expected}")


@dataclass(frozen=True)
class Agent:
    """This agent as the initiator and target sides see it.

    ``instance`` tells it from a restarted agent of the same name (in HELLO_OK
    and its metadata); ``count`` counts an event in the channel's ``stats()``,
    from any thread; ``tls`` holds the contexts built from ``opts.tls``.
    """

    name: str
    opts: TcpOptions
    secret: bytes
    instance: int
    count: Callable[[str], None]
    tls: TlsContexts | None = None
