"""Answers over a channel whose only way back is a notification of its own (nixl): a write that asks its target for an
answer, the target's answer, and the write's handle completed only once both the write is done and its answer came.

tcp answers on the connection the transfer came by (an ANSWER frame, channels/tcp/). NIXL has no such connection
within reach of Python: a write is one-sided, and all that passes between the agents besides it is a notification.
So the initiator's notification carries an ask: the handle's id and 8 random bytes drawn for this write alone, and
the target's answer goes back as a notification of its own echoing both (``Channel.answer_notifications``). NIXL's
notifications are not authenticated: whoever can send one under the target's name could guess an id (a counter),
but not bytes it never saw, so a forged answer or refusal completes or fails nothing. Both ends know from the
target's metadata that it answers; only then are notifications to it framed (a kind byte first), so a target that
does not answer sees them as before.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import struct
import threading
from dataclasses import dataclass

from pdkv.channels.handle import Notification, TransferHandle, XferState
from pdkv.channels.inbox import NotificationInbox

log = logging.getLogger(__name__)

PLAIN, ASK = 0, 1  # a framed notification's kind: deliver it; answer it (the ask follows the kind)
ANSWER = b"PKA"  # leads an answer: then its kind, the ask it answers and its body
ANSWERED, REFUSED = 2, 3  # the answer; why there is none (the answerer failed): the write fails
_ASK = struct.Struct("<Q8s")  # an ask: the handle's id, and the write's own random bytes
_HEAD = len(ANSWER) + 1 + _ASK.size
MAX_ANSWER_BYTES = 64 << 10  # an answer longer than this is refused at the target and ignored at the initiator
MAX_REASON_BYTES = 1000  # a refusal's reason is cut to this


def frame(notif: bytes, ask: bytes = b"") -> bytes:
    """A notification to a target that answers: with ``ask`` (``_ASK``-packed) to be answered, else delivered."""
    return bytes([ASK]) + ask + notif if ask else bytes([PLAIN]) + notif


def _refusal(head: bytes, why: str) -> bytes:
    return ANSWER + bytes([REFUSED]) + head + why.encode()[:MAX_REASON_BYTES]


def serve(inbox: NotificationInbox, arrived: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
    """Framed notifications that arrived together at a target that answers, as (peer, payload): the plain ones (and
    any not framed, for the layer above to refuse) delivered, the asked ones answered together (one ``take``, so
    their checks share a pass): the replies to send, as (peer, reply)."""
    asked: list[tuple[str, bytes]] = []  # (peer, the id as framed)
    notifs: list[Notification] = []
    for peer, payload in arrived:
        if payload[:1] == bytes([ASK]) and len(payload) >= 1 + _ASK.size:
            asked.append((peer, payload[1 : 1 + _ASK.size]))
            notifs.append(Notification(peer, payload[1 + _ASK.size :]))
        else:
            inbox.deliver(peer, payload[1:] if payload[:1] == bytes([PLAIN]) else payload)
    if not notifs:
        return []
    try:
        taken = inbox.take(notifs)
    except Exception as exc:  # the watcher goes on; the writers hear their writes failed
        log.exception("answering %d notifications failed", len(notifs))
        return [(peer, _refusal(head, f"the target could not take its notification: {exc}")) for peer, head in asked]
    replies = []
    for (peer, head), answer in zip(asked, taken or [b""] * len(asked), strict=True):
        if len(answer) > MAX_ANSWER_BYTES:
            replies.append((peer, _refusal(head, f"its answer exceeds {MAX_ANSWER_BYTES} bytes")))
        else:
            replies.append((peer, ANSWER + bytes([ANSWERED]) + head + answer))
    return replies


@dataclass
class _Ask:
    handle: TransferHandle
    nonce: bytes  # drawn for this write: an answer must echo it
    written: bool = False
    answer: bytes | None = None


class Asks:
    """An initiator's writes that asked for an answer and have not completed: each completes once its write is done
    (``written``) and its answer came (``answered``), in either order; a refusal fails it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[int, _Ask] = {}

    def __bool__(self) -> bool:
        return bool(self._open)

    def ask(self, handle: TransferHandle, notif: bytes) -> bytes:
        """The notification to post with ``handle``'s write, asking for an answer."""
        nonce = secrets.token_bytes(8)
        with self._lock:
            self._open[handle.id] = _Ask(handle, nonce)
        return frame(notif, _ASK.pack(handle.id, nonce))

    def asked(self, handle: TransferHandle) -> bool:
        return handle.id in self._open

    def written(self, handle: TransferHandle) -> None:
        """The write is done: complete it if its answer came, else wait for that."""
        with self._lock:
            ask = self._open.get(handle.id)
            if ask is None:
                return
            ask.written = True
            done = ask.answer is not None
            if done:
                del self._open[handle.id]
        if done:
            assert ask.answer is not None
            handle.answer = ask.answer
            handle.complete()

    def answered(self, peer: str, payload: bytes) -> bool:
        """Whether ``payload`` from ``peer`` answers one of our writes to it (then applied): a refusal fails the
        write, an answer completes it once written. One that names no write of ours, or not with its bytes, is not."""
        if not payload.startswith(ANSWER) or len(payload) < _HEAD or len(payload) > _HEAD + MAX_ANSWER_BYTES:
            return False
        kind, (ident, nonce) = payload[len(ANSWER)], _ASK.unpack_from(payload, len(ANSWER) + 1)
        body = payload[_HEAD:]
        with self._lock:
            ask = self._open.get(ident)
            if (
                ask is None
                or ask.handle.peer != peer
                or not hmac.compare_digest(ask.nonce, nonce)
                or kind not in (ANSWERED, REFUSED)
                or ask.answer is not None
            ):
                return False
            done = kind == REFUSED or ask.written
            if done:
                del self._open[ident]
            else:
                ask.answer = body
        if kind == REFUSED:
            ask.handle.fail(f"the peer refused transfer {ident}: {body.decode(errors='replace')}")
        elif done:
            ask.handle.answer = body
            ask.handle.complete()
        return True

    def forget(self, handle: TransferHandle) -> None:
        """The write failed or was given up on: no answer is awaited any more."""
        with self._lock:
            self._open.pop(handle.id, None)

    def fail(self, why: str, peer: str | None = None) -> None:
        """Fail every write (of ``peer``) still waiting for its answer: the bytes landed, what became of them is
        not known."""
        with self._lock:
            gone = [a for a in self._open.values() if peer is None or a.handle.peer == peer]
            for ask in gone:
                del self._open[ask.handle.id]
        for ask in gone:
            if ask.handle.state is XferState.PENDING:
                ask.handle.fail(why)
