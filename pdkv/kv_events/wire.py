"""vLLM's KV cache events, byte for byte: what KV-aware routers (Dynamo, llm-d, vLLM's production stack) consume.

These structs have vLLM's names, fields, field order and msgspec options
(``vllm/distributed/kv_events.py``, vllm 0.32), so a batch pdkv encodes is
decoded by vLLM's own classes and the other way round (the test suite checks
both, with vLLM's classes in its vLLM environment). On the wire, one ZMQ
message is three frames ``(topic, seq as 8 bytes big-endian, msgpack
KVEventBatch)``; a batch is an array ``[ts, events, data_parallel_rank]`` and
each event a map tagged by its class name (``"type": "BlockStored"``).

Block hashes are integers by default, bytes on request, as in vLLM
(``external_hash``, ``INT_HASHES_ENV``); decoders take either.

``medium`` and ``locality`` use vLLM's words: ``GPU`` (an engine's paged KV),
``CPU`` (host memory), ``STORAGE`` (disk or a store), with ``locality``
``LOCAL`` or ``REMOTE`` relative to the publisher; a shared store every
worker reads is ``STORAGE``/``REMOTE``, as vLLM's own object-store tier says.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pdkv.errors import ProtocolError

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
LOCAL = "LOCAL"
REMOTE = "REMOTE"

# The replay socket's end-of-replay marker, in the seq frame.
END_SEQ = (-1).to_bytes(8, "big", signed=True)

# int (vLLM's default: the hash's low 64 bits) or bytes (the whole hash, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0).
ExternalBlockHash = bytes | int

INT_HASHES_ENV = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"
"""vLLM's switch, same name and meaning: 1 (the default) publishes integer block hashes, 0 the hash's bytes."""


def external_hash(block_hash: bytes, use_int: bool) -> ExternalBlockHash:
    """A block hash as vLLM publishes it (``maybe_convert_block_hash``): the low 64 bits as an unsigned integer
    (``int.from_bytes(h, "big") & (2**64 - 1)``, msgpack uint64 from 2**63 on), or the bytes as they are.

    The integer form is what Dynamo's indexer decodes (it accepts only msgpack integers) and what vLLM
    sends unless told otherwise. Two blocks whose hashes share their low 64 bits get one name on the wire:
    see pdkv/worker/kv_events.py for what that costs (a routing guess, never KV).
    """
    return int.from_bytes(block_hash, "big") & 0xFFFF_FFFF_FFFF_FFFF if use_int else block_hash


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Base of every KV cache event; the tag is the class name."""


class BlockStored(KVCacheEvent):
    """Blocks now held: ``token_ids`` are ``len(block_hashes) * block_size`` tokens, block after block,
    the first one's parent being ``parent_block_hash`` (None: the prompt's first block)."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """Everything the publisher announced is gone (a cache reset, or a restart)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A batch from its msgpack bytes; anything else is a ``ProtocolError`` saying what was wrong."""
    try:
        return _decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"not a vLLM KVEventBatch ({len(payload)} bytes): {exc}") from None


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def decode_seq(frame: bytes) -> int:
    """A sequence number frame (8 bytes, big-endian, signed so that the end marker reads -1)."""
    if len(frame) != 8:
        raise ProtocolError(f"a KV event sequence number is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)
