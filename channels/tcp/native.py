"""The tcp channel's native half: the bindings of its receive and send loops (csrc/kvnet.h), in the kernel library
that ``pdkv.native`` loads.

The target lands a DATA frame's payload hashed as it arrives (``recv_runs``, csrc/kvland.cpp) or serves consecutive
frames in one call (``FrameLoop``, csrc/kvframes.cpp) against a native copy of its write grants (``GrantMirror``);
the initiator frames a block write (``block_frames``) and sends it as iovecs (``send_iov``, csrc/kvsend.cpp), a
sealed one hashing its pieces as they go (``send_summed``). The
functions are declared here, on the library ``pdkv.native`` loads (one loader, one switch: where it does not load or
``PDKV_NATIVE=0``, callers check ``pdkv.native.available()`` and take the Python paths, and a call here is a
ValueError). The frame format they read and write is wire.py's, which generates csrc/tcpwire.h for the C++.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from pdkv import native
from pdkv.channels.grants import Grantable
from pdkv.channels.landing import pack
from pdkv.channels.tcp.wire import HDR_SIZE, MAX_RUNS, RUN
from pdkv.native import OK

_i64 = ctypes.c_int64
_p = ctypes.c_void_p

_SIGNATURES: dict[str, list[type]] = {
    "pdkv_check_runs": [ctypes.c_char_p, _i64, _p, _i64, _i64],
    "pdkv_recv_runs": [
        ctypes.c_int,
        ctypes.c_char_p,
        _i64,
        _p,
        _i64,
        _i64,
        _i64,
        ctypes.POINTER(_i64),
        ctypes.POINTER(ctypes.c_int),
    ],
    "pdkv_grants_new": [],
    "pdkv_grants_free": [_p],
    "pdkv_grants_guard": [_p, _i64, ctypes.c_int],
    "pdkv_grants_add": [_p, ctypes.c_char_p, _i64, ctypes.c_char_p, _i64],
    "pdkv_grants_remove": [_p, ctypes.c_char_p, _i64, ctypes.c_char_p, _i64],
    "pdkv_grants_begin": [_p, ctypes.c_char_p, _i64, ctypes.c_char_p, _i64, ctypes.POINTER(_i64)],
    "pdkv_grants_end": [_p, _i64],
    "pdkv_grants_wait": [_p, ctypes.c_char_p, _i64, ctypes.c_char_p, _i64, _i64],
    "pdkv_block_frames": [_p, _p, _i64, _p, _p, _i64, _i64, _i64, _i64, _i64, ctypes.c_uint64]
    + [ctypes.c_char_p, _i64, _p, _i64, _p, _i64, _p, _p, _i64, _p],
    "pdkv_send_iov": [ctypes.c_int, _p, _i64, ctypes.POINTER(ctypes.c_int)],
    "pdkv_send_summed": [ctypes.c_int, _p, _p, _i64, _i64, _i64, _i64]
    + [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_int)],
    "pdkv_serve_frames": [ctypes.c_int, _p, ctypes.c_char_p, _i64, _p, _i64, _p, _p, _p, _p, _p, _p, _p, _p],
}
_RESTYPES: dict[str, type] = {"pdkv_grants_new": _p, "pdkv_block_frames": _i64}
_lib = native.binder(_SIGNATURES, _RESTYPES)

LAND_EOF, LAND_STALLED, LAND_EOS, LAND_EARG = 10, 11, 12, 13
"""The native receives' and sends' outcomes other than OK (kvnet.h): the peer closed, no byte for max_idle ticks, the
socket failed, a bad argument."""


def check_runs(runs: bytes, nruns: int, desc: int, n_desc: int, length: int) -> bool:
    """Whether a DATA frame's run table (``nruns`` entries) names only non-empty runs inside the regions that
    ``n_desc`` descriptors at ``desc`` describe (channels/landing.py), none overlapping, adding up to ``length``."""
    return _lib().pdkv_check_runs(runs, nruns, desc, n_desc, length) == OK


def recv_runs(
    fd: int, runs: bytes, nruns: int, desc: int, n_desc: int, piece: int, max_idle: int
) -> tuple[int, int, int]:
    """Receive a DATA frame's payload from socket ``fd`` into its checked ``runs`` (the wire's run table), hashing
    it into the regions' landing tables piece by piece (``desc``: the address of ``n_desc`` region descriptors,
    channels/landing.py); returns (outcome, payload bytes received, errno). The GIL is released for the call."""
    got, os_error = _i64(0), ctypes.c_int(0)
    code = _lib().pdkv_recv_runs(
        fd, runs, nruns, desc, n_desc, piece, max_idle, ctypes.byref(got), ctypes.byref(os_error)
    )
    if code not in (OK, LAND_EOF, LAND_STALLED, LAND_EOS):
        raise ValueError(f"pdkv landing: bad arguments to pdkv_recv_runs (code {code})")
    return code, got.value, os_error.value


FRAME_DRAIN, FRAME_HEADER, FRAME_TABLE, FRAME_CLOSED, FRAME_IDLE = 20, 21, 22, 23, 24
"""pdkv_serve_frames' outcomes besides LAND_EOF/LAND_STALLED/LAND_EOS (kvnet.h): completions to drain (and maybe a
header read to serve next), a frame handed back after its header or after its run table, the peer closed between
frames, the wake fd readable before a frame began."""
_FRAME_OUTCOMES = (
    FRAME_DRAIN,
    FRAME_HEADER,
    FRAME_TABLE,
    FRAME_CLOSED,
    FRAME_IDLE,
    LAND_EOF,
    LAND_STALLED,
    LAND_EOS,
)


class GrantMirror:
    """The native copy of one ``Grants`` object's write grants (csrc/kvframes.cpp), which the native frame loop
    checks frames against: only ``Grants`` writes it, under its own lock; ``wait`` is revoke's fence for the
    frames that loop is landing."""

    def __init__(self) -> None:
        self._lib = _lib()
        self.handle: int = self._lib.pdkv_grants_new()

    def __del__(self) -> None:
        if getattr(self, "handle", None):
            self._lib.pdkv_grants_free(self.handle)

    def guard(self, region: int, on: bool) -> None:
        self._lib.pdkv_grants_guard(self.handle, region, int(on))

    def add(self, token: bytes, ranges: Grantable) -> None:
        """Grant ``token`` each (region, offset, length) range, as ``Grants.grant`` inserts it (spans not merged)."""
        self._lib.pdkv_grants_add(self.handle, token, len(token), *pack(ranges))

    def remove(self, token: bytes, ranges: Grantable) -> None:
        """Take each range from ``token``'s spans, as ``Grants.revoke`` subtracts it."""
        self._lib.pdkv_grants_remove(self.handle, token, len(token), *pack(ranges))

    def begin(self, token: bytes, runs: bytes) -> int | None:
        """Admit a run table (the wire's) for ``token``, all runs or none: a ticket (0: nothing guarded), or None."""
        ticket = _i64(0)
        refused = self._lib.pdkv_grants_begin(
            self.handle, token, len(token), runs, len(runs) // RUN.size, ctypes.byref(ticket)
        )
        return None if refused else ticket.value

    def end(self, ticket: int) -> None:
        self._lib.pdkv_grants_end(self.handle, ticket)

    def wait(self, token: bytes, ranges: Grantable, timeout: float) -> bool:
        """Wait up to ``timeout`` s until no frame of ``token`` lands in ``ranges`` here; False if one still does."""
        return self._lib.pdkv_grants_wait(self.handle, token, len(token), *pack(ranges), int(timeout * 1e6)) == 0


