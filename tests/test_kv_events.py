"""KV events in vLLM's format: the index, following a stream through losses and restarts, and a worker's tier as events.

Streams run over real ZMQ sockets. The faults (a batch missing from the live
stream, a replay that no longer has it, a publisher that starts again at 0)
come from a scripted publisher in the test, since they must happen at an
exact point; the happy path and the replay protocol run against pdkv's own
publisher here and vLLM's in tests/test_kv_events_vllm.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio

from pdkv.config import KVEventsConfig, convert_config
from pdkv.engine.reference import ReferenceEngine
from pdkv.errors import ConfigError
from pdkv.keys import chunk_keys
from pdkv.kv_events.index import PrefixIndex, chain_hashes
from pdkv.kv_events.publisher import KVEventPublisher
from pdkv.kv_events.subscriber import EventStream, cancel
from pdkv.kv_events.wire import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
    encode_seq,
    external_hash,
)
from pdkv.testing.redis import LocalRedis
from pdkv.worker.server import Worker

from tests.test_tier_worker import serve

BS = 4
TOKENS = list(range(100, 124))  # 6 blocks of 4


def stored(
    hashes: list[bytes], parent: bytes | None, tokens: list[int], medium: str = "GPU", **extra: Any
) -> BlockStored:
    fields: dict[str, Any] = {"lora_id": None, "lora_name": None, **extra}
    return BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS, medium=medium, **fields
    )


def h(name: str, i: int) -> bytes:
    return f"{name}{i:03d}".encode()


def batch(*events: Any, ts: float | None = None) -> KVEventBatch:
    return KVEventBatch(ts=time.time() if ts is None else ts, events=list(events))


def test_index_matches_the_longest_cached_prefix_and_keeps_only_what_a_prompt_can_match() -> None:
    index = PrefixIndex(shared_blocks=2)
    for w in ("p1", "p2", "p3"):
        index.track(w)
    # p1 announces 4 blocks in two events (the second chained to the first by its parent), p2 the same
    # tokens under hashes of its own (another process seed): both match the same prompt
    index.apply(
        "p1",
        batch(
            stored([h("a", 0), h("a", 1)], None, TOKENS[:8]), stored([h("a", 2), h("a", 3)], h("a", 1), TOKENS[8:16])
        ),
    )
    index.apply("p2", batch(stored([h("b", 0), h("b", 1)], None, TOKENS[:8])))
    assert index.match(TOKENS, ["p1", "p2", "p3", "unknown"]) == {"p1": 16, "p2": 8, "p3": 0}
    assert index.match(TOKENS[:6] + [0] * 18, ["p1"]) == {"p1": 4}  # a prompt that differs in block 1
    # removal by medium: a block held on GPU and CPU stays until both let it go; the walk stops at a hole
    index.apply(
        "p1",
        batch(
            stored([h("a", 1)], h("a", 0), TOKENS[4:8], medium="CPU"),
            BlockRemoved(block_hashes=[h("a", 1)], medium="GPU"),
        ),
    )
    assert index.match(TOKENS, ["p1"]) == {"p1": 16}
    index.apply("p1", batch(BlockRemoved(block_hashes=[h("a", 1)], medium="CPU")))
    assert index.match(TOKENS, ["p1"]) == {"p1": 4}
    # what a plain prompt can never match is not indexed: a LoRA's blocks, blocks with extra keys (and those
    # after them), other KV cache groups, a block whose parent is unknown, an event whose sizes do not add up
    index.apply(
        "p3",
        batch(
            stored([h("c", 0)], None, TOKENS[:4], lora_id=7),
            stored([h("c", 1), h("c", 2)], None, TOKENS[:8], extra_keys=[("mm-hash", 0), None]),
            stored([h("c", 3)], None, TOKENS[:4], group_idx=1),
            stored([h("c", 4)], h("nope", 0), TOKENS[4:8]),
            stored([h("c", 5), h("c", 6)], None, TOKENS[:7]),
        ),
    )
    assert index.match(TOKENS, ["p3"]) == {"p3": 0}
    assert (index.stats.skipped, index.stats.orphans, index.stats.malformed) == (4, 1, 1)
    # a shared tier (REMOTE) counts for the workers that announced a block on it, and is bounded
    index.apply(
        "p2",
        batch(
            stored([h("s", 0), h("s", 1)], None, TOKENS[:8], medium="STORAGE", locality="REMOTE"),
            stored([h("s", 2)], h("s", 1), TOKENS[8:12], medium="STORAGE", locality="REMOTE"),
        ),
    )
    assert index.match(TOKENS, ["p2", "p3"]) == {"p2": 8, "p3": 0}  # the LRU of 2 dropped the first block
    index.apply(
        "p2",
        batch(
            BlockRemoved(block_hashes=[h("s", 2)], medium="STORAGE", locality="REMOTE"),
            stored([h("s", 0)], None, TOKENS[:4], medium="STORAGE", locality="REMOTE"),
        ),
    )
    assert index.summary()["shared_tier_blocks"] == 2
    # AllBlocksCleared: the worker's own blocks go, the shared tier's stay
    index.apply("p1", batch(AllBlocksCleared()))
    assert index.match(TOKENS, ["p1"]) == {"p1": 0}
    assert chain_hashes(TOKENS, BS)[:2] == chain_hashes(TOKENS[:8], BS)


def test_index_matches_salted_blocks_only_under_their_salt() -> None:
    """A prompt's first block announced with extra keys ``(salt,)`` (how vLLM and pdkv's workers announce a
    cache salt) chains from that salt: a prompt with the same tokens matches it only under the same salt."""
    index = PrefixIndex()
    index.track("p1")
    index.apply(
        "p1",
        batch(
            stored([h("a", 0), h("a", 1)], None, TOKENS[:8], extra_keys=[("tenant-a",), None]),
            stored([h("a", 2)], h("a", 1), TOKENS[8:12]),  # a later event chains on under the salt
        ),
    )
    assert index.match(TOKENS, ["p1"], salt="tenant-a") == {"p1": 12}
    assert index.match(TOKENS, ["p1"]) == {"p1": 0}
    assert index.match(TOKENS, ["p1"], salt="tenant-b") == {"p1": 0}
    index.apply("p1", batch(stored([h("u", 0)], None, TOKENS[:4])))  # the same tokens unsalted: a block of its own
    assert index.match(TOKENS, ["p1"]) == {"p1": 4}
    assert index.match(TOKENS, ["p1"], salt="tenant-a") == {"p1": 12}
    assert index.stats.skipped == 0


def test_batches_round_trip_and_garbage_is_refused() -> None:
    b = batch(
        stored([h("a", 0)], None, TOKENS[:4], medium="CPU", locality="LOCAL"),
        BlockRemoved(block_hashes=[7], medium="GPU"),
        AllBlocksCleared(),
    )
    assert decode_batch(encode_batch(b)) == b
    with pytest.raises(Exception, match="not a vLLM KVEventBatch"):
        decode_batch(b"\x93\x01\x02")


class ScriptedPublisher:
    """A publisher whose every batch, sequence number and replay answer the test chooses."""

    def __init__(self, topic: bytes = b"kv") -> None:
        ctx = zmq.asyncio.Context.instance()
        self.pub, self.router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
        self.pub.bind("tcp://127.0.0.1:0")
        self.router.bind("tcp://127.0.0.1:0")
        self.topic = topic
        self.replayable: dict[int, bytes] = {}  # what the replay socket answers with
        self.replays: list[int] = []
        self._task = asyncio.get_running_loop().create_task(self._serve_replays())

    @property
    def endpoints(self) -> tuple[str, str]:
        return self.pub.getsockopt_string(zmq.LAST_ENDPOINT), self.router.getsockopt_string(zmq.LAST_ENDPOINT)

    def keep(self, seq: int, b: KVEventBatch) -> bytes:
        payload = self.replayable[seq] = encode_batch(b)
        return payload

    async def send(self, seq: int, b: KVEventBatch, replayable: bool = True) -> None:
        payload = self.keep(seq, b) if replayable else encode_batch(b)
        await self.pub.send_multipart((self.topic, encode_seq(seq), payload))

    async def _serve_replays(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            self.replays.append(first)
            for seq in sorted(s for s in self.replayable if s >= first):
                await self.router.send_multipart((client, b"", self.topic, encode_seq(seq), self.replayable[seq]))
            await self.router.send_multipart((client, b"", b"", END_SEQ, b""))

    async def close(self) -> None:
        await cancel(self._task)
        self.pub.close(linger=0)
        self.router.close(linger=0)


async def until(pred: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def test_a_stream_heals_gaps_from_the_replay_and_rebuilds_when_batches_are_gone_or_the_publisher_restarts() -> None:
    async def scenario() -> None:
        pub = ScriptedPublisher()
        index = PrefixIndex()
        index.track("w")
        resyncs: list[float] = []

        async def resync() -> bool:
            resyncs.append(time.monotonic())
            return True

        endpoint, replay = pub.endpoints
        b = [stored([h("a", i)], h("a", i - 1) if i else None, TOKENS[i * BS : (i + 1) * BS]) for i in range(6)]
        pub.keep(0, batch(b[0]))  # published before the router subscribed: the start-up replay brings it
        stream = EventStream(
            "w", endpoint, replay, "kv", index.apply, index.clear, resync=resync, check_s=0.3, timeout_s=2
        )
        task = asyncio.get_running_loop().create_task(stream.run())
        try:
            await until(lambda: index.match(TOKENS, ["w"])["w"] == 4, "the start-up replay")
            assert pub.replays == [0] and len(resyncs) == 1
            await until(
                lambda: stream.stats["replay_failures"] == 0 and pub.replays == [0, 1], "the quiet-stream check"
            )  # nothing new: no change
            # seq 1 never reaches the live stream, seq 2 does: the gap is filled from the replay, nothing lost
            pub.keep(1, batch(b[1]))
            await asyncio.sleep(0.05)
            await pub.send(2, batch(b[2]))
            await until(lambda: index.match(TOKENS, ["w"])["w"] == 12, "the gap to be replayed")
            assert stream.stats["lost"] == 0 and len(resyncs) == 1
            # seq 3 and 4 are lost for good (not in the replay either), one of them a removal: the view is cleared,
            # then rebuilt from seq 5 on and by a resync (in pdkv: AllBlocksCleared and every block again)
            await pub.send(5, batch(b[3], b[4]), replayable=True)
            await until(lambda: stream.stats["lost"] == 1, "the loss to be noticed")
            assert (
                index.match(TOKENS, ["w"])["w"] == 0 and len(resyncs) == 2
            )  # orphans: their parents went with the clear
            await pub.send(6, batch(AllBlocksCleared(), b[0], b[1]))
            await until(lambda: index.match(TOKENS, ["w"])["w"] == 8, "the resync's blocks")
            # a trailing batch lost on a quiet stream is found by the periodic replay check
            pub.keep(7, batch(b[2]))
            await until(lambda: index.match(TOKENS, ["w"])["w"] == 12, "the periodic check")
            # the publisher restarts: its sequence starts again at 0 and its batches are newer
            pub.replayable.clear()
            await pub.send(0, batch(AllBlocksCleared(), b[0]))
            await until(
                lambda: stream.stats["restarts"] == 1 and index.match(TOKENS, ["w"])["w"] == 4,
                "the restart to be rebuilt",
            )
            assert stream.next_seq == 1
            # a malformed message is a lost batch, never a crash
            await pub.pub.send_multipart((b"kv", encode_seq(1), b"garbage"))
            await until(lambda: stream.stats["malformed"] == 1, "the malformed batch")
            assert not task.done()
        finally:
            await cancel(task)
            await pub.close()

    asyncio.run(scenario())


def test_publisher_endpoints_follow_vllms_rules_and_bad_ones_fail_at_start() -> None:
    pub = KVEventPublisher(
        KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0", replay_endpoint="tcp://*:0"),
        bind_host="127.0.0.1",
    )
    try:
        assert (
            pub.endpoint.startswith("tcp://127.0.0.1:")
            and pub.replay_endpoint
            and pub.replay_endpoint.startswith("tcp://127.0.0.1:")
        )
        port = pub.endpoint.rsplit(":", 1)[1]
        with pytest.raises(ConfigError, match="cannot bind"):
            KVEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}"))
    finally:
        pub.close()
    with pytest.raises(ConfigError, match="replay socket is bound"):
        KVEventPublisher(
            KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0", replay_endpoint="tcp://10.0.0.1:5558")
        )
    with pytest.raises(ConfigError, match="enable_kv_cache_events"):
        KVEventPublisher(KVEventsConfig(enable_kv_cache_events=False))
    with pytest.raises(ConfigError, match="kv_events.publisher"):
        convert_config({"kv_events": {"publisher": "kafka"}})


# -- a worker's tier as events --------------------------------------------------------------------------
CHUNK = 32
PROMPT = [(i * 37) % 300 + 3 for i in range(100)]  # 3 full chunks + 4 tokens
OTHER = [(i * 11) % 290 + 5 for i in range(70)]  # 2 full chunks


def events_worker(model_dir: Path, kv_events: dict[str, Any] | None = None, **tier: Any) -> Worker:
    config = convert_config(
        {
            "role": "prefill",
            "num_blocks": 128,
            "transfer": {"chunk_size": CHUNK},
            "tier": tier,
            "kv_events": {
                "enable_kv_cache_events": True,
                "endpoint": "tcp://*:0",
                "replay_endpoint": "tcp://*:0",
                "topic": "pdkv",
                **(kv_events or {}),
            },
        }
    )
    return Worker(config, ReferenceEngine.load(str(model_dir), progress=False))


@pytest.fixture
def follow() -> Callable[..., Any]:
    """``async with follow(url) as (index, stream)``: the router's view of a worker, from its /pdkv/info."""
    import contextlib

    @contextlib.asynccontextmanager
    async def make(url: str) -> AsyncIterator[tuple[PrefixIndex, EventStream, dict[str, Any]]]:
        async with aiohttp.ClientSession() as s:
            info = (await (await s.get(url + "/pdkv/info")).json())["kv_events"]

            async def resync() -> bool:
                return (await s.post(url + info["resync"])).status == 200

            index = PrefixIndex()
            index.track("w")
            stream = EventStream(
                "w",
                info["endpoint"],
                info["replay_endpoint"],
                info["topic"],
                index.apply,
                index.clear,
                resync=resync,
                check_s=0.5,
            )
            task = asyncio.get_running_loop().create_task(stream.run())
            try:
                yield index, stream, info
            finally:
                await cancel(task)

    return make


