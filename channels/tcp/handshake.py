"""A data connection's handshake, both halves: what HELLO says, the proofs over the whole transcript, the TLS branch.

The initiator ``dial``s: TCP, TLS if configured, HELLO (its link's session id, the stream's index, its token and
name, and with a secret a fresh nonce), then HELLO_OK's check: the target's name and instance must be the ones its
metadata named and, with a secret, its proof must check out before ours (AUTH) goes out, so KV never goes to an
agent without the secret and our proof never to one that lacks it. The target ``respond``s: TLS first if required,
HELLO, then HELLO_OK (with a secret, carrying its own proof, after which it reads nothing but AUTH until the
initiator's proof checks out); only then may the connection join its session (the target's business: ``Target``).
Both proofs cover everything either side said (``HandshakeTranscript``). The design: channels/README.md, "tcp";
the frames: wire.py.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass

from pdkv.auth import NONCE_BYTES, PROOF_BYTES, bound_proof, new_nonce, transcript, verify_bound
from pdkv.channels.tcp.conn import IO_ERRORS, Conn, set_buffers
from pdkv.channels.tcp.options import Agent
from pdkv.channels.tcp.wire import (
    AUTH,
    ERROR,
    FRAME_NAMES,
    HELLO,
    HELLO_OK,
    MAGIC,
    MAX_ERROR_BYTES,
    MAX_NAME_BYTES,
    MAX_TOKEN_BYTES,
    SECRET,
    Meta,
    no_extras,
)
from pdkv.errors import AuthError, ChannelError, ProtocolError

# proof roles: a target's proof is never an initiator's, and neither is ever a control-plane one
TARGET_ROLE, INITIATOR_ROLE = "tcp-target", "tcp-initiator"


@dataclass(frozen=True, kw_only=True)
class HandshakeTranscript:
    """Everything a data connection's HELLO and HELLO_OK say: both proofs cover all of it (``pdkv.auth``).

    A proof over the nonces alone would vouch for a listener whatever name and instance came with it, and for
    an initiator whatever session, stream and token: bound to the transcript, a proof checks out only for the
    exact exchange both ends took part in.
    """

    session: int  # the initiator's session id (HELLO's xfer)
    stream: int  # its stream index (HELLO's aux)
    token: bytes
    initiator: bytes  # its agent name
    initiator_nonce: bytes
    target: bytes  # the listener's agent name
    instance: int  # the listener's instance (HELLO_OK's xfer)
    target_nonce: bytes

    def proof(self, secret: bytes, role: str) -> bytes:
        return bound_proof(secret, role, self.digest())

    def verify(self, secret: bytes, role: str, given: bytes) -> bool:
        return len(self.initiator_nonce) == len(self.target_nonce) == NONCE_BYTES and verify_bound(
            secret, role, self.digest(), given
        )

    def digest(self) -> bytes:
        return transcript(
            b"tcp-handshake",
            self.session.to_bytes(8, "little"),
            self.stream.to_bytes(8, "little"),
            self.token,
            self.initiator,
            self.initiator_nonce,
            self.target,
            self.instance.to_bytes(8, "little"),
            self.target_nonce,
        )


@dataclass(frozen=True)
class Hello:
    """What an initiator's HELLO says; the target groups a link's connections by its ``session``."""

    session: int  # the initiator link's random id
    stream: int  # the stream's index in its link
    token: bytes  # the capability it presents: the target checks its frames against the grants to it
    name: bytes  # the initiator's agent name, as sent
    nonce: bytes  # its fresh nonce, or b"" without a secret

    def send(self, conn: Conn) -> None:
        conn.send_frame(
            HELLO,
            self.session,
            self.nonce + self.token + self.name,
            aux=self.stream,
            flags=SECRET if self.nonce else 0,
            shares=len(self.token),
        )

    @classmethod
    def receive(cls, conn: Conn) -> Hello:
        """The first frame of an accepted connection, which must be a well-formed HELLO (else ProtocolError)."""
        ftype, flags, shares, index, nlen, sid, _, length = conn.recv_header()
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
        return cls(
            session=sid,
            stream=index,
            token=payload[nonce_len : nonce_len + token_len],
            name=payload[nonce_len + token_len :],
            nonce=payload[:nonce_len],
        )

    @property
    def peer(self) -> str:
        return self.name.decode(errors="replace")

    def transcript(self, target: bytes, instance: int, target_nonce: bytes) -> HandshakeTranscript:
        """The transcript of this HELLO answered by ``target`` (its name), ``instance`` and ``target_nonce``."""
        return HandshakeTranscript(
            session=self.session,
            stream=self.stream,
            token=self.token,
            initiator=self.name,
            initiator_nonce=self.nonce,
            target=target,
            instance=instance,
            target_nonce=target_nonce,
        )


# -- the initiator's half ------------------------------------------------------------------------------------------


def dial(agent: Agent, peer: str, meta: Meta, where: str, session: int, stream: int, token: bytes) -> Conn:
    """Open stream ``stream`` of link ``session`` to ``peer`` (``meta``; ``where``, for messages) presenting
    ``token``, and check, through the handshake, that it reached the agent the metadata names; ChannelError if not.

    With a secret, that agent proves it before we prove ours: KV never goes
    to an agent without the secret, and our proof never to one that lacks it.
    """
    opts = agent.opts
    try:
        family, stype, proto, _, addr = socket.getaddrinfo(meta.host, meta.port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, stype, proto)
    except OSError as exc:
        raise ChannelError(f"tcp: cannot resolve {where}: {exc}") from None
    try:
        set_buffers(sock, opts)
        sock.settimeout(opts.connect_timeout)
        sock.connect(addr)
        conn = Conn(sock, opts, f"{agent.name}->{peer}#{stream}")
        # the whole answer, however a listener trickles it (as the listener bounds ours): io_timeout is per byte
        conn.patience.limit(opts.connect_timeout, f"the handshake answer from {where} (connect_timeout)")
        if agent.tls is not None:
            conn.start_tls(agent.tls.client, False, meta.host, opts.connect_timeout)
        hello = Hello(session, stream, token, agent.name.encode(), new_nonce() if agent.secret else b"")
        hello.send(conn)
        _check_answer(conn, agent, hello, peer, meta, where)
        conn.patience.limit(None)
        return conn
    except ssl.SSLError as exc:  # the handshake, or (TLS 1.3) the target refusing our certificate at the first read
        sock.close()
        agent.count("tls_failures")
        raise ChannelError(
            f"tcp: TLS with {where} failed: {exc.reason or exc}; both agents need `tls` channel options "
            "with a certificate signed by the CA the other trusts"
        ) from None
    except (*IO_ERRORS, ProtocolError) as exc:
        sock.close()
        if isinstance(exc, ChannelError):
            raise
        raise ChannelError(
            f"tcp: cannot connect to {where}: {exc} (is it running? did it restart on a new port?)"
        ) from None


def _check_answer(conn: Conn, agent: Agent, hello: Hello, peer: str, meta: Meta, where: str) -> None:
    """Read HELLO_OK: with a secret, check the target's proof and send ours (AUTH); then its name and instance."""
    secret = agent.secret
    ftype, flags, shares, _, nlen, instance, _, length = conn.recv_header()  # within dial's bound
    no_extras(conn.label, ftype, flags, shares, nlen, SECRET if ftype == HELLO_OK else 0)
    if ftype == ERROR:
        msg = conn.recv_payload(length, MAX_ERROR_BYTES, "error message").decode(errors="replace")
        raise ChannelError(f"tcp: {where} refused the connection: {msg}")
    if ftype != HELLO_OK:
        raise ProtocolError(f"tcp: {where} answered the handshake with frame type {ftype}")
    challenge = NONCE_BYTES + PROOF_BYTES if flags & SECRET else 0
    payload = conn.recv_payload(length, challenge + MAX_NAME_BYTES, "HELLO_OK")
    if secret:
        said = hello.transcript(payload[challenge:], instance, payload[:NONCE_BYTES])
        if not challenge or not said.verify(secret, TARGET_ROLE, payload[NONCE_BYTES:challenge]):
            agent.count("auth_failures")
            raise ChannelError(
                f"tcp: {where} did not prove the shared secret over this handshake (it has another "
                "`secret`, or none, or something on the path changed what either side said); nothing is sent "
                "to it"
            )
        conn.send_frame(AUTH, payload=said.proof(secret, INITIATOR_ROLE))
    elif challenge:
        raise ProtocolError(f"tcp: {where} proved a shared secret nobody asked for (this agent has none)")
    name = payload[challenge:].decode(errors="replace")
    if name != peer or instance != meta.instance:
        raise ChannelError(
            f"tcp: {where} is now agent {name!r} (instance {instance:x}), not the one its metadata "
            "describes "
            f"(instance {meta.instance:x}); the peer restarted: call add_peer with its current metadata"
        )


