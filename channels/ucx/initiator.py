"""The initiator's side of the ucx channel: a transfer's header and DATA posted (a read's receives first), done
only on the target's ACK (channels/README.md, "ucx")."""

from __future__ import annotations

from typing import Any, Literal

import msgspec
import numpy as np

from pdkv.channels.handle import TransferHandle
from pdkv.channels.ucx import wire
from pdkv.channels.ucx.lib import UCX_ERRORS, Array
from pdkv.channels.ucx.target import Peer
from pdkv.errors import ChannelError


class Outgoing(msgspec.Struct):
    """An initiator's transfer: its DATA sends (write) or receives (read), and the ACK it waits for."""

    handle: TransferHandle
    requests: list[Any]
    ack_buf: np.ndarray
    ack: Any
    keep: list[np.ndarray]  # header bytes and views UCX is still reading from


class Initiator:
    """The transfers this agent started, by handle id, until their ACK. Called holding the channel's lock."""

    def __init__(self, agent_name: str, agent_id: int, worker: Any, max_header_bytes: int) -> None:
        self._agent_name = agent_name
        self._agent_id = agent_id
        self._worker = worker  # UCXWorker
        self._max_header_bytes = max_header_bytes
        self._seq = 0
        self._outgoing: dict[int, Outgoing] = {}

    def post(
        self,
        op: Literal["write", "read"],
        peer: Peer,
        ranges: list[tuple[int, int, int]],
        views: list[np.ndarray],
        notif: bytes | None,
        token: bytes,
        total: int,
    ) -> TransferHandle:
        """Start a transfer of local ``views`` to (or from) the peer's ``ranges``; a failed post fails its handle."""
        seq, self._seq = self._seq, (self._seq + 1) & 0xFFFFFFFF
        header = wire.framed(wire.Header(op, seq, self._agent_name, self._agent_id, ranges, notif, token))
        if header.nbytes > self._max_header_bytes:
            raise ChannelError(
                f"ucx: {len(ranges)} ranges do not fit one header of {self._max_header_bytes} bytes; split "
                "the transfer or raise max_header_bytes"
            )
        handle = TransferHandle(peer.name, op, total)
        data_tag = wire.tag(wire.DATA, self._agent_id, seq)
        ack_buf = np.zeros(wire.ACK_BYTES, dtype=np.uint8)
        try:
            ack = self._worker.tag_recv(Array(ack_buf), wire.tag(wire.ACK, self._agent_id, seq))
            if op == "read":  # receives first, so the target's DATA always finds them
                requests = [self._worker.tag_recv(Array(v), data_tag) for v in views]
                requests.append(
                    peer.ep.tag_send(Array(header), wire.tag(wire.HEADER, self._agent_id, seq))
                )  # held: ucxx posts it later
            else:
                requests = [peer.ep.tag_send(Array(header), wire.tag(wire.HEADER, self._agent_id, seq))]
                requests += [peer.ep.tag_send(Array(v), data_tag) for v in views]
        except UCX_ERRORS as exc:
            handle.fail(f"posting to {peer.name!r} failed: {exc}")
            return handle
        self._outgoing[handle.id] = Outgoing(handle, requests, ack_buf, ack, [header, *views])
        return handle

    def pending(self) -> bool:
        return bool(self._outgoing)

    def serve(self) -> bool:
        """Finish the transfers whose requests and ACK completed; True if any did."""
        busy = False
        for out in list(self._outgoing.values()):
            if not wire.all_done(out.requests):
                continue
            error = wire.first_error(out.requests)  # a failed send needs no ACK to be final
            if error is None and not out.ack.completed:
                continue
            del self._outgoing[out.handle.id]
            self._finish(out, error)
            busy = True
        return busy

    def _finish(self, out: Outgoing, error: str | None) -> None:
        """The initiator's transfer is over: DONE if every request and the ACK say so."""
        error = error or wire.first_error([out.ack])
        if error is None:
            try:
                ack = msgspec.msgpack.decode(wire.unframe(out.ack_buf), type=wire.Ack)
                error = ack.error
            except (msgspec.DecodeError, ChannelError) as exc:
                error = f"malformed ACK: {exc}"
        if error is None:
            out.handle.complete()
        else:
            out.handle.fail(f"{out.handle.op} refused or failed at {out.handle.peer!r}: {error}")

    def forget(self, peer: str, reason: str) -> None:
        """Fail the peer's transfers."""
        for out in [o for o in self._outgoing.values() if o.handle.peer == peer]:
            out.handle.fail(reason)
            del self._outgoing[out.handle.id]

    def release(self, handle: TransferHandle) -> None:
        """Forget a handle; one still pending (its peer hung) is failed."""
        if self._outgoing.pop(handle.id, None) is not None:
            handle.fail("released before it completed")

    def close(self, reason: str) -> None:
        """Fail every transfer."""
        for out in self._outgoing.values():
            out.handle.fail(reason)
        self._outgoing.clear()