def completion(prompt: list[int]) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": 1, "temperature": 0}


@pytest.mark.parametrize("use_int", [None, False], ids=["int hashes (default)", "bytes hashes"])
def test_a_worker_announces_its_tier_chunks_as_blocks_and_their_eviction(
    model_dir: Path, follow: Callable[..., Any], tmp_path: Path, use_int: bool | None
) -> None:
    """Either hash form (vLLM's default integers, or the keys' bytes) indexes the same: pdkv's index keys blocks by
    their tokens."""
    engine_fp = ReferenceEngine.load(str(model_dir), progress=False).fingerprint
    chunk_bytes = 2 * 2 * CHUNK * 2 * 16 * 4  # layers, k/v, tokens, kv heads, head dim, float32

    def wire(keys: list[bytes]) -> set[int | bytes]:
        return {external_hash(k, use_int is not False) for k in keys}

    async def scenario() -> None:
        w = events_worker(
            model_dir, {"use_int_block_hashes": use_int}, memory_bytes=4 * chunk_bytes, disk_path=str(tmp_path / "disk")
        )
        runner, url = await serve(w)
        try:
            async with follow(url) as (index, stream, info), aiohttp.ClientSession() as s:
                assert info["block_size"] == CHUNK and info["topic"] == "pdkv"
                assert (await s.post(url + "/v1/completions", json=completion(PROMPT))).status == 200
                # memory (CPU) at once, disk (STORAGE) behind: 3 full chunks, keyed by pdkv's chunk keys
                await until(lambda: index.match(PROMPT, ["w"])["w"] == 96, "PROMPT's 3 full chunks")
                held = index.workers["w"].ext
                assert set(held) == wire(chunk_keys(PROMPT, engine_fp, CHUNK)[:3])
                assert (
                    all(isinstance(e, int) and 0 <= e < 2**64 for e in held)
                    if use_int is None
                    else all(isinstance(e, bytes) and len(e) == 16 for e in held)
                )
                await until(lambda: all(e.media == 3 for e in held.values()), "both levels to hold them")
                # OTHER's 2 chunks push 1 of PROMPT's out of the 4-chunk memory level: still on disk
                assert (await s.post(url + "/v1/completions", json=completion(OTHER))).status == 200
                await until(lambda: index.match(OTHER, ["w"])["w"] == 64, "OTHER's chunks")
                assert index.match(PROMPT, ["w"])["w"] == 96 and sum(e.media == 3 for e in held.values()) == 4
                # removal from every level: gone from the view
                w.tiering.tier.remove(chunk_keys(PROMPT, engine_fp, CHUNK)[:1])
                await until(lambda: index.match(PROMPT, ["w"])["w"] == 0, "the removal")
                # a subscriber that lost track asks for a resync: everything held comes again, parents first
                index.clear("w")
                assert (await s.post(url + info["resync"])).status == 200
                await until(lambda: index.match(OTHER, ["w"])["w"] == 64, "the resync")
                assert index.match(PROMPT, ["w"])["w"] == 0  # its first chunk is gone: the rest is unreachable
                assert stream.stats["lost"] == 0 and stream.stats["malformed"] == 0
        finally:
            await runner.cleanup()

    asyncio.run(scenario())


