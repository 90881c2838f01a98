"""The NIXL requests this side posted: made from prepared lists, tracked while in flight, settled from NIXL's
state (and, for a write that asked, its answer), released."""

from __future__ import annotations

import logging
from collections.abc import Callable

from pdkv.channels import answers
from pdkv.channels.answers import Asks
from pdkv.channels.handle import TransferHandle, XferState
from pdkv.channels.nixl.agent import Agent
from pdkv.channels.nixl.lib import NIXL_ERRORS, describe_nixl_error, nixl_xfer_handle
from pdkv.channels.nixl.lists import Prepped
from pdkv.channels.nixl.notices import Notices
from pdkv.channels.nixl.peers import Peers

log = logging.getLogger(__name__)


class NixlTransferHandle(TransferHandle):
    """A posted NIXL transfer: ``descriptors`` counts those pdkv handed NIXL: ops after merging adjacent ranges, or a
    block write's blocks (``write_blocks``; NIXL merges adjacent ones itself)."""

    def __init__(self, peer: str, op: str, nbytes: int, descriptors: int) -> None:
        super().__init__(peer, op, nbytes)
        self.descriptors = descriptors
        self.xfer: nixl_xfer_handle | None = None


class Transfers:
    """The transfers in flight (``inflight``) and the writes waiting for their answer (``asks``). ``poll``,
    ``release``, ``look`` and ``busy`` take the agent's lock; the rest are called holding it."""

    def __init__(self, agent: Agent, peers: Peers, asks: Asks, notices: Notices) -> None:
        self._agent = agent
        self._peers = peers
        self._notices = notices
        self.asks = asks
        self.inflight: dict[int, NixlTransferHandle] = {}

    def submit(
        self, handle: NixlTransferHandle, lists: Callable[[], Prepped], notif: bytes | None
    ) -> NixlTransferHandle:
        """Make and start the NIXL request from ``lists``, tracked until it finishes."""
        if notif is not None and handle.peer in self._peers.answering:  # framed: asked for an answer, or delivered
            notif = self.asks.ask(handle, notif) if handle.op == "write" else answers.frame(notif)
        try:
            handle.xfer = self._agent.nixl.make_prepped_xfer(handle.op.upper(), *lists(), notif or b"")
            state = self._agent.nixl.transfer(handle.xfer)
        except NIXL_ERRORS as exc:
            # Failures of a valid request (the peer gone) surface on the handle, like ERR later would.
            self._fail(handle, describe_nixl_error(exc))
            self._release_xfer(handle)
            return handle
        self.inflight[handle.id] = handle
        if self._settle(handle, state):  # its answer cannot have come yet (asked just now): only marked written
            self.asks.written(handle)
        return handle

    def poll(self, handle: TransferHandle) -> XferState:
        """The handle's state, asking NIXL (or, for a write that waits for its answer, the notifications)."""
        if handle.state is not XferState.PENDING:
            return handle.state
        if handle.id not in self.inflight and self.asks.asked(handle):  # written: its answer may be here
            self._notices.fetch()
            return handle.state
        written = False
        with self._agent.lock:
            if handle.id in self.inflight:
                assert isinstance(handle, NixlTransferHandle) and handle.xfer is not None
                try:
                    state = self._agent.nixl.check_xfer_state(handle.xfer)
                except NIXL_ERRORS as exc:
                    self._fail(handle, describe_nixl_error(exc))
                    self._release_xfer(handle)
                else:
                    written = self._settle(handle, state)
        if written:  # outside the lock: where its answer came first, this completes it, and its callbacks may call us
            self.asks.written(handle)
        return handle.state

    def look(self) -> int:
        """The watcher's pass: how many transfers finished and notifications arrived."""
        with self._agent.lock:
            pending = [h for h in self.inflight.values()]
        return sum(self.poll(h) is not XferState.PENDING for h in pending) + self._notices.fetch()

    def busy(self) -> bool:
        """Whether a transfer is in flight or a write waits for its answer."""
        with self._agent.lock:
            return bool(self.inflight) or bool(self.asks)

    def release(self, handle: TransferHandle) -> None:
        """Free the NIXL request; a still-pending transfer is aborted and its handle failed."""
        self.asks.forget(handle)
        with self._agent.lock:
            if isinstance(handle, NixlTransferHandle) and handle.xfer is not None:
                handle.fail("released before it completed")
                self._release_xfer(handle)

    def forget(self, peer: str, reason: str) -> None:
        """Fail the peer's transfers in flight and its writes waiting for an answer."""
        for handle in [h for h in self.inflight.values() if h.peer == peer]:
            handle.abandon(reason)  # a one-sided write cannot be called back: it may land when the link returns
            self._release_xfer(handle)
        self.asks.fail(f"{reason} before it answered", peer)

    def close(self, reason: str) -> None:
        """Fail and release every transfer, and every write waiting for its answer."""
        for handle in list(self.inflight.values()):
            handle.fail(reason)
            self._release_xfer(handle)
        self.asks.fail(reason)

    def _settle(self, handle: NixlTransferHandle, state: str) -> bool:
        """Apply a NIXL state ("DONE", "PROC", "ERR") to the handle. True for a written write that asked for an
        answer: the caller marks it written (``Asks.written``) once it holds no lock, since that completes it where the
        answer came first (over UCX's tcp, without NIXL's progress thread, the answer is often seen before the write's
        own DONE), and an answered write's done callback releases it through the channel (``Completions``)."""
        asked = False
        if state == "DONE":
            asked = self.asks.asked(handle)
            if not asked:
                handle.complete()
        elif state == "ERR":
            self.asks.forget(handle)
            self._fail(handle, "NIXL reported ERR (the peer went away, or a region was deregistered mid-transfer)")
        else:
            return False
        self._release_xfer(handle)
        return asked

    def _fail(self, handle: NixlTransferHandle, why: str) -> None:
        """A transfer NIXL failed: the peer's endpoints may be dead, so its agent is loaded afresh next time."""
        handle.fail(why)
        self._peers.broken.add(handle.peer)

    def _release_xfer(self, handle: NixlTransferHandle) -> None:
        """Give the NIXL request back (aborting it if still active)."""
        self.inflight.pop(handle.id, None)
        xfer, handle.xfer = handle.xfer, None
        if xfer is None:
            return
        try:
            xfer.release()
        except NIXL_ERRORS as exc:
            # NIXL keeps a request it cannot abort and frees it with the agent.
            log.warning("nixl: releasing %r: %s", handle, describe_nixl_error(exc))
