"""KV events with ZeroMQ CURVE: the right keys read the stream (live and replayed), every other subscriber gets nothing.

pdkv's own publisher and subscriber over real ZMQ tcp sockets. "Nothing" is
checked over a bounded wait: a CURVE handshake that fails is silent in ZMQ,
so a refused subscriber sees a quiet stream whose replays time out.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.auth

from pdkv.config import KVEventsConfig, KVEventSource, RouterConfig, convert_config
from pdkv.errors import ConfigError
from pdkv.kv_events.curve import CurveClient
from pdkv.kv_events.publisher import KVEventPublisher
from pdkv.kv_events.subscriber import EventStream, cancel
from pdkv.kv_events.wire import KVEventBatch
from pdkv.router.kv_aware import KVAwareness

from tests.test_kv_events import BS, TOKENS, h, stored, until

REFUSED_WAIT_S = 2.0


def _pair() -> tuple[str, str]:
    public, secret = zmq.curve_keypair()
    return public.decode(), secret.decode()


@pytest.fixture
def keys() -> dict[str, tuple[str, str]]:
    """(public, secret) of the worker, the router it admits, and a stranger."""
    return {name: _pair() for name in ("worker", "router", "stranger")}


@pytest.fixture
def publisher(keys: dict[str, tuple[str, str]]) -> Iterator[KVEventPublisher]:
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint="tcp://*:0",
        replay_endpoint="tcp://*:0",
        topic="kv",
        curve_secret_key=keys["worker"][1],
        curve_clients=[keys["router"][0]],
    )
    pub = KVEventPublisher(config)
    yield pub
    pub.close()


def _event(i: int) -> Any:
    return stored([h("c", i)], h("c", i - 1) if i else None, TOKENS[i * BS : (i + 1) * BS])


def _follow(
    pub: KVEventPublisher, curve: CurveClient | None, wait_s: float, publish_live: bool
) -> tuple[list[KVEventBatch], dict[str, Any]]:
    """Run a subscriber against ``pub`` (batch 0 published before it subscribed, batch 1 after); what it applied,
    and its stats."""
    got: list[KVEventBatch] = []

    async def scenario() -> None:
        stream = EventStream(
            "w",
            pub.endpoint,
            pub.replay_endpoint,
            "kv",
            lambda _w, b: got.append(b),
            lambda _w: None,
            check_s=0.3,
            timeout_s=0.5,
            curve=curve,
        )
        task = asyncio.get_running_loop().create_task(stream.run())
        try:
            if publish_live:
                await until(lambda: len(got) == 1, "the replayed batch", timeout=10)
                deadline = time.monotonic() + 10
                pub.publish([_event(1)])  # live now; a batch lost to PUB/SUB's slow join is replayed on the next check
                await until(lambda: len(got) == 2 or time.monotonic() > deadline, "the live batch", timeout=15)
            else:
                await asyncio.sleep(wait_s)
        finally:
            await cancel(task)
        stats.update(stream.stats)

    stats: dict[str, Any] = {}
    pub.publish([_event(0)])
    asyncio.run(scenario())
    return got, stats


def test_a_subscriber_with_the_right_keys_gets_every_batch_live_and_replayed(
    publisher: KVEventPublisher, keys: dict[str, tuple[str, str]]
) -> None:
    curve = CurveClient.load(keys["router"][1], keys["worker"][0], "secret", "server")
    got, stats = _follow(publisher, curve, 0, publish_live=True)
    assert [b.events[0].block_hashes for b in got] == [[h("c", 0)], [h("c", 1)]]
    assert stats["replayed"] >= 1  # batch 0 came through the CURVE replay socket


@pytest.mark.parametrize("who", ["no keys", "wrong server key", "key not admitted"])
def test_a_subscriber_without_keys_or_with_wrong_ones_gets_nothing_live_or_replayed(
    publisher: KVEventPublisher, keys: dict[str, tuple[str, str]], who: str
) -> None:
    curve = {
        "no keys": None,
        "wrong server key": CurveClient.load(keys["router"][1], keys["stranger"][0], "secret", "server"),
        "key not admitted": CurveClient.load(keys["stranger"][1], keys["worker"][0], "secret", "server"),
    }[who]
    got, stats = _follow(publisher, curve, REFUSED_WAIT_S, publish_live=False)
    publisher.publish([_event(1)])
    assert got == [] and stats.get("batches", 0) == 0 and stats.get("replayed", 0) == 0
    assert stats["replay_failures"] >= 1  # it asked the replay socket and never got an answer
    # a raw SUB socket (vLLM's subscribers' way) with no keys reads nothing either, however long it listens
    sub = zmq.Context.instance().socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(publisher.endpoint)
        deadline = time.monotonic() + REFUSED_WAIT_S
        while time.monotonic() < deadline:
            publisher.publish([_event(2)])
            assert not sub.poll(100), "a subscriber without keys read a CURVE stream"
    finally:
        sub.close(linger=0)


def test_keys_from_certificate_files_and_bad_keys_name_their_field(
    tmp_path: Path, keys: dict[str, tuple[str, str]]
) -> None:
    server_public, server_secret = zmq.auth.create_certificates(tmp_path, "worker")
    client_public, client_secret = zmq.auth.create_certificates(tmp_path, "router")
    pub = KVEventPublisher(
        KVEventsConfig(
            enable_kv_cache_events=True,
            endpoint="tcp://*:0",
            replay_endpoint="tcp://*:0",
            topic="kv",
            curve_secret_key=server_secret,
            curve_clients=[client_public],
        )
    )
    try:
        got, _ = _follow(pub, CurveClient.load(client_secret, server_public, "secret", "server"), 0, publish_live=True)
        assert len(got) == 2
    finally:
        pub.close()
    base = {"enable_kv_cache_events": True, "endpoint": "tcp://*:0"}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"curve_secret_key": "~" * 40, "curve_clients": [keys["router"][0]]}, "kv_events.curve_secret_key"),
        ({"curve_secret_key": keys["worker"][1]}, "kv_events.curve_clients"),
        (
            {
                "curve_secret_key": keys["worker"][1],
                "curve_clients": [keys["router"][0], str(tmp_path / "missing.key")],
            },
            r"kv_events.curve_clients\[1\]",
        ),
        (
            {"curve_secret_key": server_public, "curve_clients": [keys["router"][0]]},
            "holds no secret key",
        ),  # the public half
        ({"curve_clients": [keys["router"][0]]}, "without 'kv_events.curve_secret_key'"),
    ]
    for extra, field in cases:
        with pytest.raises(ConfigError, match=field) as exc:
            KVEventPublisher(convert_config({"kv_events": {**base, **extra}}).kv_events)
        assert keys["worker"][1] not in str(exc.value)  # a secret is never shown


def test_the_router_reads_with_curve_only_when_configured_and_names_a_missing_key(
    keys: dict[str, tuple[str, str]],
) -> None:
    pool: Any = None
    plain = KVAwareness(RouterConfig(), pool)
    assert plain._discovered_curve is None
    curved = KVAwareness(
        RouterConfig(kv_events_curve_secret_key=keys["router"][1], kv_events_curve_server_key=keys["worker"][0]), pool
    )
    assert curved._discovered_curve is not None and curved._discovered_curve.server_key == keys["worker"][0].encode()
    with pytest.raises(ConfigError, match="router.kv_events_curve_server_key"):
        KVAwareness(RouterConfig(kv_events_curve_secret_key=keys["router"][1]), pool)
    with pytest.raises(ConfigError, match="router.kv_events_curve_secret_key"):
        KVAwareness(RouterConfig(kv_events_curve_server_key=keys["worker"][0]), pool)
    source = KVEventSource(worker="http://127.0.0.1:9", endpoint="tcp://127.0.0.1:9", curve_server_key="bad")
    with pytest.raises(ConfigError, match=r"router.kv_events\[0\].curve_server_key"):
        KVAwareness(
            RouterConfig(kv_events=[source], kv_events_discover=False, kv_events_curve_secret_key=keys["router"][1]),
            pool,
        )


def test_the_vllm_launcher_passes_vllm_only_its_own_fields_and_refuses_curve(keys: dict[str, tuple[str, str]]) -> None:
    import json

    from pdkv.launch.vllm import vllm_command

    events_config = {"enable_kv_cache_events": True, "endpoint": "tcp://*:0"}
    cmd, _ = vllm_command(
        convert_config({"role": "prefill", "engine": "vllm", "kv_events": events_config}), "/models/m", [], python="py"
    )
    assert not [
        k for k in json.loads(cmd[cmd.index("--kv-events-config") + 1]) if k.startswith("curve_")
    ]  # vLLM refuses unknown fields
    curved = convert_config(
        {
            "role": "prefill",
            "engine": "vllm",
            "kv_events": {**events_config, "curve_secret_key": keys["worker"][1], "curve_clients": [keys["router"][0]]},
        }
    )
    with pytest.raises(ConfigError, match="kv_events.curve_secret_key.*speaks no CURVE"):
        vllm_command(curved, "/models/m", [], python="py")


def test_a_worker_publishing_with_curve_says_so_and_only_a_router_with_its_keys_indexes_its_blocks(
    model_dir: Path, keys: dict[str, tuple[str, str]]
) -> None:
    """A real worker (engine, tier, HTTP) with CURVE keys: the KV-aware index fills over CURVE, and stays empty
    without the keys."""
    from pdkv.engine.reference import ReferenceEngine
    from pdkv.kv_events.index import PrefixIndex
    from pdkv.worker.server import Worker

    from tests.test_kv_events import CHUNK, PROMPT, completion
    from tests.test_tier_worker import serve

    config = convert_config(
        {
            "role": "prefill",
            "num_blocks": 128,
            "transfer": {"chunk_size": CHUNK},
            "kv_events": {
                "enable_kv_cache_events": True,
                "endpoint": "tcp://*:0",
                "replay_endpoint": "tcp://*:0",
                "topic": "pdkv",
                "curve_secret_key": keys["worker"][1],
                "curve_clients": [keys["router"][0]],
            },
        }
    )

    async def scenario() -> None:
        import aiohttp

        runner, url = await serve(Worker(config, ReferenceEngine.load(str(model_dir), progress=False)))
        try:
            async with aiohttp.ClientSession() as s:
                info = (await (await s.get(url + "/pdkv/info")).json())["kv_events"]
                assert info["curve"] is True
                indexes = {name: PrefixIndex() for name in ("router", "stranger")}
                curves = {
                    "router": CurveClient.load(keys["router"][1], keys["worker"][0], "secret", "server"),
                    "stranger": CurveClient.load(keys["stranger"][1], keys["worker"][0], "secret", "server"),
                }
                streams = []
                for name, index in indexes.items():
                    index.track("w")
                    streams.append(
                        EventStream(
                            "w",
                            info["endpoint"],
                            info["replay_endpoint"],
                            "pdkv",
                            index.apply,
                            index.clear,
                            check_s=0.3,
                            timeout_s=1,
                            curve=curves[name],
                        )
                    )
                tasks = [asyncio.get_running_loop().create_task(st.run()) for st in streams]
                try:
                    assert (await s.post(url + "/v1/completions", json=completion(PROMPT))).status == 200
                    await until(
                        lambda: indexes["router"].match(PROMPT, ["w"])["w"] == 3 * CHUNK,
                        "the prompt's chunks over CURVE",
                    )
                    await asyncio.sleep(REFUSED_WAIT_S)
                    assert (
                        indexes["stranger"].match(PROMPT, ["w"])["w"] == 0 and streams[1].stats.get("batches", 0) == 0
                    )
                finally:
                    for task in tasks:
                        await cancel(task)
        finally:
            await runner.cleanup()

    asyncio.run(scenario())
