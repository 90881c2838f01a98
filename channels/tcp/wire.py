"""The tcp channel's wire format: frame header, frame types and flags, limits, metadata, and the checks on them.

Both sides of a link and the tools that speak the protocol from outside (the soak's corrupting proxy, the fuzz
tests) build and read frames through these names alone. The format, frame by frame: channels/README.md, "Wire
format". Every header field from the wire is checked before use; nothing is allocated from a length the peer sent
before that length is bounded.
"""

from __future__ import annotations

import itertools
import re
import struct

import msgspec

from pdkv.errors import ChannelError, ProtocolError
from pdkv.netaddr import is_wildcard

MAGIC = b"PK"
TLS_RECORD_START = b"\x16\x03"  # how a TLS connection starts (a handshake record): told apart from a HELLO
VERSION = 3  # 3: a DATA frame carries a table of runs (one frame per share), not one range
HEADER = struct.Struct("<2sBBBxHIIQQQ")
HDR_SIZE = HEADER.size
RUN = struct.Struct("<IQQ")  # one entry of a DATA frame's run table: region, offset, length

# ANSWER: an ACK with the target's answer to the transfer's notification (``Channel.answer_notifications``)
HELLO, HELLO_OK, DATA, ACK, READ_REQ, READ_DATA, NOTIF, ERROR, AUTH, NACK, ANSWER = range(1, 12)
FRAME_NAMES = {
    HELLO: "HELLO",
    HELLO_OK: "HELLO_OK",
    DATA: "DATA",
    ACK: "ACK",
    READ_REQ: "READ_REQ",
    READ_DATA: "READ_DATA",
    NOTIF: "NOTIF",
    ERROR: "ERROR",
    AUTH: "AUTH",
    NACK: "NACK",
    ANSWER: "ANSWER",
}
LAST, NOTIF_FOLLOWS = 1, 2  # DATA flags
SECRET = 1  # HELLO/HELLO_OK flag: the sender holds a shared secret, and nonce (and proof) lead the payload
MAX_NAME_BYTES = 255
MAX_TOKEN_BYTES = 64
MAX_ERROR_BYTES = 1024
MAX_STREAMS = 64
MAX_ACK_BATCH = 256  # ids per ACK frame; a full batch is sent even if more frames wait
MAX_RUNS = 4096  # runs per DATA frame (a table of 80 KiB at most); a share with more goes out as several frames

Header = tuple[int, int, int, int, int, int, int, int]  # (type, flags, shares, aux, notif, xfer, offset, length)


def pack(ftype: int, xfer: int = 0, length: int = 0, aux: int = 0, flags: int = 0, shares: int = 0) -> bytes:
    """A header for the frame types that use only these fields."""
    return HEADER.pack(MAGIC, VERSION, ftype, flags, shares, aux, 0, xfer, 0, length)


def data_frame(
    xfer: int, runs: list[tuple[int, int, int]], nbytes: int, flags: int = 0, shares: int = 0, notif: int = 0
) -> bytearray:
    """A DATA frame's header and run table in one buffer; its payload (``nbytes``, the runs' bytes in order) follows."""
    out = bytearray(HDR_SIZE)
    HEADER.pack_into(out, 0, MAGIC, VERSION, DATA, flags, shares, len(runs), notif, xfer, 0, nbytes)
    out += b"".join(itertools.starmap(RUN.pack, runs))
    return out


def unpack_header(buf: bytearray, label: str) -> Header:
    """A received header as (type, flags, shares, aux, notif, xfer, offset, length); magic and version checked."""
    magic, version, ftype, flags, shares, aux, notif, xfer, offset, length = HEADER.unpack_from(buf)
    if magic != MAGIC:
        if bytes(magic) == TLS_RECORD_START:
            raise ProtocolError(
                f"tcp {label}: the peer speaks TLS and this agent has no `tls` channel options; give both sides the "
                "same CA"
            )
        raise ProtocolError(f"tcp {label}: bad magic {bytes(magic)!r}; the peer does not speak pdkv tcp")
    if version != VERSION:
        raise ProtocolError(f"tcp {label}: protocol version {version}, this agent speaks {VERSION}; upgrade both")
    return ftype, flags, shares, aux, notif, xfer, offset, length


def no_extras(label: str, ftype: int, flags: int, shares: int, notif: int, allowed_flags: int = 0) -> None:
    """Fields only DATA may set must be zero in every other frame (but for the flags the handshake allows)."""
    if flags & ~allowed_flags or shares or notif:
        raise ProtocolError(f"tcp {label}: {FRAME_NAMES.get(ftype, ftype)} frame sets flags/shares/notif fields")


class Meta(msgspec.Struct, forbid_unknown_fields=True):
    """What a peer needs to reach this agent; ``instance`` tells a restarted agent from the old one."""

    name: str
    host: str
    port: int
    instance: int
    regions: dict[int, int]
    version: int = VERSION