# -- the target's half ---------------------------------------------------------------------------------------------


def respond(conn: Conn, agent: Agent, closed: Callable[[], bool]) -> Hello:
    """TLS if this agent requires it, then HELLO, HELLO_OK and, with a secret, the peer's proof: the HELLO, once
    the connection may join its session (``closed``: whether this agent is closing, so a hang-up is its own).

    Until then a failure hangs up this connection alone, and no frame of it
    but AUTH has been read. All of it, TLS included, is bounded by the connection's
    ``patience.limit``, which the caller sets (``Target``: ``connect_timeout``).
    """
    if agent.tls is not None:
        _accept_tls(conn, agent)
    hello = Hello.receive(conn)
    conn.label += f" ({hello.peer!r})"
    if agent.secret and not hello.nonce:
        raise AuthError(
            f"tcp {conn.label}: this agent requires the shared secret and the peer has none (set the same `secret` "
            "on both sides)"
        )
    if hello.nonce and not agent.secret:
        raise AuthError(
            f"tcp {conn.label}: the peer holds a shared secret and this agent none (set the same `secret` on both "
            "sides)"
        )
    if agent.secret:
        _check_proof(conn, agent, hello.transcript(agent.name.encode(), agent.instance, new_nonce()), closed)
    else:
        conn.send_frame(HELLO_OK, agent.instance, agent.name.encode())
    return hello


