"""What ``metadata()`` carries to a peer, in the two stages NIXL needs, and the checks a peer's passes before use.

Stage 1 is the NIXL agent metadata (connection info and registration keys), stage 2 the region table descriptor
lists are prepared against (channels/README.md, "nixl").
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
import numpy as np

from pdkv.errors import ChannelError
from pdkv.memory import byte_view, memory_kind

METADATA_VERSION = 4  # 2: a region's block size (block-granular descriptor lists); 3: whether the agent answers;
# 4: an ask carries its write's own random bytes, which the answer echoes (channels/answers.py)
MemType = Literal["DRAM", "VRAM"]


class RegionMeta(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    addr: Annotated[int, msgspec.Meta(ge=0)]
    size: Annotated[int, msgspec.Meta(gt=0)]
    dev: Annotated[int, msgspec.Meta(ge=0)]
    mem: MemType
    block: Annotated[int, msgspec.Meta(ge=0)] = 0  # the region is a grid of blocks this size (0: it is not)


class NixlMeta(msgspec.Struct, forbid_unknown_fields=True):
    version: int
    name: Annotated[str, msgspec.Meta(min_length=1)]
    agent: bytes  # stage 1: NIXL agent metadata
    regions: dict[int, RegionMeta]  # stage 2: what descriptor lists are prepared against
    answers: bool = False  # it answers notifications (``Channel.answer_notifications``): they go to it framed


def describe_buffer(buf: Any) -> RegionMeta:
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
            return RegionMeta(buf.data_ptr(), size, 0, "DRAM")
        return RegionMeta(buf.data_ptr(), size, buf.device.index or 0, "VRAM")
    view = byte_view(buf)
    if view.readonly:
        raise ChannelError("nixl: register needs writable memory (peers may WRITE into it)")
    if view.nbytes == 0:
        raise ChannelError("nixl: cannot register an empty buffer")
    return RegionMeta(np.frombuffer(view, dtype=np.uint8).ctypes.data, view.nbytes, 0, "DRAM")


def check_grid(meta: RegionMeta, whose: str, limit: int) -> None:
    """Raise ``ChannelError`` unless ``meta``'s block size cuts it into at most ``limit`` blocks."""
    if meta.block < 0 or (meta.block and (meta.size % meta.block or meta.size // meta.block > limit)):
        raise ChannelError(
            f"nixl: {whose} of {meta.size} bytes is not a whole number of at most {limit} blocks of {meta.block} "
            "bytes; register it with its layout's block_bytes (or none), or raise max_region_blocks"
        )


def decode_metadata(metadata: bytes, own_name: str, max_blocks: int) -> NixlMeta:
    """A peer's ``metadata()``, checked: its version, a name not ``own_name``, regions inside the address space and
    cut into at most ``max_blocks`` blocks."""
    try:
        meta = msgspec.msgpack.decode(metadata, type=NixlMeta)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise ChannelError(f"nixl: malformed peer metadata: {exc}") from None
    if meta.version != METADATA_VERSION:
        raise ChannelError(
            f"nixl: peer metadata version {meta.version}, this pdkv speaks {METADATA_VERSION}; upgrade the older side"
        )
    if meta.name == own_name:
        raise ChannelError(f"nixl: peer has this agent's own name {meta.name!r}; give every worker a unique agent name")
    for region, r in meta.regions.items():
        if r.addr + r.size > 1 << 64:
            raise ChannelError(
                f"nixl: peer {meta.name!r} region {region} ({r.addr:#x}+{r.size}) overflows the address space"
            )
        check_grid(r, f"peer {meta.name!r} region {region}", max_blocks)
    return meta
