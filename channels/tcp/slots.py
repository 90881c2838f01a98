"""Who may hold a connection on the tcp channel's listener, and how refusals are said.

Anyone who reaches the data port can open a connection, and until its
handshake has proved the secret it is nobody's. So connections still in
their handshake get a small budget of their own (``max_handshakes``, at most
``max_handshakes_per_host`` from one source address), apart from the
``max_connections`` of those that completed it: an attacker who opens
thousands of idle or trickling connections fills only the first, and an
authenticated peer always finds a slot. When the budget is full a new
connection is still admitted, and the oldest handshake of its own address
(or, with the total full, of the address that holds the most) is dropped:
every handshake is bounded by ``connect_timeout`` anyway, a real one takes a
round trip, so the oldest is the one least likely to be a peer about to
prove itself, and a flood from one address never pushes out another's.

What keeps happening (anyone can make connections fail) is said at a bounded rate (``pdkv.ratelog``), and counted.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable

from pdkv.channels.tcp.conn import Conn, shutdown
from pdkv.channels.tcp.options import TcpOptions
from pdkv.errors import HandshakeError
from pdkv.ratelog import Throttled


class Slots:
    """The listener's two budgets: handshaking connections per source address and in all, and authenticated ones.

    ``admit`` takes every accepted connection, dropping older handshakes to
    make room; ``authenticate`` moves one that proved itself to the
    authenticated budget, or refuses it; ``release`` gives back whichever slot
    a connection held. The drop (a ``shutdown``, which wakes the connection's
    reader) happens under the lock ``release`` takes, so a socket is never
    shut down after its owner closed it.
    """

    def __init__(self, opts: TcpOptions, name: str, count: Callable[[str], None], said: Throttled) -> None:
        self._opts = opts
        self._name = name
        self._count = count
        self._said = said
        self._lock = threading.Lock()
        self._handshaking: dict[Conn, str] = {}  # in arrival order: the oldest first
        self._per_host: collections.Counter[str] = collections.Counter()
        self._authenticated: set[Conn] = set()
        self._dropped: set[Conn] = set()

    def admit(self, conn: Conn, host: str) -> None:
        """Give ``conn`` (from ``host``) a handshake slot, dropping the oldest handshake of ``host`` when it holds
        ``max_handshakes_per_host``, else of the busiest address when ``max_handshakes`` are under way."""
        opts = self._opts
        with self._lock:
            victim_host = None
            if self._per_host[host] >= opts.max_handshakes_per_host:
                victim_host = host
            elif len(self._handshaking) >= opts.max_handshakes:
                victim_host = self._per_host.most_common(1)[0][0]
            if victim_host is not None:
                victim = next(c for c, h in self._handshaking.items() if h == victim_host)
                self._forget(victim)
                self._dropped.add(victim)
                shutdown(victim.sock)
            self._handshaking[conn] = host
            self._per_host[host] += 1
        if victim_host is not None:
            self._count("handshakes_dropped")
            self._said.log(
                logging.WARNING,
                "dropped",
                "tcp %s: dropped the oldest unauthenticated connection from %s to admit %s (max_handshakes=%d, "
                "max_handshakes_per_host=%d: many connections that do not complete their handshake, an attack or a "
                "misconfigured peer)",
                self._name,
                victim_host,
                conn.label,
                opts.max_handshakes,
                opts.max_handshakes_per_host,
            )

    def authenticate(self, conn: Conn) -> None:
        """Move ``conn``, whose handshake just completed, to the authenticated budget; HandshakeError if it was
        dropped meanwhile or ``max_connections`` authenticated connections are open."""
        with self._lock:
            if conn in self._dropped:
                raise HandshakeError(f"tcp {conn.label}: dropped to admit newer connections before it authenticated")
            full = len(self._authenticated) >= self._opts.max_connections
            if not full:
                self._forget(conn)
                self._authenticated.add(conn)
                return
        self._count("connections_refused")
        raise HandshakeError(
            f"tcp {conn.label}: refused: max_connections={self._opts.max_connections} authenticated connections are "
            "open here (raise max_connections, or fewer streams per peer)"
        )

    def dropped(self, conn: Conn) -> bool:
        """Whether ``conn`` was dropped to admit a newer connection (its reader then failed through no fault of its
        peer's own making, which need not be logged again)."""
        with self._lock:
            return conn in self._dropped

    def release(self, conn: Conn) -> None:
        """``conn`` is closing: whatever slot it held is free."""
        with self._lock:
            self._forget(conn)
            self._authenticated.discard(conn)
            self._dropped.discard(conn)

    def _forget(self, conn: Conn) -> None:
        host = self._handshaking.pop(conn, None)
        if host is not None:
            self._per_host[host] -= 1
            if not self._per_host[host]:
                del self._per_host[host]
