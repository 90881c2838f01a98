"""The S3 level against a real S3 server started by the test (SeaweedFS's `weed server -s3`, pdkv.testing.s3): the
conformance kit, what one worker process stores another serves, multipart objects, the TTL rule, and a server
killed mid-run costing misses, never a request.
"""

from __future__ import annotations

import asyncio
import logging
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from pdkv.config import convert_config
from pdkv.errors import ConfigError
from pdkv.layout import KVLayout
from pdkv.netaddr import free_port
from pdkv.testing.http import get_text, metric, post_json
from pdkv.testing.procs import start_configured
from pdkv.testing.s3 import INSTALL_HINT, LocalS3, local_s3, server_binary
from pdkv.testing.tier_conformance import HOSTILE_RULES, LAYOUT, RULES, Harness, Raw, run_conformance
from pdkv.tier import build_tier
from pdkv.tier.base import CacheTier
from pdkv.tier.s3 import S3Options, S3Tier

from tests.conftest import wait_until
from tests.test_tier_worker import BASE, CHUNK, body, serve, worker

BUCKET = "pdkv-tests"


def have_server() -> None:
    pytest.importorskip("boto3", reason="the S3 level needs boto3: pip install 'pdkv[s3]'")
    if server_binary() is None:
        pytest.skip(f"no SeaweedFS `weed` found (the S3 level is tested against a real server): {INSTALL_HINT}")


@pytest.fixture(scope="module")
def s3() -> Iterator[LocalS3]:
    have_server()
    with local_s3() as server:
        yield server


def options(server: LocalS3, bucket: str = BUCKET, **extra: Any) -> S3Options:
    return S3Options(**server.level_options(bucket, **extra))


def test_s3_keeps_the_contract(s3: LocalS3) -> None:
    client = s3.client()
    prefix = "conformance/"

    def read(key: bytes) -> bytes | None:
        try:
            return client.get_object(Bucket=BUCKET, Key=prefix + key.hex())["Body"].read()
        except client.exceptions.NoSuchKey:
            return None

    def open_tier(layout: KVLayout, secret: str) -> CacheTier:
        tier = S3Tier(layout, options(s3, prefix=prefix, secret=secret))
        assert tier.ping()  # creates the bucket on first use
        return tier

    dead = f"http://127.0.0.1:{free_port()}"  # nobody listens on it
    harness = Harness(
        open=open_tier,
        raw=Raw(
            read=read, write=lambda key, value: client.put_object(Bucket=BUCKET, Key=prefix + key.hex(), Body=value)
        ),
        dead=lambda layout: S3Tier(layout, options(s3, endpoint_url=dead, timeout_s=0.5, connect_timeout_s=0.5)),
        shared=True,
        seals=True,
    )
    report = run_conformance(harness)  # the rules on a hostile store: tests/test_tier_hostile.py
    assert {rule for rule, result in report.items() if result == "passed"} == set(RULES) - HOSTILE_RULES


def test_large_chunks_go_up_in_parts_and_read_back(s3: LocalS3) -> None:
    layout = KVLayout(num_layers=4, num_kv_heads=4, head_dim=128, block_size=16, dtype="float32")  # 8 KiB a token
    tokens = 1024  # 8 MiB a chunk: two parts of 5 MiB
    tier = S3Tier(layout, options(s3, prefix="parts/", multipart_bytes=5 << 20))
    try:
        assert tier.ping()
        keys = [bytes([i]) * 16 for i in range(2)]
        data = [torch.randn(layout.chunk_shape(tokens), generator=torch.Generator().manual_seed(i)) for i in range(2)]
        tier.put(keys, data)
        head = s3.client().head_object(Bucket=BUCKET, Key="parts/" + keys[0].hex())
        assert re.fullmatch(r"[0-9a-f]{32}-\d+", head["ETag"].strip('"'))  # S3's mark of an object uploaded in parts
        outs = [torch.empty_like(d) for d in data]
        assert tier.get(keys, outs) == 2 and all(torch.equal(o, d) for o, d in zip(outs, data, strict=True))
    finally:
        tier.close()


def test_ttl_is_a_lifecycle_rule_beside_the_buckets_own(s3: LocalS3) -> None:
    client = s3.client()
    client.create_bucket(Bucket="pdkv-ttl")
    theirs = {"ID": "theirs", "Filter": {"Prefix": "logs/"}, "Status": "Enabled", "Expiration": {"Days": 30}}
    client.put_bucket_lifecycle_configuration(Bucket="pdkv-ttl", LifecycleConfiguration={"Rules": [theirs]})
    for days in (3, 5):  # a restart with another TTL replaces pdkv's rule, never adds a second
        tier = S3Tier(LAYOUT, options(s3, bucket="pdkv-ttl", ttl_days=days))
        assert tier.ping()
        tier.close()
    rules = {r["ID"]: r for r in client.get_bucket_lifecycle_configuration(Bucket="pdkv-ttl")["Rules"]}
    assert rules.keys() == {"theirs", "pdkv-ttl:pdkv/kv/"}
    assert rules["pdkv-ttl:pdkv/kv/"]["Expiration"] == {"Days": 5}
    assert rules["pdkv-ttl:pdkv/kv/"]["Filter"] == {"Prefix": "pdkv/kv/"}


