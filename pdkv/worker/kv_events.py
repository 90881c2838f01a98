"""A pdkv worker's cache as vLLM KV events: what a KV-aware router needs to know to send a prompt here.

What is a "block" for pdkv. The reference engine's paged blocks hold a
request's KV only while it runs: they are freed when it ends and nothing
looks them up again, so announcing them would tell a router about KV that
is gone by the time the next prompt comes. What outlives a request, and
what the next prompt with the same prefix loads instead of computing, is
the cache tier. So a pdkv block is a tier chunk: ``transfer.chunk_size``
tokens (the events' ``block_size``), whole chunks only (the tier never
stores a partial one), its hash the chunk key (``pdkv.keys``: 16 bytes,
chained over the parent's key, the model and the tokens), its parent the
key of the chunk before it (None for a prompt's first chunk).

On the wire a key is, as in vLLM, its low 64 bits as an integer by default
and its 16 bytes with ``kv_events.use_int_block_hashes: false`` (or
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` when the field is unset): Dynamo's
indexer decodes integers only. The event hash only names a block to
routers; nothing loads KV by it. A worker loads a chunk by its full 128-bit
key, computed from the prompt it is given, and pdkv's router indexes blocks
by their token ids (pdkv.kv_events.index), so a collision of two chunks'
low 64 bits (odds about n^2 / 2^65 for n chunks announced: 1 in 3.7e7 for a
million) costs at most a routing guess: a router that keys by the event
hash (Dynamo) may take one block for the other and send a prompt to a
worker that then finds less of it cached and computes the rest. Never wrong
KV: the load misses, it does not return the other chunk.

Each level of the tier says what it holds, with vLLM's ``medium`` and
``locality`` words (pdkv.kv_events.wire):

=========  =========  ========  ==============================================
level      medium     locality  announced
=========  =========  ========  ==============================================
memory     CPU (*)    LOCAL     stored when put, removed when evicted/dropped
disk       STORAGE    LOCAL     stored when written, removed when evicted/bad
redis      STORAGE    REMOTE    stored when written (or found already there);
                                removed when a read finds it gone (evicted or
                                expired on the server, which tells no one)
=========  =========  ========  ==============================================

(*) ``kv_events.memory_medium``: ``GPU`` for a router that credits only GPU
blocks (Dynamo's flat ``scores``; see the README's kv-events section).

A worker publishes ``AllBlocksCleared`` when it starts (an earlier
incarnation's announcements are void) and, when a subscriber asks
(``POST /pdkv/kv-events/resync``: it lost track), ``AllBlocksCleared``
followed by every block its memory and disk levels hold, parents first.
Files a disk level finds at start are not announced (their token ids are
not stored with them) until they are used again. The events carry no LoRA
or multimodal keys (the reference engine has none). A salted prompt's first
block carries its cache salt the way vLLM announces one, as the block's
``extra_keys`` entry ``(salt,)``; its hash (the salted chunk key) and every
later block chain from it. A consumer that reads extra keys (pdkv's router
index) matches such blocks only under that salt; one that ignores them and
rehashes token ids (as Dynamo's router does) would match them to any prompt
with the same tokens, so announce salted blocks only to consumers that
honour extra keys, or not at all (README, Security).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from collections.abc import Sequence

import numpy as np

from pdkv.config import KVEventsConfig
from pdkv.kv_events.publisher import KVEventPublisher
from pdkv.kv_events.wire import (
    LOCAL,
    MEDIUM_STORAGE,
    REMOTE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    external_hash,
)
from pdkv.tier import LeafTier, MemoryTier, RedisTier, TieredCache

log = logging.getLogger(__name__)

# How many chunks' token ids are remembered while no local level holds them (a write behind to
# Redis after the memory level evicted the chunk; a chunk put again after an eviction).
SPARE_BLOCKS = 4096


def medium_of(level: LeafTier, memory_medium: str) -> tuple[str, str]:
    """(medium, locality) of a tier level, in vLLM's words (the memory level's is ``kv_events.memory_medium``)."""
    if isinstance(level, MemoryTier):
        return memory_medium, LOCAL
    if isinstance(level, RedisTier):
        return MEDIUM_STORAGE, REMOTE
    return MEDIUM_STORAGE, LOCAL  # a disk level


@dataclasses.dataclass
class _Block:
    parent: bytes | None
    tokens: np.ndarray
    position: int  # index of the chunk in its prompt: parents sort before children
    salt: str = ""  # a salted prompt's first block: its cache salt, announced in extra_keys
    levels: set[str] = dataclasses.field(default_factory=set)  # the local levels holding it


class TierEvents:
    """Listens to every level of a worker's tier and publishes what they hold; see the module docstring."""

    def __init__(
        self,
        publisher: KVEventPublisher,
        tier: TieredCache | None,
        chunk_size: int,
        use_int_hashes: bool = True,
        memory_medium: str = "CPU",
    ) -> None:
        self.publisher = publisher
        self.chunk_size = chunk_size
        self.use_int_hashes = use_int_hashes
        self.memory_medium = memory_medium
        levels = tier.levels if tier is not None else []
        self._levels = {level.name: level for level in levels if isinstance(level, LeafTier)}
        self._held: dict[bytes, _Block] = {}  # held by at least one local level
        self._spare: collections.OrderedDict[bytes, _Block] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.unannounced = 0  # stores of chunks whose token ids were not known (files found at start)
        for level in self._levels.values():
            level.add_listener(self)
        publisher.publish([AllBlocksCleared()])

    @classmethod
    def start(cls, config: KVEventsConfig, tier: TieredCache | None, chunk_size: int, host: str) -> TierEvents | None:
        """The worker's publisher when ``config`` enables one, else None."""
        if not config.publishing:
            return None
        use_int = (
            config.int_block_hashes()
        )  # a bad VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES fails the start, not the first event
        if tier is None:
            log.warning(
                "kv_events: enabled, but the cache tier is off (tier.enabled: false): there are no blocks to announce"
            )
        publisher = KVEventPublisher(config, bind_host=host)
        exposed = any(
            e.startswith("tcp://") and not e.startswith(("tcp://127.", "tcp://[::1]", "tcp://localhost"))
            for e in (publisher.endpoint, publisher.replay_endpoint or "")
        )
        if exposed and publisher.curve is None:
            log.warning(
                "kv_events: publishing on %s (replay %s) with no authentication (vLLM's protocol has none), and the "
                "events carry prompt token ids: "
                "keep it on a private network, or set kv_events.curve_secret_key and curve_clients (pdkv's subscribers "
                "only)",
                publisher.endpoint,
                publisher.replay_endpoint,
            )
        return cls(publisher, tier, chunk_size, use_int, config.memory_medium)

    def note(self, keys: Sequence[bytes], tokens: Sequence[int], salt: str = "") -> None:
        """A prompt's chunk keys, token ids and cache salt, before its chunks are loaded or stored: what a store
        event needs."""
        cs = self.chunk_size
        full = min(len(keys), len(tokens) // cs)
        if not full:
            return
        arr = np.asarray(tokens[: full * cs], dtype=np.int64)
        with self._lock:
            for i in range(full):
                key = keys[i]
                if key in self._held:
                    continue
                if key in self._spare:
                    self._spare.move_to_end(key)
                    continue
                self._spare[key] = _Block(keys[i - 1] if i else None, arr[i * cs : (i + 1) * cs], i, "" if i else salt)
            self._trim()

    def changed(self, level: LeafTier, stored: Sequence[bytes], removed: Sequence[bytes]) -> None:
        medium, locality = medium_of(level, self.memory_medium)
        local = locality == LOCAL
        events: list[KVEvent] = []
        with self._lock:
            if removed:
                if local:
                    for key in removed:
                        self._release(key, level.name)
                events.append(
                    BlockRemoved(block_hashes=[self._wire(k) for k in removed], medium=medium, locality=locality)
                )
            for key in stored:
                block = self._held.get(key) or self._spare.get(key)
                if block is None:
                    self.unannounced += 1
                    continue
                if local:
                    block.levels.add(level.name)
                    self._held[key] = block
                    self._spare.pop(key, None)
                elif key in self._spare:
                    self._spare.move_to_end(key)
                events.append(self._stored([key], block, medium, locality))
            self.publisher.publish(events)  # under the lock: batches go out in the order the levels changed

    def resync(self) -> int:
        """Publish ``AllBlocksCleared`` and then every block the local levels hold; returns how many."""
        with self._lock:
            blocks = sorted(self._held.items(), key=lambda kv: kv[1].position)
            events: list[KVEvent] = [AllBlocksCleared()]
            for key, block in blocks:
                for name in sorted(block.levels):
                    medium, locality = medium_of(self._levels[name], self.memory_medium)
                    events.append(self._stored([key], block, medium, locality))
            self.publisher.publish(events)
        return len(blocks)

    def close(self) -> None:
        self.publisher.close()

    def _wire(self, key: bytes) -> int | bytes:
        return external_hash(key, self.use_int_hashes)

    def _stored(self, keys: list[bytes], block: _Block, medium: str, locality: str) -> BlockStored:
        return BlockStored(
            block_hashes=[self._wire(k) for k in keys],
            parent_block_hash=None if block.parent is None else self._wire(block.parent),
            token_ids=block.tokens.tolist(),
            block_size=self.chunk_size,
            lora_id=None,
            medium=medium,
            lora_name=None,
            locality=locality,
            extra_keys=[(block.salt,)] if block.salt else None,
        )

    def _release(self, key: bytes, level: str) -> None:
        """``level`` no longer holds ``key`` (lock held); a block no local level holds becomes spare."""
        block = self._held.get(key)
        if block is None:
            return
        block.levels.discard(level)
        if not block.levels:
            del self._held[key]
            self._spare[key] = block
            self._trim()

    def _trim(self) -> None:
        while len(self._spare) > SPARE_BLOCKS:
            self._spare.popitem(last=False)
