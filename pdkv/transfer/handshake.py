"""The handshake, both ends: Hello, Auth with a shared secret, the peers each side knows.

The sender handshakes once per receiver address (``SenderHandshake``) and forgets a receiver that died,
restarted or refused it; the receiver admits a compatible, authenticated peer (``ReceiverHandshake``) and
makes it reachable over the channel. See README.md, "keyed" and the late-write rule for why a restarted
receiver's old transfers fail before its new run is used.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Protocol

import msgspec

from pdkv.auth import bound_proof, new_nonce, session_key, verify_bound
from pdkv.errors import HandshakeError, PdkvError, TransferError, TransferTimeout
from pdkv.layout import HeadWindow
from pdkv.transfer import protocol
from pdkv.transfer.parts import ReceiverParts, SenderParts
from pdkv.transfer.peers import ReceiverPeer, SenderPeer
from pdkv.transfer.protocol import HELLO_REQUIRED, Auth, Hello, Refused, Reserve, reserve_fields

log = logging.getLogger(__name__)

MIN_TOKEN_BYTES = 16  # a sender's data_token: unguessable
_ROUTING_ID_HEX = 16  # random hex digits in a sender's routing id: a ROUTER knows a peer by it, so nobody may guess it


def answer(fut: Future[Any], outcome: Any) -> None:
    """Resolve ``fut`` with a result, or fail it with an exception; the first thread to answer wins."""
    with contextlib.suppress(InvalidStateError):
        if isinstance(outcome, BaseException):
            fut.set_exception(outcome)
        else:
            fut.set_result(outcome)


def signed_reserve(
    peer: ReceiverPeer,
    secret: bytes,
    *,
    transfer_id: str,
    num_tokens: int,
    prompt_key: bytes,
    codec: str,
    heads: HeadWindow | None = None,
) -> Reserve:
    """A Reserve for ``peer``; with a secret, its proof bound to the handshake's transcript (``reserving_peer``)."""
    msg = Reserve(transfer_id, num_tokens, prompt_key, codec=codec, heads=heads)
    if secret and peer.session:
        msg.proof = bound_proof(secret, "reserve", peer.session, *reserve_fields(msg))
    return msg


