"""Values read from a shared Redis are checked before they become KV: planted, swapped, truncated and old values are
misses.

Everything runs against a real redis-server (``pdkv.testing.redis``). The
"attacker" is whoever else can write to that server: a raw redis-py client,
or a pdkv tier with no secret or another one.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterator

import pytest
import redis
import torch
from prometheus_client import CollectorRegistry, generate_latest

from pdkv.testing.redis import LocalRedis
from pdkv.tier import RedisTier
from pdkv.tier.base import HEADER_BYTES, MAGIC, encode_value
from pdkv.worker.tiering import TierCollector

from tests.test_tier import LAYOUT, bufs, chunk, keys

SECRET = "tier-secret"


@pytest.fixture
def namespace(request: pytest.FixtureRequest) -> str:
    return f"seal:{request.node.name}:"


@pytest.fixture
def sealed(redis_server: LocalRedis, namespace: str) -> Iterator[RedisTier]:
    """The worker's tier: seals what it writes, takes only what is sealed with its secret."""
    tier = RedisTier(LAYOUT, redis_server.url, namespace=namespace, secret=SECRET)
    yield tier
    tier.close()


@pytest.fixture
def client(redis_server: LocalRedis) -> redis.Redis:
    return redis.Redis.from_url(redis_server.url)


def _read(tier: RedisTier, ks: list[bytes]) -> tuple[int, list[torch.Tensor]]:
    outs = bufs(len(ks))
    return tier.get(ks, outs), outs


