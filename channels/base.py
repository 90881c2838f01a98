"""The transfer channel interface, shaped like NIXL's agent API: ``Channel``, its options and errors.

Each method's docstring is its contract; how the parts fit (the life cycle, answers, why nothing above a channel
polls) is described once, in channels/README.md, "The interface".
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Annotated, Any, ClassVar, Literal

import msgspec

from pdkv.channels.grants import Access, Grantable, Grants
from pdkv.channels.handle import BlockWrite, Notification, TransferHandle, TransferOp, XferState
from pdkv.channels.inbox import Answerer, NotificationInbox
from pdkv.channels.reachability import Reachability
from pdkv.channels.regions import RegionTable
from pdkv.errors import ChannelError, ConfigError, PeerUnreachableError, TransferTimeout

log = logging.getLogger(__name__)


class ChannelOptions(msgspec.Struct, forbid_unknown_fields=True):
    """Options shared by every channel; each channel subclasses this with its own.

    ``secret`` is the worker's shared secret (the top-level ``secret``, filled
    in by ``PdkvConfig.channel_options``): one secret guards the control plane
    and, in a channel that can check it (``authenticates_data``), every data
    connection too.

    ``host`` is where the channel's data plane lives, which is the worker's
    ``host`` unless the channel's options say otherwise: the tcp channel
    listens there, and the UCX-based channels (nixl, ucx) use the network
    interface that holds it (``UCX_NET_DEVICES``, unless the user set it).
    """

    secret: str = ""
    host: str = "127.0.0.1"
    # After a peer was found unreachable, ``connect`` fails at once for this long before trying again; for a peer
    # reached before (a link that was up), at most this long: from 0.5 s, doubling with each failure in a row.
    unreachable_retry_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0

    def __repr__(self) -> str:
        """Every field, the secret's value left out: options may be logged."""
        shown = ", ".join(
            f"{f}={'<secret>' if f == 'secret' and self.secret else repr(getattr(self, f))}"
            for f in self.__struct_fields__
        )
        return f"{type(self).__name__}({shown})"