class SenderHandshake:
    """The receivers one sender talks to (``parts.peers``): handshake on first use, forget on loss."""

    def __init__(self, parts: SenderParts) -> None:
        self.parts = parts
        self.peers = parts.peers
        # agent name -> the live peer whose handshake put that name's entry in the channel (under ``parts.cond``): the
        # channel keys its peers by agent name, so the entry is that session's, and goes or is handed on with it
        self.installed: dict[str, ReceiverPeer] = {}

    def connect(self, address: str) -> ReceiverPeer:
        """The receiver at ``address``, handshaken (control and data path) within handshake_timeout_s."""
        parts = self.parts
        with parts.cond:
            peer = self.peers.get(address)
            if peer is None:
                # the agent name for the receiver's logs, then what nobody can guess (``control``, "Sessions")
                ident = f"{parts.channel.agent_name}/{secrets.token_hex(_ROUTING_ID_HEX // 2)}".encode()
                peer = self.peers[address] = ReceiverPeer(address=address, identity=ident)
                peer.sent = msgspec.structs.replace(parts.greeting.hello(), nonce=peer.nonce, data_token=peer.token)
                parts.outbox.send(peer, peer.sent)
        timeout = parts.config.handshake_timeout_s
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
            with parts.cond:
                refused = self._claim(peer, hello) if not peer.agent else None
                if not peer.agent and refused is None:
                    self._retire_previous_run(peer, hello)
                    peer.agent = parts.channel.add_peer(hello.channel_metadata)
                    self.installed.setdefault(peer.agent, peer)  # a live holder (same metadata: ``_claim``) keeps it
            if refused is not None:  # dropped outside the lock, as every drop is
                self.drop(peer, str(refused))
                raise refused
        parts.channel.connect(peer.agent, timeout, peer.token)  # the data path too: an unreachable one fails here
        return peer

    def _claim(self, peer: ReceiverPeer, hello: Hello) -> HandshakeError | None:
        """Why a handshake that would re-point a name under a live session is refused; None when it is not (caller
        holds the lock).

        The channel reaches a receiver by its agent name, so ``add_peer`` with another address for a name that a live
        session at another control address installed would move that session's links, and every transfer on them, to
        wherever this Hello says. A receiver that really moved ends its old session first (its control connection
        drops and ``lost`` forgets it); until then, a second claim of its name is a relay or a misconfiguration.
        """
        holder = self.installed.get(hello.agent)
        if holder is None or holder is peer or holder.dropped or holder.hello is None:
            return None
        if holder.hello.channel_metadata == hello.channel_metadata:
            return None
        self.parts.counters["handshake_failures"] += 1
        return HandshakeError(
            f"receiver {peer.address} names agent {hello.agent!r} with another data address, and that agent is "
            f"reachable at {holder.address} in a live session: its links are not re-pointed (a relay between us, "
            "or two receivers with one agent name)"
        )

    def _retire_previous_run(self, peer: ReceiverPeer, hello: Hello) -> None:
        """Fail transfers reserved on an earlier run of the receiver ``hello`` comes from (caller holds the lock).

        ``add_peer`` of a restarted receiver that kept its agent name points every later write to that
        name at the new run, where the old reservations' block ids belong to other requests. So the old
        transfers fail first, and a write of theirs being posted right now (to the old run) is waited for.
        """
        stale = [
            x
            for x in self.parts.transfers.values()
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
        timeout = self.parts.config.handshake_timeout_s
        deadline = time.monotonic() + timeout
        while any(x.posting for x in stale):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransferTimeout(
                    f"a write to the previous run of receiver {hello.agent!r} was still being posted after "
                    f"handshake_timeout_s={timeout:.3g}s"
                )
            self.parts.cond.wait(remaining)

    def lost(self, peer: ReceiverPeer, why: str) -> None:
        """A receiver's control connection dropped, never came up, or its answers stopped: nothing open with it can
        finish, so fail it now (I/O thread).

        ZeroMQ would reconnect on its own; we drop the peer instead so that a receiver that comes back is met
        with a fresh Hello.
        """
        if not peer.dropped:
            self.parts.counters["peers_lost"] += 1
            log.warning("%s: failing what is open with it; the next transfer to it handshakes again", why)
            self.drop(peer, why)

    def drop(self, peer: ReceiverPeer, reason: str) -> None:
        """Forget a receiver that died, restarted, refused us or stopped answering; fail what is open with it.

        Its open transfers can never complete (no ``Landed`` comes back over a closed socket), so they
        fail now with ``reason`` instead of at transfer_timeout_s, and so do its unanswered Reserves. The next
        ``connect`` handshakes again.
        """
        parts = self.parts
        err = TransferError(reason)
        with parts.cond:
            if peer.dropped:
                return
            peer.dropped = reason
            if self.peers.get(peer.address) is peer:
                del self.peers[peer.address]
            for xfer in parts.transfers.values():
                if xfer.peer is peer:
                    xfer.fail(err)
            waiting = [peer.hello_future, *(fut for owner, fut in parts.asking.values() if owner is peer)]
            remove = bool(peer.agent) and self.installed.get(peer.agent) is peer and self._hand_on(peer)
        if remove:  # its link goes too (outside the lock): a write still in flight to it fails now
            parts.channel.remove_peer(peer.agent)
        for fut in waiting:
            answer(fut, err)
        parts.outbox.close_peer(peer)

    def _hand_on(self, peer: ReceiverPeer) -> bool:
        """``peer``'s session ends and its agent's channel entry with it (caller holds the lock): handed on to another
        live session with that agent (``_claim`` let it in only with the same metadata: the entry is right for it),
        else to be removed (True), so no write is ever dialled to an address whose session is gone."""
        heir = next((p for p in self.peers.values() if p.agent == peer.agent and p.hello is not None), None)
        if heir is None:
            del self.installed[peer.agent]
            return True
        self.installed[peer.agent] = heir
        return False

    def on_hello(self, peer: ReceiverPeer, msg: Hello) -> None:
        """The receiver's Hello (I/O thread): check it, prove our secret, let ``connect`` go on."""
        parts = self.parts
        try:
            protocol.check_compatible(parts.greeting.hello(), msg, "prefill")
            if parts.config.codec not in msg.codecs:
                raise HandshakeError(
                    f"receiver {peer.address} cannot decode transfer.codec {parts.config.codec!r}: it offers "
                    f"{', '.join(msg.codecs) or 'none'} "
                    "(install the codec's extra there, or set the same transfer.codec on both sides)"
                )
            session = protocol.hello_transcript(peer.sent, msg) if parts.secret and peer.sent is not None else b""
            if parts.secret and not verify_bound(parts.secret, "receiver", session, msg.auth):
                parts.counters["auth_failures"] += 1
                raise HandshakeError(
                    f"receiver {peer.address} did not prove the shared secret over this handshake (missing or "
                    "different `secret`, or something between us changed what either side said)"
                )
        except HandshakeError as exc:
            parts.counters["handshake_failures"] += 1
            answer(peer.hello_future, exc)
            return
        if parts.secret:  # queued before anyone can queue a Reserve: the receiver sees it first
            peer.session, peer.session_key = session, session_key(parts.secret, session)
            parts.outbox.send(peer, Auth(bound_proof(parts.secret, "sender", session)))
        peer.hello = msg
        answer(peer.hello_future, msg)

    def on_error(self, peer: ReceiverPeer, msg: protocol.Error) -> None:
        if not peer.hello_future.done():
            answer(peer.hello_future, HandshakeError(f"receiver {peer.address} refused us: {msg.message}"))
        else:
            log.warning("receiver %s reported: %s", peer.address, msg.message)


class Admitted(Protocol):
    """Told once a sender is admitted, after its Hello was answered (``pool.ReceiverPools.admitted``: it offers
    the sender a pool)."""

    def admitted(self, identity: bytes, token: bytes) -> None: ...


def reserving_peer(parts: ReceiverParts, identity: bytes, req: Reserve) -> SenderPeer | Refused:
    """The admitted sender a Reserve comes from, authenticated (its proof checked with a secret), or why not
    (caller holds the lock)."""
    peer = parts.peers.get(identity)
    if peer is None and identity in parts.unproven:
        parts.counters["auth_failures"] += 1
        return Refused(
            req.transfer_id,
            "not authenticated: this receiver requires the shared secret (set the same `secret` on both sides)",
        )
    if peer is None:
        return Refused(req.transfer_id, f"{HELLO_REQUIRED}: this receiver has no Hello from you (did it restart?)")
    if parts.secret and not verify_bound(parts.secret, "reserve", peer.session, req.proof, *reserve_fields(req)):
        parts.counters["auth_failures"] += 1
        return Refused(
            req.transfer_id,
            "the Reserve's proof does not check out: it was not made by the peer that proved the shared secret",
        )
    return peer


class ReceiverHandshake:
    """Admits senders: compatible, and with a secret proven both ways, before any Reserve of theirs counts."""

    def __init__(self, parts: ReceiverParts, admitted: Admitted) -> None:
        self.parts, self.admitted = parts, admitted
        self.peers = parts.peers
        self.unproven = parts.unproven

    def session_key(self, identity: bytes) -> bytes:
        """``control.SessionKeys``: the key of an admitted peer's session (I/O thread)."""
        peer = self.peers.get(identity)
        return b"" if peer is None else peer.session_key

    def on_hello(self, identity: bytes, hello: Hello) -> None:
        parts = self.parts
        ours = parts.greeting.hello()
        try:
            protocol.check_compatible(ours, hello, "decode")
        except HandshakeError as exc:
            parts.counters["handshake_failures"] += 1
            log.warning("refusing peer %r: %s", hello.agent, exc)
            parts.outbox.reply(identity, protocol.Error(str(exc)))
            return
        if not parts.secret:
            if self._admit(identity, hello, b""):
                parts.outbox.reply(identity, ours)
                self.admitted.admitted(identity, hello.data_token)
            return
        # with a secret: prove ours now, over both Hellos whole, so the proof vouches for this exchange alone (a relay
        # that changes either Hello gets a proof no sender accepts); admit the peer once it proves its own (Auth)
        reply = msgspec.structs.replace(ours, nonce=new_nonce())
        session = protocol.hello_transcript(hello, reply)
        if len(self.unproven) >= parts.config.max_reservations:
            self.unproven.pop(next(iter(self.unproven)))
        self.unproven[identity] = (hello, session)
        proven = msgspec.structs.replace(reply, auth=bound_proof(parts.secret, "receiver", session))
        parts.outbox.reply(identity, proven)

    def on_auth(self, identity: bytes, msg: Auth) -> None:
        parts = self.parts
        pending = self.unproven.pop(identity, None)
        if pending is None or not parts.secret:
            parts.outbox.reply(identity, protocol.Error("unexpected Auth: send Hello first"))
            return
        hello, session = pending
        if not verify_bound(parts.secret, "sender", session, msg.proof):
            parts.counters["auth_failures"] += 1
            log.warning("peer %r failed authentication (wrong or missing shared secret)", hello.agent)
            self.unproven[identity] = pending  # its Reserves are refused as unauthenticated
            parts.outbox.reply(identity, protocol.Error("authentication failed: the shared secret does not match"))
            return
        if self._admit(identity, hello, session):
            self.admitted.admitted(identity, hello.data_token)

    def _admit(self, identity: bytes, hello: Hello, session: bytes) -> bool:
        """Make a compatible (and, with a secret, authenticated) peer reachable over the channel."""
        parts = self.parts
        try:
            if len(hello.data_token) < MIN_TOKEN_BYTES:
                raise HandshakeError(
                    f"peer {hello.agent!r} sent no data_token of at least {MIN_TOKEN_BYTES} bytes: it cannot be "
                    "granted any blocks (an older pdkv?)"
                )
            agent = parts.channel.add_peer(hello.channel_metadata)
        except PdkvError as exc:
            parts.counters["handshake_failures"] += 1
            log.warning("refusing peer %r: %s", hello.agent, exc)
            parts.outbox.reply(identity, protocol.Error(str(exc)))
            return False
        with parts.lock:
            self.peers[identity] = SenderPeer(
                agent=agent,
                layout=hello.layout,
                token=hello.data_token,
                session=session,
                session_key=session_key(parts.secret, session) if session else b"",
                kv_reached=bool(hello.kv_regions),
            )
        return True
