"""The ucx channel's messages: the metadata a peer adds, the header that starts a transfer, the ACK that ends it,
and the 64-bit tags they travel under (channels/README.md, "ucx")."""

from __future__ import annotations

import struct
from typing import Annotated, Any, Literal

import msgspec
import numpy as np

from pdkv.channels.ucx.lib import UCX_ERRORS, ucx_api
from pdkv.errors import ChannelError

METADATA_VERSION = 1
HEADER, DATA, ACK = 1, 2, 3
KIND_MASK = ucx_api.UCXXTagMask(0xFF << 56)
_LEN = struct.Struct("<I")  # length prefix of a header or ACK in its fixed-size receive buffer
ACK_BYTES = 4096
ACK_ERROR_CHARS = 1000  # an error longer than this is cut so the ACK always fits ACK_BYTES


def tag(kind: int, agent_id: int, seq: int) -> ucx_api.UCXXTag:
    """The 64-bit tag of a message of ``kind`` in transfer ``seq`` started by ``agent_id``."""
    return ucx_api.UCXXTag((kind << 56) | (agent_id << 32) | (seq & 0xFFFFFFFF))


class Meta(msgspec.Struct, forbid_unknown_fields=True):
    version: int
    name: Annotated[str, msgspec.Meta(min_length=1)]
    agent_id: Annotated[int, msgspec.Meta(ge=0, lt=1 << 24)]
    address: bytes  # UCX worker address
    regions: dict[int, Annotated[int, msgspec.Meta(gt=0)]]


class Header(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    op: Literal["write", "read"]
    seq: Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]
    src: str
    agent_id: Annotated[int, msgspec.Meta(ge=0, lt=1 << 24)]  # the initiator's, for the DATA tag
    ranges: list[tuple[int, int, int]]  # (region, offset, length) on the target
    notif: bytes | None
    token: Annotated[bytes, msgspec.Meta(max_length=64)] = b""  # the capability its guarded regions check (``Grants``)


class Ack(msgspec.Struct, array_like=True):
    seq: int
    error: str | None


def framed(msg: msgspec.Struct) -> np.ndarray:
    body = msgspec.msgpack.encode(msg)
    return np.frombuffer(_LEN.pack(len(body)) + body, dtype=np.uint8)


def unframe(buf: np.ndarray) -> bytes:
    (n,) = _LEN.unpack(buf[: _LEN.size].tobytes())
    if n > len(buf) - _LEN.size:
        raise ChannelError(f"ucx: message claims {n} bytes, buffer holds {len(buf) - _LEN.size}")
    return buf[_LEN.size : _LEN.size + n].tobytes()


def all_done(requests: list[Any]) -> bool:
    return all(r.completed for r in requests)


def first_error(requests: list[Any]) -> str | None:
    for r in requests:
        try:
            r.check_error()
        except UCX_ERRORS as exc:
            return f"{type(exc).__name__}: {exc}"
    return None
