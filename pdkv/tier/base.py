"""The cache tier's one interface, its statistics, and the stored value format.

A tier maps a chunk key (``pdkv.keys``: prefix-chained, so equal keys mean
equal prompt prefixes under the same model) to that chunk's canonical KV
(``[layers, kv, tokens, heads, head_dim]``, ``pdkv.layout``). Everything a
worker needs is prefix-shaped, so the reads are too: ``contains`` answers
how many leading chunks are cached, ``get`` fills caller-provided buffers for
the longest leading run it can serve. Keys are universal (any process, any
machine, any restart), so a value read back is never trusted blindly: what
leaves memory carries a header (the key, the layout's wire fields, the token
count, an xxh3-64 of the payload) and a value that does not match is a miss.

A value that reaches a shared server can be written by anyone who reaches
that server, and the header alone is no defence: it is public, and xxh3 is
no MAC. With a tier secret (``tier.redis_secret``) a value is *sealed*: a
32-byte HMAC-SHA256, under that secret, of the header (which holds the chunk
key) and the payload follows the payload. A reader with the secret takes only
sealed values whose tag checks out, so a value written by someone without the
secret, or a valid value copied under another key, is a miss. The format is
versioned by the magic: a value of another version (``PDKVKV01``, before the
``sealed`` byte) is a miss, rewritten by the next store.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import hmac
import logging
import struct
import threading
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch

from pdkv.checksum import checksum
from pdkv.errors import LayoutError
from pdkv.keys import KEY_BYTES
from pdkv.layout import DTYPE_CODES, KVLayout, check_chunk
from pdkv.memory import byte_view

log = logging.getLogger(__name__)

MAGIC = b"PDKVKV02"  # the format's version: 02 added the sealed byte
_MAGIC_FAMILY = MAGIC[:6]
# magic, key, tokens, layers, kv factor, kv heads, head_dim, dtype code, payload xxh3-64, sealed; padded to
# 64 bytes so a payload that follows the header in one buffer stays 64-byte aligned.
_HEADER = struct.Struct("<8s16sIHBHHBQB19x")
HEADER_BYTES = _HEADER.size
TAG_BYTES = hashlib.sha256().digest_size  # a sealed value's trailer: HMAC-SHA256 of header and payload

Parents = Sequence[bytes | None] | None
"""Per key, the key of the chunk before it in its prompt (``CacheTier.put``)."""


@dataclasses.dataclass(frozen=True)
class ChunkHeader:
    """What is stored in front of a chunk's bytes outside memory, enough to refuse a wrong value."""

    key: bytes
    num_tokens: int
    num_layers: int
    kv_factor: int
    num_kv_heads: int
    head_dim: int
    dtype_code: int
    checksum: int
    sealed: bool = False  # a TAG_BYTES tag follows the payload

    @classmethod
    def of(cls, layout: KVLayout, key: bytes, chunk: torch.Tensor, sealed: bool = False) -> ChunkHeader:
        """The header of ``chunk`` (a canonical chunk of ``layout``) stored under ``key``."""
        return cls(
            key,
            chunk.shape[2],
            layout.num_layers,
            layout.kv_factor,
            layout.num_kv_heads,
            layout.head_dim,
            DTYPE_CODES[layout.dtype],
            checksum([byte_view(chunk)]),
            sealed,
        )

    def encode(self) -> bytes:
        return _HEADER.pack(
            MAGIC,
            self.key,
            self.num_tokens,
            self.num_layers,
            self.kv_factor,
            self.num_kv_heads,
            self.head_dim,
            self.dtype_code,
            self.checksum,
            self.sealed,
        )

    @classmethod
    def decode(cls, raw: bytes | memoryview) -> ChunkHeader | None:
        """The header at the start of ``raw``, or None when it is too short or not a pdkv chunk."""
        if len(raw) < HEADER_BYTES:
            return None
        magic, *fields, sealed = _HEADER.unpack_from(raw)
        return cls(*fields, bool(sealed)) if magic == MAGIC and sealed in (0, 1) else None

    def mismatch(self, layout: KVLayout, key: bytes, num_tokens: int) -> str | None:
        """Why this value cannot be served for ``key`` as ``num_tokens`` tokens of ``layout``; None when it can."""
        if self.key != key:
            return f"stored under another key ({self.key.hex()})"
        expected = (
            num_tokens,
            layout.num_layers,
            layout.kv_factor,
            layout.num_kv_heads,
            layout.head_dim,
            DTYPE_CODES[layout.dtype],
        )
        found = (self.num_tokens, self.num_layers, self.kv_factor, self.num_kv_heads, self.head_dim, self.dtype_code)
        if found != expected:
            names = ("tokens", "layers", "kv", "kv_heads", "head_dim", "dtype code")
            return "shape differs: " + ", ".join(
                f"{n} {f} (expected {e})" for n, f, e in zip(names, found, expected, strict=True) if f != e
            )
        return None


def _tag(secret: bytes, sealed: memoryview) -> bytes:
    return hmac.new(secret, sealed, hashlib.sha256).digest()


