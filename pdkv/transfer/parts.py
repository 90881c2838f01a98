"""What each side's rooms share, and the named hooks by which a room calls back into the object that owns it.

``KVSender`` makes one ``SenderParts`` and hands it to every room of the prefill side (the handshake, the Reserves,
the pools, the heartbeats, each transfer); ``KVReceiver`` makes one ``ReceiverParts`` for the decode side's. Where a
room must call back into another it goes through a small protocol that says who implements it: the ones every room
uses are here (``Greeting``, ``SenderOutbox``, ``ReceiverOutbox``, ``OpenTransfer``), the others sit beside the one
room that calls them (``outgoing.SettleListener``, ``handshake.Admitted``, ``pool.Bookings``). So a reader who meets
``parts.outbox.send(...)`` finds the binding by the protocol's name, not in a constructor's argument list. This
module sits below every room: none of them imports another to be wired.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

from pdkv.blocks import BlockAllocator
from pdkv.channels.base import Channel
from pdkv.config import TransferConfig
from pdkv.errors import TransferError
from pdkv.transfer.control import ControlLoop
from pdkv.transfer.hosttime import HostTimes
from pdkv.transfer.incoming import ReceiveMemory
from pdkv.transfer.peers import ReceiverPeer, SenderPeer
from pdkv.transfer.protocol import Hello, Message


class Greeting(Protocol):
    """Our side's Hello, made afresh for each peer (``KVSender.hello``, ``KVReceiver.hello``)."""

    def hello(self) -> Hello: ...


class SenderOutbox(Protocol):
    """Control messages to one receiver over its own DEALER socket, from any thread (``control.DealerSockets``)."""

    def send(self, peer: ReceiverPeer, msg: Message) -> None: ...

    def close_peer(self, peer: ReceiverPeer) -> None: ...


class OpenTransfer(Protocol):
    """What the sender's rooms read of an open transfer (``outgoing.OutgoingTransfer``)."""

    transfer_id: str
    peer: ReceiverPeer
    posting: int  # chunks between taking credit and their write being tracked
    settled: bool
    renewed: float  # when an answered heartbeat last renewed its reservation

    def fail(self, err: TransferError) -> None: ...


@dataclass(kw_only=True)
class SenderParts:
    """What the prefill side's rooms share: one lock, the counters, the receivers, the open transfers."""

    channel: Channel
    config: TransferConfig
    secret: bytes
    greeting: Greeting
    outbox: SenderOutbox
    loop: ControlLoop  # the I/O thread: owns the DEALER sockets, runs what the channel's threads hand over
    cond: threading.Condition  # guards every room's state and every transfer's: one lock, no ordering to get wrong
    counters: collections.Counter[str]
    peers: dict[str, ReceiverPeer]  # by address: handshaken, or on their way (``handshake.SenderHandshake``)
    transfers: Mapping[str, OpenTransfer]  # open by transfer id; only ``KVSender`` adds and removes them
    asking: dict[str, tuple[ReceiverPeer, Future[Message]]]  # Reserves sent and not answered yet, by transfer id
    host: HostTimes = field(default_factory=HostTimes)  # host time per chunk and per request (hosttime.py)


class ReceiverOutbox(Protocol):
    """A reply to a sender by its routing identity, sent from the I/O thread (``KVReceiver.reply``: its ROUTER)."""

    def reply(self, identity: bytes, msg: Message) -> None: ...


@dataclass(kw_only=True)
class ReceiverParts:
    """What the decode side's rooms share: one lock, the counters, its memory and allocator, the admitted senders."""

    channel: Channel
    config: TransferConfig
    secret: bytes
    greeting: Greeting
    outbox: ReceiverOutbox
    loop: ControlLoop  # the I/O thread: owns the ROUTER, lands chunks as their notifications arrive
    lock: threading.Condition  # guards the book, the pools and the admitted senders
    counters: collections.Counter[str]
    memory: ReceiveMemory  # where chunks land, and its regions in the channel
    allocator: BlockAllocator  # shared with the decode engine
    peers: dict[bytes, SenderPeer]  # admitted senders by routing identity (``handshake.ReceiverHandshake``)
    unproven: dict[bytes, tuple[Hello, bytes]]  # with a secret: identity -> (Hello, transcript) till it proves it
    host: HostTimes = field(default_factory=HostTimes)  # host time per chunk and per request (hosttime.py)
