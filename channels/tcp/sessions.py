"""The target side's sessions: one per initiator link, grouping its connections, since a transfer's shares span
them.

A transfer has landed once the LAST frame of every share has been read (``Session.end`` counts them); only then
is its notification delivered and the transfer acknowledged.
"""

from __future__ import annotations

import threading

from pdkv.channels.tcp.conn import Conn
from pdkv.errors import ProtocolError


class Ending:
    """Target-side state of one WRITE whose shares have not all arrived yet."""

    __slots__ = ("conns", "notif", "refused", "shares")

    def __init__(self, shares: int) -> None:
        self.conns: set[int] = set()
        self.shares = shares
        self.notif: bytes | None = None
        self.refused = ""  # why a share of it was refused: the whole transfer is answered with NACK


class Session:
    """The target side of one initiator link: its connections, its capability token, its partly arrived transfers."""

    def __init__(self, sid: int, peer: str, token: bytes) -> None:
        self.sid = sid
        self.peer = peer
        self.token = token
        self.conns: set[Conn] = set()
        self.ending: dict[int, Ending] = {}
        self.lock = threading.Lock()

    def end(
        self, conn: Conn, xfer: int, shares: int, notif: bytes | None, refused: str, max_inflight: int
    ) -> tuple[bool, bytes | None, str]:
        """Record that one share of a multi-stream transfer ended; returns (all ended, its notification, why
        refused)."""
        with self.lock:
            st = self.ending.get(xfer)
            if st is None:
                if len(self.ending) >= max_inflight:
                    raise ProtocolError(
                        f"tcp {conn.label}: more than max_inflight={max_inflight} transfers partly arrived"
                    )
                st = self.ending[xfer] = Ending(shares)
            if st.shares != shares or id(conn) in st.conns:
                raise ProtocolError(f"tcp {conn.label}: inconsistent shares for transfer {xfer}")
            if notif is not None:
                if st.notif is not None:
                    raise ProtocolError(f"tcp {conn.label}: transfer {xfer} carries two notifications")
                st.notif = notif
            st.refused = st.refused or refused
            st.conns.add(id(conn))
            if len(st.conns) < shares:
                return False, None, ""
            del self.ending[xfer]
            return True, st.notif, st.refused