def _accept_tls(conn: Conn, agent: Agent) -> None:
    """TLS before anything else; a peer that starts in clear is told (in clear) that TLS is required."""
    assert agent.tls is not None
    while True:
        try:
            first = conn.sock.recv(len(MAGIC), socket.MSG_PEEK | socket.MSG_WAITALL)
            break
        except BlockingIOError:
            if not conn.patience.remaining():
                raise conn.patience.late() from None
    if first == MAGIC:
        raise AuthError(
            f"tcp {conn.label}: this agent requires TLS (`tls` channel options) and the peer connected without it"
        )
    try:
        conn.start_tls(agent.tls.server, True, None, conn.patience.remaining())
    except ssl.SSLError as exc:
        raise AuthError(
            f"tcp {conn.label}: TLS handshake failed: {exc.reason or exc} (the peer needs a certificate signed by "
            "this agent's `tls.ca`)"
        ) from None


def _check_proof(conn: Conn, agent: Agent, said: HandshakeTranscript, closed: Callable[[], bool]) -> None:
    """Prove the secret over the handshake's transcript, then read the peer's proof over the same: the one frame
    read before it checks out."""
    conn.send_frame(
        HELLO_OK,
        agent.instance,
        said.target_nonce + said.proof(agent.secret, TARGET_ROLE) + agent.name.encode(),
        flags=SECRET,
    )
    try:
        ftype, flags, shares, _, nlen, _, _, length = conn.recv_header()
    except (*IO_ERRORS, ProtocolError) as exc:  # leaving is what a peer with another secret does: it refuses our proof
        if closed():
            raise  # we hung up, at close: no failure of the peer's
        raise AuthError(f"tcp {conn.label}: no proof of the shared secret from the peer ({exc})") from None
    if ftype != AUTH or length != PROOF_BYTES:
        raise AuthError(
            f"tcp {conn.label}: {FRAME_NAMES.get(ftype, ftype)} frame of {length} bytes where the proof of the "
            "shared secret was due"
        )
    no_extras(conn.label, ftype, flags, shares, nlen)
    if not said.verify(agent.secret, INITIATOR_ROLE, conn.recv_payload(length, PROOF_BYTES, "proof")):
        raise AuthError(
            f"tcp {conn.label}: the peer failed to prove the shared secret (set the same `secret` on both sides)"
        )