def test_the_shared_redis_level_is_announced_as_remote_storage(
    model_dir: Path, follow: Callable[..., Any], redis_server: LocalRedis, tmp_path: Path
) -> None:
    namespace = f"events-{tmp_path.name}:"

    async def scenario() -> None:
        w = events_worker(model_dir, memory_bytes=0, redis_url=redis_server.url, redis_namespace=namespace)
        runner, url = await serve(w)
        try:
            async with follow(url) as (index, _stream, _info), aiohttp.ClientSession() as s:
                assert (await s.post(url + "/v1/completions", json=completion(PROMPT))).status == 200
                await until(lambda: index.summary()["shared_tier_blocks"] == 3, "3 chunks on the shared tier")
                assert index.match(PROMPT, ["w"])["w"] == 96 and index.workers["w"].reads_shared
                import redis

                redis.Redis.from_url(redis_server.url).flushall()  # the server evicts behind everyone's back...
                assert (await s.post(url + "/v1/completions", json=completion(PROMPT))).status == 200
                # ...and the worker that misses says so (the first missing chunk), then writes the chunks again
                await until(lambda: index.stats.removed_blocks >= 1, "the miss to be announced")
        finally:
            await runner.cleanup()

    asyncio.run(scenario())


def test_the_vllm_launcher_passes_kv_events_as_vllms_flag_and_names_the_stream() -> None:
    import json

    from pdkv.launch.vllm import vllm_command

    cfg = convert_config(
        {
            "role": "prefill",
            "engine": "vllm",
            "kv_events": {
                "enable_kv_cache_events": True,
                "endpoint": "tcp://*:0",
                "replay_endpoint": "tcp://*:0",
                "topic": "t",
            },
        }
    )
    cmd, info = vllm_command(cfg, "/models/m", [], python="py")
    events = json.loads(cmd[cmd.index("--kv-events-config") + 1])
    port = int(events["endpoint"].rsplit(":", 1)[1])
    assert (
        port > 0 and events["endpoint"] == f"tcp://*:{port}"
    )  # vLLM binds a wildcard endpoint; port 0 would be its node IP
    assert (
        events["replay_endpoint"].startswith("tcp://127.0.0.1:")
        and events["publisher"] == "zmq"
        and events["enable_kv_cache_events"] is True
    )
    assert info["kv_events"] == {
        "endpoint": f"tcp://127.0.0.1:{port}",
        "replay_endpoint": events["replay_endpoint"],
        "topic": "t",
    }
    with pytest.raises(ConfigError, match="--kv-events-config"):
        vllm_command(cfg, "/models/m", ["--kv-events-config", "{}"], python="py")
    plain, plain_info = vllm_command(
        convert_config({"role": "prefill", "engine": "vllm"}), "/models/m", [], python="py"
    )
    assert "--kv-events-config" not in plain and "kv_events" not in plain_info


