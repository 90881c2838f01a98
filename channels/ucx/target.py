"""The target's side of the ucx channel: headers received and checked, DATA received into (a write) or sent from (a
read) the registered regions, then the notification delivered and the initiator ACKed (channels/README.md, "ucx")."""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import numpy as np

from pdkv.channels.grants import Grants
from pdkv.channels.inbox import NotificationInbox
from pdkv.channels.regions import RegionTable
from pdkv.channels.ucx.lib import Array, ucx_api
from pdkv.channels.ucx.wire import (
    ACK,
    ACK_ERROR_CHARS,
    DATA,
    HEADER,
    KIND_MASK,
    Ack,
    Header,
    all_done,
    first_error,
    framed,
    tag,
    unframe,
)
from pdkv.errors import ChannelError

log = logging.getLogger(__name__)


class Peer(msgspec.Struct):
    name: str
    agent_id: int
    ep: Any  # UCXEndpoint


class Incoming(msgspec.Struct):
    """A target's side of a transfer: its DATA receives (write) or sends (read), then notify and ACK."""

    peer: str
    header: Header
    requests: list[Any]
    error: str | None
    tickets: list[int | None] = []  # its ranges, marked landing (``Grants``) until it is over


class Target:
    """Serves the transfers peers start here: ``serve`` is one pass over what may have completed. Called holding
    the channel's lock."""

    def __init__(
        self,
        agent_name: str,
        worker: Any,  # UCXWorker
        max_header_bytes: int,
        peers: dict[str, Peer],
        regions: RegionTable[np.ndarray],
        grants: Grants,
        inbox: NotificationInbox,
    ) -> None:
        self._agent_name = agent_name
        self._worker = worker
        self._peers = peers
        self._regions = regions
        self._grants = grants
        self._inbox = inbox
        self._incoming: list[Incoming] = []
        self._acks: list[tuple[Any, np.ndarray]] = []  # ACK sends in flight, with the bytes UCX reads from
        # receives discarding a stranger's DATA; kept so they get posted (delayed submission)
        self._drains: list[Any] = []
        self._header_buf = np.zeros(max_header_bytes, dtype=np.uint8)
        self._header_req = self._post_header_recv()
        self._drain_buf = np.zeros(1, dtype=np.uint8)

    def _post_header_recv(self) -> Any:
        return self._worker.tag_recv(Array(self._header_buf), ucx_api.UCXXTag(HEADER << 56), KIND_MASK)

    def pending(self) -> bool:
        """Whether a transfer here or an ACK is still under way."""
        return bool(self._incoming or self._acks)

    def serve(self) -> bool:
        """Take a header that came, then finish the transfers whose requests all completed; True if anything
        moved."""
        busy = False
        if self._header_req.completed:
            error = first_error([self._header_req])
            raw = None if error else unframe(self._header_buf)
            self._header_req = self._post_header_recv()
            if raw is not None:
                self._accept(raw)
            else:
                log.warning("ucx: dropped a header: %s", error)
            busy = True
        self._acks = [(r, b) for r, b in self._acks if not r.completed]
        self._drains = [r for r in self._drains if not r.completed]
        for inc in [i for i in self._incoming if all_done(i.requests)]:
            self._incoming.remove(inc)
            self._finish(inc)
            busy = True
        return busy

    def forget(self, peer: str) -> None:
        """Drop the transfers ``peer`` started here."""
        self._incoming = [i for i in self._incoming if i.peer != peer]

    def clear(self) -> None:
        self._incoming.clear()

    def _accept(self, raw: bytes) -> None:
        """Check a header and start the target's side of its transfer."""
        try:
            header = msgspec.msgpack.decode(raw, type=Header)
        except msgspec.DecodeError as exc:
            log.warning("ucx: dropped a malformed header: %s", exc)
            return
        peer = self._peers.get(header.src)
        data_tag = tag(DATA, header.agent_id, header.seq)
        if peer is None or peer.agent_id != header.agent_id:
            # Nothing can be sent back to a stranger; drain what it wrote so UCX does not keep it.
            log.warning("ucx: refused a %s from %r, which is not a peer of %r", header.op, header.src, self._agent_name)
            if header.op == "write":
                self._drains += [self._worker.tag_recv(Array(self._drain_buf), data_tag) for _ in header.ranges]
            return
        error = None
        tickets: list[int | None] = []
        try:
            for region, offset, length in header.ranges:
                self._regions.check(region, offset, length)
            for region, offset, length in header.ranges:
                tickets.append(self._grants.begin(header.token, header.op, region, offset, length))
        except ChannelError as exc:
            error = str(exc)
            for ticket in tickets:
                self._grants.end(ticket)
            tickets = []
        if header.op == "write":
            if error is None:
                requests = [
                    self._worker.tag_recv(Array(self._regions[r][o : o + n]), data_tag) for r, o, n in header.ranges
                ]
            else:  # drain: a one-byte buffer truncates and discards each DATA message
                requests = [self._worker.tag_recv(Array(self._drain_buf), data_tag) for _ in header.ranges]
        else:
            empty = self._drain_buf[:0]
            views = (
                [self._regions[r][o : o + n] for r, o, n in header.ranges]
                if error is None
                else [empty] * len(header.ranges)
            )
            requests = [peer.ep.tag_send(Array(v), data_tag) for v in views]
        self._incoming.append(Incoming(header.src, header, requests, error, tickets))

    def _finish(self, inc: Incoming) -> None:
        """The target's side is over: notify (on success) and ACK the initiator."""
        for ticket in inc.tickets:
            self._grants.end(ticket)
        error = inc.error or first_error(inc.requests)  # drained receives fail with truncation: not the error
        if error is None and inc.header.notif is not None:
            self._inbox.deliver(inc.peer, inc.header.notif)
        peer = self._peers.get(inc.peer)
        if peer is not None:
            ack = framed(Ack(inc.header.seq, error[:ACK_ERROR_CHARS] if error else None))
            self._acks.append((peer.ep.tag_send(Array(ack), tag(ACK, peer.agent_id, inc.header.seq)), ack))
