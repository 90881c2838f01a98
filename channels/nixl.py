"""The NIXL channel: the real NIXL agent (``nixl._api.nixl_agent``), UCX backend by default.

DRAM<->DRAM between processes runs without a GPU (so CI tests it); CUDA tensors register as VRAM. How it maps onto
the ``Channel`` interface, the UCX environment it sets and why its progress thread keeps a delay: channels/README.md,
"nixl".
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Annotated, Any, ClassVar, Literal

import msgspec
import numpy as np

from pdkv.channels import answers
from pdkv.channels.answers import Asks
from pdkv.channels.base import Channel, ChannelOptions
from pdkv.channels.grants import Access, Range
from pdkv.channels.handle import BlockWrite, Notification, TransferHandle, TransferOp, XferState, merge_ops
from pdkv.channels.ucx_env import UCX_ENV_DEFAULTS, OpenChannels, apply_env_defaults, ucx_follow_host
from pdkv.errors import ChannelError
from pdkv.memory import byte_view, memory_kind

NIXL_ENV_DEFAULTS: dict[str, str] = {**UCX_ENV_DEFAULTS, "NIXL_LOG_LEVEL": "WARN"}
apply_env_defaults(NIXL_ENV_DEFAULTS)

# UCX reads the environment set above when it loads, hence these late imports.
import nixl._bindings as nixl_bindings  # noqa: E402
from nixl._api import nixl_agent, nixl_agent_config, nixl_prepped_dlist_handle, nixl_xfer_handle  # noqa: E402

_OPEN = OpenChannels()  # after the library's import: see OpenChannels

log = logging.getLogger(__name__)

# The bindings' exceptions share no base class but Exception; catch exactly them.
NIXL_ERRORS: tuple[type[Exception], ...] = tuple(
    v for k, v in vars(nixl_bindings).items() if k.startswith("nixl") and k.endswith("Error") and isinstance(v, type)
)
METADATA_VERSION = 3  # 2: a region's block size (block-granular descriptor lists); 3: whether the agent answers
MemType = Literal["DRAM", "VRAM"]
Desc = tuple[int, int, int]  # NIXL transfer descriptor: (address, length, device id)
ListKey = tuple[str, str, tuple[Desc, ...]]  # (agent, "" for local; memory type; descriptors)
# what make_prepped_xfer takes for a transfer: the local list and indices into it, the remote list and indices
_Prepped = tuple[nixl_prepped_dlist_handle, np.ndarray, nixl_prepped_dlist_handle, np.ndarray]


def describe_nixl_error(exc: BaseException) -> str:
    """A message a user can act on for a NIXL exception."""
    if isinstance(exc, nixl_bindings.nixlRemoteDisconnectError):
        return "the peer disconnected (its process exited or closed its channel)"
    return f"NIXL {type(exc).__name__}: {exc}"


class NixlOptions(ChannelOptions):
    """Options of the nixl channel (``channel_options`` in config)."""

    backends: Annotated[list[str], msgspec.Meta(min_length=1)] = msgspec.field(default_factory=lambda: ["UCX"])
    progress_thread: bool = True  # NIXL's progress thread, event-driven (see module docstring)
    progress_delay_us: Annotated[int, msgspec.Meta(ge=1, le=10_000_000)] = 1000  # its longest sleep between wake-ups
    spin_s: Annotated[float, msgspec.Meta(ge=0)] = 0.005  # wait() busy-polls this long before backing off
    # longest pause between polls in wait(), and the watcher's while a region is open to every peer
    max_poll_interval_s: Annotated[float, msgspec.Meta(gt=0)] = 0.001
    # the watcher's pause right after activity (channels/README.md, "nixl")
    watch_min_s: Annotated[float, msgspec.Meta(gt=0)] = 0.00005
    # the watcher's longest pause while a peer holds a write grant here (a reservation or a pool open: its
    # notification may come any moment); with no grant and every region guarded it sleeps until an event
    granted_poll_s: Annotated[float, msgspec.Meta(gt=0)] = 0.0002
    # after this long with nothing moving, a held grant is watched at max_poll_interval_s instead: a pool a sender
    # holds between requests costs ~1.6% of a core rather than ~11%, and the first write after the quiet spell
    # is seen up to max_poll_interval_s later (a grant, a post or a landed write makes the watch fast again)
    granted_idle_s: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    prep_cache_size: Annotated[int, msgspec.Meta(ge=1)] = 4096  # prepared lists of unaligned writes kept per side
    # the most blocks a region registered with a block size may have, here or at a peer: one descriptor each
    max_region_blocks: Annotated[int, msgspec.Meta(ge=1)] = 1 << 22
    num_threads: Annotated[int, msgspec.Meta(ge=0)] = 0  # UCX backend worker threads (0: NIXL's default)
    # forgotten peers whose NIXL agent stays loaded for their next add_peer (see _load_agent); past this many the
    # one forgotten longest ago is unloaded (a peer that died for good: a decode worker restarted under a new name)
    parked_peers: Annotated[int, msgspec.Meta(ge=0)] = 16


class _RegionMeta(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    addr: Annotated[int, msgspec.Meta(ge=0)]
    size: Annotated[int, msgspec.Meta(gt=0)]
    dev: Annotated[int, msgspec.Meta(ge=0)]
    mem: MemType
    block: Annotated[int, msgspec.Meta(ge=0)] = 0  # the region is a grid of blocks this size (0: it is not)


class _NixlMeta(msgspec.Struct, forbid_unknown_fields=True):
    version: int
    name: Annotated[str, msgspec.Meta(min_length=1)]
    agent: bytes  # stage 1: NIXL agent metadata
    regions: dict[int, _RegionMeta]  # stage 2: what descriptor lists are prepared against
    answers: bool = False  # it answers notifications (``Channel.answer_notifications``): they go to it framed


class _Region(msgspec.Struct):
    meta: _RegionMeta
    reg: Any  # nixlRegDList, for deregistration
    buf: Any  # keeps the registered memory alive


class NixlTransferHandle(TransferHandle):
    """A posted NIXL transfer: ``descriptors`` counts those pdkv handed NIXL: ops after merging adjacent ranges, or a
    block write's blocks (``write_blocks``; NIXL merges adjacent ones itself)."""

    def __init__(self, peer: str, op: str, nbytes: int, descriptors: int) -> None:
        super().__init__(peer, op, nbytes)
        self.descriptors = descriptors
        self.xfer: nixl_xfer_handle | None = None