def test_what_one_worker_process_stores_another_serves(s3: LocalS3, model_dir: Path, tmp_path: Path) -> None:
    """Two `pdkv launch` prefill workers, each with its own memory level and the same bucket: a prefix the first
    computed is an S3 hit on the second, bit-identical KV."""
    level = s3.options(BUCKET, prefix=f"shared-{tmp_path.name}/", secret="fleet-secret")
    workers = []
    try:
        for i in range(2):
            cfg = {
                "model": str(model_dir),
                "num_blocks": 128,
                "transfer": {"chunk_size": CHUNK},
                "tier": {"levels": [level]},
            }
            workers.append(start_configured("prefill", cfg, tmp_path / f"p{i}.yaml", timeout=120))
        p1, p2 = workers
        no_decode = {"do_remote_decode": True, "return_kv_digest": True}  # KV computed, not sent
        first = post_json(p1.url + "/v1/completions", body(BASE, 1, **no_decode))
        client = s3.client()
        wait_until(
            lambda: client.list_objects_v2(Bucket=BUCKET, Prefix=level["prefix"]).get("KeyCount") == 3,
            timeout=30,
            what="P1's three full chunks to be written behind to the bucket",
        )
        second = post_json(p2.url + "/v1/completions", body(BASE, 1, **no_decode))
        assert second["kv_transfer_params"]["kv_digest"] == first["kv_transfer_params"]["kv_digest"]
        assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
        m2 = get_text(p2.url + "/metrics")
        assert metric(m2, "pdkv_tier_hits_total", tier="s3") == 3
        assert metric(m2, "pdkv_prompt_tokens_total", source="tier") == 96
        info = get_text(p2.url + "/pdkv/info")
        assert '"backend": "pdkv.tier.s3:S3Tier"' in info and "fleet-secret" not in info
    finally:
        for w in workers:
            assert w.stop() == 0


def test_a_server_killed_mid_run_costs_misses_and_a_warning_never_a_request(
    model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    have_server()

    async def scenario(server: LocalS3) -> None:
        w = worker(
            model_dir,
            "prefill",
            memory_bytes=0,
            levels=[server.options(BUCKET, timeout_s=1, connect_timeout_s=0.5, retry_s=30)],
        )
        runner, url = await serve(w)
        try:
            async with aiohttp.ClientSession() as s:

                async def complete() -> tuple[list[int], str]:
                    r = await s.post(url + "/v1/completions", json=body(BASE))
                    assert r.status == 200
                    out = await r.json()
                    return out["choices"][0]["token_ids"], await (await s.get(url + "/metrics")).text()

                cold, _ = await complete()
                w.tiering.cache.flush()
                served, m = await complete()
                assert served == cold and metric(m, "pdkv_tier_hits_total", tier="s3") == 3
                server.kill()
                with caplog.at_level(logging.WARNING, logger="pdkv"):
                    for _ in range(2):
                        after, m = await complete()
                        assert after == cold
            assert metric(m, "pdkv_tier_hits_total", tier="s3") == 3  # nothing more served
            assert metric(m, "pdkv_tier_errors_total", tier="s3") >= 1
            assert caplog.text.count("serving misses") == 1  # one warning, then skipped for retry_s
        finally:
            await runner.cleanup()

    with local_s3() as server:
        asyncio.run(scenario(server))


def test_bad_options_fail_at_start_naming_the_field_and_a_missing_client_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ConfigError, match=r"'tier.levels\[0\].bucket' = 'No_Such': Expected `str` matching"):
        convert_config({"tier": {"levels": [{"backend": "s3", "bucket": "No_Such"}]}})
    with pytest.raises(ConfigError, match=r"'tier.levels\[0\].bucket' = missing"):
        convert_config({"tier": {"levels": [{"backend": "s3"}]}})
    with pytest.raises(ConfigError, match=r"'tier.levels\[0\].multipart_bytes' = 1024: Expected `int` >= 5242880"):
        convert_config({"tier": {"levels": [{"backend": "s3", "bucket": "kv-a", "multipart_bytes": 1024}]}})
    with pytest.raises(
        ConfigError, match=r"'tier.levels\[0\].secret_access_key' = '<redacted>': Expected `str`, got `int`"
    ):
        convert_config({"tier": {"levels": [{"backend": "s3", "bucket": "kv-a", "secret_access_key": 5}]}})
    config = convert_config({"tier": {"memory_bytes": 0, "levels": [{"backend": "s3", "bucket": "kv-a"}]}}).tier
    monkeypatch.setitem(sys.modules, "boto3", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"pip install 'pdkv\[s3\]'"):
        build_tier(config, LAYOUT)