def decode_meta(metadata: bytes) -> Meta:
    """A peer's ``metadata()``, checked: this protocol version, and an address that can be dialled."""
    try:
        meta = msgspec.msgpack.decode(metadata, type=Meta)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ChannelError(
            f"tcp: malformed peer metadata ({exc}); pass the bytes of the peer's metadata() unchanged"
        ) from None
    if meta.version != VERSION:
        raise ChannelError(
            f"tcp: peer {meta.name!r} speaks protocol {meta.version}, this agent {VERSION}; upgrade both"
        )
    if is_wildcard(meta.host):
        raise ChannelError(
            f"tcp: peer {meta.name!r} advertises {meta.host!r}, which is no address to dial; it must set advertise_host"
        )
    return meta


# -- the native loops' copy of the format (csrc/tcpwire.h), generated from the names above -----------------------------

C_HEADER_PATH = "csrc/tcpwire.h"
HEADER_FIELDS = ("magic", "version", "type", "flags", "shares", "aux", "notif", "xfer", "offset", "length")
RUN_FIELDS = ("region", "offset", "length")


_C_TYPES = {"B": "uint8_t", "H": "uint16_t", "I": "uint32_t", "Q": "uint64_t"}  # the codes a field of ours uses


def _fields(layout: struct.Struct, names: tuple[str, ...]) -> list[tuple[str, int, str]]:
    """Each named field of ``layout`` (pad bytes have no name) with its byte offset and struct code."""
    order, codes = layout.format[0], re.findall(r"\d*[a-zA-Z?]", layout.format[1:])
    found = [(struct.calcsize(order + "".join(codes[:i])), code) for i, code in enumerate(codes) if code != "x"]
    return [(name, offset, code) for name, (offset, code) in zip(names, found, strict=True)]


def c_header() -> str:
    """csrc/tcpwire.h: the constants of this format that the native frame loops (csrc/kvframes.cpp, kvland.cpp,
    kvsend.cpp) read and write frames with, so the format is written here alone; tests/test_wire_header.py fails
    when the checked-in header is not this text."""
    magic = ", ".join(f"'{chr(b)}'" for b in MAGIC)

    def fields(prefix: str, layout: struct.Struct, names: tuple[str, ...]) -> list[str]:
        """Each field's offset (``k<Prefix><Name>``) and, for a number, its C type (``<Prefix><Name>T``)."""
        out = []
        for name, offset, code in _fields(layout, names):
            out.append(f"constexpr int64_t k{prefix}{name.title()} = {offset};")
            if code in _C_TYPES:
                out.append(f"using {prefix}{name.title()}T = {_C_TYPES[code]};")
        return out

    lines = [
        f"// Generated from channels/tcp/wire.py by `python -m pdkv.channels.tcp.wire > {C_HEADER_PATH}`: do not edit.",
        "// The tcp channel's frame format as the native loops read and write it (tests/test_wire_header.py).",
        "#pragma once",
        "",
        "#include <cstdint>",
        "#include <cstring>",
        "",
        "namespace pdkv::tcpwire {",
        "",
        f"constexpr char kMagic[{len(MAGIC)}] = {{{magic}}};",
        f"constexpr uint8_t kVersion = {VERSION};",
        f"constexpr uint8_t kData = {DATA};  // the frame type the native loops send and land",
        f"constexpr uint8_t kLast = {LAST}, kNotifFollows = {NOTIF_FOLLOWS};  // DATA flags",
        f"constexpr int64_t kMaxStreams = {MAX_STREAMS};  // a transfer's shares",
        f"constexpr int64_t kMaxRuns = {MAX_RUNS};  // runs per DATA frame",
        "",
        f"// A frame header ({HEADER.format}): its size, each field's byte offset and each number's type.",
        f"constexpr int64_t kHeaderBytes = {HDR_SIZE};",
        *fields("Header", HEADER, HEADER_FIELDS),
        "",
        f"// A run table entry ({RUN.format}): its size, each field's byte offset and type.",
        f"constexpr int64_t kRunBytes = {RUN.size};",
        *fields("Run", RUN, RUN_FIELDS),
        "",
        "// Run `k` of a run table, each field read at its offset and width.",
        "inline void read_run(const char* table, int64_t k, RunRegionT* region, RunOffsetT* offset,",
        "                     RunLengthT* length) {",
        "  const char* at = table + k * kRunBytes;",
        "  std::memcpy(region, at + kRunRegion, sizeof *region);",
        "  std::memcpy(offset, at + kRunOffset, sizeof *offset);",
        "  std::memcpy(length, at + kRunLength, sizeof *length);",
        "}",
        "",
        "}  // namespace pdkv::tcpwire",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(c_header(), end="")