class BlockFrames(NamedTuple):
    """A block write's DATA frames (``block_frames``): one buffer holding its headers and run tables, then every
    share's buffers as (address, length) rows (``iov``), each row's place in the payload stream (``offsets``, -1
    for a header), and per share (first row, rows, payload bytes); a sealed write's ``tails``, per share: the run
    (region, offset, length) of the row after the share's rows, sent after them in a LAST frame of the caller's."""

    out: np.ndarray
    iov: np.ndarray
    offsets: np.ndarray
    shares: list[tuple[int, int, int]]
    tails: list[tuple[int, int, int]]


class FrameRegions(NamedTuple):
    """What ``block_frames`` reads of a write's regions, worked out once per set of them: our regions' host
    addresses and the peer's region ids, each as an int64 array and its address."""

    bases: np.ndarray
    remote: np.ndarray
    bases_at: int
    remote_at: int

    @classmethod
    def of(cls, bases: Sequence[int], remote: Sequence[int]) -> FrameRegions:
        if len(bases) != len(remote):
            raise ValueError(f"{len(bases)} local regions but {len(remote)} remote ones")
        b, r = np.array(bases, dtype=np.int64), np.array(remote, dtype=np.int64)
        return cls(b, r, b.ctypes.data, r.ctypes.data)