def encode_value(layout: KVLayout, key: bytes, chunk: torch.Tensor, secret: bytes = b"") -> bytes:
    """The stored form of ``chunk`` under ``key``: header and payload, sealed with ``secret`` when one is given."""
    value = bytearray(ChunkHeader.of(layout, key, chunk, sealed=bool(secret)).encode())
    value += byte_view(chunk)
    if secret:
        value += _tag(secret, memoryview(value))
    return bytes(value)


class Rejection(NamedTuple):
    """Why a stored value was not served: ``reason`` is the metric's label, ``detail`` the log's words."""

    reason: str  # format, key, shape, size, mac, checksum
    detail: str


def read_value(
    layout: KVLayout, key: bytes, value: bytes | memoryview, out: torch.Tensor, secret: bytes = b""
) -> Rejection | None:
    """Copy a stored value into ``out`` after checking it (header, size, with ``secret`` its seal, checksum); why it
    was refused, or None."""
    header = ChunkHeader.decode(value)
    if header is None:
        start = bytes(memoryview(value)[:8])
        if start.startswith(_MAGIC_FAMILY):
            return Rejection(
                "format", f"value format {start.decode(errors='replace')}, this pdkv reads {MAGIC.decode()}"
            )
        return Rejection("format", "not a pdkv chunk (bad or missing header)")
    reason = header.mismatch(layout, key, out.shape[2])
    if reason is not None:
        return Rejection("key" if reason.startswith("stored under") else "shape", reason)
    view = memoryview(value)
    dest = byte_view(out)
    end = HEADER_BYTES + len(dest)
    if len(view) != end + (TAG_BYTES if header.sealed else 0):
        return Rejection(
            "size",
            f"{len(view)} bytes, expected {end + (TAG_BYTES if header.sealed else 0)} (header, "
            f"payload{', tag' if header.sealed else ''})",
        )
    if secret and not header.sealed:
        return Rejection("mac", "not sealed: written without the tier secret")
    if secret and not hmac.compare_digest(_tag(secret, view[:end]), view[end:]):
        return Rejection(
            "mac", "the seal does not check out: written by someone without the tier secret, or under another key"
        )
    payload = view[HEADER_BYTES:end]
    if checksum([payload]) != header.checksum:
        return Rejection("checksum", "checksum mismatch")
    dest[:] = payload
    return None


@dataclasses.dataclass
class TierStats:
    """Counters of one tier since it was opened, and what it holds now.

    ``hits``: chunks served by ``get``. ``misses``: chunks ``get`` was asked for
    and could not serve; since reads are prefix-shaped, that is at most one per
    call (the key where the run ended). ``entries``/``bytes`` are None where the
    tier cannot know them (a shared server).
    """

    name: str
    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0
    read_bytes: int = 0
    written_bytes: int = 0
    evictions: int = 0
    errors: int = 0
    rejected: dict[str, int] = dataclasses.field(default_factory=dict)  # values read but refused, by Rejection.reason
    entries: int | None = None
    bytes: int | None = None
    capacity_bytes: int | None = None


