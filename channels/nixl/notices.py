"""NIXL's notifications taken from the agent: answers to our writes applied, the rest delivered to the inbox or
answered, each answer sent back as a notification of its own (channels/answers.py)."""

from __future__ import annotations

import logging

from pdkv.channels import answers
from pdkv.channels.answers import Asks
from pdkv.channels.inbox import NotificationInbox
from pdkv.channels.nixl.agent import Agent
from pdkv.channels.nixl.lib import NIXL_ERRORS, describe_nixl_error
from pdkv.errors import ChannelError

log = logging.getLogger(__name__)


class Notices:
    """Moves what NIXL received into the inbox (or its answerer). Takes the agent's lock itself."""

    def __init__(self, agent: Agent, asks: Asks, inbox: NotificationInbox) -> None:
        self._agent = agent
        self._asks = asks
        self._inbox = inbox

    def fetch(self) -> int:
        """Move NIXL's new notifications into the inbox; how many there were."""
        with self._agent.lock:
            if self._agent.closed:
                return 0
            try:
                fresh = self._agent.nixl.get_new_notifs()
            except NIXL_ERRORS as exc:
                raise ChannelError(f"nixl: reading notifications failed: {describe_nixl_error(exc)}") from exc
        count = 0
        arrived: list[tuple[str, bytes]] = []  # for us to deliver or answer, in order
        for peer, payloads in fresh.items():
            name = peer.decode() if isinstance(peer, bytes) else peer
            for payload in payloads:
                count += 1
                if self._asks.answered(name, payload):
                    continue  # an answer to a write of ours, applied
                if payload.startswith(answers.ANSWER):  # late (its write given up), repeated or forged: not kept,
                    log.debug("nixl: dropping an answer from %r that no write of ours awaits", name)
                    continue  # where nobody drains (a sender's inbox) it would pile up
                arrived.append((name, payload))
        if self._inbox.answerer is None:
            for name, payload in arrived:
                self._inbox.deliver(name, payload)
        else:  # the pass's notices answered together: their checks share one pass (answers.serve)
            self._reply(answers.serve(self._inbox, arrived))
        return count

    def _reply(self, replies: list[tuple[str, bytes]]) -> None:
        """Send the answers of a pass, each as a notification to the peer that asked."""
        for peer, reply in replies:
            with self._agent.lock:
                if self._agent.closed:
                    return
                try:
                    self._agent.nixl.send_notif(peer, reply)
                except NIXL_ERRORS as exc:  # its write then waits out the sender's stall bound, as one to a dead peer
                    log.warning("nixl: answering %r: %s", peer, describe_nixl_error(exc))