class Channel(ABC):
    """Base of every transfer channel; channels/README.md, "The interface", says how its members fit."""

    name: ClassVar[str]
    Options: ClassVar[type[ChannelOptions]] = ChannelOptions
    # Whether data connections must prove ``options.secret`` before anything lands in a region.
    authenticates_data: ClassVar[bool] = False
    # Whether the target checks every incoming write and read against its grants (``guard``). A channel
    # whose transfers are one-sided in hardware (nixl: RDMA, cma) cannot: the target never sees them.
    enforces_grants: ClassVar[bool] = True
    # The memory this channel registers and moves by itself (``pdkv.memory.memory_kind``): tcp, ucx and mock
    # move host memory through host views; nixl also addresses VRAM. A KV buffer in memory the channel does
    # not reach is staged through pinned host memory by the sender and receiver (``pdkv.staging``);
    # ``pdkv.memory.in_reach`` says which (here only the names: this module stays free of torch).
    memory: ClassVar[frozenset[str]] = frozenset({"host"})
    # Whether the target can answer a notification back to the writer, with the completion the writer gets
    # (``answer_notifications``): tcp on the connection the transfer came by, nixl as a notification of its own.
    carries_answers: ClassVar[bool] = False
    runs_after_answers: ClassVar[bool] = False  # and an answer pass's ``after`` once its answers went (tcp)
    # Whether ``wait`` reads the handle's completion on the calling thread, asleep in the kernel until it comes (tcp:
    # the link's sockets), so a waiter alone is woken by its answer directly; where ``wait`` would spin (nixl can
    # only be polled), a waiter sleeps until the channel's own thread completes the handle.
    wakes_waiter: ClassVar[bool] = False

    def __init__(self, agent_name: str, options: ChannelOptions | None = None) -> None:
        self.agent_name = agent_name
        self.options = options if options is not None else self.Options()
        self.counters: collections.Counter[str] = collections.Counter()
        self.regions: RegionTable[Any] = RegionTable(self.name)  # per region: a view, a registration
        self.inbox = NotificationInbox()
        self.grants = Grants()
        self.reachability = Reachability(self.name, agent_name, self.options.unreachable_retry_s, self.counters)
        if self.options.secret and not self.authenticates_data:
            log.warning(
                "%s channel: the shared secret authenticates the control plane only; this channel's data "
                "connections are not checked, so keep its network trusted",
                self.name,
            )

    @classmethod
    def parse_options(cls, raw: dict[str, Any] | None) -> ChannelOptions:
        """Options from a config mapping; errors name the channel, field and expectation (never the secret)."""
        try:
            return msgspec.convert(raw or {}, cls.Options, strict=False)
        except msgspec.ValidationError as exc:
            shown = {k: "<secret>" if k == "secret" else v for k, v in (raw or {}).items()}
            raise ConfigError(f"channel {cls.name!r} options {shown!r}: {exc}") from None

    def stats(self) -> dict[str, int]:
        """The channel's own event counters (``auth_failures``), named as the sender's and receiver's are, so a
        worker exports their sum as one ``pdkv_transfer_events_total`` series per event."""
        return dict(self.counters)

    # -- memory ------------------------------------------------------------
    @abstractmethod
    def register(self, buf: Any, block_bytes: int = 0) -> int:
        """Register a buffer (tensor, array, bytearray) for transfers; returns its region id.

        ``block_bytes``: the buffer is a grid of blocks this size (a KV buffer's ``layout.block_bytes``), so
        transfers will mostly move whole blocks of it. A channel that prepares descriptors (nixl) prepares
        them once per block for such a region, as vLLM's NixlConnector does; the others ignore it.
        """

    @abstractmethod
    def deregister(self, region: int) -> None:
        """Forget a region; later descriptors naming it fail."""

    @abstractmethod
    def metadata(self) -> bytes:
        """Opaque bytes a peer passes to ``add_peer`` to reach this agent and its regions."""

    def guard(self, region: int, sealed: bool = False) -> None:
        """Peers may touch ``region`` only through grants from now on (see ``Grants``). ``sealed``: never (no grant is
        made), and a channel whose peers reach memory by keys it hands out (nixl) leaves it out of ``metadata()``."""
        self.grants.guard(region, sealed)

    def grant(self, token: bytes, access: Access, ranges: Grantable) -> None:
        """Let the peer presenting ``token`` write or read these guarded (region, offset, length) ranges (or blocks)."""
        self.grants.grant(token, access, ranges)

    def revoke(self, token: bytes, access: Access, ranges: Grantable, timeout: float) -> bool:
        """Take a grant back and fence it: False if a frame of that peer was still landing there after ``timeout`` s."""
        return self.grants.revoke(token, access, ranges, timeout)

    def hash_landing(self, region: int, unit: int) -> bool:
        """Hash what lands in guarded ``region`` as it lands, in units of ``unit`` bytes (a KV block); True if this
        channel does, and then ``landed_checksum`` answers for it without reading the bytes again.

        Only a channel that receives the bytes itself can (tcp, on clear connections); where the peer writes them
        one-sided (nixl, ucx) the receiver reads them back to verify them.
        """
        return False

    def landed_checksum(self, regions: Sequence[int], ids: Sequence[int], unit: int) -> int:
        """``blocks_checksum`` of blocks ``ids`` of every region in turn (each ``hash_landing``ed in units of
        ``unit``), from what was hashed as it landed: the value of the bytes as they sit in memory."""
        raise ChannelError(f"{self.name} channel does not hash what lands; verify by reading the bytes")

    def fence(self, peer: str, token: bytes) -> None:  # noqa: B027 - channels with connections override it
        """Make sure nothing ``peer`` (presenting ``token``) sent so far can still land here, then return.

        Called before the memory of a sender that went silent is reused. Revoking its grants already waits out frames
        landing now; a channel with connections also cuts them, so that bytes the peer queued before (a frozen process)
        die with them instead of arriving later.
        """

    # -- peers -------------------------------------------------------------
    @abstractmethod
    def add_peer(self, metadata: bytes) -> str:
        """Make a peer reachable from its ``metadata()``; returns the peer's agent name."""

    def remove_peer(self, peer: str) -> None:
        """Drop a peer; its pending handles fail, its reachability verdicts go (a restarted worker has a new name)."""
        self.reachability.forget(peer)
        self._remove_peer(peer)

    @abstractmethod
    def _remove_peer(self, peer: str) -> None:
        """``remove_peer``'s work in this channel."""

    # -- reachability --------------------------------------------------------
    def connect(self, peer: str, timeout: float, token: bytes = b"") -> None:
        """Open the data path to ``peer`` now and prove it works, rather than at its first transfer; ``token``: the
        capability the transfers to it will present (``write``), so the path opened is theirs.

        ``add_peer`` may only read metadata, so an address this host cannot reach (a ``host`` left at loopback, a NAT
        without ``advertise_host``, a firewall, ``UCX_NET_DEVICES`` naming another network) would otherwise surface as
        a failed chunk and a silent recompute of every request. Raises ``PeerUnreachableError`` with what failed and
        what to set, after a warning and a ``peer_unreachable`` count; then the peer fails at once for a while
        (``reachability.py``), so requests do not each wait out a connect timeout. Cheap when the path is up. Waits
        at most ``timeout`` s (the tcp channel also stops at its ``connect_timeout``).
        """
        self.reachability.check(peer, trial=True)
        try:
            self._probe(peer, timeout, token)
        except PeerUnreachableError:
            raise
        except (ChannelError, TransferTimeout) as exc:
            raise self.reachability.record(peer, str(exc)) from None
        self.reachability.reached(peer)

    def _probe(self, peer: str, timeout: float, token: bytes) -> None:  # noqa: B027 - optional hook
        """``connect``'s work: open and check the path to ``peer``, raising ``ChannelError``; nothing to open by
        default."""

    # -- transfers ---------------------------------------------------------
    def write(
        self, peer: str, ops: Sequence[TransferOp], notif: bytes | None = None, token: bytes = b""
    ) -> TransferHandle:
        """Post a one-sided WRITE of local ranges into the peer's; ``notif`` reaches the peer after the data.

        ``token``: the capability the peer's guarded regions check this transfer
        against (``Grants``); a sender passes the one its receiver granted its
        reservation to, so a write left over from an earlier session can never
        borrow a later one's grants.
        """
        return self._post("write", peer, ops, notif, token)

    def write_blocks(
        self, peer: str, blocks: BlockWrite, notif: bytes | None = None, token: bytes = b"", *, inline: bool = False
    ) -> TransferHandle:
        """``write`` of whole blocks given as arrays (a direct-mode chunk): checked and posted with no Python pass
        per op where the channel can (nixl: index arrays into its block lists; tcp: the check); by default, as the
        ops it stands for. ``inline``: the caller has nothing else to do until this write is answered (a request of
        one chunk), so a channel that sends from threads of its own may send on the caller's instead (tcp)."""
        return self.write(peer, blocks.ops(), notif, token)

    def read(
        self, peer: str, ops: Sequence[TransferOp], notif: bytes | None = None, token: bytes = b""
    ) -> TransferHandle:
        """Post a one-sided READ of the peer's ranges into local ones; ``notif`` reaches the peer after."""
        return self._post("read", peer, ops, notif, token)

    @abstractmethod
    def _post(
        self, op: Literal["write", "read"], peer: str, ops: Sequence[TransferOp], notif: bytes | None, token: bytes
    ) -> TransferHandle:
        """Validate (``regions.check_ops``) and post one WRITE or READ; the one method a channel implements for both."""

    def poll(self, handle: TransferHandle) -> XferState:
        """Current state of a handle; channels that need progress calls override this."""
        return handle.state

    def wait(self, handle: TransferHandle, timeout: float) -> None:
        """Block until the handle is done; raise ``ChannelError`` on failure, ``TransferTimeout`` after
        ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.poll(handle)
            if state is XferState.DONE:
                return
            if state is XferState.ERROR:
                raise ChannelError(f"{self.name} {handle.op} to {handle.peer!r} failed: {handle.error}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransferTimeout(
                    f"{self.name} {handle.op} of {handle.nbytes} bytes to {handle.peer!r} not done after {timeout:.3g}s"
                )
            pause = self.poll_interval(timeout - remaining)
            if pause > 0:
                handle.sleep(min(remaining, pause))
            else:
                time.sleep(0)  # spin, but let other threads of this process run

    def poll_interval(self, waited: float) -> float:
        """Seconds ``wait`` pauses between polls once it has waited ``waited`` s; 0 spins.

        Channels whose handles complete from their own I/O thread wake the waiter early through the handle's event;
        channels whose completion is only seen by polling (nixl) override this to spin first.
        """
        return 0.0005

    def release(self, handle: TransferHandle) -> None:  # noqa: B027 - optional hook
        """Free resources a finished handle holds (NIXL handles must be released)."""

    def answer_notifications(self, answerer: Answerer, after: Callable[[], None] | None = None) -> bool:
        """Have ``answerer(notifications)`` run on the thread that landed their transfers (those that arrived
        together, together), not waiting in ``get_notifications``, each answer going back to its writer with the
        completion (``TransferHandle.answer``; b"": none), and ``after`` there once a pass's answers are on their way
        (``runs_after_answers``; else never). Set before any peer writes (over nixl, before ``metadata()`` goes to
        peers: it says the agent answers). False, and nothing set, where answers cannot go (``carries_answers``)."""
        if self.carries_answers:
            self.inbox.answerer, self.inbox.after_answers = answerer, after if self.runs_after_answers else None
        return self.carries_answers

    def get_notifications(self) -> list[Notification]:
        """Drain notifications whose transfers have fully landed here."""
        return self.inbox.drain()

    def notification_fd(self) -> int:
        """A file descriptor that polls readable while notifications wait in ``get_notifications``."""
        return self.inbox.fileno()

    @abstractmethod
    def close(self) -> None:
        """Fail pending handles, drop peers, deregister everything. Idempotent.

        Implementations end with ``super().close()``, which releases the notification fd.
        """
        with contextlib.suppress(OSError):
            self.inbox.close()

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SummedWrites(ABC):
    """What a channel that sends a block write's bytes itself may offer: the write of a chunk whose notification
    vouches for the bytes' checksum, hashed as they are sent. The caller would otherwise read them all once more
    before the first could leave; here each piece is hashed right after the kernel copied it, and the notification
    made last (tcp: ``Initiator.post_blocks_sealed``). A channel without it (nixl, ucx, mock) is hashed first."""

    @abstractmethod
    def write_blocks_summed(
        self, peer: str, blocks: BlockWrite, seal: Callable[[int], bytes], token: bytes = b"", *, inline: bool = False
    ) -> TransferHandle | None:
        """``write_blocks(..., inline=inline)`` of ``blocks`` and the notification ``seal(checksum)`` makes from
        their ``blocks_checksum`` (units of ``blocks.block_bytes``, in the write's order), called once, by the
        thread whose part of the hashing ends last, after its bytes went and before the notification; None where
        this write cannot go so (the caller then hashes and calls ``write_blocks``). A notification that proves too
        long once sealed, or a ``seal`` that raises, ends the link, failing every write in flight on it
        (``write_blocks`` refuses one before a byte leaves)."""
