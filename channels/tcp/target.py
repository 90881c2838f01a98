"""The target side of the tcp channel: the listening socket, a thread per accepted connection for its handshake
(``handshake.respond``), which joins it to its session, and the serve threads that serve its frames
(``FrameServer``) from then on.

Threads: an acceptor; one per connection still in its handshake (at most
``max_handshakes``); the serve pool's watcher and its serve threads
(``parking.ServePool``: ``serve_threads`` of them, more only while every one
is held inside a frame), which land DATA, answer READ_REQ and send ACKs. A
connection idle between frames is parked and holds no thread, unless there
are no more connections than serve threads (then a thread keeps it). The
connections of one initiator link share a
*session* (its random id in HELLO; ``Session``), since a transfer's shares
span them: a transfer has landed once the LAST frame of every share has been
read, and only then is its notification delivered and the transfer
acknowledged.

A frame that fails a check makes the target log an error, answer ERROR and
hang up every connection of that session, so its transfer fails on the
initiator and nothing lands outside the range the frame named. A frame
outside the grants (``Grants``) of the token its session presented lands
nothing and fails only its transfer, with NACK.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

from pdkv.channels.tcp import handshake
from pdkv.channels.tcp.conn import IO_ERRORS, Conn, PeerClosed, set_buffers, shutdown
from pdkv.channels.tcp.frames import Crowd, FrameServer, Serving
from pdkv.channels.tcp.options import Agent
from pdkv.channels.tcp.parking import ServePool
from pdkv.channels.tcp.sessions import Session
from pdkv.channels.tcp.slots import Slots
from pdkv.channels.tcp.wire import ERROR, MAX_ERROR_BYTES
from pdkv.errors import AuthError, ConfigError, ProtocolError, TransferTimeout
from pdkv.ratelog import Throttled

log = logging.getLogger(__name__)


class Target:
    """Accepts the links of initiators and serves them; see the module docstring.

    ``frames`` serves the frames of every connection that completed its
    handshake: into the channel's regions, under its grants, notifications
    to its inbox.
    """

    def __init__(self, agent: Agent, frames: FrameServer) -> None:
        self.agent = agent
        self.frames = frames
        self._sessions: dict[int, Session] = {}
        self._accepted: dict[Conn, threading.Event] = {}  # set once the connection is over and closed
        self._greeting: set[threading.Thread] = set()  # the handshakes in progress
        self._here = threading.local()  # the connection this thread is serving, if any (fence waits out the others)
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
        self._pool: ServePool[Serving] = ServePool(agent, lambda s: self._turn(s, self._pool))
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"tcp-{agent.name}-accept", daemon=True)
        self._acceptor.start()

    @property
    def pool(self) -> ServePool[Serving]:
        """The serve threads and the connections parked with them (``parking.ServePool``: ``parked()``,
        ``crowded``)."""
        return self._pool

    def _accept_loop(self) -> None:
        """Accept every connection into a handshake slot (``Slots``: older handshakes make room), each greeted on
        a thread of its own."""
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
            t = threading.Thread(target=self._greet, args=(conn,), name=f"tcp-{self.agent.name}-greet", daemon=True)
            with self._lock:
                if self.closed:
                    sock.close()
                    return
                self._accepted[conn] = threading.Event()
                self._greeting.add(t)
            self._slots.admit(conn, addr[0])
            t.start()

    def _greet(self, conn: Conn) -> None:
        """One accepted connection's handshake; then its first turn of frames on this thread (they usually follow
        at once), and the pool's serve threads take it from there."""
        session: Session | None = None
        try:
            try:
                bound = "the handshake (TLS, HELLO and proof; connect_timeout)"
                conn.patience.limit(self.agent.opts.connect_timeout, bound)
                session = self._join(conn, handshake.respond(conn, self.agent, lambda: self.closed))
                conn.patience.limit(None)
                serving = self.frames.serving(conn, session)
            except BaseException as exc:  # noqa: BLE001 - every way out ends the connection, said by its kind
                self._ended(conn, session, exc)
                return
            self._pool.run(serving, lambda s: self._turn(s, None))
        finally:
            with self._lock:
                self._greeting.discard(threading.current_thread())

    def _turn(self, s: Serving, crowd: Crowd | None) -> bool:
        """Serve ``s``'s frames until it is idle between frames (True: park it) or over (False: finished here);
        ``crowd``: whether this thread may keep it while it waits for more (``FrameServer.serve``)."""
        self._here.conn = s.conn
        try:
            self.frames.serve(s, crowd)
            return True
        except BaseException as exc:  # noqa: BLE001 - every way out ends the connection, said by its kind
            self._ended(s.conn, s.session, exc)
            return False
        finally:
            self._here.conn = None

    def _ended(self, conn: Conn, session: Session | None, exc: BaseException) -> None:
        """The connection is over (``exc`` says why): said, its session hung up as it must be, and closed."""
        try:
            self._say_ended(conn, session, exc)
        finally:
            self._finish(conn, session)

    def _say_ended(self, conn: Conn, session: Session | None, exc: BaseException) -> None:
        if not isinstance(exc, (ProtocolError, *IO_ERRORS)):  # a bug of ours: said loudly, the peer told nothing
            log.error("tcp %s: serving %s failed", self.agent.name, conn.label, exc_info=exc)
            self._hang_up(conn, session, None)
            return
        if isinstance(exc, ProtocolError):
            if isinstance(exc, AuthError):
                self.agent.count("auth_failures")
            if session is None:
                self._unproven(conn, exc)
            else:
                log.error(
                    "tcp %s: rejecting connection %s (peer %r): %s", self.agent.name, conn.label, session.peer, exc
                )
            self._hang_up(conn, session, None if self._slots.dropped(conn) else str(exc))
            return
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

    def _finish(self, conn: Conn, session: Session | None) -> None:
        """Exactly once per accepted connection: its slot, its session membership and its socket given back."""
        self._slots.release(conn)
        self._pool.forget(conn.sock.fileno())
        with self._lock:
            done = self._accepted.pop(conn, None)
            if session is not None:
                session.conns.discard(conn)
                if not session.conns and self._sessions.get(session.sid) is session:
                    del self._sessions[session.sid]
        with conn.send_lock:  # another session member may be telling this one why it hangs up
            conn.sock.close()
        if done is not None:
            done.set()

    def _unproven(self, conn: Conn, exc: BaseException) -> None:
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

    def _join(self, conn: Conn, hello: handshake.Hello) -> Session:
        """The proven connection takes an authenticated slot (``Slots``) and joins the session its HELLO names."""
        self._slots.authenticate(conn)
        peer = hello.peer
        with self._lock:
            session = self._sessions.get(hello.session)
            if session is None:
                session = self._sessions[hello.session] = Session(hello.session, peer, hello.token)
            elif session.peer != peer or session.token != hello.token:
                raise ProtocolError(
                    f"tcp {conn.label}: session {hello.session:x} belongs to {session.peer!r} with another token"
                )
            session.conns.add(conn)
        return session

    def _hang_up(self, conn: Conn, session: Session | None, reason: str | None) -> None:
        """Hang up every connection of the session (its transfers span them all), telling each ``reason`` first.

        Each initiator stream then fails with the reason rather than with a bare
        EOF. Every ERROR goes out before the first hang-up, since each hang-up
        makes the thread that serves that connection next (parked or kept, it
        is woken) hang up the rest of the session.
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
        """Hang up every session that presented ``token`` and wait until each of its connections is over, served or
        parked: nothing queued behind them lands."""
        mine = getattr(self._here, "conn", None)  # called while serving one of them: that one ends after this
        with self._lock:
            sessions = [sess for sess in self._sessions.values() if sess.token == token]
            conns = [c for sess in sessions for c in sess.conns]
            overs = [self._accepted[c] for c in conns if c in self._accepted and c is not mine]
        for sess in sessions:
            members = list(sess.conns)
            if members:
                self._hang_up(
                    members[0], sess, f"fenced by {self.agent.name!r}: it went silent mid-transfer; handshake again"
                )
        deadline = time.monotonic() + self.agent.opts.io_timeout
        for over in overs:
            over.wait(max(0.0, deadline - time.monotonic()))
        log.warning("tcp %s: fenced peer %r: cut %d data connection(s)", self.agent.name, peer, len(conns))

    def close(self) -> list[threading.Thread]:
        """Stop listening and hang up every accepted connection; returns the threads to join (acceptor, handshakes,
        the serve pool's). The connections parked are finished here, since no thread holds them."""
        with self._lock:
            self.closed = True
            accepted = list(self._accepted)
            greeting = list(self._greeting)
        shutdown(self._listener)
        self._listener.close()
        for conn in accepted:
            shutdown(conn.sock)
        threads = self._pool.close()
        for parked in self._pool.parked():
            self._finish(parked.conn, parked.session)
        return [self._acceptor, *greeting, *threads]