def block_frames(
    regions: FrameRegions,
    local_ids: np.ndarray,
    remote_ids: np.ndarray,
    block_bytes: int,
    parts: int,
    max_frame: int,
    max_runs: int,
    xfer: int,
    notif: bytes | None,
    sealed_tail: int = 0,
) -> BlockFrames | None:
    """The tcp initiator's frames of a block write (csrc/kvsend.cpp): blocks ``local_ids`` of the regions at
    ``regions.bases`` to blocks ``remote_ids`` of ``regions.remote``, cut into at most ``parts`` shares exactly as
    ``Initiator.post`` cuts and frames the same write's ops, ``notif`` after share 0. ``sealed_tail`` > 0: no
    ``notif``, shares that end at a checksum word, and each share's last piece's last ``sealed_tail`` bytes (up to a
    checksum word more, or all of a shorter piece) held back (``BlockFrames.tails``) for the share's LAST frame, sent
    once the share is hashed and sent (``send_summed``); None when its pieces are not whole checksum words."""
    ours = np.ascontiguousarray(local_ids, dtype=np.int64)
    theirs = np.ascontiguousarray(remote_ids, dtype=np.int64)
    tensors = len(regions.bases)
    # pieces: every op (at most a tensor per block), cut at most once per share and once per max_frame bytes
    # (and a sealed write's tail cut off each share's last piece)
    pieces = tensors * len(ours) + 2 * parts + tensors * len(ours) * block_bytes // max_frame + 2
    table_words = -(-pieces * (HDR_SIZE + RUN.size) // 8)
    iov_rows = 2 * pieces + 1
    share_words = 6 * parts  # each share's rows, then each share's tail run
    # tables, iov, offsets, shares, tails: one allocation
    out = np.empty(table_words + 3 * iov_rows + share_words, dtype=np.int64)
    at = out.ctypes.data
    n = _lib().pdkv_block_frames(
        regions.bases_at,
        regions.remote_at,
        tensors,
        ours.ctypes.data,
        theirs.ctypes.data,
        len(ours),
        block_bytes,
        parts,
        max_frame,
        max_runs,
        xfer,
        notif,
        -1 if notif is None else len(notif),
        at,
        8 * table_words,
        at + 8 * table_words,
        iov_rows,
        at + 8 * (table_words + 3 * iov_rows),
        at + 8 * (table_words + 2 * iov_rows),
        sealed_tail,
        at + 8 * (table_words + 3 * iov_rows + 3 * parts),
    )
    if n == -3:
        return None
    if n <= 0:
        raise ValueError(f"pdkv_block_frames failed ({n}) for {len(ours)} blocks of {tensors} regions")
    iov = out[table_words : table_words + 2 * iov_rows].reshape(iov_rows, 2)
    offsets = out[table_words + 2 * iov_rows : table_words + 3 * iov_rows]
    words = out[table_words + 3 * iov_rows :].tolist()
    shares = [(words[3 * i], words[3 * i + 1], words[3 * i + 2]) for i in range(n)]
    t = 3 * parts  # the tails' words, written only for a sealed write
    tails = [(words[t + 3 * i], words[t + 3 * i + 1], words[t + 3 * i + 2]) for i in range(n if sealed_tail else 0)]
    return BlockFrames(out, iov, offsets, shares, tails)


def send_summed(fd: int, frames: BlockFrames, share: int, unit: int, window: int) -> tuple[int, int, int]:
    """Send one share of a sealed write's frames (``block_frames`` with ``sealed_tail``) on the blocking socket
    ``fd``, hashing every payload row, its tail's too, in ``window`` bytes right after each is sent
    (csrc/kvsend.cpp): (``OK``, ``LAND_STALLED``, ``LAND_EOS`` or ``LAND_EARG``: rows not whole checksum words,
    nothing sent; errno; the share's part of the chunk checksum's accumulator in units of ``unit``)."""
    os_error, acc = ctypes.c_int(0), ctypes.c_uint64(0)
    first, rows, _ = frames.shares[share]
    code = _lib().pdkv_send_summed(
        fd,
        frames.iov[first:].ctypes.data,
        frames.offsets[first:].ctypes.data,
        rows,
        rows + 1,
        unit,
        window,
        ctypes.byref(acc),
        ctypes.byref(os_error),
    )
    return code, os_error.value, acc.value


def send_iov(fd: int, iov: np.ndarray) -> tuple[int, int]:
    """Send (address, length) rows in order on the blocking socket ``fd`` (csrc/kvsend.cpp): (``OK`` or
    ``LAND_STALLED`` or ``LAND_EOS``, errno)."""
    os_error = ctypes.c_int(0)
    code = _lib().pdkv_send_iov(fd, iov.ctypes.data, len(iov), ctypes.byref(os_error))
    return code, os_error.value


class FrameLoop:
    """One connection's buffers for ``pdkv_serve_frames`` (csrc/kvframes.cpp): the last header and run table read,
    the share it is inside, where a frame stopped, and the ring of completions (transfers whose last frame landed)
    with their notifications."""

    def __init__(self, max_notif: int, ring: int) -> None:
        self.header = ctypes.create_string_buffer(HDR_SIZE)
        self.table = ctypes.create_string_buffer(MAX_RUNS * RUN.size)
        self.share = (ctypes.c_uint64 * 3)()  # inside a share (0/1), its transfer id, a header waits to be served
        self.io = (_i64 * 5)()  # frames landed, part (0 header, 1 table, 2 payload, 3 notification), got, wanted, errno
        self._ring = (_i64 * (1 + 4 * ring))()  # entries, then (transfer id, shares, notif offset, length or -1)
        self._notifs = ctypes.create_string_buffer(max(1, max_notif))
        self._limits = (_i64 * 10)()

    @property
    def pending(self) -> bool:
        """Whether a header was read and waits to be served by the next ``serve`` (after owed ACKs went out)."""
        return bool(self.share[2])

    def serve(
        self,
        fd: int,
        mirror: GrantMirror,
        token: bytes,
        regions: tuple[int, int, int, int],
        limits: Sequence[int],
        room: int,
        acks_held: bool,
        wake: int = -1,
    ) -> int:
        """Serve DATA frames until one comes back to Python; the outcome (``FRAME_*`` or ``LAND_*``). ``regions``:
        the descriptors' address and count, the address of the generation counter and the generation they are of
        (channels/landing.py); ``limits``: piece, max_idle ticks, max_frame_bytes, max_notif_bytes, the payload
        length before which owed completions go out; ``room``: completions it may queue (at most the ring's size);
        ``acks_held``: whether the caller holds ACKs not sent yet; ``wake``: an fd (-1: none) whose becoming readable
        ends the wait for the call's first frame (``FRAME_IDLE``)."""
        desc, n_desc, generation, current = regions
        self._limits[:] = [
            *limits,
            current,
            min(room, (len(self._ring) - 1) // 4),
            len(self._notifs),
            acks_held,
            wake,
        ]
        code = _lib().pdkv_serve_frames(
            fd,
            mirror.handle,
            token,
            len(token),
            desc,
            n_desc,
            generation,
            self._limits,
            self.share,
            self.header,
            self.table,
            self._ring,
            self._notifs,
            self.io,
        )
        if code not in _FRAME_OUTCOMES:
            raise ValueError(f"pdkv landing: bad arguments to pdkv_serve_frames (code {code})")
        return code

    def completions(self) -> list[tuple[int, int, bytes | None]]:
        """The transfers (shares) whose last frame the last ``serve`` landed, in order: (transfer id, shares, its
        notification or None)."""
        ring, base = self._ring, ctypes.addressof(self._notifs)
        return [
            (
                ring[k] & ((1 << 64) - 1),
                ring[k + 1],
                ctypes.string_at(base + ring[k + 2], ring[k + 3]) if ring[k + 3] >= 0 else None,
            )
            for k in range(1, 1 + 4 * ring[0], 4)
        ]
