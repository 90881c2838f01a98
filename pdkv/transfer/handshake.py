"""The handshake, both ends: Hello, Auth with a shared secret, the peers each side knows.

The sender handshakes once per receiver address (``SenderHandshake``) and forgets a receiver that died,
restarted or refused it; the receiver admits a compatible, authenticated peer (``ReceiverHandshake``) and
makes it reachable over the channel. See README.md, "keyed" and the late-write rule for why a restarted
receiver's old transfers fail before its new run is used.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from pdkv.auth import new_nonce, proof, session_key, verify
from pdkv.channels.base import Channel
from pdkv.config import TransferConfig
from pdkv.errors import HandshakeError, PdkvError, TransferError, TransferTimeout
from pdkv.layout import KVLayout
from pdkv.transfer import protocol
from pdkv.transfer.heartbeat import Beats
from pdkv.transfer.protocol import Auth, Hello

if TYPE_CHECKING:
    from pdkv.transfer.outgoing import OutgoingTransfer

log = logging.getLogger(__name__)

MIN_TOKEN_BYTES = 16  # a sender's data_token: unguessable
_ROUTING_ID_HEX = 16  # random hex digits in a sender's routing id: a ROUTER knows a peer by it, so nobody may guess it


@dataclass(eq=False)  # hashable by identity: it keys its DEALER socket
class ReceiverPeer:
    """A receiver as the sender knows it, one per address and run."""

    address: str
    identity: bytes
    hello: Hello | None = None
    agent: str = ""
    dropped: str = ""  # why it was forgotten; once set, its socket is closed for good and messages to it discarded
    nonce: bytes = field(default_factory=new_nonce)
    token: bytes = field(default_factory=lambda: os.urandom(16))  # our data connections' capability at this receiver
    hello_future: Future[Hello] = field(default_factory=Future)
    pool: protocol.Pool | None = None  # blocks it granted us ahead, unused yet (README.md here, "Pools")
    pool_renewed: float = 0.0  # when a heartbeat last renewed the pool's lease (or it arrived)
    session_key: bytes = b""  # with a secret, once its Hello proved it: what our messages to it are tagged with
    beats: Beats = field(default_factory=Beats)  # heartbeats it has not answered yet


@dataclass
class SenderPeer:
    """A sender as the receiver knows it, once admitted."""

    agent: str
    layout: KVLayout
    token: bytes  # its data connections' capability: its reservations are granted to it
    session: bytes = b""  # both handshake nonces (with a secret): what its Reserves' proofs are bound to
    session_key: bytes = b""  # with a secret: what its control messages are tagged with (``control``, "Sessions")
    kv_reached: bool = True  # its channel registered its KV (an empty kv_regions in its Hello: not, so staging only)


def answer(fut: Future[Any], outcome: Any) -> None:
    """Resolve ``fut`` with a result, or fail it with an exception; the first thread to answer wins."""
    with contextlib.suppress(InvalidStateError):
        if isinstance(outcome, BaseException):
            fut.set_exception(outcome)
        else:
            fut.set_result(outcome)


class SenderHandshake:
    """The receivers one sender talks to: handshake on first use, forget on loss."""

    def __init__(
        self,
        channel: Channel,
        config: TransferConfig,
        secret: bytes,
        cond: threading.Condition,
        counters: collections.Counter[str],
        hello: Callable[[], Hello],
        send: Callable[[ReceiverPeer, protocol.Message], None],
        transfers: Callable[[], Iterable[OutgoingTransfer]],
        on_drop: Callable[[ReceiverPeer, TransferError], list[Future[Any]]],
        close_peer: Callable[[ReceiverPeer], None],
    ) -> None:
        self.channel, self.config, self.secret, self.cond, self.counters = channel, config, secret, cond, counters
        self._hello, self._send, self._transfers, self._on_drop, self._close_peer = (
            hello,
            send,
            transfers,
            on_drop,
            close_peer,
        )
        self.peers: dict[str, ReceiverPeer] = {}

    def connect(self, address: str) -> ReceiverPeer:
        """The receiver at ``address``, handshaken (control and data path) within handshake_timeout_s."""
        with self.cond:
            peer = self.peers.get(address)
            if peer is None:
                # the agent name for the receiver's logs, then what nobody can guess (``control``, "Sessions")
                ident = f"{self.channel.agent_name}/{secrets.token_hex(_ROUTING_ID_HEX // 2)}".encode()
                peer = self.peers[address] = ReceiverPeer(address, ident)
                self._send(peer, msgspec.structs.replace(self._hello(), nonce=peer.nonce, data_token=peer.token))
        timeout = self.config.handshake_timeout_s
        try:
            hello = peer.hello_future.result(timeout)
        except FutureTimeout:
            reason = f"no Hello reply from receiver {address} within handshake_timeout_s={timeout:.3g}s"
            self.drop(peer, reason)
            raise TransferTimeout(reason) from None
        except PdkvError as exc:  # refused (HandshakeError), or the receiver went away mid-handshake
            self.drop(peer, str(exc))
            raise
        if not peer.agent:
            with self.cond:
                if not peer.agent:
                    self._retire_previous_run(peer, hello)
                    peer.agent = self.channel.add_peer(hello.channel_metadata)
        self.channel.connect(
            peer.agent, timeout, peer.token
        )  # the data path too: an unreachable one fails here, loudly
        return peer

    def _retire_previous_run(self, peer: ReceiverPeer, hello: Hello) -> None:
        """Fail transfers reserved on an earlier run of the receiver ``hello`` comes from (caller holds the lock).

        ``add_peer`` of a restarted receiver that kept its agent name points every later write to that
        name at the new run, where the old reservations' block ids belong to other requests. So the old
        transfers fail first, and a write of theirs being posted right now (to the old run) is waited for.
        """
        stale = [
            x
            for x in self._transfers()
            if x.peer is not peer
            and x.peer.hello is not None
            and x.peer.hello.agent == hello.agent
            and x.peer.hello.channel_metadata != hello.channel_metadata
        ]
        for xfer in stale:
            xfer.fail(
                TransferError(
                    f"receiver {hello.agent!r} at {xfer.peer.address} restarted: transfer {xfer.transfer_id!r} was "
                    "reserved on its previous run"
                )
            )
        deadline = time.monotonic() + self.config.handshake_timeout_s
        while any(x.posting for x in stale):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransferTimeout(
                    f"a write to the previous run of receiver {hello.agent!r} was still being posted after "
                    f"handshake_timeout_s={self.config.handshake_timeout_s:.3g}s"
                )
            self.cond.wait(remaining)

    def drop(self, peer: ReceiverPeer, reason: str) -> None:
        """Forget a receiver that died, restarted, refused us or stopped answering; fail what is open with it.

        Its open transfers can never complete (no ``Landed`` comes back over a closed socket), so they
        fail now with ``reason`` instead of at transfer_timeout_s. The next ``connect`` handshakes again.
        """
        err = TransferError(reason)
        with self.cond:
            if peer.dropped:
                return
            peer.dropped = reason
            if self.peers.get(peer.address) is peer:
                del self.peers[peer.address]
            waiting = [peer.hello_future, *self._on_drop(peer, err)]
            last_of_agent = peer.agent and not any(p.agent == peer.agent for p in self.peers.values())
        if last_of_agent:
            self.channel.remove_peer(peer.agent)  # its link goes too: a write still in flight to it fails now
        for fut in waiting:
            answer(fut, err)
        self._close_peer(peer)

    def on_hello(self, peer: ReceiverPeer, msg: Hello) -> None:
        """The receiver's Hello (I/O thread): check it, prove our secret, let ``connect`` go on."""
        try:
            protocol.check_compatible(self._hello(), msg)
            if self.config.codec not in msg.codecs:
                raise HandshakeError(
                    f"receiver {peer.address} cannot decode transfer.codec {self.config.codec!r}: it offers "
                    f"{', '.join(msg.codecs) or 'none'} "
                    "(install the codec's extra there, or set the same transfer.codec on both sides)"
                )
            if self.secret and not verify(self.secret, "receiver", peer.nonce, msg.nonce, msg.auth):
                self.counters["auth_failures"] += 1
                raise HandshakeError(
                    f"receiver {peer.address} did not prove the shared secret (missing or different `secret`)"
                )
        except HandshakeError as exc:
            self.counters["handshake_failures"] += 1
            answer(peer.hello_future, exc)
            return
        if self.secret:  # queued before anyone can queue a Reserve: the receiver sees it first
            peer.session_key = session_key(self.secret, msg.nonce + peer.nonce)
            self._send(peer, Auth(proof(self.secret, "sender", msg.nonce, peer.nonce)))
        peer.hello = msg
        answer(peer.hello_future, msg)

    def on_error(self, peer: ReceiverPeer, msg: protocol.Error) -> None:
        if not peer.hello_future.done():
            answer(peer.hello_future, HandshakeError(f"receiver {peer.address} refused us: {msg.message}"))
        else:
            log.warning("receiver %s reported: %s", peer.address, msg.message)


