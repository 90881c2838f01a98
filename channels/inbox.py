"""Notifications that landed and wait to be drained, with an fd the receiver's I/O thread sleeps on."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from pdkv.channels.handle import Notification
from pdkv.wakeup import Waker

log = logging.getLogger(__name__)

Answerer = Callable[[list[Notification]], list[bytes]]
"""Notifications whose transfers landed -> the answer to each, which its writer gets with its completion
(``TransferHandle.answer``; b"": none). Given together what arrived together (a nixl watcher's pass), so that their
checks can share a pass (one checksum read-back on a GPU, not one each)."""


class NotificationInbox:
    """Notifications that landed here and wait to be drained, with an fd that is readable while any wait.

    One per channel, shared by every implementation: whichever thread
    delivers (a tcp reader, NIXL's poller) wakes whoever sleeps in ``poll`` on
    ``fileno()`` (the receiver's I/O thread) at once.
    """

    def __init__(self) -> None:
        self._items: list[Notification] = []
        self._lock = threading.Lock()
        self._waker = Waker()
        self.answerer: Answerer | None = None
        # work the answers' writers need not wait for, run once they went out (``Channel.answer_notifications``)
        self.after_answers: Callable[[], None] | None = None

    def take(self, notifs: list[Notification]) -> list[bytes] | None:
        """Notifications whose transfers landed, on the thread that landed them: with an answerer (a channel that
        carries answers back to the writer, ``Channel.answer_notifications``), the answer to each (b"": none, a
        plain acknowledgement); else delivered to the fd's sleeper, and None."""
        if self.answerer is not None:
            answers = self.answerer(notifs)
            if len(answers) != len(notifs):
                raise RuntimeError(f"the answerer gave {len(answers)} answers to {len(notifs)} notifications")
            return answers
        for n in notifs:
            self.deliver(n.peer, n.payload)
        return None

    def answered(self) -> None:
        """The answers of a ``take`` went out: run ``after_answers`` on this thread, off their writers' path (a
        failure is logged: the answers are sent)."""
        if self.after_answers is None:
            return
        try:
            self.after_answers()
        except Exception:
            log.exception("the work after answering notifications failed")

    def fileno(self) -> int:
        return self._waker.fileno()

    def deliver(self, peer: str, payload: bytes) -> None:
        with self._lock:
            self._items.append(Notification(peer, payload))
        self._waker.wake()

    def drain(self) -> list[Notification]:
        self._waker.clear()  # before taking the items: a delivery racing with us leaves the fd readable
        with self._lock:
            out, self._items = self._items, []
        return out

    def close(self) -> None:
        self._waker.close()