# -- block hashes on the wire: vLLM's integer default, bytes on request --------------------------------
def test_external_hash_is_vllms_low_64_bits_and_survives_msgpack_as_uint64() -> None:
    key = bytes(range(0xF0, 0x100))  # 16 bytes whose low 64 bits have the top bit set: above i64
    low = external_hash(key, True)
    assert low == int.from_bytes(key, "big") & (2**64 - 1) == int.from_bytes(key[8:], "big") and low >= 2**63
    assert external_hash(key, False) == key
    event = BlockStored(
        block_hashes=[low],
        parent_block_hash=external_hash(b"\x00" * 16, True),
        token_ids=[1] * BS,
        block_size=BS,
        lora_id=None,
        medium="CPU",
        lora_name=None,
    )
    payload = encode_batch(batch(event))
    assert b"\xcf" + low.to_bytes(8, "big") in payload  # msgpack uint64, as Dynamo's u64 decoder wants
    assert decode_batch(payload).events[0].block_hashes == [low]


def test_the_hash_form_follows_the_config_field_then_vllms_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", raising=False)
    assert KVEventsConfig().int_block_hashes()
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    assert not KVEventsConfig().int_block_hashes()
    assert KVEventsConfig(use_int_block_hashes=True).int_block_hashes()  # the field wins
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "yes")
    with pytest.raises(ConfigError, match="kv_events.use_int_block_hashes"):
        KVEventsConfig().int_block_hashes()
    with pytest.raises(ConfigError, match="memory_medium"):
        convert_config({"kv_events": {"memory_medium": "NVME"}})


def test_a_64_bit_collision_costs_the_index_a_route_never_kv() -> None:
    """Two different blocks announced under one integer hash (the low 64 bits of two keys agree): the index
    believes the latest announcement, keyed by its tokens, so it routes one prompt wrongly at worst; it holds no
    KV and names none (a worker loads by its own 128-bit keys)."""
    index = PrefixIndex()
    other = [t + 1000 for t in TOKENS]
    index.apply("w", batch(stored([7], None, TOKENS[:BS])))  # type: ignore[list-item]
    assert index.match(TOKENS, ["w"]) == {"w": BS}
    index.apply("w", batch(stored([7], None, other[:BS])))  # type: ignore[list-item]
    assert index.match(TOKENS, ["w"]) == {"w": 0} and index.match(other, ["w"]) == {"w": BS}
    index.apply("w", batch(BlockRemoved(block_hashes=[7], medium="GPU")))
    assert index.match(other, ["w"]) == {"w": 0}
