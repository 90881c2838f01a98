"""Asking a receiver for room, on the prefill side: Reserve, wait for Reserved, retry what may fit later.

A receiver refuses what it cannot hold now (``retryable``) or ever; a refusal that says it forgot us
(``hello-required``: it restarted) is answered with one fresh handshake. A grant is checked before any
write is built from it. See README.md, "keyed".
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from pdkv.auth import bound_proof
from pdkv.config import TransferConfig
from pdkv.errors import ReservationError, TransferError, TransferTimeout
from pdkv.transfer import protocol
from pdkv.transfer.handshake import ReceiverPeer, SenderHandshake, answer
from pdkv.transfer.protocol import HELLO_REQUIRED, Cancel, Refused, Reserve, Reserved, reserve_fields


def lease_margin(lease_s: float, heartbeat_s: float) -> float:
    """How long after its last heartbeat a lease is still surely ours: less two beats of slack for a renewal
    that was queued but not yet on the wire."""
    return max(lease_s - 2 * heartbeat_s, lease_s / 2)


@dataclass(frozen=True)
class PoolClaim:
    """A transfer written into the receiver's pool instead of reserved first: the Reserve its chunk's notice
    carries, the pool's generation, and when a heartbeat last renewed the pool (its lease counts from there)."""

    reserve: Reserve
    generation: int
    renewed: float


