"""This side's NIXL agent: created with the progress delay pdkv keeps, the lock its calls take, and the memory
registered with it."""

from __future__ import annotations

import logging
import threading
from typing import Any

import msgspec

from pdkv.channels.nixl.lib import NIXL_ERRORS, describe_nixl_error, nixl_agent, nixl_agent_config, nixl_bindings
from pdkv.channels.nixl.meta import RegionMeta
from pdkv.channels.nixl.options import NixlOptions
from pdkv.channels.ucx_env import ucx_follow_host
from pdkv.errors import ChannelError

log = logging.getLogger(__name__)

_AGENT_CONFIG_LOCK = threading.Lock()


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


class Region(msgspec.Struct):
    meta: RegionMeta
    reg: Any  # nixlRegDList, for deregistration
    buf: Any  # keeps the registered memory alive


class Agent:
    """The channel's NIXL agent (``nixl``), the lock every call into it takes (NIXL's default sync mode leaves agent
    calls to the caller to serialize), and whether the channel closed. Its methods are called holding the lock."""

    def __init__(self, name: str, options: NixlOptions) -> None:
        self.name = name
        self.backends = options.backends
        self.lock = threading.Lock()
        self.closed = False
        self._told_mixed = False  # ``metadata`` logged that sealed memory's keys go to peers
        try:
            self.nixl = create_nixl_agent(name, options)
        except NIXL_ERRORS as exc:
            raise ChannelError(
                f"nixl: could not create agent {name!r} with backends {options.backends}: "
                f"{describe_nixl_error(exc)}. "
                "With UCX, UCX_TLS=shm, posix or sysv fail here; leave UCX_TLS unset or use 'cma,tcp' or 'tcp'"
            ) from exc
        missing = [b for b in options.backends if b not in self.nixl.backends]
        if missing:
            raise ChannelError(
                f"nixl: backends {missing} are not available; this NIXL build has {self.nixl.get_plugin_list()}"
            )

    def check_open(self) -> None:
        if self.closed:
            raise ChannelError(f"nixl channel {self.name!r} is closed")

    def register(self, meta: RegionMeta, buf: Any) -> Region:
        """Register ``buf``'s memory, described by ``meta``, with NIXL; the region keeps ``buf`` alive."""
        if meta.mem not in self._supported_mems():
            raise ChannelError(f"nixl: backends {self.backends} cannot register {meta.mem} memory")
        try:
            reg = self.nixl.register_memory([(meta.addr, meta.size, meta.dev, "")], meta.mem)
        except NIXL_ERRORS as exc:
            raise ChannelError(
                f"nixl: registering {meta.size} bytes of {meta.mem} failed: {describe_nixl_error(exc)}"
            ) from exc
        return Region(meta, reg, buf)

    def _supported_mems(self) -> set[str]:
        return {m.removesuffix("_SEG") for b in self.nixl.backends for m in self.nixl.get_backend_mem_types(b)}

    def metadata(self, shown: list[RegionMeta] | None) -> bytes:
        """NIXL's metadata of this agent for its peers: all of it (``shown`` None), or its connection info and the
        keys to ``shown``'s memory alone, so that a peer holds none to the rest (sealed regions: NIXL has no way to
        refuse a one-sided op at the target). NIXL's partial metadata takes one memory type: regions of two shown
        beside a sealed one give all of it, and that is logged."""
        if shown is None:
            return self.nixl.get_agent_metadata()
        mems = {m.mem for m in shown}
        if len(mems) > 1:
            log.log(
                logging.DEBUG if self._told_mixed else logging.WARNING,
                "nixl: agent %r shows peers %s memory beside sealed regions; NIXL's partial metadata takes one "
                "memory type, so its peers get the keys to the sealed regions' memory too",
                self.name,
                " and ".join(sorted(mems)),
            )
            self._told_mixed = True  # once: a kv_both worker seals the KV it also shows as a receiver
            return self.nixl.get_agent_metadata()
        try:
            descs = (
                self.nixl.get_reg_descs([(m.addr, m.size, m.dev, "") for m in shown], shown[0].mem)
                if shown
                else nixl_bindings.nixlRegDList(nixl_bindings.DRAM_SEG)
            )
            return self.nixl.get_partial_agent_metadata(descs, True, list(self.backends))
        except NIXL_ERRORS as exc:
            raise ChannelError(f"nixl: this agent's partial metadata failed: {describe_nixl_error(exc)}") from exc

    def deregister(self, entry: Region) -> None:
        try:
            self.nixl.deregister_memory(entry.reg)
        except NIXL_ERRORS as exc:
            log.warning("nixl: deregistering %d bytes failed: %s", entry.meta.size, describe_nixl_error(exc))

    def registered(self, meta: RegionMeta) -> bool:
        """NIXL's own word: whether ``meta``'s bytes are registered with this agent (it prepares a list over them)."""
        try:
            self.nixl.prep_xfer_dlist("", [(meta.addr, meta.size, meta.dev)], meta.mem).release()
        except NIXL_ERRORS:
            return False
        return True
