"""What the target answers a transfer with once every share of it landed: ACK (several transfers' in one frame),
ANSWER (the ACK carrying the receiver's answer to its notification, e.g. a chunk's verdict) or NACK (refused).

ACKs wait in the frame loop's ``acks`` list while more frames are readable (``FrameServer.serve``), and go out
before anything else the connection sends.
"""

from __future__ import annotations

import logging
import struct

from pdkv.channels.handle import Notification
from pdkv.channels.inbox import NotificationInbox
from pdkv.channels.tcp.conn import Conn
from pdkv.channels.tcp.options import Agent
from pdkv.channels.tcp.sessions import Session
from pdkv.channels.tcp.wire import ACK, ANSWER, MAX_ERROR_BYTES, NACK, pack

log = logging.getLogger(__name__)


class Replies:
    """Ends a transfer's shares on the target and answers it; its notification goes to ``inbox`` (taken on the
    connection's thread, whose answer, if any, travels back in ANSWER)."""

    def __init__(self, agent: Agent, inbox: NotificationInbox) -> None:
        self.agent = agent
        self._inbox = inbox

    def ended(
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
            self.send_acks(conn, acks)
            self.nack(conn, xfer, why)
        elif done:
            answer, why = self._take(session, notif) if notif is not None else (None, "")
            if answer:
                self.send_acks(conn, acks)
                with conn.send_lock:
                    conn.send([pack(ANSWER, xfer, len(answer)), answer])
                self._inbox.answered()
            elif why:
                self.send_acks(conn, acks)
                self.nack(conn, xfer, why)
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

    @staticmethod
    def nack(conn: Conn, xfer: int, why: str) -> None:
        conn.send_frame(NACK, xfer, why.encode()[:MAX_ERROR_BYTES])

    @staticmethod
    def send_acks(conn: Conn, acks: list[int]) -> None:
        """Send the queued ACKs in one frame (the first id in the header, the others after it), and clear them."""
        if not acks:
            return
        n = len(acks)
        hdr = pack(ACK, acks[0], 8 * (n - 1), aux=n)
        with conn.send_lock:
            conn.send([hdr, struct.pack(f"<{n - 1}Q", *acks[1:])] if n > 1 else [hdr])
        acks.clear()
