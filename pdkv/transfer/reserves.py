"""Asking a receiver for room, on the prefill side: Reserve, wait for Reserved, retry what may fit later.

A receiver refuses what it cannot hold now (``retryable``) or ever; a refusal that says it forgot us
(``hello-required``: it restarted) is answered with one fresh handshake. A ``Reserved`` is checked before any
write is built from it. A request written into the receiver's pool asks no Reserve of its own here: its Reserve
rides on its chunk (pool.py). See README.md, "keyed".
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from pdkv.errors import ReservationError, TransferError, TransferTimeout
from pdkv.layout import HeadWindow
from pdkv.transfer import protocol
from pdkv.transfer.handshake import SenderHandshake, answer, signed_reserve
from pdkv.transfer.parts import SenderParts
from pdkv.transfer.peers import ReceiverPeer
from pdkv.transfer.protocol import HELLO_REQUIRED, Cancel, Refused, Reserved


class Reserves:
    """The sender's Reserves in flight (``parts.asking``), one future per transfer id."""

    def __init__(self, parts: SenderParts, handshake: SenderHandshake, block_size: int) -> None:
        self.parts, self.handshake, self.block_size = parts, handshake, block_size

    def reserve(
        self,
        address: str,
        *,
        transfer_id: str,
        num_tokens: int,
        prompt_key: bytes,
        codec: str,
        heads: HeadWindow | None = None,
    ) -> tuple[ReceiverPeer, Reserved]:
        """Room for the whole transfer at ``address``, retried within reserve_timeout_s while it may still fit;
        ``heads``: the receiver's heads it carries (``protocol.Reserve.heads``)."""
        parts = self.parts
        deadline = time.monotonic() + parts.config.reserve_timeout_s
        rehandshaked = False
        backoff = 0.005
        while True:
            peer = self.handshake.connect(address)
            msg = signed_reserve(
                peer,
                parts.secret,
                transfer_id=transfer_id,
                num_tokens=num_tokens,
                prompt_key=prompt_key,
                codec=codec,
                heads=heads,
            )
            try:
                reply = self._ask(peer, msg)
            except TransferError as exc:
                if rehandshaked or not peer.dropped or isinstance(exc, TransferTimeout):
                    raise
                # its connection dropped while we asked: a restart looks like this, so ask its new run
                rehandshaked = True
                continue
            if isinstance(reply, Reserved):
                self._check(reply, num_tokens, codec, heads is not None)
                return peer, reply
            reason = reply.reason if isinstance(reply, Refused) else getattr(reply, "message", repr(reply))
            if not rehandshaked and reason.startswith(HELLO_REQUIRED):
                rehandshaked = True
                self.handshake.drop(
                    peer, f"receiver {address} restarted: it no longer knows the transfers reserved on its previous run"
                )
                continue  # handshake with the new run
            if isinstance(reply, Refused) and reply.retryable and time.monotonic() + backoff < deadline:
                parts.counters["reservations_retried"] += 1
                time.sleep(backoff)  # room frees up as other transfers finish
                backoff = min(backoff * 2, 0.1)
                continue
            parts.counters["reservations_refused"] += 1
            raise ReservationError(f"receiver {address} refused transfer {transfer_id!r}: {reason}")

    def on_reply(self, peer: ReceiverPeer, msg: Reserved | Refused) -> None:
        """A receiver's answer (I/O thread); a reservation nobody waits for any more is handed back at once."""
        with self.parts.cond:
            owner, fut = self.parts.asking.get(msg.transfer_id, (None, None))
        if owner is peer and fut is not None and not fut.done():
            answer(fut, msg)
        elif isinstance(msg, Reserved):
            self.parts.outbox.send(peer, Cancel(msg.transfer_id, "reservation arrived after the sender gave up"))

    def _ask(self, peer: ReceiverPeer, msg: protocol.Reserve) -> protocol.Message:
        parts = self.parts
        transfer_id = msg.transfer_id
        fut: Future[protocol.Message] = Future()
        with parts.cond:
            if transfer_id in parts.asking or transfer_id in parts.transfers:
                raise ReservationError(f"transfer {transfer_id!r} is already open")
            if peer.dropped:  # lost since the handshake: its socket is closed, a Reserve would go nowhere
                raise TransferError(peer.dropped)
            parts.asking[transfer_id] = (peer, fut)
        parts.outbox.send(peer, msg)
        timeout = parts.config.reserve_timeout_s
        try:
            return fut.result(timeout)
        except FutureTimeout:
            # queued before the drop closes the socket
            parts.outbox.send(peer, Cancel(transfer_id, "reservation timed out at the sender"))
            reason = (
                f"receiver {peer.address} did not answer Reserve for {transfer_id!r} within "
                f"reserve_timeout_s={timeout:.3g}s"
            )
            self.handshake.drop(peer, reason)
            raise TransferTimeout(reason) from None
        finally:
            with parts.cond:
                parts.asking.pop(transfer_id, None)

    def _check(self, reply: Reserved, num_tokens: int, codec: str, window: bool = False) -> None:
        """A reservation from the wire is checked before any write is built from it."""
        if (codec != "none" or window) and reply.mode != "staging":
            why = "a head window" if window else f"encoded with {codec!r}"
            raise ReservationError(f"receiver reserved {reply.mode} mode for a transfer {why}: it needs staging")
        held = reply.held_tokens
        if held >= num_tokens or (reply.mode == "direct" and held % self.block_size):
            raise ReservationError(
                f"receiver says it holds {held} of {num_tokens} tokens: a transfer starts before the prompt's end, "
                f"and in direct mode at a whole number of our {self.block_size}-token blocks"
            )
        blocks_needed = -(-num_tokens // self.block_size) - held // self.block_size
        if reply.mode == "direct" and len(reply.block_ids) < blocks_needed:
            raise ReservationError(
                f"receiver reserved {len(reply.block_ids)} blocks for tokens {held} to {num_tokens} ({blocks_needed})"
            )
        if reply.mode == "staging" and not reply.staging_slots:
            raise ReservationError("receiver reserved staging mode without staging slots")
