"""The target's frame loop: every frame of an authenticated connection, until EOF or a bad frame.

DATA lands in place (``Lander``); when a transfer has fully landed it is answered (``Replies``). READ_REQ is
answered with READ_DATA from the region it names, NOTIF delivered. On a clear connection with the kernels
loaded, DATA frames are served by the native loop (csrc/kvframes.cpp, ``tcp_native.FrameLoop``), which comes
back here with the transfers that ended and with any frame it leaves to the Python loop, its reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from pdkv import native
from pdkv.channels.grants import Grants
from pdkv.channels.inbox import NotificationInbox
from pdkv.channels.landing import LandingSums
from pdkv.channels.regions import RegionTable
from pdkv.channels.tcp import native as tcp_native
from pdkv.channels.tcp.conn import Conn, shutdown
from pdkv.channels.tcp.lander import HASH_PIECE_BYTES, Lander
from pdkv.channels.tcp.options import Agent
from pdkv.channels.tcp.replies import Replies
from pdkv.channels.tcp.sessions import Session
from pdkv.channels.tcp.wire import (
    DATA,
    FRAME_NAMES,
    LAST,
    MAX_ACK_BATCH,
    MAX_STREAMS,
    NOTIF,
    NOTIF_FOLLOWS,
    READ_DATA,
    READ_REQ,
    Header,
    no_extras,
    pack,
)
from pdkv.errors import ChannelError, ProtocolError

ACK_FLUSH_BYTES = 64 << 10  # send pending ACKs before landing a payload this big, not after
FRAMES_ENV_VAR = "PDKV_NATIVE_FRAMES"
"""Set to 0 to serve every DATA frame through the Python loop while the kernels still land and hash them (the
native frame loop's reference; ``PDKV_NATIVE=0`` turns off both)."""


class Crowd(Protocol):
    """Whether a serve thread may keep the connection it serves (``parking.ServePool``): not while ``crowded``;
    ``crowd_fd`` becomes readable the moment it may not, which ends the native loop's wait between frames."""

    crowd_fd: int
    crowded: bool


@dataclass(eq=False)
class Serving:
    """One proven connection as its frame loop left it: between turns (parked, ``parking.ServePool``) it is owned by
    no thread, and the next turn goes on from here, on whichever serve thread takes it.

    ``cur_xfer``: the transfer whose share the connection is in the middle of (-1: none); ``refused``: why a frame
    of that share was refused (it lands nothing, the transfer gets NACK); ``acks``: transfers landed and not yet
    acknowledged (empty whenever it is parked); ``loop``: its native frame loop (None: the Python loop serves it).
    """

    conn: Conn
    session: Session
    loop: tcp_native.FrameLoop | None
    cur_xfer: int = -1
    refused: str = ""
    acks: list[int] = field(default_factory=list)

    def fileno(self) -> int:
        return self.conn.sock.fileno()

    def hang_up(self) -> None:
        shutdown(self.conn.sock)


class FrameServer:
    """Serves the frames of the target's authenticated connections into its ``regions`` under its ``grants``,
    notifications to its ``inbox``; ``landing``: where DATA is received natively and hashed as it lands (clear
    connections), or None where the native kernels are not loaded (every payload then lands through Python,
    unhashed).

    ``native``: whether clear connections' DATA frames are served by the native loop (where the kernels load,
    unless ``FRAMES_ENV_VAR`` says 0).
    """

    def __init__(
        self,
        agent: Agent,
        regions: RegionTable[memoryview],
        grants: Grants,
        inbox: NotificationInbox,
        landing: LandingSums | None,
    ) -> None:
        self.agent = agent
        self._grants = grants
        self._inbox = inbox
        self._landing = landing
        self.lander = Lander(agent, regions, grants, landing)
        self.replies = Replies(agent, inbox)
        self.native = landing is not None and grants.mirror is not None and not native.switched_off(FRAMES_ENV_VAR)

    def serving(self, conn: Conn, session: Session) -> Serving:
        """A proven connection's frame loop state, before its first turn."""
        native_loop = self.native and not conn.tls
        opts = self.agent.opts
        return Serving(
            conn, session, tcp_native.FrameLoop(opts.max_notif_bytes, MAX_ACK_BATCH) if native_loop else None
        )

    def serve(self, s: Serving, crowd: Crowd | None) -> None:
        """One turn of the hot loop: land DATA in place; when a transfer has fully landed, notify, then ACK; return
        once the connection is idle between frames (its ACKs sent), to be parked until more bytes come.

        Unless ``crowd`` lets this thread keep the connection (a serve thread
        of a pool with no more connections than threads; None: a handshake's
        thread, which never keeps one): then, natively served, it waits for
        the next frame in the native loop, woken by its bytes as a thread of
        its own would be, and returns once it is idle and the pool crowded.

        ACKs wait in ``acks`` only while more frames are already readable (or
        until a batch is full), and go out before any large payload is landed
        or anything else is sent, so holding them never delays a transfer by
        more than the frames that were queued behind it anyway.

        On a clear connection with the kernels loaded, DATA frames are served
        by the native loop (``_serve_native``) and come back here only as
        completions to drain or as frames it hands back; every other frame,
        and every frame with TLS or ``PDKV_NATIVE_FRAMES=0``, is served here.
        """
        conn, session, loop, acks = s.conn, s.session, s.loop, s.acks
        opts = self.agent.opts
        lander, replies = self.lander, self.replies
        while True:
            waiting = loop is not None and loop.pending  # a header the native loop read and left to serve next
            keep = crowd is not None and loop is not None and not crowd.crowded  # may wait in the native loop
            wake = crowd.crowd_fd if keep and crowd is not None else -1
            readable = waiting or (keep and not acks) or conn.readable()  # (the native loop polls for itself)
            if acks and (len(acks) >= MAX_ACK_BATCH or waiting or not readable):
                replies.send_acks(conn, acks)
            if not readable and not keep:
                return  # idle between frames: parked until more bytes come
            table: bytes | None = None  # a handed back frame's run table, read already
            if loop is None:
                header = conn.recv_header()
            else:
                served, table, idle = self._serve_native(s, loop, wake)
                if idle:
                    if acks:
                        replies.send_acks(conn, acks)
                    return  # the pool needs this thread: parked
                if served is None:
                    continue  # only completions: drained
                header = served
            ftype, flags, shares, aux, nlen, xfer, offset, length = header
            if ftype == DATA:
                nruns = aux
                if xfer != s.cur_xfer:
                    if s.cur_xfer != -1:
                        raise ProtocolError(
                            f"tcp {conn.label}: DATA of transfer {xfer} inside the share of transfer {s.cur_xfer}"
                        )
                    s.cur_xfer = xfer
                # everything checked before a byte lands: flags, the share count, the notification size, every run
                bad = (
                    flags & ~(LAST | NOTIF_FOLLOWS)
                    or nlen > opts.max_notif_bytes
                    or (nlen and not flags & NOTIF_FOLLOWS)
                )
                if bad or (not 1 <= shares <= MAX_STREAMS if flags & LAST else flags or shares):
                    raise ProtocolError(
                        f"tcp {conn.label}: DATA with flags={flags} shares={shares} notif={nlen} "
                        f"(max {MAX_STREAMS} shares, max_notif_bytes={opts.max_notif_bytes})"
                    )
                table, runs, dest = lander.runs(conn, nruns, offset, length, table)
                if acks and length >= ACK_FLUSH_BYTES:
                    replies.send_acks(conn, acks)
                s.refused = lander.land(conn, session, table, runs, dest, length) or s.refused
                if flags & LAST:
                    notif = (
                        conn.recv_payload(nlen, opts.max_notif_bytes, "notification") if flags & NOTIF_FOLLOWS else None
                    )
                    s.cur_xfer = -1
                    replies.ended(conn, session, xfer, shares, notif, s.refused, acks)
                    s.refused = ""
                continue
            if s.cur_xfer != -1:
                raise ProtocolError(
                    f"tcp {conn.label}: {FRAME_NAMES.get(ftype, ftype)} frame inside the share of transfer {s.cur_xfer}"
                )
            no_extras(conn.label, ftype, flags, shares, nlen)
            if acks:
                replies.send_acks(conn, acks)
            if ftype == READ_REQ:
                view = lander.region_slice(conn, aux, offset, length)
                try:
                    ticket = self._grants.begin(session.token, "read", aux, offset, length)
                except ChannelError as exc:
                    self.agent.count("refused_frames")
                    replies.nack(conn, xfer, str(exc))
                    continue
                try:
                    with conn.send_lock:
                        conn.send([pack(READ_DATA, xfer, length), view])
                finally:
                    self._grants.end(ticket)
            elif ftype == NOTIF:
                self._inbox.deliver(session.peer, conn.recv_payload(length, opts.max_notif_bytes, "notification"))
            else:
                raise ProtocolError(f"tcp {conn.label}: unexpected frame type {FRAME_NAMES.get(ftype, ftype)}")

    def _serve_native(
        self, s: Serving, loop: tcp_native.FrameLoop, wake: int
    ) -> tuple[Header | None, bytes | None, bool]:
        """DATA frames served natively until the loop comes back: (the header of a frame it hands back, or None;
        that frame's run table if read; whether it came back idle, ``wake`` readable before a frame began); ``s``
        left in the share the connection is now in.

        First the completions it queued (the shares whose last frame landed)
        end as they end in the Python loop, in order; a frame handed back is
        then served by the Python loop from where the native one stopped.
        """
        assert self._landing is not None and self._grants.mirror is not None
        conn, session, acks = s.conn, s.session, s.acks
        snap = self._landing.snapshot  # held: the regions it names stay alive while frames land under it
        loop.share[0], loop.share[1] = (0, 0) if s.cur_xfer == -1 else (1, s.cur_xfer)
        opts = self.agent.opts
        ticks = conn.patience.max_idle_ticks
        limits = (HASH_PIECE_BYTES, ticks, opts.max_frame_bytes, opts.max_notif_bytes, ACK_FLUSH_BYTES)
        code = loop.serve(
            conn.sock.fileno(),
            self._grants.mirror,
            session.token,
            snap.regions(self._landing.generation_address),
            limits,
            MAX_ACK_BATCH - len(acks),
            bool(acks),
            wake,
        )
        for xfer, shares, notif in loop.completions():
            self.replies.ended(conn, session, xfer, shares, notif, s.refused, acks)
            s.refused = ""
        header, table = conn.frames_served(loop, code)
        s.cur_xfer = loop.share[1] if loop.share[0] else -1
        return header, table, code == tcp_native.FRAME_IDLE