class CacheTier(abc.ABC):
    """A prefix-keyed store of canonical KV chunks; every method is thread-safe.

    ``put`` takes ownership of the tensors it is given (memory keeps them
    without a copy): the caller must not write to them afterwards.
    """

    remote: bool = False
    """Whether ``has`` costs a round trip to another process (a shared server): then ``has_local`` skips it."""

    @abc.abstractmethod
    def has(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is stored (no data is read, no counter moves)."""

    def has_local(self, keys: Sequence[bytes]) -> list[bool]:
        """``has`` as far as it can be answered without a round trip; a remote level answers False.

        What a writer asks before gathering a chunk during a forward step: a
        chunk a remote level may hold is written anyway, behind, and the
        level drops the duplicate itself.
        """
        return [False] * len(keys) if self.remote else self.has(keys)

    def contains(self, keys: Sequence[bytes]) -> int:
        """How many leading chunks of ``keys`` are cached."""
        return leading(self.has(keys))

    @abc.abstractmethod
    def get(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor], parent: bytes | None = None) -> int:
        """Fill ``outs[i]`` (canonical chunks, shaped for the tokens expected) for the longest leading run of
        keys; return its length.

        ``keys`` are consecutive chunks of one prompt; ``parent``, when given,
        is the key of the chunk before ``keys[0]`` (a caller reading a prompt
        in batches knows it): a cache that copies what a slower level served
        into a faster one (``TieredCache``) stores the copies under it, as
        ``put``'s ``parents`` do. One level alone does not use it.
        """

    @abc.abstractmethod
    def put(self, keys: Sequence[bytes], chunks: Sequence[torch.Tensor], parents: Parents = None) -> None:
        """Store canonical chunks under their keys (a key already stored is left as it is).

        ``parents[i]``, when given, is the key of the chunk before ``keys[i]``
        in its prompt (None for a prompt's first chunk, or where unknown):
        what a prefix-aware eviction policy (``tier.memory_policy: prefix``)
        builds its tree from. Leaving it out is always correct; that policy
        then sees every key as a root.
        """

    @abc.abstractmethod
    def remove(self, keys: Sequence[bytes]) -> int:
        """Drop these keys; return how many were stored."""

    @abc.abstractmethod
    def stats(self) -> dict[str, TierStats]:
        """A snapshot of each level's counters, by level name."""

    def ping(self) -> bool:
        """Whether the level's store answers now; called once at start, where a failure is logged (and served as
        misses), never raised. A local level always answers."""
        return True

    def close(self) -> None:  # noqa: B027 - optional: a tier that holds nothing has nothing to release
        """Release files, connections and threads."""


class TierListener(Protocol):
    """Told what a level now holds and no longer holds (``pdkv.worker.kv_events`` publishes it as KV events)."""

    def changed(self, level: LeafTier, stored: Sequence[bytes], removed: Sequence[bytes]) -> None: ...


class LeafTier(CacheTier):
    """One storage level: validates arguments and keeps the counters; subclasses move the bytes."""

    def __init__(self, layout: KVLayout, name: str, capacity_bytes: int | None = None) -> None:
        self.layout = layout
        self.name = name
        self._stats = TierStats(name, capacity_bytes=capacity_bytes)
        self._stats_lock = threading.Lock()
        self._listeners: list[TierListener] = []

    def add_listener(self, listener: TierListener) -> None:
        self._listeners.append(listener)

    def _changed(self, stored: Sequence[bytes] = (), removed: Sequence[bytes] = ()) -> None:
        """Tell the listeners (``removed`` first). A level with a lock calls this under it, so the listeners
        see its changes in the order they happened; a listener's failure never fails the tier."""
        for listener in self._listeners:
            try:
                listener.changed(self, stored, removed)
            except Exception:
                log.exception("%s tier: a listener failed", self.name)

    def get(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor], parent: bytes | None = None) -> int:
        self.check(keys, outs, "get buffer")
        if not keys:
            return 0
        got = self._get(keys, outs)
        served = outs[:got]
        self._count(
            hits=got,
            misses=int(got < len(keys)),
            hit_tokens=sum(o.shape[2] for o in served),
            read_bytes=sum(o.numel() * o.element_size() for o in served),
        )
        return got

    def put(self, keys: Sequence[bytes], chunks: Sequence[torch.Tensor], parents: Parents = None) -> None:
        self.check(keys, chunks, "chunk to store")
        if parents is None:
            parents = [None] * len(keys)
        elif (
            isinstance(parents, bytes | str)
            or len(parents) != len(keys)
            or any(p is not None and (not isinstance(p, bytes) or len(p) != KEY_BYTES) for p in parents)
        ):
            raise LayoutError(
                f"{self.name} tier: parents must be one {KEY_BYTES}-byte key (or None) per key stored; got "
                f"{len(parents)} for {len(keys)} keys"
            )
        if keys:
            self._put(keys, chunks, parents)

    def stats(self) -> dict[str, TierStats]:
        with self._stats_lock:
            snapshot = dataclasses.replace(self._stats, rejected=dict(self._stats.rejected))
        snapshot.entries, snapshot.bytes = self._resident()
        return {self.name: snapshot}

    @abc.abstractmethod
    def _get(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor]) -> int:
        """``get`` after validation."""

    @abc.abstractmethod
    def _put(self, keys: Sequence[bytes], chunks: Sequence[torch.Tensor], parents: Sequence[bytes | None]) -> None:
        """``put`` after validation (``parents`` has one entry per key); counts ``written_bytes`` and
        ``evictions`` itself."""

    def _resident(self) -> tuple[int | None, int | None]:
        """(entries, bytes) held now; None where unknown."""
        return None, None

    def _reject(self, reason: str) -> None:
        with self._stats_lock:
            self._stats.rejected[reason] = self._stats.rejected.get(reason, 0) + 1

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + delta)

    def check(self, keys: Sequence[bytes], tensors: Sequence[torch.Tensor], what: str) -> None:
        """Raise ``LayoutError`` unless there is one contiguous CPU chunk of this layout per 16-byte key."""
        if len(keys) != len(tensors):
            raise LayoutError(f"{self.name} tier: {len(keys)} keys but {len(tensors)} chunks; pass one chunk per key")
        for key in keys:
            if len(key) != KEY_BYTES:
                raise LayoutError(
                    f"{self.name} tier: a chunk key is {KEY_BYTES} bytes (pdkv.keys.chunk_keys), got {len(key)}"
                )
        for t in tensors:
            check_chunk(self.layout, t, f"{self.name} tier {what}")
            if not t.is_contiguous() or t.device.type != "cpu":
                raise LayoutError(f"{self.name} tier: a {what} must be a contiguous CPU tensor")


def leading(flags: Sequence[bool]) -> int:
    """Length of the leading run of True."""
    for i, flag in enumerate(flags):
        if not flag:
            return i
    return len(flags)
