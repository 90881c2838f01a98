"""Where a DATA frame's bytes land on the target: its run table checked against the registered regions, then the
payload received into the runs if the session's grants cover every one of them, else read away.

Everything is checked before a byte lands; a bad run is a ProtocolError (the session is hung up), a run outside
the grants refuses the frame's transfer (NACK). The Python frame loop lands every frame through here; the native
one (csrc/kvframes.cpp) does the same checks itself and hands back what it refuses.
"""

from __future__ import annotations

import itertools
import logging

from pdkv.channels.grants import Grants
from pdkv.channels.landing import LandingSums, Snapshot
from pdkv.channels.regions import RegionTable
from pdkv.channels.tcp import native as tcp_native
from pdkv.channels.tcp.conn import Conn
from pdkv.channels.tcp.options import Agent
from pdkv.channels.tcp.sessions import Session
from pdkv.channels.tcp.wire import MAX_RUNS, RUN
from pdkv.errors import ChannelError, ProtocolError

log = logging.getLogger(__name__)

# A DATA payload lands in pieces this big, each hashed right after it arrived (channels/landing.py): small enough
# to still be in cache, big enough that the extra system calls cost little.
HASH_PIECE_BYTES = 256 << 10


class Lander:
    """Checks and lands DATA frames into the channel's ``regions`` under its ``grants``; ``landing``: where a clear
    connection's payload is received natively and hashed as it lands, or None (every payload through Python)."""

    def __init__(
        self, agent: Agent, regions: RegionTable[memoryview], grants: Grants, landing: LandingSums | None
    ) -> None:
        self.agent = agent
        self._regions = regions
        self._grants = grants
        self._landing = landing

    def region_slice(self, conn: Conn, region: int, offset: int, length: int) -> memoryview:
        """The view a DATA/READ_REQ frame names, or ProtocolError: nothing outside a region, ever."""
        view = self._regions.get(region)
        if view is None:
            raise ProtocolError(f"tcp {conn.label}: frame names region {region}, which is not registered here")
        if length == 0 or length > self.agent.opts.max_frame_bytes or offset + length > view.nbytes:
            raise ProtocolError(
                f"tcp {conn.label}: frame range offset={offset} length={length} does not fit region {region} "
                f"of {view.nbytes} bytes (max_frame_bytes={self.agent.opts.max_frame_bytes})"
            )
        return view[offset : offset + length]

    def runs(
        self, conn: Conn, nruns: int, offset: int, length: int, table: bytes | None = None
    ) -> tuple[bytes, list[tuple[int, int, int]], Snapshot | list[memoryview]]:
        """A DATA frame's run table (as sent, and read), checked, and where it lands; ProtocolError if any run is bad.

        Every run must lie inside a registered region and not be empty, no two may
        overlap, and together they must be the frame's ``length``, which is at
        most ``max_frame_bytes``: all checked before a byte of the payload lands.
        On a clear connection the native check does it in one call, and the
        frame lands natively under the region snapshot it was checked against;
        else (or if that check fails: these checks then name the bad run) the
        runs' views are built and checked here, and the frame lands through them.
        ``table``: the run table where the native loop read it already.
        """
        max_frame = self.agent.opts.max_frame_bytes
        if not 1 <= nruns <= MAX_RUNS or offset or not 0 < length <= max_frame:
            raise ProtocolError(
                f"tcp {conn.label}: DATA frame of {nruns} runs, offset field {offset}, {length} bytes (1..{MAX_RUNS} "
                f"runs, offset 0, max_frame_bytes={max_frame})"
            )
        if table is None:
            table = conn.recv_payload(nruns * RUN.size, MAX_RUNS * RUN.size, "DATA run table")
        runs = list(RUN.iter_unpack(table))
        if self._landing is not None and not conn.tls:
            snap = self._landing.snapshot
            if tcp_native.check_runs(table, nruns, snap.address, snap.count, length):
                return table, runs, snap
        views = [self.region_slice(conn, region, off, n) for region, off, n in runs]
        total = sum(n for _, _, n in runs)
        if total != length:
            raise ProtocolError(f"tcp {conn.label}: DATA runs add up to {total} bytes, the frame says {length}")
        ordered = sorted(runs)
        for (r0, o0, n0), (r1, o1, _) in itertools.pairwise(ordered):
            if r0 == r1 and o1 < o0 + n0:
                raise ProtocolError(f"tcp {conn.label}: DATA runs overlap in region {r0}: [{o0}, {o0 + n0}) and {o1}")
        return table, runs, views

    def land(
        self,
        conn: Conn,
        session: Session,
        table: bytes,
        runs: list[tuple[int, int, int]],
        dest: Snapshot | list[memoryview],
        length: int,
    ) -> str:
        """Receive a DATA payload into its runs if the session's grants allow every run, else read it away; why
        refused, or "".

        ``dest`` is where ``runs`` says it lands: natively under a region
        snapshot (which keeps the regions alive meanwhile), each hashed piece
        while the ticket is held, so a revoke waits for the hashing too; or
        through the runs' views.
        """
        try:
            ticket = self._grants.begin_many(session.token, "write", runs)
        except ChannelError as exc:
            self.agent.count("refused_frames")
            log.warning("tcp %s: refusing a write from %r: %s", self.agent.name, session.peer, exc)
            conn.drain(length)
            return str(exc)
        try:
            if isinstance(dest, Snapshot):
                conn.recv_runs(table, len(runs), dest, length, HASH_PIECE_BYTES)
            else:
                conn.recv_views(dest, length)
        finally:
            self._grants.end(ticket)
        return ""
