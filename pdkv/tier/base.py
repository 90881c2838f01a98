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
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import struct
import threading
from collections.abc import Sequence
from typing import Protocol

import torch

from pdkv.checksum import checksum
from pdkv.errors import LayoutError
from pdkv.keys import KEY_BYTES
from pdkv.layout import KVLayout, check_chunk
from pdkv.memory import byte_view

log = logging.getLogger(__name__)

MAGIC = b"PDKVKV01"
_DTYPE_CODES = {"float32": 1, "float16": 2, "bfloat16": 3}
# magic, key, tokens, layers, kv factor, kv heads, head_dim, dtype code, payload xxh3-64; padded to 64
# bytes so a payload that follows the header in one buffer stays 64-byte aligned.
_HEADER = struct.Struct("<8s16sIHBHHBQ20x")
HEADER_BYTES = _HEADER.size

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

    @classmethod
    def of(cls, layout: KVLayout, key: bytes, chunk: torch.Tensor) -> ChunkHeader:
        """The header of ``chunk`` (a canonical chunk of ``layout``) stored under ``key``."""
        return cls(key, chunk.shape[2], layout.num_layers, layout.kv_factor, layout.num_kv_heads, layout.head_dim, _DTYPE_CODES[layout.dtype], checksum([byte_view(chunk)]))

    def encode(self) -> bytes:
        return _HEADER.pack(MAGIC, self.key, self.num_tokens, self.num_layers, self.kv_factor, self.num_kv_heads, self.head_dim, self.dtype_code, self.checksum)

    @classmethod
    def decode(cls, raw: bytes | memoryview) -> ChunkHeader | None:
        """The header at the start of ``raw``, or None when it is too short or not a pdkv chunk."""
        if len(raw) < HEADER_BYTES:
            return None
        magic, *fields = _HEADER.unpack_from(raw)
        return cls(*fields) if magic == MAGIC else None

    def mismatch(self, layout: KVLayout, key: bytes, num_tokens: int) -> str | None:
        """Why this value cannot be served for ``key`` as ``num_tokens`` tokens of ``layout``; None when it can."""
        if self.key != key:
            return f"stored under another key ({self.key.hex()})"
        expected = (num_tokens, layout.num_layers, layout.kv_factor, layout.num_kv_heads, layout.head_dim, _DTYPE_CODES[layout.dtype])
        found = (self.num_tokens, self.num_layers, self.kv_factor, self.num_kv_heads, self.head_dim, self.dtype_code)
        if found != expected:
            names = ("tokens", "layers", "kv", "kv_heads", "head_dim", "dtype code")
            return "shape differs: " + ", ".join(f"{n} {f} (expected {e})" for n, f, e in zip(names, found, expected, strict=True) if f != e)
        return None


def read_value(layout: KVLayout, key: bytes, value: bytes | memoryview, out: torch.Tensor) -> str | None:
    """Copy a stored value (header + payload) into ``out`` after checking both; returns why it was refused, or None."""
    header = ChunkHeader.decode(value)
    if header is None:
        return "not a pdkv chunk (bad or missing header)"
    reason = header.mismatch(layout, key, out.shape[2])
    if reason is not None:
        return reason
    payload = memoryview(value)[HEADER_BYTES:]
    dest = byte_view(out)
    if len(payload) != len(dest):
        return f"payload is {len(payload)} bytes, expected {len(dest)}"
    if checksum([payload]) != header.checksum:
        return "checksum mismatch"
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
        """Fill ``outs[i]`` (canonical chunks, shaped for the tokens expected) for the longest leading run of keys; return its length.

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
        self._check(keys, outs, "get buffer")
        if not keys:
            return 0
        got = self._get(keys, outs)
        served = outs[:got]
        self._count(
            hits=got, misses=int(got < len(keys)), hit_tokens=sum(o.shape[2] for o in served), read_bytes=sum(o.numel() * o.element_size() for o in served)
        )
        return got

    def put(self, keys: Sequence[bytes], chunks: Sequence[torch.Tensor], parents: Parents = None) -> None:
        self._check(keys, chunks, "chunk to store")
        if parents is None:
            parents = [None] * len(keys)
        elif isinstance(parents, bytes | str) or len(parents) != len(keys) or any(p is not None and (not isinstance(p, bytes) or len(p) != KEY_BYTES) for p in parents):
            raise LayoutError(f"{self.name} tier: parents must be one {KEY_BYTES}-byte key (or None) per key stored; got {len(parents)} for {len(keys)} keys")
        if keys:
            self._put(keys, chunks, parents)

    def stats(self) -> dict[str, TierStats]:
        with self._stats_lock:
            snapshot = dataclasses.replace(self._stats)
        snapshot.entries, snapshot.bytes = self._resident()
        return {self.name: snapshot}

    @abc.abstractmethod
    def _get(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor]) -> int:
        """``get`` after validation."""

    @abc.abstractmethod
    def _put(self, keys: Sequence[bytes], chunks: Sequence[torch.Tensor], parents: Sequence[bytes | None]) -> None:
        """``put`` after validation (``parents`` has one entry per key); counts ``written_bytes`` and ``evictions`` itself."""

    def _resident(self) -> tuple[int | None, int | None]:
        """(entries, bytes) held now; None where unknown."""
        return None, None

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + delta)

    def _check(self, keys: Sequence[bytes], tensors: Sequence[torch.Tensor], what: str) -> None:
        if len(keys) != len(tensors):
            raise LayoutError(f"{self.name} tier: {len(keys)} keys but {len(tensors)} chunks; pass one chunk per key")
        for key in keys:
            if len(key) != KEY_BYTES:
                raise LayoutError(f"{self.name} tier: a chunk key is {KEY_BYTES} bytes (pdkv.keys.chunk_keys), got {len(key)}")
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