@pytest.mark.parametrize("writer_secret", ["", "another-secret"], ids=["no secret", "another secret"])
def test_a_value_written_under_a_valid_chunk_key_without_the_secret_is_never_loaded(
    sealed: RedisTier,
    redis_server: LocalRedis,
    namespace: str,
    client: redis.Redis,
    writer_secret: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    ks = keys(3, salt=1)
    sealed.put(ks[:1], [chunk(0)])
    # a well-formed value (right key in its header, right checksum) by a writer without this tier's secret
    poison = chunk(666)
    attacker = RedisTier(LAYOUT, redis_server.url, namespace=namespace, secret=writer_secret)
    try:
        attacker.put(ks[1:2], [poison])
    finally:
        attacker.close()
    assert client.exists(sealed._name(ks[1]))
    with caplog.at_level(logging.WARNING, logger="pdkv.tier.store"):
        got, outs = _read(sealed, ks)
    assert got == 1 and torch.equal(outs[0], chunk(0))
    assert torch.isnan(outs[1]).all()  # never KV: not one byte of the planted value reached the buffer
    s = sealed.stats()["redis"]
    assert s.rejected == {"mac": 1} and s.hits == 1
    assert sealed._name(ks[1]).decode() in caplog.text and "refused (mac" in caplog.text
    assert not client.exists(sealed._name(ks[1]))  # deleted: the next store puts a sealed one there (SET NX)
    sealed.put(ks[1:2], [chunk(1)])
    got, outs = _read(sealed, ks[:2])
    assert got == 2 and torch.equal(outs[1], chunk(1))


def test_a_valid_value_copied_under_another_key_is_never_loaded(
    sealed: RedisTier, client: redis.Redis, namespace: str, redis_server: LocalRedis
) -> None:
    ks = keys(2, salt=2)
    sealed.put(ks[:1], [chunk(10)])
    client.set(sealed._name(ks[1]), client.get(sealed._name(ks[0])))  # byte for byte the other key's good value
    got, outs = _read(sealed, ks[1:])
    assert got == 0 and torch.isnan(outs[0]).all()
    assert sealed.stats()["redis"].rejected == {"key": 1}
    # rewriting the header's key to match does not help: the seal covers it
    value = bytearray(client.get(sealed._name(ks[0])))
    value[8:24] = ks[1]
    client.set(sealed._name(ks[1]), bytes(value))
    assert _read(sealed, ks[1:])[0] == 0
    assert sealed.stats()["redis"].rejected == {"key": 1, "mac": 1}
    # a reader without a secret still refuses the swap (the key is in the header)
    client.set(sealed._name(ks[1]), client.get(sealed._name(ks[0])))
    plain = RedisTier(LAYOUT, redis_server.url, namespace=namespace)
    try:
        assert _read(plain, ks[1:])[0] == 0 and plain.stats()["redis"].rejected == {"key": 1}
    finally:
        plain.close()


def test_truncated_altered_and_old_format_values_are_misses_not_errors(sealed: RedisTier, client: redis.Redis) -> None:
    ks = keys(4, salt=3)
    sealed.put(ks, [chunk(20 + i) for i in range(4)])
    good = client.get(sealed._name(ks[0]))
    client.set(sealed._name(ks[0]), good[:-100])  # truncated
    assert _read(sealed, ks[:1])[0] == 0
    client.set(sealed._name(ks[1]), good[: HEADER_BYTES // 2])  # not even a header
    assert _read(sealed, ks[1:2])[0] == 0
    flipped = bytearray(client.get(sealed._name(ks[2])))
    flipped[HEADER_BYTES + 5] ^= 1
    client.set(sealed._name(ks[2]), bytes(flipped))
    assert _read(sealed, ks[2:3])[0] == 0
    old = bytearray(client.get(sealed._name(ks[3])))
    old[: len(MAGIC)] = b"PDKVKV01"  # the format before the sealed byte
    client.set(sealed._name(ks[3]), bytes(old))
    assert _read(sealed, ks[3:4])[0] == 0
    assert sealed.stats()["redis"].rejected == {"size": 1, "format": 2, "mac": 1}


def test_without_a_secret_the_checksum_still_guards_and_sealed_values_read(
    redis_server: LocalRedis, namespace: str, client: redis.Redis
) -> None:
    plain = RedisTier(LAYOUT, redis_server.url, namespace=namespace)
    try:
        ks = keys(2, salt=4)
        client.set(
            plain._name(ks[0]), encode_value(LAYOUT, ks[0], chunk(30), SECRET.encode())
        )  # a sealing worker's value
        value = bytearray(encode_value(LAYOUT, ks[1], chunk(31)))
        struct.pack_into("<Q", value, 8 + 16 + 4 + 2 + 1 + 2 + 2 + 1, 12345)  # a wrong checksum in the header
        client.set(plain._name(ks[1]), bytes(value))
        got, outs = _read(plain, ks)
        assert got == 1 and torch.equal(outs[0], chunk(30)) and torch.isnan(outs[1]).all()
        assert plain.stats()["redis"].rejected == {"checksum": 1}
    finally:
        plain.close()


def test_rejections_are_a_metric_by_reason_and_logged_once_per_key(
    sealed: RedisTier, client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    ks = keys(1, salt=5)
    with caplog.at_level(logging.WARNING, logger="pdkv.tier.store"):
        for _ in range(3):  # planted again after each deletion
            client.set(sealed._name(ks[0]), encode_value(LAYOUT, ks[0], chunk(40)))
            assert _read(sealed, ks)[0] == 0
    assert caplog.text.count(sealed._name(ks[0]).decode()) == 1
    registry = CollectorRegistry()
    registry.register(TierCollector(sealed, "prefill"))
    assert (
        'pdkv_tier_rejected_total{reason="mac",role="prefill",tier="redis"} 3.0' in generate_latest(registry).decode()
    )


def test_the_config_secret_reaches_the_redis_level_and_seals_what_it_writes(
    redis_server: LocalRedis, namespace: str, client: redis.Redis
) -> None:
    from pdkv.config import convert_config
    from pdkv.tier import build_tier
    from pdkv.tier.base import TAG_BYTES

    config = convert_config(
        {
            "tier": {
                "memory_bytes": 0,
                "redis_url": redis_server.url,
                "redis_namespace": namespace,
                "redis_secret": SECRET,
            }
        }
    ).tier
    cache = build_tier(config, LAYOUT)
    assert cache is not None
    try:
        ks = keys(1, salt=6)
        cache.put(ks, [chunk(50)])
        cache.flush()
        value = client.get(namespace.encode() + ks[0].hex().encode())
        assert value is not None and len(value) == HEADER_BYTES + chunk(50).numel() * 4 + TAG_BYTES
        assert value == encode_value(LAYOUT, ks[0], chunk(50), SECRET.encode())
    finally:
        cache.close()