class _BlockLists:
    """One side's block-gridded regions as prepared descriptor lists, one descriptor per block, one list per memory
    type: what vLLM's NixlConnector prepares once per peer, so that a write of whole blocks is only index arrays
    into lists made long before it (``make_prepped_xfer`` merges runs of adjacent blocks back into one descriptor).
    """

    def __init__(self, agent: nixl_agent, name: str, regions: Mapping[int, _RegionMeta]) -> None:
        """Prepare the lists over ``regions``' gridded ones, local (``name`` "") or the peer ``name``'s."""
        self.lists: dict[str, nixl_prepped_dlist_handle] = {}
        self.first: dict[int, int] = {}  # region -> the index of its first block in its memory type's list
        descs: dict[str, list[np.ndarray]] = {}
        for region, meta in regions.items():
            if meta.block:
                rows = descs.setdefault(meta.mem, [])
                self.first[region] = sum(len(r) for r in rows)
                count = meta.size // meta.block
                addrs = meta.addr + meta.block * np.arange(count, dtype=np.uint64)
                rows.append(
                    np.column_stack([addrs, np.full(count, meta.block, np.uint64), np.full(count, meta.dev, np.uint64)])
                )
        try:
            for mem, rows in descs.items():
                self.lists[mem] = agent.prep_xfer_dlist(name, np.concatenate(rows), mem)
        except BaseException:
            self.release()
            raise

    def indices(self, regions: np.ndarray, offsets: np.ndarray, blocks: np.ndarray, block: int) -> np.ndarray:
        """The list indices of ``blocks[i]`` blocks from byte ``offsets[i]`` of ``regions[i]``, op after op."""
        ids, where = np.unique(regions, return_inverse=True)
        starts = np.array([self.first[int(r)] for r in ids], dtype=np.int64)[where] + offsets // block
        within = np.arange(int(blocks.sum()), dtype=np.int64) - np.repeat(np.cumsum(blocks) - blocks, blocks)
        return np.repeat(starts, blocks) + within

    def of(self, regions: Sequence[int], blocks: np.ndarray) -> np.ndarray:
        """The list indices of ``blocks`` of each of ``regions`` in turn (all in one memory type's list)."""
        firsts = np.fromiter((self.first[r] for r in regions), dtype=np.int64, count=len(regions))
        return (firsts[:, None] + blocks.astype(np.int64, copy=False)[None, :]).ravel()

    def release(self) -> None:
        for handle in self.lists.values():
            handle.release()
        self.lists.clear()