class ReceiverHandshake:
    """Admits senders: compatible, and with a secret proven both ways, before any Reserve of theirs counts."""

    def __init__(
        self,
        channel: Channel,
        config: TransferConfig,
        secret: bytes,
        lock: threading.Condition,
        counters: collections.Counter[str],
        hello: Callable[[], Hello],
        reply: Callable[[bytes, protocol.Message], None],
        on_admitted: Callable[[bytes, bytes], None],
    ) -> None:
        """``on_admitted(identity, token)``: a peer was admitted (after its Hello was answered: the receiver
        offers it a pool)."""
        self.channel, self.config, self.secret, self.lock, self.counters = channel, config, secret, lock, counters
        self._hello, self._reply, self._on_admitted = hello, reply, on_admitted
        self.peers: dict[bytes, SenderPeer] = {}
        self.unproven: dict[bytes, tuple[Hello, bytes]] = {}  # identity -> (its Hello, our nonce)

    def session_key(self, identity: bytes) -> bytes:
        """``control.SessionKeys``: the key of an admitted peer's session (I/O thread)."""
        peer = self.peers.get(identity)
        return b"" if peer is None else peer.session_key

    def on_hello(self, identity: bytes, hello: Hello) -> None:
        ours = self._hello()
        try:
            protocol.check_compatible(ours, hello)
        except HandshakeError as exc:
            self.counters["handshake_failures"] += 1
            log.warning("refusing peer %r: %s", hello.agent, exc)
            self._reply(identity, protocol.Error(str(exc)))
            return
        if not self.secret:
            if self._admit(identity, hello, b""):
                self._reply(identity, ours)
                self._on_admitted(identity, hello.data_token)
            return
        # with a secret: prove ours now, admit the peer once it proves its own (Auth)
        nonce = new_nonce()
        if len(self.unproven) >= self.config.max_reservations:
            self.unproven.pop(next(iter(self.unproven)))
        self.unproven[identity] = (hello, nonce)
        self._reply(
            identity,
            msgspec.structs.replace(ours, nonce=nonce, auth=proof(self.secret, "receiver", hello.nonce, nonce)),
        )

    def on_auth(self, identity: bytes, msg: Auth) -> None:
        pending = self.unproven.pop(identity, None)
        if pending is None or not self.secret:
            self._reply(identity, protocol.Error("unexpected Auth: send Hello first"))
            return
        hello, nonce = pending
        if not verify(self.secret, "sender", nonce, hello.nonce, msg.proof):
            self.counters["auth_failures"] += 1
            log.warning("peer %r failed authentication (wrong or missing shared secret)", hello.agent)
            self.unproven[identity] = pending  # its Reserves are refused as unauthenticated
            self._reply(identity, protocol.Error("authentication failed: the shared secret does not match"))
            return
        if self._admit(identity, hello, nonce + hello.nonce):
            self._on_admitted(identity, hello.data_token)

    def _admit(self, identity: bytes, hello: Hello, session: bytes) -> bool:
        """Make a compatible (and, with a secret, authenticated) peer reachable over the channel."""
        try:
            if len(hello.data_token) < MIN_TOKEN_BYTES:
                raise HandshakeError(
                    f"peer {hello.agent!r} sent no data_token of at least {MIN_TOKEN_BYTES} bytes: it cannot be "
                    "granted any blocks (an older pdkv?)"
                )
            agent = self.channel.add_peer(hello.channel_metadata)
        except PdkvError as exc:
            self.counters["handshake_failures"] += 1
            log.warning("refusing peer %r: %s", hello.agent, exc)
            self._reply(identity, protocol.Error(str(exc)))
            return False
        with self.lock:
            self.peers[identity] = SenderPeer(
                agent,
                hello.layout,
                hello.data_token,
                session,
                session_key(self.secret, session) if session else b"",
                kv_reached=bool(hello.kv_regions),
            )
        return True
