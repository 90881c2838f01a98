"""What each worker caches, from its KV events, and the longest cached prefix of a prompt on each.

The index never reproduces a publisher's own block hash. vLLM's is a
sha256 over a per-process random seed unless ``PYTHONHASHSEED`` is set,
pdkv's is its chunk key (over the model fingerprint): neither can be
computed from a prompt by a router. Every event carries the blocks' token
ids and their parent, so the index keys each block by its own chained hash,
``xxh3_64(block tokens, seed=parent's hash)`` from a root per block size,
and keeps, per worker, the publisher's hash -> its own (to find a parent
and to apply a removal). A prompt is matched by hashing its token ids the
same way, block after block, and walking each worker's set until a block
is missing: the number of tokens its cache holds from the prompt's start.
Two workers that cache the same prefix hold the same index hashes, whatever
their own hashes are, and a publisher's hash may be an integer (vLLM's
default, pdkv's too: 64 bits) or bytes: it is only a name for an event to
refer to. The index only routes: nothing loads KV because of it (the worker
a prompt is sent to looks its chunks up by their full 128-bit keys). A
publisher that reuses a hash for other tokens (a 64-bit collision included)
is believed: its block becomes the new tokens, so a collision costs at most
a routing guess.

Blocks on a shared tier (``locality: REMOTE``, pdkv's Redis level) are
held once for all workers, in an LRU of ``shared_blocks`` entries (the
store evicts without telling anyone; a worker that finds a block gone
says so with ``BlockRemoved``, and the LRU bounds what is never
disproved). A worker counts them as its own once it has announced one
(it is wired to that tier).

Cache salts (vLLM's ``cache_salt``; a tenant's behind pdkv's router): a
prompt's first block announced with the extra keys ``(salt,)``, as vLLM
and pdkv's workers announce a salted prompt, chains from a root of that
salt, and so does every block after it. Such blocks match a prompt only
when it is matched under the same salt (``match(..., salt=)``): one
tenant's blocks are never counted for another's prompt, nor for an
unsalted one.

What is not indexed, because a prompt alone can never match it: blocks of
a LoRA adapter, blocks with other extra keys (multimodal inputs, a salt on
a block that is not a prompt's first) and every block after one of them in
the same event, KV cache groups other
than the first (hybrid models' sliding-window groups), and a block whose
parent the index does not know (an event was lost: ``orphans``).
Removals are by (medium, locality): a block leaves a worker when no medium
holds it any more; a removal with no medium clears it from all of them.
Repeated stores of one block are idempotent (vLLM re-announces blocks when
a prefix cache hit reuses them).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import xxhash

from pdkv.kv_events.wire import REMOTE, AllBlocksCleared, BlockRemoved, BlockStored, ExternalBlockHash, KVEventBatch

MAX_BLOCK_SIZE = 1 << 16  # tokens per block; a larger one in an event is malformed


def root_hash(block_size: int, salt: str = "") -> int:
    """The parent of a prompt's first block, per block size and cache salt: blocks of different sizes or salts never
    collide."""
    root = b"pdkv-router-index/" + str(block_size).encode()
    return xxhash.xxh3_64_intdigest(root + b"/salt/" + salt.encode("utf-8", "surrogatepass") if salt else root)


def _salt_of(extra: tuple[Any, ...] | None) -> str | None:
    """The cache salt a prompt's first block announces in its extra keys (``(salt,)``), else None."""
    return extra[0] if extra is not None and len(extra) == 1 and isinstance(extra[0], str) and extra[0] else None


def _token_bytes(tokens: Sequence[int] | np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(tokens, dtype="<i8")).cast("B")


def chain_hashes(
    tokens: Sequence[int] | np.ndarray, block_size: int, parent: int | None = None, limit: int | None = None
) -> list[int]:
    """Index hashes of the full blocks of ``tokens`` (at most ``limit``), the first one's parent ``parent``
    (default: the root)."""
    data = _token_bytes(tokens)
    step = block_size * 8
    count = len(data) // step if limit is None else min(limit, len(data) // step)
    h = root_hash(block_size) if parent is None else parent
    out = []
    for i in range(count):
        h = xxhash.xxh3_64_intdigest(data[i * step : (i + 1) * step], seed=h)
        out.append(h)
    return out