class _PrepCache:
    """LRU of prepared descriptor lists keyed by (agent, memory type, descriptors).

    Releasing a prepared list does not disturb transfers already made from
    it (NIXL copies what it needs into the request), so eviction is safe at
    any time.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lists: OrderedDict[ListKey, nixl_prepped_dlist_handle] = OrderedDict()

    def get(self, key: ListKey, make: Callable[[], nixl_prepped_dlist_handle]) -> nixl_prepped_dlist_handle:
        handle = self._lists.get(key)
        if handle is not None:
            self._lists.move_to_end(key)
            return handle
        handle = self._lists[key] = make()
        while len(self._lists) > self.capacity:
            self._lists.popitem(last=False)[1].release()
        return handle

    def drop(self, agent: str | None = None) -> None:
        """Release the lists prepared for ``agent`` (all of them when None)."""
        for key in [k for k in self._lists if agent is None or k[0] == agent]:
            self._lists.pop(key).release()


_AGENT_CONFIG_LOCK = threading.Lock()
PR_SET_TIMERSLACK = 29  # prctl(2)
WATCH_TIMER_SLACK_NS = 1000


def tighten_timer_slack(ns: int) -> bool:
    """Let the calling thread's timed waits end within ``ns`` of their timeout; False where that cannot be set.

    Linux lets a thread's sleep run up to its timer slack (50 us by default) past
    the timeout, so the watcher's 50 us pause while a transfer is in flight
    measured ~130 us (p50) here, ~80 us with 1 us of slack: NIXL sends the
    target's notification only when this side's ``check_xfer_state`` sees the
    transfer done, so each pause is latency every chunk pays.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        return bool(ctypes.CDLL(None, use_errno=True).prctl(PR_SET_TIMERSLACK, ctypes.c_ulong(ns), 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def keep_delay_config(delay_us: int) -> type:
    """A ``nixlAgentConfig`` subclass whose ``pthrDelay`` stays ``delay_us`` whatever is assigned to it."""
    base = nixl_bindings.nixlAgentConfig

    class KeepDelay(base):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self) -> int:
            return int(base.pthrDelay.__get__(self))

        @pthrDelay.setter
        def pthrDelay(self, _ignored: int) -> None:
            base.pthrDelay.__set__(self, delay_us)

    return KeepDelay


def create_nixl_agent(name: str, options: NixlOptions) -> nixl_agent:
    """A ``nixl_agent`` configured from ``options``, its progress thread sleeping ``progress_delay_us``.

    UCX uses the interface of ``options.host`` unless the user chose
    (``ucx_follow_host``).

    ``nixl_agent.__init__`` builds its ``nixlAgentConfig`` and sets
    ``pthrDelay = 0`` (a busy spin) with no way to pass another value. For
    the constructor's duration this swaps in ``keep_delay_config``'s class,
    under a lock. The raw NIXL baseline builds its agents here too, so both
    sides of the comparison run the same settings.
    """
    ucx_follow_host(options.host)  # before the agent creates its UCX context, which reads it
    conf = nixl_agent_config(
        enable_prog_thread=options.progress_thread, backends=list(options.backends), num_threads=options.num_threads
    )
    base = nixl_bindings.nixlAgentConfig
    if not options.progress_thread or not hasattr(base, "pthrDelay"):
        if options.progress_thread:
            log.warning("nixl: no nixlAgentConfig.pthrDelay in this NIXL; its progress thread keeps NIXL's own delay")
        return nixl_agent(name, conf)
    with _AGENT_CONFIG_LOCK:
        nixl_bindings.nixlAgentConfig = keep_delay_config(options.progress_delay_us)
        try:
            return nixl_agent(name, conf)
        finally:
            nixl_bindings.nixlAgentConfig = base


class NixlChannel(Channel):
    """Transfers through a NIXL agent; the design: channels/README.md, "nixl"."""

    name: ClassVar[str] = "nixl"
    Options = NixlOptions
    enforces_grants: ClassVar[bool] = False  # RDMA/cma writes never pass through the target's code
    # VRAM by address; emulated device memory (PDKV_EMULATE_DEVICE) by address too, as DRAM: the direct
    # device path on CPU, with no host view taken.
    memory: ClassVar[frozenset[str]] = frozenset({"host", "cuda", "emulated"})
    carries_answers: ClassVar[bool] = True  # as notifications of their own (channels/answers.py)

    def __init__(self, agent_name: str, options: ChannelOptions | None = None) -> None:
        super().__init__(agent_name, options)
        opts: NixlOptions = self.options  # type: ignore[assignment]
        self._lock = threading.Lock()  # NIXL's default sync mode leaves agent calls to the caller to serialize
        try:
            self._agent = create_nixl_agent(agent_name, opts)
        except NIXL_ERRORS as exc:
            raise ChannelError(
                f"nixl: could not create agent {agent_name!r} with backends {opts.backends}: "
                f"{describe_nixl_error(exc)}. "
                "With UCX, UCX_TLS=shm, posix or sysv fail here; leave UCX_TLS unset or use 'cma,tcp' or 'tcp'"
            ) from exc
        missing = [b for b in opts.backends if b not in self._agent.backends]
        if missing:
            raise ChannelError(
                f"nixl: backends {missing} are not available; this NIXL build has {self._agent.get_plugin_list()}"
            )
        self._peers: dict[str, dict[int, _RegionMeta]] = {}
        # NIXL agents loaded, by name: their metadata blob, kept past remove_peer (see _load_agent); and those a
        # transfer failed to (their endpoints may be dead: loaded afresh on the next add_peer)
        self._loaded: dict[str, bytes] = {}
        self._broken: set[str] = set()
        self._parked: OrderedDict[str, None] = OrderedDict()  # loaded but forgotten, the longest ago first
        self._inflight: dict[int, NixlTransferHandle] = {}
        self._answering: set[str] = set()  # peers that answer our notifications (their metadata says so)
        self._asks = Asks()  # our writes waiting for their answer
        self._local_lists = _PrepCache(opts.prep_cache_size)
        self._remote_lists = _PrepCache(opts.prep_cache_size)
        self._local_blocks: _BlockLists | None = None  # made on first use after a gridded region came or went
        self._remote_blocks: dict[str, _BlockLists] = {}  # per peer written to, made by connect or the first write
        self._closed = False
        # set by a post, a grant, a registration or close: the watcher polls at its fastest again
        self._activity = threading.Event()
        self._moved_at = time.monotonic()  # the last grant, post or completed transfer or notification
        self.watch_polls = 0  # the watcher's passes: none while nothing can arrive
        self._watcher = threading.Thread(target=self._watch, name=f"nixl-{agent_name}-watch", daemon=True)
        self._watcher.start()
        _OPEN.add(self)

    # -- memory ------------------------------------------------------------
    def register(self, buf: Any, block_bytes: int = 0) -> int:
        meta = self._describe_buffer(buf)
        if block_bytes:
            meta.block = block_bytes
            self._check_grid(meta, "a buffer registered here")
        with self._lock:
            self._check_open()
            if meta.mem not in self._supported_mems():
                raise ChannelError(f"nixl: backends {self.options.backends} cannot register {meta.mem} memory")  # type: ignore[attr-defined]
            try:
                reg = self._agent.register_memory([(meta.addr, meta.size, meta.dev, "")], meta.mem)
            except NIXL_ERRORS as exc:
                raise ChannelError(
                    f"nixl: registering {meta.size} bytes of {meta.mem} failed: {describe_nixl_error(exc)}"
                ) from exc
            region = self.regions.add(_Region(meta, reg, buf), meta.size)
            if meta.block:
                self._drop_local_blocks()
        self._activity.set()  # open to every peer until guarded: the watcher looks for notifications
        return region

    def grant(self, token: bytes, access: Access, ranges: Sequence[Range]) -> None:
        """A peer may write here from now on: its notification is what the watcher waits for."""
        super().grant(token, access, ranges)
        self._moved()

    @staticmethod
    def _describe_buffer(buf: Any) -> _RegionMeta:
        """Address, size, device and NIXL memory type of a buffer, checked."""
        kind = memory_kind(buf)
        if kind in ("cuda", "emulated"):
            # VRAM path: written for GPU machines, run there only by tests/gpu/check.py.
            if not buf.is_contiguous():
                raise ChannelError("nixl: register needs a contiguous tensor; call .contiguous() first")
            size = buf.numel() * buf.element_size()
            if size == 0:
                raise ChannelError("nixl: cannot register an empty tensor")
            if kind == "emulated":
                return _RegionMeta(buf.data_ptr(), size, 0, "DRAM")
            return _RegionMeta(buf.data_ptr(), size, buf.device.index or 0, "VRAM")
        view = byte_view(buf)
        if view.readonly:
            raise ChannelError("nixl: register needs writable memory (peers may WRITE into it)")
        if view.nbytes == 0:
            raise ChannelError("nixl: cannot register an empty buffer")
        return _RegionMeta(np.frombuffer(view, dtype=np.uint8).ctypes.data, view.nbytes, 0, "DRAM")

    def _check_grid(self, meta: _RegionMeta, whose: str) -> None:
        """Raise ``ChannelError`` unless ``meta``'s block size cuts it into at most ``max_region_blocks`` blocks."""
        limit = self.options.max_region_blocks  # type: ignore[attr-defined]
        if meta.block < 0 or (meta.block and (meta.size % meta.block or meta.size // meta.block > limit)):
            raise ChannelError(
                f"nixl: {whose} of {meta.size} bytes is not a whole number of at most {limit} blocks of {meta.block} "
                "bytes; register it with its layout's block_bytes (or none), or raise max_region_blocks"
            )

    def _drop_local_blocks(self) -> None:
        """Forget the local block lists: the regions they cover changed. Holds the lock."""
        if self._local_blocks is not None:
            self._local_blocks.release()
            self._local_blocks = None

    def _peer_block_lists(self, peer: str) -> _BlockLists:
        """``peer``'s block lists, made on the first need (``connect`` or a write): only a side that writes to a
        peer pays for one descriptor per block of its KV (a receiver adds every sender as a peer). Holds the lock."""
        lists = self._remote_blocks.get(peer)
        if lists is None:
            try:
                lists = self._remote_blocks[peer] = _BlockLists(self._agent, peer, self._peers[peer])
            except NIXL_ERRORS as exc:
                raise ChannelError(
                    f"nixl: preparing the block lists of peer {peer!r}'s regions failed: {describe_nixl_error(exc)}"
                ) from exc
        return lists

    def _local_block_lists(self) -> _BlockLists:
        """The local block lists, made now if a gridded region came or went since. Holds the lock."""
        if self._local_blocks is None:
            try:
                self._local_blocks = _BlockLists(self._agent, "", {r: e.meta for r, e in self.regions.items()})
            except NIXL_ERRORS as exc:
                raise ChannelError(
                    f"nixl: preparing the block lists of this agent's regions failed: {describe_nixl_error(exc)}"
                ) from exc
        return self._local_blocks

    def _supported_mems(self) -> set[str]:
        return {m.removesuffix("_SEG") for b in self._agent.backends for m in self._agent.get_backend_mem_types(b)}

    def deregister(self, region: int) -> None:
        with self._lock:
            entry = self.regions.remove(region)
            if entry is None or self._closed:
                return
            # A prepared list holds the registration it was checked against.
            self._local_lists.drop()
            self._drop_local_blocks()
            self._deregister(entry)

    def registered_with_nixl(self, buf: Any) -> bool:
        """NIXL's own word, not pdkv's table: whether ``buf``'s bytes are registered with this agent (NIXL prepares a
        descriptor list over them). A leak check reads it: a released region must be gone from NIXL too."""
        meta = self._describe_buffer(buf)
        with self._lock:
            self._check_open()
            try:
                self._agent.prep_xfer_dlist("", [(meta.addr, meta.size, meta.dev)], meta.mem).release()
            except NIXL_ERRORS:
                return False
        return True

    def _deregister(self, entry: _Region) -> None:
        try:
            self._agent.deregister_memory(entry.reg)
        except NIXL_ERRORS as exc:
            log.warning("nixl: deregistering %d bytes failed: %s", entry.meta.size, describe_nixl_error(exc))

    def metadata(self) -> bytes:
        with self._lock:
            self._check_open()
            meta = _NixlMeta(
                METADATA_VERSION,
                self.agent_name,
                self._agent.get_agent_metadata(),
                {r: e.meta for r, e in self.regions.items()},
                self.inbox.answerer is not None,
            )
        return msgspec.msgpack.encode(meta)

    # -- peers -------------------------------------------------------------
    def add_peer(self, metadata: bytes) -> str:
        meta = self._decode_metadata(metadata)
        self.reachability.check(meta.name)  # UCX connects here: a known-unreachable peer fails without waiting again
        with self._lock:
            self._check_open()
            self._load_agent(meta)  # stage 1
            self._forget_lists(meta.name)
            self._peers[meta.name] = dict(meta.regions)
            if meta.answers:
                self._answering.add(meta.name)
            else:
                self._answering.discard(meta.name)
            self.regions.add_peer(meta.name, {r: m.size for r, m in meta.regions.items()})
            for region in meta.regions.values():  # stage 2: NIXL checks each region against stage 1
                try:
                    self._prepared(meta.name, region.mem, ((region.addr, region.size, region.dev),))
                except NIXL_ERRORS as exc:
                    self._forget_peer(meta.name, unload=True)
                    raise ChannelError(
                        f"nixl: peer {meta.name!r} region of {region.size} bytes at {region.addr:#x} does not match "
                        f"its registrations ({describe_nixl_error(exc)}); its metadata is stale or malformed"
                    ) from exc
        return meta.name

    def _decode_metadata(self, metadata: bytes) -> _NixlMeta:
        try:
            meta = msgspec.msgpack.decode(metadata, type=_NixlMeta)
        except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
            raise ChannelError(f"nixl: malformed peer metadata: {exc}") from None
        if meta.version != METADATA_VERSION:
            raise ChannelError(
                f"nixl: peer metadata version {meta.version}, this pdkv speaks {METADATA_VERSION}; upgrade the older "
                "side"
            )
        if meta.name == self.agent_name:
            raise ChannelError(
                f"nixl: peer has this agent's own name {meta.name!r}; give every worker a unique agent name"
            )
        for region, r in meta.regions.items():
            if r.addr + r.size > 1 << 64:
                raise ChannelError(
                    f"nixl: peer {meta.name!r} region {region} ({r.addr:#x}+{r.size}) overflows the address space"
                )
            self._check_grid(r, f"peer {meta.name!r} region {region}")
        return meta

    def _load_agent(self, meta: _NixlMeta) -> None:
        """Stage 1: load the peer's agent metadata; a restarted peer of the same name replaces the old one.

        An agent still loaded from the same metadata is kept, endpoints and all, unless a transfer to it
        failed: NIXL's ``remove_remote_agent`` closes its UCX endpoints without waiting, and UCX keeps their
        TCP connections open on both sides, so unloading and reloading a live peer after each fence or lost
        control connection leaked a socket on each side per round of link faults (issue 31).
        """
        self._parked.pop(meta.name, None)
        if self._loaded.get(meta.name) == meta.agent and meta.name not in self._broken:
            return
        if meta.name in self._loaded:  # the peer restarted (new metadata under its name), or its endpoints failed
            self._unload(meta.name)
        try:
            loaded = self._agent.add_remote_agent(meta.agent)
        except NIXL_ERRORS as exc:
            raise self.reachability.record(
                meta.name,
                f"nixl: cannot reach peer {meta.name!r} from its metadata ({describe_nixl_error(exc)}); is it running, "
                "and do "
                "both sides use a network they share (UCX_NET_DEVICES is "
                f"{os.environ.get('UCX_NET_DEVICES', 'unset')!r} here)?",
            ) from exc
        name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if name != meta.name:
            self._agent.remove_remote_agent(name)
            raise ChannelError(f"nixl: peer metadata names {meta.name!r} but its NIXL agent is {name!r}")
        self._loaded[name] = meta.agent

    def _unload(self, peer: str) -> None:
        """Drop the peer's NIXL agent and endpoints. Holds the lock."""
        self._loaded.pop(peer, None)
        self._broken.discard(peer)
        self._parked.pop(peer, None)
        try:
            self._agent.remove_remote_agent(peer)
        except NIXL_ERRORS as exc:
            log.debug("nixl: removing peer %r: %s", peer, describe_nixl_error(exc))

    def fence(self, peer: str, token: bytes) -> None:
        """NIXL writes are one-sided: the target cannot stop a peer holding its registration keys. The sender's
        own lease check (it stops writing once its heartbeats may have lapsed) is the defence here; forget the
        peer (``remove_peer``) so that it must hand over its metadata again."""
        log.warning("nixl: cannot fence peer %r: its one-sided writes never pass through this agent", peer)
        self.remove_peer(peer)

    def remove_peer(self, peer: str) -> None:
        with self._lock:
            if not self._closed:
                self._forget_peer(peer, f"peer {peer!r} removed")

    def _probe(self, peer: str, timeout: float, token: bytes) -> None:
        """Have NIXL open its connections to ``peer`` now (UCX created the endpoint, and connected, in ``add_peer``)."""
        with self._lock:
            self._check_open()
            if peer not in self._peers:
                raise ChannelError(f"nixl: unknown peer {peer!r}; call add_peer with its metadata first")
            try:
                self._agent.make_connection(peer)
            except NIXL_ERRORS as exc:
                raise ChannelError(f"nixl: cannot connect to peer {peer!r}: {describe_nixl_error(exc)}") from exc
            # the side that writes connects (a sender, at its handshake): its first write finds the lists made
            self._local_block_lists()
            self._peer_block_lists(peer)

    def _forget_peer(self, peer: str, reason: str = "peer removed", unload: bool = False) -> None:
        """Fail the peer's pending transfers, release its prepared lists and regions: nothing reaches it until
        ``add_peer`` again. Its NIXL agent goes too with ``unload`` or when a transfer to it failed; otherwise
        it stays loaded for that ``add_peer`` (``_load_agent`` says why), one of at most ``parked_peers``.
        Holds the lock."""
        for handle in [h for h in self._inflight.values() if h.peer == peer]:
            handle.abandon(reason)  # a one-sided write cannot be called back: it may land when the link returns
            self._release_xfer(handle)
        self._asks.fail(f"{reason} before it answered", peer)
        self._forget_lists(peer)
        self._peers.pop(peer, None)
        self.regions.remove_peer(peer)
        if unload or peer in self._broken:
            self._unload(peer)
        elif peer in self._loaded:
            self._parked[peer] = None
            self._parked.move_to_end(peer)
            opts: NixlOptions = self.options  # type: ignore[assignment]
            while len(self._parked) > opts.parked_peers:
                self._unload(next(iter(self._parked)))

    def _forget_lists(self, peer: str) -> None:
        """Release the lists prepared against ``peer``'s regions. Holds the lock."""
        self._remote_lists.drop(peer)
        blocks = self._remote_blocks.pop(peer, None)
        if blocks is not None:
            blocks.release()

    def _fail(self, handle: NixlTransferHandle, why: str) -> None:
        """A transfer NIXL failed: the peer's endpoints may be dead, so its agent is loaded afresh next time."""
        handle.fail(why)
        self._broken.add(handle.peer)

    # -- transfers ---------------------------------------------------------
    def _post(
        self, op: Literal["write", "read"], peer: str, ops: Sequence[TransferOp], notif: bytes | None, token: bytes
    ) -> NixlTransferHandle:
        with self._lock:
            self._check_open()
            total = self.regions.check_ops(peer, ops)
            merged = merge_ops(ops)
            remote = self._peers[peer]
            # each region looked up once: a chunk is an op per tensor and run of blocks, hundreds of them
            local = {r: self.regions[r].meta for r in {o.local_region for o in merged}}
            theirs = {r: remote[r] for r in {o.remote_region for o in merged}}
            mems = self._mems(peer, local.values(), theirs.values())
            handle = self._submit(
                NixlTransferHandle(peer, op, total, len(merged)),
                lambda: (
                    self._block_lists(peer, merged, local, theirs, mems)
                    or self._range_lists(peer, merged, local, theirs, mems)
                ),
                notif,
            )
        self._moved()
        return handle

    def write_blocks(
        self, peer: str, blocks: BlockWrite, notif: bytes | None = None, token: bytes = b"", *, inline: bool = False
    ) -> TransferHandle:
        """The blocks checked on their arrays (``check_blocks``) and posted as index arrays into the block lists, as
        NixlConnector posts them: no op made, none merged in Python (NIXL merges adjacent descriptors). Regions
        not gridded in ``blocks.block_bytes`` on both sides go as ops (``Channel.write_blocks``)."""
        with self._lock:
            self._check_open()
            total = self.regions.check_blocks(peer, blocks)
            remote = self._peers[peer]
            local = [self.regions[r].meta for r in blocks.local_regions]
            theirs = [remote[r] for r in blocks.remote_regions]
            gridded = all(m.block == blocks.block_bytes for m in (*local, *theirs))
            if gridded:
                mems = self._mems(peer, local, theirs)
                handle = self._submit(
                    NixlTransferHandle(peer, "write", total, len(local) * len(blocks.local_blocks)),
                    lambda: self._indexed(peer, blocks, mems),
                    notif,
                )
        if not gridded:
            return super().write_blocks(peer, blocks, notif, token)
        self._moved()
        return handle

    def _mems(self, peer: str, local: Iterable[_RegionMeta], theirs: Iterable[_RegionMeta]) -> tuple[str, str]:
        """The one memory type of each side's regions in a transfer."""
        return (
            self._one_mem({m.mem for m in local}, "local"),
            self._one_mem({m.mem for m in theirs}, f"peer {peer!r}"),
        )

    def _submit(
        self, handle: NixlTransferHandle, lists: Callable[[], _Prepped], notif: bytes | None
    ) -> NixlTransferHandle:
        """Make and start the NIXL request from ``lists``, tracked until it finishes. Holds the lock."""
        if notif is not None and handle.peer in self._answering:  # framed: asked for an answer, or delivered
            notif = self._asks.ask(handle, notif) if handle.op == "write" else answers.frame(notif)
        try:
            handle.xfer = self._agent.make_prepped_xfer(handle.op.upper(), *lists(), notif or b"")
            state = self._agent.transfer(handle.xfer)
        except NIXL_ERRORS as exc:
            # Failures of a valid request (the peer gone) surface on the handle, like ERR later would.
            self._fail(handle, describe_nixl_error(exc))
            self._release_xfer(handle)
            return handle
        self._inflight[handle.id] = handle
        self._settle(handle, state)
        return handle

    def _moved(self) -> None:
        """A transfer was posted: the watcher polls at its fastest again."""
        self._moved_at = time.monotonic()
        self._activity.set()

    @staticmethod
    def _one_mem(mems: set[str], whose: str) -> str:
        if len(mems) != 1:
            raise ChannelError(
                f"nixl: one transfer must use one memory type per side; {whose} ranges mix {sorted(mems)}: split it"
            )
        return mems.pop()

    @staticmethod
    def _desc(region: _RegionMeta, offset: int, length: int) -> Desc:
        return (region.addr + offset, length, region.dev)

    def _block_lists(
        self,
        peer: str,
        ops: Sequence[TransferOp],
        local: Mapping[int, _RegionMeta],
        theirs: Mapping[int, _RegionMeta],
        mems: tuple[str, str],
    ) -> _Prepped | None:
        """Both sides' block lists and the indices of ``ops``' blocks in them; None unless every op moves whole
        blocks between regions gridded in one block size on both sides. Holds the lock."""
        sizes = {m.block for m in local.values()} | {m.block for m in theirs.values()}
        if len(sizes) != 1 or 0 in sizes:
            return None
        block = sizes.pop()
        spans = np.array(ops, dtype=np.int64)  # TransferOp's fields as columns; check_ops bounded every one
        if (spans[:, [1, 3, 4]] % block).any():
            return None
        mine, peers = self._local_block_lists(), self._peer_block_lists(peer)
        blocks = spans[:, 4] // block
        return (
            mine.lists[mems[0]],
            mine.indices(spans[:, 0], spans[:, 1], blocks, block),
            peers.lists[mems[1]],
            peers.indices(spans[:, 2], spans[:, 3], blocks, block),
        )

    def _indexed(self, peer: str, blocks: BlockWrite, mems: tuple[str, str]) -> _Prepped:
        """Both sides' block lists and the indices of ``blocks``' blocks in them, tensor by tensor. Holds the lock."""
        mine, peers = self._local_block_lists(), self._peer_block_lists(peer)
        return (
            mine.lists[mems[0]],
            mine.of(blocks.local_regions, blocks.local_blocks),
            peers.lists[mems[1]],
            peers.of(blocks.remote_regions, blocks.remote_blocks),
        )

    def _range_lists(
        self,
        peer: str,
        ops: Sequence[TransferOp],
        local: Mapping[int, _RegionMeta],
        theirs: Mapping[int, _RegionMeta],
        mems: tuple[str, str],
    ) -> _Prepped:
        """Lists of exactly ``ops``' ranges (a staging slot, a partial block), from the caches or made now, and
        every index of each. Holds the lock."""
        local_descs = tuple(self._desc(local[o.local_region], o.local_offset, o.length) for o in ops)
        remote_descs = tuple(self._desc(theirs[o.remote_region], o.remote_offset, o.length) for o in ops)
        indices = np.arange(len(ops), dtype=np.int32)
        return self._prepared("", mems[0], local_descs), indices, self._prepared(peer, mems[1], remote_descs), indices

    def _prepared(self, agent: str, mem: str, descs: tuple[Desc, ...]) -> nixl_prepped_dlist_handle:
        """A prepared descriptor list, local (agent "") or for a peer, from the cache or made now. Holds the lock."""
        cache = self._remote_lists if agent else self._local_lists
        return cache.get((agent, mem, descs), lambda: self._agent.prep_xfer_dlist(agent, list(descs), mem))

    def _settle(self, handle: NixlTransferHandle, state: str) -> None:
        """Apply a NIXL state ("DONE", "PROC", "ERR") to the handle (a write that asked for an answer completes once
        that came too). Holds the lock."""
        if state == "DONE":
            if self._asks.asked(handle):
                self._asks.written(handle)
            else:
                handle.complete()
        elif state == "ERR":
            self._asks.forget(handle)
            self._fail(handle, "NIXL reported ERR (the peer went away, or a region was deregistered mid-transfer)")
        else:
            return
        self._release_xfer(handle)

    def _release_xfer(self, handle: NixlTransferHandle) -> None:
        """Give the NIXL request back (aborting it if still active). Holds the lock."""
        self._inflight.pop(handle.id, None)
        xfer, handle.xfer = handle.xfer, None
        if xfer is None:
            return
        try:
            xfer.release()
        except NIXL_ERRORS as exc:
            # NIXL keeps a request it cannot abort and frees it with the agent.
            log.warning("nixl: releasing %r: %s", handle, describe_nixl_error(exc))

    def poll(self, handle: TransferHandle) -> XferState:
        if handle.state is not XferState.PENDING:
            return handle.state
        if handle.id not in self._inflight and self._asks.asked(handle):  # written: its answer may be here
            self._fetch_notifications()
            return handle.state
        with self._lock:
            if handle.id in self._inflight:
                assert isinstance(handle, NixlTransferHandle) and handle.xfer is not None
                try:
                    state = self._agent.check_xfer_state(handle.xfer)
                except NIXL_ERRORS as exc:
                    self._fail(handle, describe_nixl_error(exc))
                    self._release_xfer(handle)
                else:
                    self._settle(handle, state)
        return handle.state

    def poll_interval(self, waited: float) -> float:
        """Spin for ``spin_s`` (polling is what moves the data), then pause 10% of the time waited past it."""
        opts: NixlOptions = self.options  # type: ignore[assignment]
        return 0.0 if waited < opts.spin_s else min(opts.max_poll_interval_s, (waited - opts.spin_s) * 0.1)

    def release(self, handle: TransferHandle) -> None:
        """Free the NIXL request; a still-pending transfer is aborted and its handle failed."""
        self._asks.forget(handle)
        with self._lock:
            if isinstance(handle, NixlTransferHandle) and handle.xfer is not None:
                handle.fail("released before it completed")
                self._release_xfer(handle)

    # -- notifications and the watcher ---------------------------------------
    def get_notifications(self) -> list[Notification]:
        self._fetch_notifications()
        return super().get_notifications()

    def _fetch_notifications(self) -> int:
        """Move NIXL's new notifications into the inbox; how many there were."""
        with self._lock:
            if self._closed:
                return 0
            try:
                fresh = self._agent.get_new_notifs()
            except NIXL_ERRORS as exc:
                raise ChannelError(f"nixl: reading notifications failed: {describe_nixl_error(exc)}") from exc
        count = 0
        arrived: list[tuple[str, bytes]] = []  # for us to deliver or answer, in order
        for peer, payloads in fresh.items():
            name = peer.decode() if isinstance(peer, bytes) else peer
            for payload in payloads:
                count += 1
                if not self._asks.answered(name, payload):  # else an answer to a write of ours, applied
                    arrived.append((name, payload))
        if self.inbox.answerer is None:
            for name, payload in arrived:
                self.inbox.deliver(name, payload)
        else:  # the pass's notices answered together: their checks share one pass (answers.serve)
            self._reply(answers.serve(self.inbox, arrived))
        return count

    def _reply(self, replies: list[tuple[str, bytes]]) -> None:
        """Send the answers of a pass, each as a notification to the peer that asked."""
        for peer, reply in replies:
            with self._lock:
                if self._closed:
                    return
                try:
                    self._agent.send_notif(peer, reply)
                except NIXL_ERRORS as exc:  # its write then waits out the sender's stall bound, as one to a dead peer
                    log.warning("nixl: answering %r: %s", peer, describe_nixl_error(exc))

    def _watch(self) -> None:
        """Find finished transfers and new notifications for those who sleep until they happen (channels/README.md,
        "nixl"): fast after an event, backing off while something may still come, asleep when nothing can."""
        opts: NixlOptions = self.options  # type: ignore[assignment]
        tighten_timer_slack(WATCH_TIMER_SLACK_NS)
        pause: float | None = opts.watch_min_s
        while not self._closed:
            self._activity.wait(pause)
            self._activity.clear()
            self.watch_polls += 1
            try:
                with self._lock:
                    pending = [h for h in self._inflight.values()]
                moved = sum(self.poll(h) is not XferState.PENDING for h in pending) + self._fetch_notifications()
            except ChannelError as exc:
                if not self._closed:
                    log.warning("nixl: watcher: %s", exc)
                moved = 0
            with self._lock:
                busy = bool(self._inflight) or bool(self._asks)
            pause = self._next_pause(pause, bool(moved) or busy)

    def _next_pause(self, pause: float | None, active: bool) -> float | None:
        """The watcher's next pause: ``watch_min_s`` while things move, doubling up to ``granted_poll_s`` while a
        peer holds a grant here and something moved within ``granted_idle_s``, else up to ``max_poll_interval_s``
        (an idle grant, or a region open to every peer); None (sleep until a post, grant, registration or close)
        when no notification can arrive."""
        opts: NixlOptions = self.options  # type: ignore[assignment]
        if active:
            self._moved_at = time.monotonic()
            return opts.watch_min_s
        with self._lock:
            regions = [region for region, _ in self.regions.items()]
        exposure = self.grants.exposure(regions)
        if exposure == "closed":
            return None
        recent = time.monotonic() - self._moved_at < opts.granted_idle_s
        cap = opts.granted_poll_s if exposure == "granted" and recent else opts.max_poll_interval_s
        return min(2 * (pause or opts.watch_min_s), cap)

    # -- shutdown ------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ChannelError(f"nixl channel {self.agent_name!r} is closed")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for handle in list(self._inflight.values()):
                handle.fail("nixl channel closed")
                self._release_xfer(handle)
            self._asks.fail("nixl channel closed")
            self._local_lists.drop()
            self._drop_local_blocks()
            for peer in list(self._loaded):
                self._forget_peer(peer, "nixl channel closed", unload=True)
            for _, entry in self.regions.items():
                self._deregister(entry)
            self.regions.clear()
        self._activity.set()
        if self._watcher is not threading.current_thread():
            self._watcher.join(timeout=5.0)
        _OPEN.discard(self)
        super().close()
