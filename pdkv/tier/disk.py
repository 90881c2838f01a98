"""L2: one file per chunk in a local directory, byte-bounded, surviving restarts.

``<dir>/<first 2 hex of key>/<key hex>.kv`` holds the chunk header
(``pdkv.tier.base``) and its bytes. Files are written to a temporary name and
renamed into place, so a reader never sees half a file; a file damaged later
(a crash before the page cache reached the disk, a bad sector, a hand edit)
fails the header, size or checksum check on read and is then a miss and
deleted, never an error for the request. Which file goes when the bound is
reached is the eviction policy's choice (``pdkv.tier.policy``: ``lru``,
``s3fifo`` or ``prefix``, as for memory). At start the directory is scanned
into the policy oldest modification time first (a read refreshes it), and
trimmed to the configured bound; parents are not stored in the files, so
after a restart the ``prefix`` policy sees the old files as roots until
new chunks are stored under them.

One directory belongs to one process: it is locked (``flock``) while open,
because two processes evicting from one directory would each count bytes the
other deletes.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path

import torch

from pdkv.checksum import checksum
from pdkv.errors import ConfigError
from pdkv.keys import KEY_BYTES
from pdkv.layout import KVLayout
from pdkv.memory import byte_view
from pdkv.tier.base import HEADER_BYTES, ChunkHeader, LeafTier
from pdkv.tier.policy import EvictionPolicy, make_policy

log = logging.getLogger(__name__)

SUFFIX = ".kv"
_TMP = ".tmp-"


class DiskTier(LeafTier):
    def __init__(
        self,
        layout: KVLayout,
        path: str | os.PathLike[str],
        capacity_bytes: int,
        policy: str = "lru",
        name: str = "disk",
    ) -> None:
        super().__init__(layout, name, capacity_bytes)
        self._policy: EvictionPolicy = make_policy(
            policy, capacity_bytes
        )  # first: a bad name fails before the directory is locked
        self.root = Path(path)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._lock_file = open(self.root / ".lock", "a+")  # noqa: SIM115 - held open until close()
        except OSError as exc:
            raise ConfigError(
                f"tier.disk_path {str(path)!r} cannot be used: {exc.strerror}; give a writable directory"
            ) from None
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock_file.close()
            raise ConfigError(
                f"tier.disk_path {str(path)!r} is in use by another pdkv process; give each worker its own directory"
            ) from None
        self._lock = threading.Lock()
        self._scan()

    # -- CacheTier ------------------------------------------------------------------
    def has(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [k in self._policy for k in keys]

    def _get(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor]) -> int:
        for i, (key, out) in enumerate(zip(keys, outs, strict=True)):
            with self._lock:
                if key not in self._policy:
                    return i
                self._policy.touch(key)
            if not self._read(key, out):
                return i
        return len(keys)

    def _put(self, keys: Sequence[bytes], chunks: Sequence[torch.Tensor], parents: Sequence[bytes | None]) -> None:
        for key, chunk, parent in zip(keys, chunks, parents, strict=True):
            nbytes = HEADER_BYTES + chunk.numel() * chunk.element_size()
            with self._lock:
                if key in self._policy or nbytes > self._policy.capacity:
                    continue
            path = self._path(key)
            tmp = path.with_name(f"{_TMP}{uuid.uuid4().hex}")
            try:
                path.parent.mkdir(exist_ok=True)
                with open(tmp, "wb") as f:
                    f.write(ChunkHeader.of(self.layout, key, chunk).encode())
                    f.write(byte_view(chunk))
                os.replace(tmp, path)
            except OSError as exc:
                log.warning("disk tier %s: cannot write a chunk (%s); it stays uncached here", self.root, exc)
                self._count(errors=1)
                with contextlib.suppress(OSError):
                    tmp.unlink()
                continue
            self._count(written_bytes=nbytes)
            self._admit(key, nbytes, parent)

    def remove(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            present = [k for k in keys if k in self._policy]
            for key in present:
                self._drop(key)
        return len(present)

    def close(self) -> None:
        if not self._lock_file.closed:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()

    def _resident(self) -> tuple[int | None, int | None]:
        with self._lock:
            return len(self._policy), self._policy.used

    # -- files ----------------------------------------------------------------------
    def _path(self, key: bytes) -> Path:
        name = key.hex()
        return self.root / name[:2] / (name + SUFFIX)

    def _read(self, key: bytes, out: torch.Tensor) -> bool:
        """Read ``key``'s file into ``out``; a file that fails any check is deleted and the read is a miss."""
        dest = byte_view(out)
        try:
            with open(self._path(key), "rb") as f:
                header = ChunkHeader.decode(f.read(HEADER_BYTES))
                reason = (
                    "not a pdkv chunk (bad or missing header)"
                    if header is None
                    else header.mismatch(self.layout, key, out.shape[2])
                )
                if reason is None:
                    assert header is not None
                    got = f.readinto(dest)
                    if got != len(dest) or f.read(1):
                        reason = f"wrong length (payload expected {len(dest)} bytes)"
                    elif checksum([dest]) != header.checksum:
                        reason = "checksum mismatch"
        except FileNotFoundError:  # deleted behind our back: forget it
            with self._lock:
                self._drop(key)
            return False
        except OSError as exc:
            reason = f"read failed: {exc}"
        if reason is not None:
            log.warning(
                "disk tier %s: chunk %s is unusable (%s); deleted, it will be recomputed", self.root, key.hex(), reason
            )
            self._count(errors=1)
            with self._lock:
                self._drop(key)
            return False
        with contextlib.suppress(OSError):
            os.utime(self._path(key))  # the recency order survives a restart
        return True

    def _admit(self, key: bytes, nbytes: int, parent: bytes | None) -> None:
        with self._lock:
            if key in self._policy:  # another thread stored it meanwhile
                return
            victims = self._policy.admit(key, nbytes, parent) or []
            for victim in victims:
                self._unlink(victim)
            self._changed(stored=(key,), removed=victims)
        self._count(evictions=len(victims))

    def _drop(self, key: bytes) -> None:
        """Forget and delete ``key`` (lock held)."""
        self._policy.discard(key)
        self._unlink(key)
        self._changed(removed=(key,))

    def _unlink(self, key: bytes) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(key).unlink()

    def _scan(self) -> None:
        """Index the files left by an earlier run, oldest first; drop leftovers and trim to the bound."""
        found: list[tuple[float, bytes, int]] = []
        for shard in self.root.iterdir():
            if not shard.is_dir():
                continue
            for entry in os.scandir(shard):
                if entry.name.startswith(_TMP):  # a write interrupted by a crash
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
                    continue
                key = _key_of(entry.name)
                if key is None or not entry.is_file():
                    continue
                st = entry.stat()
                found.append((st.st_mtime, key, st.st_size))
        found.sort()
        evicted = 0
        with self._lock:
            for _mtime, key, size in found:
                victims = self._policy.admit(key, size)
                for victim in victims if victims is not None else [key]:
                    self._unlink(victim)
                    evicted += 1
        self._count(evictions=evicted)


def _key_of(name: str) -> bytes | None:
    """The key a file name encodes, or None for a file that is not ours."""
    if not name.endswith(SUFFIX) or len(name) != 2 * KEY_BYTES + len(SUFFIX):
        return None
    try:
        return bytes.fromhex(name[: -len(SUFFIX)])
    except ValueError:
        return None