@dataclasses.dataclass
class IndexStats:
    events: int = 0
    stored_blocks: int = 0
    removed_blocks: int = 0
    clears: int = 0
    orphans: int = 0  # stores whose parent was unknown (an event was lost): not indexed
    skipped: int = 0  # blocks that can never match a plain prompt (LoRA, extra keys, other groups)
    malformed: int = 0  # events whose fields do not add up (token count, block size)


@dataclasses.dataclass
class _Entry:
    index_hash: int
    media: int  # bit per (medium, locality) that holds it


class WorkerBlocks:
    """One worker's blocks: its own hashes -> the index's, and how many of its hashes hold each index hash."""

    def __init__(self) -> None:
        self.ext: dict[ExternalBlockHash, _Entry] = {}
        self.held: dict[int, int] = {}
        self.block_sizes: set[int] = set()
        self.reads_shared = False  # it announced a block on the shared tier: it can load from there

    def __len__(self) -> int:
        return len(self.held)


class PrefixIndex:
    """Per-worker indexes and the shared tier's; not thread-safe (the router runs it on its event loop)."""

    def __init__(self, shared_blocks: int = 1 << 20) -> None:
        self.workers: dict[str, WorkerBlocks] = {}
        self.shared_blocks = shared_blocks
        self._shared: collections.OrderedDict[ExternalBlockHash, int] = collections.OrderedDict()
        self._shared_held: dict[int, int] = {}
        self._shared_sizes: set[int] = set()
        self._media: dict[tuple[str | None, str | None], int] = {}
        self.stats = IndexStats()

    # -- updates ------------------------------------------------------------------------
    def track(self, worker: str) -> None:
        """Start indexing ``worker`` (it holds nothing known yet): from now on ``match`` answers for it."""
        self.workers.setdefault(worker, WorkerBlocks())

    def forget(self, worker: str) -> None:
        """Stop indexing ``worker`` (deregistered, or its stream is gone)."""
        self.workers.pop(worker, None)

    def apply(self, worker: str, batch: KVEventBatch) -> None:
        w = self.workers.setdefault(worker, WorkerBlocks())
        for event in batch.events:
            self.stats.events += 1
            if isinstance(event, BlockStored):
                self._stored(w, event)
            elif isinstance(event, BlockRemoved):
                self._removed(w, event)
            elif isinstance(event, AllBlocksCleared):
                w = self.clear(worker)

    def clear(self, worker: str) -> WorkerBlocks:
        """Forget what ``worker`` holds (its reset, restart or a lost event); the shared tier's blocks stay,
        and so does whether it reads them (that is how it is wired, not what it caches)."""
        old = self.workers.get(worker)
        fresh = self.workers[worker] = WorkerBlocks()
        if old is not None:
            fresh.reads_shared = old.reads_shared
        self.stats.clears += 1
        return fresh

    def _medium(self, medium: str | None, locality: str | None) -> int:
        return self._media.setdefault((medium, locality), 1 << len(self._media))

    def _stored(self, w: WorkerBlocks, ev: BlockStored) -> None:
        n, size = len(ev.block_hashes), ev.block_size
        if ev.group_idx not in (None, 0) or ev.lora_id is not None or ev.lora_name is not None:
            self.stats.skipped += n
            return
        if (
            not 0 < size <= MAX_BLOCK_SIZE
            or len(ev.token_ids) != n * size
            or (ev.extra_keys is not None and len(ev.extra_keys) != n)
        ):
            self.stats.malformed += 1
            return
        shared = ev.locality == REMOTE
        keys = list(ev.extra_keys or ())
        if ev.parent_block_hash is None:
            salt = _salt_of(keys[0]) if keys else None
            if salt is not None:
                keys[0] = None  # the salt is the root's: the block itself has no other key
            parent: int | None = root_hash(size, salt or "")
        else:
            entry = w.ext.get(ev.parent_block_hash)
            parent = entry.index_hash if entry is not None else self._shared.get(ev.parent_block_hash)
        if parent is None:
            self.stats.orphans += n
            return
        usable = next((i for i, k in enumerate(keys) if k is not None), n)
        self.stats.skipped += n - usable
        hashes = chain_hashes(ev.token_ids, size, parent, usable)
        bit = self._medium(ev.medium, ev.locality)
        for ext, h in zip(ev.block_hashes, hashes, strict=False):
            self.stats.stored_blocks += 1
            if shared:
                w.reads_shared = True
                self._store_shared(ext, h, size)
                continue
            entry = w.ext.get(ext)
            if entry is None:
                w.ext[ext] = _Entry(h, bit)
                w.held[h] = w.held.get(h, 0) + 1
                w.block_sizes.add(size)
            elif entry.index_hash == h:
                entry.media |= bit
            else:  # the publisher reused a hash for other tokens: the new ones are what it holds now
                self._drop(w, ext, entry)
                w.ext[ext] = _Entry(h, bit)
                w.held[h] = w.held.get(h, 0) + 1

    def _removed(self, w: WorkerBlocks, ev: BlockRemoved) -> None:
        if ev.group_idx not in (None, 0):
            return
        if ev.locality == REMOTE:
            for ext in ev.block_hashes:
                h = self._shared.pop(ext, None)
                if h is not None:
                    self.stats.removed_blocks += 1
                    self._unhold_shared(h)
            return
        mask = ~self._medium(ev.medium, ev.locality) if ev.medium is not None else 0
        for ext in ev.block_hashes:
            entry = w.ext.get(ext)
            if entry is None:
                continue
            entry.media &= mask
            if not entry.media:
                self.stats.removed_blocks += 1
                self._drop(w, ext, entry)

    @staticmethod
    def _drop(w: WorkerBlocks, ext: ExternalBlockHash, entry: _Entry) -> None:
        del w.ext[ext]
        left = w.held[entry.index_hash] - 1
        if left:
            w.held[entry.index_hash] = left
        else:
            del w.held[entry.index_hash]

    def _store_shared(self, ext: ExternalBlockHash, h: int, size: int) -> None:
        if ext in self._shared:
            self._shared.move_to_end(ext)
            return
        self._shared[ext] = h
        self._shared_held[h] = self._shared_held.get(h, 0) + 1
        self._shared_sizes.add(size)
        while len(self._shared) > self.shared_blocks:
            _, old = self._shared.popitem(last=False)
            self._unhold_shared(old)

    def _unhold_shared(self, h: int) -> None:
        left = self._shared_held[h] - 1
        if left:
            self._shared_held[h] = left
        else:
            del self._shared_held[h]

    # -- lookups ---------------------------------------------------------------------------
    def tracks(self, worker: str) -> bool:
        return worker in self.workers

    def match(self, tokens: Sequence[int] | np.ndarray, workers: Iterable[str], salt: str = "") -> dict[str, int]:
        """For each known worker of ``workers``: how many leading tokens of the prompt its cache holds
        (its own blocks, or the shared tier's when it reads that tier), under cache salt ``salt``.

        The prompt is hashed block by block only as far as some worker still matches: a lookup costs the
        longest cached prefix among the workers, not the prompt's length.
        """
        known = [(url, w) for url in workers if (w := self.workers.get(url)) is not None]
        out = dict.fromkeys((url for url, _ in known), 0)
        walks: dict[int, list[tuple[str, dict[int, int]]]] = {}
        for url, w in known:
            for size in w.block_sizes:
                walks.setdefault(size, []).append((url, w.held))
        if self._shared_held and any(w.reads_shared for _, w in known):
            for size in self._shared_sizes:
                walks.setdefault(size, []).append(("", self._shared_held))
        if not walks:
            return out
        data = _token_bytes(tokens)
        shared = 0
        for size, alive in walks.items():
            step, h, depth = size * 8, root_hash(size, salt), 0
            while alive and (depth + 1) * step <= len(data):
                h = xxhash.xxh3_64_intdigest(data[depth * step : (depth + 1) * step], seed=h)
                depth += 1
                still = []
                for url, held in alive:
                    if h in held:
                        still.append((url, held))
                    elif url:
                        out[url] = max(out[url], (depth - 1) * size)
                    else:
                        shared = max(shared, (depth - 1) * size)
                alive = still
            for url, _ in alive:  # matched to the prompt's last full block
                if url:
                    out[url] = max(out[url], depth * size)
                else:
                    shared = max(shared, depth * size)
        if shared:
            for url, w in known:
                if w.reads_shared:
                    out[url] = max(out[url], shared)
        return out

    def summary(self) -> dict[str, object]:
        return {
            "workers": {
                url: {"blocks": len(w), "block_sizes": sorted(w.block_sizes), "reads_shared_tier": w.reads_shared}
                for url, w in self.workers.items()
            },
            "shared_tier_blocks": len(self._shared),
            **dataclasses.asdict(self.stats),
        }
