"""The target side of the tcp channel: the listening socket, and a reader per accepted connection that
checks the handshake, lands DATA in registered memory under the grants and answers READ_REQ.

Threads: an acceptor, and one reader per accepted connection (lands DATA,
answers READ_REQ, sends ACKs). The connections of one initiator link share a
*session* (its random id in HELLO), since a transfer's shares span them: a
transfer has landed once the LAST frame of every share has been read, and
only then is its notification delivered and the transfer acknowledged.

A frame that fails a check makes the target log an error, answer ERROR and
hang up every connection of that session, so its transfer fails on the
initiator and nothing lands outside the range the frame named. A frame
outside the grants (``Grants``) of the token its session presented lands
nothing and fails only its transfer, with NACK.
"""

from __future__ import annotations

import itertools
import logging
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable

from pdkv import native
from pdkv.auth import NONCE_BYTES, PROOF_BYTES, new_nonce
from pdkv.channels.grants import Grants
from pdkv.channels.handle import Notification
from pdkv.channels.inbox import NotificationInbox
from pdkv.channels.landing import LandingSums, Snapshot
from pdkv.channels.regions import RegionTable
from pdkv.channels.tcp import native as tcp_native
from pdkv.channels.tcp.conn import IO_ERRORS, Conn, PeerClosed, idle_deadline, set_buffers, shutdown
from pdkv.channels.tcp.options import Agent
from pdkv.channels.tcp.slots import Slots
from pdkv.channels.tcp.wire import (
    ACK,
    ANSWER,
    AUTH,
    DATA,
    ERROR,
    FRAME_NAMES,
    HELLO,
    HELLO_OK,
    INITIATOR_ROLE,
    LAST,
    MAGIC,
    MAX_ACK_BATCH,
    MAX_ERROR_BYTES,
    MAX_NAME_BYTES,
    MAX_RUNS,
    MAX_STREAMS,
    MAX_TOKEN_BYTES,
    NACK,
    NOTIF,
    NOTIF_FOLLOWS,
    READ_DATA,
    READ_REQ,
    RUN,
    SECRET,
    TARGET_ROLE,
    HandshakeTranscript,
    Header,
    no_extras,
    pack,
)
from pdkv.errors import AuthError, ChannelError, ConfigError, ProtocolError, TransferTimeout
from pdkv.ratelog import Throttled

log = logging.getLogger(__name__)

_ACK_FLUSH_BYTES = 64 << 10  # send pending ACKs before landing a payload this big, not after
# A DATA payload lands in pieces this big, each hashed right after it arrived (channels/landing.py): small enough
# to still be in cache, big enough that the extra system calls cost little.
_HASH_PIECE_BYTES = 256 << 10
FRAMES_ENV_VAR = "PDKV_NATIVE_FRAMES"
"""Set to 0 to serve every DATA frame through the Python loop while the kernels still land and hash them (the
native frame loop's reference; ``PDKV_NATIVE=0`` turns off both)."""


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


