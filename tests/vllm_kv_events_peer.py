"""vLLM's side of the KV event tests, run with the vLLM environment's Python (tests/test_kv_events.py).

It only uses vLLM's own code (``vllm.distributed.kv_events``): its
``KVEventBatch`` decodes what a pdkv worker publishes, and its
``ZmqEventPublisher`` publishes for pdkv's subscriber to follow.
Protocol, one JSON object per line:

    argv: PDKV_ENDPOINT PDKV_REPLAY_ENDPOINT TOPIC VLLM_ENDPOINT VLLM_REPLAY_ENDPOINT
    1. subscribe to pdkv's stream, ask its replay socket for everything from 0 (vLLM's protocol), decode
       each batch with vLLM's KVEventBatch: print {"pdkv": [batches as seen by vLLM], "config_fields": [the
       fields of vLLM's KVEventsConfig]}
    2. start vLLM's publisher, print {"vllm": "ready"}, then for each line read from stdin (a JSON list of
       events in the shape below) publish one vLLM batch, print {"published": seq} once vLLM's publisher thread
       sent it and holds it for replay; "quit" ends.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

import msgspec
import zmq
from vllm.config.kv_events import KVEventsConfig
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher


def wire(h: object) -> object:
    """A block hash as JSON: the integer form as it is, the bytes form in hex."""
    return h.hex() if isinstance(h, bytes) else h


def describe(event: object) -> dict[str, object]:
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": [wire(h) for h in event.block_hashes],
            "parent": None if event.parent_block_hash is None else wire(event.parent_block_hash),
            "token_ids": event.token_ids,
            "block_size": event.block_size,
            "medium": event.medium,
            "locality": event.locality,
            "lora_id": event.lora_id,
        }
    if isinstance(event, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": [wire(h) for h in event.block_hashes],
            "medium": event.medium,
            "locality": event.locality,
        }
    assert isinstance(event, AllBlocksCleared), type(event)
    return {"type": "AllBlocksCleared"}


def read_pdkv(endpoint: str, replay_endpoint: str, topic: str) -> list[dict[str, object]]:
    ctx = zmq.Context.instance()
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    replay = ctx.socket(zmq.DEALER)
    replay.connect(replay_endpoint)
    replay.send_multipart((b"", (0).to_bytes(8, "big")))
    batches = []
    while True:
        assert replay.poll(30_000), "pdkv's replay socket did not answer"
        _, got_topic, seq, payload = replay.recv_multipart()
        if int.from_bytes(seq, "big", signed=True) == -1:
            break
        assert got_topic == topic.encode(), got_topic
        batch = decoder.decode(payload)
        batches.append(
            {
                "seq": int.from_bytes(seq, "big"),
                "ts": batch.ts,
                "dp_rank": batch.data_parallel_rank,
                "events": [describe(e) for e in batch.events],
            }
        )
    replay.close(linger=0)
    return batches


def make_event(spec: dict[str, object]) -> object:
    kind = spec.pop("type")
    if kind == "BlockStored":
        parent = spec.pop("parent")
        return BlockStored(
            block_hashes=[bytes.fromhex(h) for h in spec.pop("block_hashes")],
            parent_block_hash=bytes.fromhex(parent) if parent else None,
            lora_name=None,
            **spec,
        )
    if kind == "BlockRemoved":
        return BlockRemoved(block_hashes=[bytes.fromhex(h) for h in spec.pop("block_hashes")], **spec)
    return AllBlocksCleared()


def main() -> None:
    endpoint, replay_endpoint, topic, vllm_endpoint, vllm_replay = sys.argv[1:6]
    fields = [f.name for f in dataclasses.fields(KVEventsConfig)]
    print(json.dumps({"pdkv": read_pdkv(endpoint, replay_endpoint, topic), "config_fields": fields}), flush=True)
    config = KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=vllm_endpoint, replay_endpoint=vllm_replay, topic=topic
    )
    publisher = ZmqEventPublisher(
        data_parallel_rank=0, endpoint=config.endpoint, replay_endpoint=config.replay_endpoint, topic=config.topic
    )
    print(json.dumps({"vllm": "ready"}), flush=True)
    seq = 0
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        publisher.publish(KVEventBatch(ts=time.time(), events=[make_event(e) for e in json.loads(line)]))
        # publish() only queues the batch for vLLM's publisher thread; "published" means sent and in its replay
        # buffer (its queue's task is done then), or a subscriber starting next may miss it in the replay
        deadline = time.monotonic() + 10
        while publisher._event_queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.001)
        print(json.dumps({"published": seq}), flush=True)
        seq += 1
    publisher.shutdown()


if __name__ == "__main__":
    main()
