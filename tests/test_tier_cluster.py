"""The shared tier on a real local Redis Cluster: three primaries, a replica each, formed by redis-cli, and a primary
killed mid-run.

The cluster is started by ``pdkv.testing.redis_cluster`` (real redis-server
processes with ``--cluster-enabled yes``); skipped, saying why, where no
redis-server is installed, like every other Redis test.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from pdkv.errors import ConfigError
from pdkv.layout import KVLayout
from pdkv.netaddr import free_port
from pdkv.testing import redis_cluster
from pdkv.testing.redis import server_binary
from pdkv.testing.redis_cluster import LocalCluster, local_redis_cluster
from pdkv.testing.tier_conformance import HOSTILE_RULES, RULES, Harness, Raw, run_conformance
from pdkv.tier import RedisTier
from pdkv.tier.redis_backend import parse_cluster_url

from tests.test_tier_worker import BASE, body, serve, worker

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, dtype="float32")
TOKENS = 32


def have_server() -> None:
    pytest.importorskip("redis", reason="the remote tier needs redis-py: pip install 'pdkv[redis]'")
    if server_binary() is None:
        pytest.skip(
            "redis-server is not installed (apt-get install -y redis-server); the cluster tier is tested against a "
            "real one"
        )


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    have_server()
    with local_redis_cluster(primaries=3, replicas=1, node_timeout_ms=1000) as c:
        yield c


def chunk(i: int) -> torch.Tensor:
    return torch.full(LAYOUT.chunk_shape(TOKENS), float(i))


def tier(url: str, **kw: Any) -> RedisTier:
    return RedisTier(
        LAYOUT,
        url,
        namespace=kw.pop("namespace", "cl:"),
        timeout_s=1,
        connect_timeout_s=0.5,
        retry_s=kw.pop("retry_s", 5),
        **kw,
    )


def test_cluster_urls_name_seed_nodes_and_bad_ones_fail_at_start() -> None:
    assert parse_cluster_url("redis+cluster://a:1,b:2") == {
        "seeds": [("a", 1), ("b", 2)],
        "username": None,
        "password": None,
        "ssl": False,
    }
    assert parse_cluster_url("rediss+cluster://u:p%40ss@[::1]:7000/0")["seeds"] == [("::1", 7000)]
    assert parse_cluster_url("rediss+cluster://u:p%40ss@h:7000/")["password"] == "p@ss"
    for bad in ("redis+cluster://a", "redis+cluster://a:1/3", "redis+cluster://a:99999", "redis+cluster://a:1?x=1"):
        with pytest.raises(ConfigError, match="redis\\+cluster://HOST:PORT"):
            tier(bad)


def test_the_cluster_level_keeps_the_contract(cluster: LocalCluster) -> None:
    """The conformance kit (pdkv.testing.tier_conformance) on the cluster, before any primary is killed: values are
    damaged and planted on whichever primary owns their slot; the dead store is a cluster nobody runs."""
    namespace = "conformance:"

    def node(key: bytes) -> Any:
        name = namespace + key.hex()
        return cluster.client(cluster.primary_of(name).port), name

    def read(key: bytes) -> bytes | None:
        client, name = node(key)
        return client.get(name)

    def write(key: bytes, value: bytes) -> None:
        client, name = node(key)
        client.set(name, value)

    dead = f"redis+cluster://127.0.0.1:{free_port()}"
    harness = Harness(
        open=lambda layout, secret: RedisTier(layout, cluster.url, namespace=namespace, secret=secret),
        raw=Raw(read=read, write=write),
        dead=lambda layout: RedisTier(layout, dead, timeout_s=0.5, connect_timeout_s=0.5),
        shared=True,
        seals=True,
    )
    report = run_conformance(harness)  # the rules on a hostile store: tests/test_tier_hostile.py
    assert {rule for rule, result in report.items() if result == "passed"} == set(RULES) - HOSTILE_RULES


def test_on_the_cluster_a_planted_or_swapped_value_is_a_counted_miss_on_whichever_primary_holds_it(
    cluster: LocalCluster,
) -> None:
    ours, theirs = tier(cluster.url, namespace="seal:", secret="s3"), tier(cluster.url, namespace="seal:")
    keys = [bytes([0x40 + i]) * 16 for i in range(6)]
    ours.put(keys[:3], [chunk(i) for i in range(3)])
    theirs.put(
        keys[3:], [chunk(66) for _ in range(3)]
    )  # well-formed values by a writer without the secret, on every primary
    client = cluster.client(cluster.primary_of(ours._name(keys[2])).port)
    swapped = client.get(ours._name(keys[2]))
    cluster.client(cluster.primary_of(ours._name(keys[0])).port).set(
        ours._name(keys[0]), swapped
    )  # another key's sealed value
    outs = [torch.full(LAYOUT.chunk_shape(TOKENS), float("nan")) for _ in keys]
    assert ours.get(keys[:1], outs[:1]) == 0 and torch.isnan(outs[0]).all()
    assert ours.get(keys[1:3], outs[1:3]) == 2 and torch.equal(outs[2], chunk(2))
    assert sum(ours.get([k], [o]) for k, o in zip(keys[3:], outs[3:], strict=True)) == 0
    assert all(torch.isnan(o).all() for o in outs[3:])
    assert ours.stats()["redis"].rejected == {"key": 1, "mac": 3}
    ours.close()
    theirs.close()


def test_a_worker_on_the_cluster_tier_never_fails_a_request_while_a_primary_dies(
    cluster: LocalCluster, model_dir: Path, tmp_path: Path
) -> None:
    """Prefill workers with only the cluster level (memory off): a prompt computed by one is loaded by the next; a
    primary killed between requests costs some of those loads (recomputed), never a request or its tokens."""
    namespace = f"w-{tmp_path.name}:"
    tier_cfg = {
        "memory_bytes": 0,
        "redis_url": cluster.url,
        "redis_namespace": namespace,
        "redis_retry_s": 1,
        "redis_timeout_s": 1,
        "redis_connect_timeout_s": 0.5,
    }

    async def one(prompt: list[int]) -> tuple[list[int], float]:
        w = worker(model_dir, "prefill", **tier_cfg)
        runner, url = await serve(w)
        try:
            async with aiohttp.ClientSession() as s:
                resp = await s.post(url + "/v1/completions", json=body(prompt))
                assert resp.status == 200
                tokens = (await resp.json())["choices"][0]["token_ids"]
                loaded = _tier_tokens(await (await s.get(url + "/metrics")).text())
        finally:
            await runner.cleanup()  # flushes the writes behind into the cluster
        return tokens, loaded

    first, loaded = asyncio.run(one(BASE))
    assert loaded == 0
    again, loaded = asyncio.run(one(BASE))
    assert again == first and loaded == 96  # 3 chunks from the cluster
    for node in cluster.primaries():
        cluster.client(node.port).execute_command("WAIT", 1, 5000)
    stored = [k for node in cluster.primaries() for k in cluster.client(node.port).keys(namespace + "*")]
    assert len(stored) == 3
    victim = cluster.primary_of(stored[0])  # a fresh cluster: every primary has a replica
    cluster.kill(victim)
    during, loaded = asyncio.run(one(BASE))
    assert during == first and loaded < 96
    cluster.wait_ok(30)
    time.sleep(1.5)  # past the worker's retry window (a fresh worker anyway) and the slot map refresh
    after, loaded = asyncio.run(one(BASE))
    assert after == first and loaded == 96


def test_keys_spread_over_every_primary_and_a_killed_one_costs_only_its_keys_until_its_replica_takes_over(
    cluster: LocalCluster,
) -> None:
    t = tier(cluster.url, namespace="spread:")
    keys = [bytes([i]) * 16 for i in range(24)]
    t.put(keys, [chunk(i) for i in range(24)])
    assert all(t.has(keys))
    held = [len(cluster.client(n.port).keys("spread:*")) for n in cluster.primaries()]
    assert sum(held) == 24 and len(held) == 3 and all(held), f"keys per primary: {held}"
    for node in cluster.primaries(with_replica=True):  # replicated before the crash (replication is asynchronous)
        cluster.client(node.port).execute_command("WAIT", 1, 5000)
    owner = {k: cluster.primary_of(t._name(k)).port for k in keys}
    victim = cluster.primaries(with_replica=True)[0]
    lost = [k for k in keys if owner[k] == victim.port]
    cluster.kill(victim)
    start = time.monotonic()
    during = t.has(keys)  # never raises: the dead primary's keys are misses, every other key is served
    assert [k for k, h in zip(keys, during, strict=True) if not h] == lost
    out = [torch.empty(LAYOUT.chunk_shape(TOKENS))]
    survivor = next(k for k in keys if k not in lost)
    assert t.get([survivor], out) == 1 and torch.equal(out[0], chunk(keys.index(survivor)))
    assert t.get([lost[0]], out) == 0
    assert time.monotonic() - start < 5, "a dead primary must not stall the calls that skip it"
    assert t.stats()["redis"].errors >= 1
    cluster.wait_ok(30)  # the replica took over: its keys are served again, with the bytes written before the crash
    deadline = time.monotonic() + 30
    while not all(t.has(keys)):
        assert time.monotonic() < deadline, "the promoted replica's keys were not served within 30s"
        time.sleep(0.2)
    assert t.get([lost[0]], out) == 1 and torch.equal(out[0], chunk(keys.index(lost[0])))
    assert t.remove(keys) == 24
    t.close()


def test_an_unreachable_cluster_is_misses_not_a_failed_start() -> None:
    t = tier("redis+cluster://127.0.0.1:1,127.0.0.1:2", retry_s=60)
    assert not t.ping()
    assert t.has([b"k" * 16]) == [False]
    t.put([b"k" * 16], [chunk(0)])
    assert t.stats()["redis"].errors >= 1
    t.close()


def test_a_cluster_formed_without_redis_cli_serves_the_tier() -> None:
    have_server()
    with local_redis_cluster(primaries=3, replicas=0, use_cli=False) as c:
        t = tier(c.url)
        keys = [bytes([i]) * 16 for i in range(6)]
        t.put(keys, [chunk(i) for i in range(6)])
        outs = [torch.empty(LAYOUT.chunk_shape(TOKENS)) for _ in keys]
        assert t.get(keys, outs) == 6 and all(torch.equal(o, chunk(i)) for i, o in enumerate(outs))
        assert sum(c.client(n.port).dbsize() for n in c.nodes) == 6
        t.close()


def _tier_tokens(metrics: str) -> float:
    from pdkv.testing.http import metric

    return metric(metrics, "pdkv_prompt_tokens_total", source="tier")


def test_a_cluster_node_never_gets_a_port_whose_bus_port_is_out_of_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node listens on its port + 10000 too and exits at once past 65535; the kernel's picks reach 60999. A pick
    above 55535 is skipped (it failed a CI run: three such picks in a row), and so is one whose bus port is taken."""
    import socket

    from pdkv.netaddr import free_port

    good = free_port() - redis_cluster.BUS_OFFSET  # its bus port was free a moment ago (picks are 32768-60999)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy_bus = taken.getsockname()[1] - redis_cluster.BUS_OFFSET
        picks = iter([60001, redis_cluster.MAX_NODE_PORT + 1, busy_bus, good])
        monkeypatch.setattr(redis_cluster, "free_port", lambda: next(picks))
        assert redis_cluster.node_port() == good