class Reservations:
    """The sender's Reserves in flight, one future per transfer id."""

    def __init__(
        self,
        handshake: SenderHandshake,
        block_size: int,
        config: TransferConfig,
        secret: bytes,
        cond: threading.Condition,
        counters: collections.Counter[str],
        send: Callable[[ReceiverPeer, protocol.Message], None],
    ) -> None:
        self.handshake, self.block_size, self.config, self.secret, self.cond, self.counters, self._send = (
            handshake,
            block_size,
            config,
            secret,
            cond,
            counters,
            send,
        )
        self.pending: dict[str, tuple[ReceiverPeer, Future[protocol.Message]]] = {}

    def reserve(
        self,
        address: str,
        transfer_id: str,
        num_tokens: int,
        prompt_key: bytes,
        codec: str,
        is_open: Callable[[str], bool],
    ) -> tuple[ReceiverPeer, Reserved]:
        """Room for the whole transfer at ``address``, retried within reserve_timeout_s while it may still fit."""
        deadline = time.monotonic() + self.config.reserve_timeout_s
        rehandshaked = False
        backoff = 0.005
        while True:
            peer = self.handshake.connect(address)
            try:
                reply = self._ask(peer, transfer_id, num_tokens, prompt_key, codec, is_open)
            except TransferError as exc:
                if rehandshaked or not peer.dropped or isinstance(exc, TransferTimeout):
                    raise
                # its connection dropped while we asked: a restart looks like this, so ask its new run
                rehandshaked = True
                continue
            if isinstance(reply, Reserved):
                self._check(reply, num_tokens, codec)
                return peer, reply
            reason = reply.reason if isinstance(reply, Refused) else getattr(reply, "message", repr(reply))
            if not rehandshaked and reason.startswith(HELLO_REQUIRED):
                rehandshaked = True
                self.handshake.drop(
                    peer, f"receiver {address} restarted: it no longer knows the transfers reserved on its previous run"
                )
                continue  # handshake with the new run
            if isinstance(reply, Refused) and reply.retryable and time.monotonic() + backoff < deadline:
                self.counters["reservations_retried"] += 1
                time.sleep(backoff)  # room frees up as other transfers finish
                backoff = min(backoff * 2, 0.1)
                continue
            self.counters["reservations_refused"] += 1
            raise ReservationError(f"receiver {address} refused transfer {transfer_id!r}: {reason}")

    def on_reply(self, peer: ReceiverPeer, msg: Reserved | Refused) -> None:
        """A receiver's answer (I/O thread); a grant nobody waits for any more is handed back at once."""
        with self.cond:
            owner, fut = self.pending.get(msg.transfer_id, (None, None))
        if owner is peer and fut is not None and not fut.done():
            answer(fut, msg)
        elif isinstance(msg, Reserved):
            self._send(peer, Cancel(msg.transfer_id, "reservation arrived after the sender gave up"))

    def waiting_on(self, peer: ReceiverPeer) -> list[Future[protocol.Message]]:
        """The Reserves ``peer`` has not answered (caller holds the lock)."""
        return [fut for owner, fut in self.pending.values() if owner is peer]

    def _ask(
        self,
        peer: ReceiverPeer,
        transfer_id: str,
        num_tokens: int,
        prompt_key: bytes,
        codec: str,
        is_open: Callable[[str], bool],
    ) -> protocol.Message:
        fut: Future[protocol.Message] = Future()
        with self.cond:
            if transfer_id in self.pending or is_open(transfer_id):
                raise ReservationError(f"transfer {transfer_id!r} is already open")
            if peer.dropped:  # lost since the handshake: its socket is closed, a Reserve would go nowhere
                raise TransferError(peer.dropped)
            self.pending[transfer_id] = (peer, fut)
        self._send(peer, self._reserve(peer, transfer_id, num_tokens, prompt_key, codec))
        timeout = self.config.reserve_timeout_s
        try:
            return fut.result(timeout)
        except FutureTimeout:
            self._send(
                peer, Cancel(transfer_id, "reservation timed out at the sender")
            )  # queued before the drop closes the socket
            reason = (
                f"receiver {peer.address} did not answer Reserve for {transfer_id!r} within "
                f"reserve_timeout_s={timeout:.3g}s"
            )
            self.handshake.drop(peer, reason)
            raise TransferTimeout(reason) from None
        finally:
            with self.cond:
                self.pending.pop(transfer_id, None)

    def from_pool(
        self,
        address: str,
        transfer_id: str,
        num_tokens: int,
        prompt_key: bytes,
        codec: str,
        is_open: Callable[[str], bool],
    ) -> tuple[ReceiverPeer, Reserved, PoolClaim] | None:
        """Take the pool the receiver at ``address`` granted us, when this transfer fits it: one chunk, no
        codec, its lease surely still ours. (peer, the grant the pool stands for, the claim), or None: reserve
        the usual way."""
        if codec != "none" or num_tokens > self.config.chunk_size:
            return None
        peer = self.handshake.connect(address)  # cheap once connected; the data path proven before any write
        with self.cond:
            pool = peer.pool if not peer.dropped else None
            needed = -(-num_tokens // self.block_size)
            if (
                pool is None
                or len(pool.block_ids) < needed
                or time.monotonic() - peer.pool_renewed > lease_margin(pool.lease_s, self.config.heartbeat_s)
                or transfer_id in self.pending
                or is_open(transfer_id)
            ):
                return None
            peer.pool = None  # one request per pool: the receiver grants the next once it took this one
            renewed = peer.pool_renewed
        self.counters["reserved_from_pool"] += 1
        grant = Reserved(transfer_id, "direct", pool.block_ids[:needed], [], pool.lease_s)
        claim = PoolClaim(self._reserve(peer, transfer_id, num_tokens, prompt_key, codec), pool.generation, renewed)
        return peer, grant, claim

    def _reserve(self, peer: ReceiverPeer, transfer_id: str, num_tokens: int, prompt_key: bytes, codec: str) -> Reserve:
        msg = Reserve(transfer_id, num_tokens, prompt_key, codec=codec)
        if self.secret and peer.hello is not None:
            msg.proof = bound_proof(self.secret, "reserve", peer.hello.nonce + peer.nonce, *reserve_fields(msg))
        return msg

    def _check(self, reply: Reserved, num_tokens: int, codec: str) -> None:
        """A grant from the wire is checked before any write is built from it."""
        if codec != "none" and reply.mode != "staging":
            raise ReservationError(
                f"receiver granted {reply.mode} mode for a transfer encoded with {codec!r}: codecs need staging"
            )
        blocks_needed = -(-num_tokens // self.block_size)
        if reply.mode == "direct" and len(reply.block_ids) < blocks_needed:
            raise ReservationError(f"receiver granted {len(reply.block_ids)} blocks for {num_tokens} tokens")
        if reply.mode == "staging" and not reply.staging_slots:
            raise ReservationError("receiver granted staging mode without staging slots")