class Target:
    """Accepts the links of initiators and serves them; see the module docstring.

    The channel's ``regions`` are where frames land, its ``grants`` what
    guarded regions admit, its ``inbox`` where notifications go.
    """

    def __init__(
        self,
        agent: Agent,
        regions: RegionTable[memoryview],
        grants: Grants,
        inbox: NotificationInbox,
        landing: LandingSums | None,
    ) -> None:
        """``landing``: where DATA is received natively and hashed as it lands (clear connections), or None where
        the native kernels are not loaded (every payload then lands through Python, unhashed)."""
        self.agent = agent
        self._regions = regions
        self._landing = landing
        self._grants = grants
        self._inbox = inbox
        # DATA frames of clear connections are served by the native loop (csrc/kvframes.cpp) where the kernels
        # load, unless FRAMES_ENV_VAR says 0: then by the Python loop, the reference it must agree with
        self.native_frames = (
            landing is not None and grants.mirror is not None and not native.switched_off(FRAMES_ENV_VAR)
        )
        self._sessions: dict[int, Session] = {}
        self._accepted: dict[Conn, threading.Thread] = {}
        self._lock = threading.Lock()
        self._said = Throttled(log)
        self._slots = Slots(agent.opts, agent.name, agent.count, self._said)
        self.closed = False
        opts = agent.opts
        try:
            family, stype, proto, _, addr = socket.getaddrinfo(
                opts.host, opts.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0]
            self._listener = socket.socket(family, stype, proto)
        except OSError as exc:
            raise ConfigError(f"tcp channel cannot listen on {opts.host}:{opts.port}: {exc}") from None
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            set_buffers(self._listener, opts)
            self._listener.bind(addr)
            self._listener.listen(min(socket.SOMAXCONN, opts.max_connections))
        except OSError as exc:
            self._listener.close()
            raise ConfigError(f"tcp channel cannot listen on {opts.host}:{opts.port}: {exc}") from None
        self.port: int = self._listener.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"tcp-{agent.name}-accept", daemon=True)
        self._acceptor.start()

    def _accept_loop(self) -> None:
        """Accept every connection into a handshake slot (``Slots``: older handshakes make room), each served by
        its own reader."""
        while not self.closed:
            try:
                sock, addr = self._listener.accept()
            except OSError as exc:
                if self.closed:
                    return
                self.agent.count("data_accept_failures")
                self._said.log(logging.WARNING, "accept", "tcp %s: accept failed: %s", self.agent.name, exc)
                time.sleep(0.1)  # e.g. out of file descriptors: do not spin
                continue
            label = f"{self.agent.name}<-{addr[0]}:{addr[1]}"
            try:
                conn = Conn(sock, self.agent.opts, label)
            except OSError as exc:
                self._said.log(
                    logging.WARNING, "setup", "tcp %s: cannot set up connection %s: %s", self.agent.name, label, exc
                )
                sock.close()
                continue
            t = threading.Thread(target=self._serve, args=(conn,), name=f"tcp-{self.agent.name}-serve", daemon=True)
            with self._lock:
                if self.closed:
                    sock.close()
                    return
                self._accepted[conn] = t
            self._slots.admit(conn, addr[0])
            t.start()

    def _serve(self, conn: Conn) -> None:
        """Reader of one accepted connection: handshake, then frames until EOF or a bad frame."""
        session: Session | None = None
        try:
            conn.limit(self.agent.opts.connect_timeout, "the handshake (TLS, HELLO and proof; connect_timeout)")
            if self.agent.tls is not None:
                self._accept_tls(conn)
            session = self._handshake(conn)
            conn.limit(None)
            self._serve_frames(conn, session)
        except ProtocolError as exc:
            if isinstance(exc, AuthError):
                self.agent.count("auth_failures")
            if session is None:
                self._unproven(conn, exc)
            else:
                log.error(
                    "tcp %s: rejecting connection %s (peer %r): %s", self.agent.name, conn.label, session.peer, exc
                )
            self._hang_up(conn, session, None if self._slots.dropped(conn) else str(exc))
        except IO_ERRORS as exc:
            if session is None:
                self._unproven(conn, exc)
            elif not self.closed and not isinstance(exc, PeerClosed):
                log.warning("tcp %s: connection %s failed: %s", self.agent.name, conn.label, exc)
            elif session.ending:
                log.warning(
                    "tcp %s: %s closed with %d transfers partly arrived",
                    self.agent.name,
                    conn.label,
                    len(session.ending),
                )
            self._hang_up(conn, session, None)
        finally:
            self._slots.release(conn)
            with self._lock:
                self._accepted.pop(conn, None)
                if session is not None:
                    session.conns.discard(conn)
                    if not session.conns and self._sessions.get(session.sid) is session:
                        del self._sessions[session.sid]
            with conn.send_lock:  # another session member may be telling this one why it hangs up
                conn.sock.close()

    def _unproven(self, conn: Conn, exc: Exception) -> None:
        """A connection failed before it authenticated: said at a bounded rate (anyone can make many fail), and
        not at all when it was dropped for a newer one (``Slots`` said so) or left without a word."""
        if isinstance(exc, TransferTimeout):
            self.agent.count("handshake_timeouts")
        if self.closed or isinstance(exc, PeerClosed) or self._slots.dropped(conn):
            return
        level = logging.ERROR if isinstance(exc, ProtocolError) else logging.WARNING
        self._said.log(
            level,
            type(exc).__name__,
            "tcp %s: rejecting connection %s before it authenticated: %s",
            self.agent.name,
            conn.label,
            exc,
        )

    def _accept_tls(self, conn: Conn) -> None:
        """TLS before anything else; a peer that starts in clear is told (in clear) that TLS is required."""
        assert self.agent.tls is not None
        timeout = conn.remaining()
        deadline = idle_deadline(timeout, f"first bytes on {conn.label}")
        while True:
            try:
                first = conn.sock.recv(len(MAGIC), socket.MSG_PEEK | socket.MSG_WAITALL)
                break
            except BlockingIOError:
                deadline()
        if first == MAGIC:
            raise AuthError(
                f"tcp {conn.label}: this agent requires TLS (`tls` channel options) and the peer connected without it"
            )
        try:
            conn.start_tls(self.agent.tls.server, True, None, conn.remaining())
        except ssl.SSLError as exc:
            raise AuthError(
                f"tcp {conn.label}: TLS handshake failed: {exc.reason or exc} (the peer needs a certificate signed by "
                "this agent's `tls.ca`)"
            ) from None

    def _handshake(self, conn: Conn) -> Session:
        """HELLO, HELLO_OK and, with a secret, the peer's proof; only then does the connection join its session.

        Until it has joined, a failure hangs up this connection alone, and no
        frame of it but AUTH has been read.
        """
        deadline = idle_deadline(self.agent.opts.connect_timeout, f"handshake on {conn.label}")
        ftype, flags, shares, index, nlen, sid, _, length = conn.recv_header(deadline)
        if ftype != HELLO:
            raise ProtocolError(
                f"tcp {conn.label}: expected HELLO first, got frame type {FRAME_NAMES.get(ftype, ftype)}"
            )
        token_len = shares  # HELLO's one use of the field
        if token_len > MAX_TOKEN_BYTES:
            raise ProtocolError(f"tcp {conn.label}: HELLO with a {token_len} byte token (at most {MAX_TOKEN_BYTES})")
        no_extras(conn.label, ftype, flags, 0, nlen, SECRET)
        nonce_len = NONCE_BYTES if flags & SECRET else 0
        payload = conn.recv_payload(length, nonce_len + token_len + MAX_NAME_BYTES, "HELLO")
        if len(payload) < nonce_len + token_len:
            raise ProtocolError(
                f"tcp {conn.label}: HELLO of {len(payload)} bytes cannot hold its {nonce_len} byte nonce and "
                f"{token_len} byte token"
            )
        theirs, token, name = (
            payload[:nonce_len],
            payload[nonce_len : nonce_len + token_len],
            payload[nonce_len + token_len :],
        )
        peer = name.decode(errors="replace")
        conn.label += f" ({peer!r})"
        if self.agent.secret and not nonce_len:
            raise AuthError(
                f"tcp {conn.label}: this agent requires the shared secret and the peer has none (set the same `secret` "
                "on both sides)"
            )
        if nonce_len and not self.agent.secret:
            raise AuthError(
                f"tcp {conn.label}: the peer holds a shared secret and this agent none (set the same `secret` on both "
                "sides)"
            )
        if self.agent.secret:
            said = HandshakeTranscript(
                session=sid,
                stream=index,
                token=token,
                initiator=name,
                initiator_nonce=theirs,
                target=self.agent.name.encode(),
                instance=self.agent.instance,
                target_nonce=new_nonce(),
            )
            self._check_proof(conn, said, deadline)
        else:
            conn.send_frame(HELLO_OK, self.agent.instance, self.agent.name.encode())
        self._slots.authenticate(conn)
        with self._lock:
            session = self._sessions.get(sid)
            if session is None:
                session = self._sessions[sid] = Session(sid, peer, token)
            elif session.peer != peer or session.token != token:
                raise ProtocolError(f"tcp {conn.label}: session {sid:x} belongs to {session.peer!r} with another token")
            session.conns.add(conn)
        return session

    def _check_proof(self, conn: Conn, said: HandshakeTranscript, deadline: Callable[[], None]) -> None:
        """Prove the secret over the handshake's transcript, then read the peer's proof over the same: the one frame
        read before it checks out."""
        conn.send_frame(
            HELLO_OK,
            self.agent.instance,
            said.target_nonce + said.proof(self.agent.secret, TARGET_ROLE) + self.agent.name.encode(),
            flags=SECRET,
        )
        try:
            ftype, flags, shares, _, nlen, _, _, length = conn.recv_header(deadline)
        except (
            *IO_ERRORS,
            ProtocolError,
        ) as exc:  # leaving is what a peer with another secret does: it refuses our proof
            if self.closed:
                raise  # we hung up, at close: no failure of the peer's
            raise AuthError(f"tcp {conn.label}: no proof of the shared secret from the peer ({exc})") from None
        if ftype != AUTH or length != PROOF_BYTES:
            raise AuthError(
                f"tcp {conn.label}: {FRAME_NAMES.get(ftype, ftype)} frame of {length} bytes where the proof of the "
                "shared secret was due"
            )
        no_extras(conn.label, ftype, flags, shares, nlen)
        if not said.verify(self.agent.secret, INITIATOR_ROLE, conn.recv_payload(length, PROOF_BYTES, "proof")):
            raise AuthError(
                f"tcp {conn.label}: the peer failed to prove the shared secret (set the same `secret` on both sides)"
            )

    def _region_slice(self, conn: Conn, region: int, offset: int, length: int) -> memoryview:
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

    def _serve_frames(self, conn: Conn, session: Session) -> None:
        """The hot loop: land DATA in place; when a transfer has fully landed, notify, then ACK.

        ACKs wait in ``acks`` only while more frames are already readable (or
        until a batch is full), and go out before any large payload is landed
        or anything else is sent, so holding them never delays a transfer by
        more than the frames that were queued behind it anyway.

        On a clear connection with the kernels loaded, DATA frames are served
        by the native loop (``_native_frames``) and come back here only as
        completions to drain or as frames it hands back; every other frame,
        and every frame with TLS or ``PDKV_NATIVE_FRAMES=0``, is served here.
        """
        opts = self.agent.opts
        loop = (
            tcp_native.FrameLoop(opts.max_notif_bytes, MAX_ACK_BATCH) if self.native_frames and not conn.tls else None
        )
        cur_xfer = -1  # the transfer whose share this stream is in the middle of
        refused = ""  # why a frame of that share was refused: it lands nothing, the transfer gets NACK
        acks: list[int] = []
        while True:
            if acks and (len(acks) >= MAX_ACK_BATCH or (loop is not None and loop.pending) or not conn.readable()):
                self._send_acks(conn, acks)
            table: bytes | None = None  # a handed back frame's run table, read already
            if loop is None:
                header = conn.recv_header()
            else:
                served, table, cur_xfer, refused = self._native_frames(conn, session, loop, cur_xfer, refused, acks)
                if served is None:
                    continue  # only completions: drained
                header = served
            ftype, flags, shares, aux, nlen, xfer, offset, length = header
            if ftype == DATA:
                nruns = aux
                if xfer != cur_xfer:
                    if cur_xfer != -1:
                        raise ProtocolError(
                            f"tcp {conn.label}: DATA of transfer {xfer} inside the share of transfer {cur_xfer}"
                        )
                    cur_xfer = xfer
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
                table, runs, dest = self._runs(conn, nruns, offset, length, table)
                if acks and length >= _ACK_FLUSH_BYTES:
                    self._send_acks(conn, acks)
                refused = self._land(conn, session, table, runs, dest, length) or refused
                if flags & LAST:
                    notif = (
                        conn.recv_payload(nlen, opts.max_notif_bytes, "notification") if flags & NOTIF_FOLLOWS else None
                    )
                    cur_xfer = -1
                    self._ended(conn, session, xfer, shares, notif, refused, acks)
                    refused = ""
                continue
            if cur_xfer != -1:
                raise ProtocolError(
                    f"tcp {conn.label}: {FRAME_NAMES.get(ftype, ftype)} frame inside the share of transfer {cur_xfer}"
                )
            no_extras(conn.label, ftype, flags, shares, nlen)
            if acks:
                self._send_acks(conn, acks)
            if ftype == READ_REQ:
                view = self._region_slice(conn, aux, offset, length)
                try:
                    ticket = self._grants.begin(session.token, "read", aux, offset, length)
                except ChannelError as exc:
                    self.agent.count("refused_frames")
                    self._nack(conn, xfer, str(exc))
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

    def _native_frames(
        self, conn: Conn, session: Session, loop: tcp_native.FrameLoop, cur_xfer: int, refused: str, acks: list[int]
    ) -> tuple[Header | None, bytes | None, int, str]:
        """DATA frames served natively until the loop comes back: (the header of a frame it hands back, or None;
        that frame's run table if read; the share the connection is now in, ``cur_xfer``; ``refused``, as the
        transfers that ended leave it).

        First the completions it queued (the shares whose last frame landed)
        end as they end in the Python loop, in order; a frame handed back is
        then served by the Python loop from where the native one stopped.
        """
        assert self._landing is not None and self._grants.mirror is not None
        snap = self._landing.snapshot  # held: the regions it names stay alive while frames land under it
        loop.share[0], loop.share[1] = (0, 0) if cur_xfer == -1 else (1, cur_xfer)
        opts = self.agent.opts
        limits = (_HASH_PIECE_BYTES, conn.max_idle_ticks, opts.max_frame_bytes, opts.max_notif_bytes, _ACK_FLUSH_BYTES)
        code = loop.serve(
            conn.sock.fileno(),
            self._grants.mirror,
            session.token,
            snap.regions(self._landing.generation_address),
            limits,
            MAX_ACK_BATCH - len(acks),
            bool(acks),
        )
        for xfer, shares, notif in loop.completions():
            self._ended(conn, session, xfer, shares, notif, refused, acks)
            refused = ""
        header, table = conn.frames_served(loop, code)
        return header, table, loop.share[1] if loop.share[0] else -1, refused

    def _ended(
        self, conn: Conn, session: Session, xfer: int, shares: int, notif: bytes | None, refused: str, acks: list[int]
    ) -> None:
        """The last frame of a share of ``xfer`` landed: once every share has, notify and queue its ACK, or NACK it
        (``refused``: why a frame of this share landed nothing)."""
        # a one-stream transfer has fully landed now: no shared state to consult
        done, notif, why = (
            (True, notif, refused)
            if shares == 1
            else session.end(conn, xfer, shares, notif, refused, self.agent.opts.max_inflight)
        )
        if done and why:
            self._send_acks(conn, acks)
            self._nack(conn, xfer, why)
        elif done:
            answer, why = self._take(session, notif) if notif is not None else (None, "")
            if answer:
                self._send_acks(conn, acks)
                with conn.send_lock:
                    conn.send([pack(ANSWER, xfer, len(answer)), answer])
            elif why:
                self._send_acks(conn, acks)
                self._nack(conn, xfer, why)
            else:
                acks.append(xfer)

    def _take(self, session: Session, notif: bytes) -> tuple[bytes | None, str]:
        """The transfer's notification, taken on this thread (``NotificationInbox.take``): (the answer to send back,
        b"" for a plain ACK, None where it went to the inbox; why the transfer is NACKed instead, where no answer
        can go: the answerer failed, or answered more than ``max_notif_bytes``)."""
        try:
            taken = self._inbox.take([Notification(session.peer, notif)])
            answer = None if taken is None else taken[0]
        except Exception as exc:
            log.exception("tcp %s: answering a notification from %r failed", self.agent.name, session.peer)
            return None, f"the target could not take its notification: {exc}"
        limit = self.agent.opts.max_notif_bytes
        if answer is not None and len(answer) > limit:
            log.error("tcp %s: an answer of %d bytes exceeds max_notif_bytes=%d", self.agent.name, len(answer), limit)
            return None, f"its answer exceeds max_notif_bytes={limit}"
        return answer, ""

    def _runs(
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
        views = [self._region_slice(conn, region, off, n) for region, off, n in runs]
        total = sum(n for _, _, n in runs)
        if total != length:
            raise ProtocolError(f"tcp {conn.label}: DATA runs add up to {total} bytes, the frame says {length}")
        ordered = sorted(runs)
        for (r0, o0, n0), (r1, o1, _) in itertools.pairwise(ordered):
            if r0 == r1 and o1 < o0 + n0:
                raise ProtocolError(f"tcp {conn.label}: DATA runs overlap in region {r0}: [{o0}, {o0 + n0}) and {o1}")
        return table, runs, views

    def _land(
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

        ``dest`` is where ``_runs`` says it lands: natively under a region
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
                conn.recv_runs(table, len(runs), dest, length, _HASH_PIECE_BYTES)
            else:
                conn.recv_views(dest, length)
        finally:
            self._grants.end(ticket)
        return ""

    @staticmethod
    def _nack(conn: Conn, xfer: int, why: str) -> None:
        conn.send_frame(NACK, xfer, why.encode()[:MAX_ERROR_BYTES])

    @staticmethod
    def _send_acks(conn: Conn, acks: list[int]) -> None:
        if not acks:
            return
        n = len(acks)
        hdr = pack(ACK, acks[0], 8 * (n - 1), aux=n)
        with conn.send_lock:
            conn.send([hdr, struct.pack(f"<{n - 1}Q", *acks[1:])] if n > 1 else [hdr])
        acks.clear()

    def _hang_up(self, conn: Conn, session: Session | None, reason: str | None) -> None:
        """Hang up every connection of the session (its transfers span them all), telling each ``reason`` first.

        Each initiator stream then fails with the reason rather than with a bare
        EOF. Every ERROR goes out before the first hang-up, since each hang-up
        makes that connection's own thread hang up the rest of the session.
        """
        with self._lock:
            conns = list(session.conns) if session is not None else [conn]
        if reason is not None:
            for c in conns:
                try:
                    c.send_frame(ERROR, payload=reason.encode()[:MAX_ERROR_BYTES])
                except IO_ERRORS:
                    pass
        for c in conns:
            shutdown(c.sock)

    def fence(self, peer: str, token: bytes) -> None:
        """Hang up every session that presented ``token`` and wait for their readers: nothing queued behind them
        lands."""
        with self._lock:
            sessions = [sess for sess in self._sessions.values() if sess.token == token]
            threads = [self._accepted[c] for sess in sessions for c in sess.conns if c in self._accepted]
        for sess in sessions:
            conns = list(sess.conns)
            if conns:
                self._hang_up(
                    conns[0], sess, f"fenced by {self.agent.name!r}: it went silent mid-transfer; handshake again"
                )
        deadline = time.monotonic() + self.agent.opts.io_timeout
        for t in threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))
        log.warning("tcp %s: fenced peer %r: cut %d data connection(s)", self.agent.name, peer, len(threads))

    def close(self) -> list[threading.Thread]:
        """Stop listening and hang up every accepted connection; returns the threads to join (acceptor, readers)."""
        with self._lock:
            self.closed = True
            accepted = dict(self._accepted)
        shutdown(self._listener)
        self._listener.close()
        for conn in accepted:
            shutdown(conn.sock)
        return [self._acceptor, *accepted.values()]
