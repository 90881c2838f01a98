"""Workers with the cache tier: prefill skips what is cached, and nothing else changes.

The oracle is the same tiny model generating in one process with no cache;
the KV digests (per layer, of the whole prompt) must be bit-identical with
the tier on or off, and on the decode worker that received the KV.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from pdkv.config import convert_config
from pdkv.engine.reference import ReferenceEngine
from pdkv.engine.sampling import SamplingParams
from pdkv.netaddr import free_port
from pdkv.testing.http import get_text, metric, post_json
from pdkv.testing.procs import start_configured
from pdkv.testing.redis import LocalRedis
from pdkv.worker.server import Worker

from tests.conftest import wait_until

CHUNK = 32
BASE = [(i * 37) % 300 + 3 for i in range(100)]  # 3 full chunks + 4 tokens: 3 chunks (96 tokens) loadable
SHARED = BASE[:64] + [(i * 13) % 290 + 5 for i in range(40)]  # its first two chunks are BASE's
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> dict[str, list[int]]:
    engine = ReferenceEngine.load(str(model_dir), progress=False)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return {
        name: engine.generate(p, params, chunk_size=CHUNK).output_token_ids
        for name, p in (("base", BASE), ("shared", SHARED))
    }


def worker(model_dir: Path, role: str, **tier: Any) -> Worker:
    config = convert_config(
        {
            "role": role,
            "channel": {"name": "tcp"},
            "num_blocks": 128,
            "transfer": {"chunk_size": CHUNK, "transfer_timeout_s": 30},
            "tier": tier,
        }
    )
    return Worker(config, ReferenceEngine.load(str(model_dir), progress=False))


async def serve(w: Worker) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(w.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def body(prompt: list[int], max_tokens: int = MAX_TOKENS, **kv: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt": prompt,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "max_tokens": max_tokens,
    }
    if kv:
        out["kv_transfer_params"] = kv
    return out


def test_prefill_from_the_tier_is_token_and_kv_identical_and_pushes_the_whole_prompt(
    model_dir: Path, expected: dict[str, list[int]]
) -> None:
    async def scenario() -> None:
        p_on, p_off, d = (
            worker(model_dir, "prefill"),
            worker(model_dir, "prefill", enabled=False),
            worker(model_dir, "decode", enabled=False),
        )
        runners = [await serve(w) for w in (p_on, p_off, d)]
        (_, on_url), (_, off_url), (_, d_url) = runners
        try:
            async with aiohttp.ClientSession() as s:
                info = await (await s.get(d_url + "/pdkv/info")).json()

                async def pair(p_url: str, prompt: list[int], tid: str) -> tuple[list[str], list[int]]:
                    kv = {
                        "do_remote_decode": True,
                        "remote_host": info["remote_host"],
                        "remote_port": info["remote_port"],
                        "transfer_id": tid,
                        "return_kv_digest": True,
                    }
                    p = await (await s.post(p_url + "/v1/completions", json=body(prompt, 1, **kv))).json()
                    out = await (
                        await s.post(
                            d_url + "/v1/completions",
                            json=body(prompt, **p["kv_transfer_params"], return_kv_digest=True),
                        )
                    ).json()
                    assert (out["kv_transfer_params"] or {}).get("kv_digest") == p["kv_transfer_params"][
                        "kv_digest"
                    ]  # D got every chunk, loaded ones too
                    return p["kv_transfer_params"]["kv_digest"], out["choices"][0]["token_ids"]

                runs = {
                    "base off": await pair(off_url, BASE, "b0"),
                    "base cold": await pair(on_url, BASE, "b1"),
                    "base cached": await pair(on_url, BASE, "b2"),  # 3 chunks from memory
                    "shared off": await pair(off_url, SHARED, "s0"),
                    "shared cached": await pair(on_url, SHARED, "s1"),  # 2 chunks from memory
                }
                on_metrics = await (await s.get(on_url + "/metrics")).text()
                d_metrics = await (await s.get(d_url + "/metrics")).text()
            for name, (digest, tokens) in runs.items():
                kind = name.split()[0]
                assert tokens == expected[kind], name
                assert digest == runs[f"{kind} off"][0], name
            assert metric(on_metrics, "pdkv_prompt_tokens_total", source="tier") == 96 + 64
            assert metric(on_metrics, "pdkv_prompt_tokens_total", source="computed") == len(BASE) + (len(BASE) - 96) + (
                len(SHARED) - 64
            )
            assert metric(on_metrics, "pdkv_tier_hits_total", tier="memory") == 3 + 2
            assert metric(on_metrics, "pdkv_tier_hit_tokens_total", tier="memory") == 96 + 64
            assert (
                metric(on_metrics, "pdkv_tier_misses_total", tier="memory") == 2
            )  # the cold run's first chunk, SHARED's third
            assert (
                metric(on_metrics, "pdkv_tier_entries", tier="memory") == 3 + 1
            )  # BASE's 3 full chunks, SHARED's third
            assert metric(d_metrics, "pdkv_fallbacks_total") == 0
            assert metric(d_metrics, "pdkv_prompt_tokens_total", source="transferred") == 3 * len(BASE) + 2 * len(
                SHARED
            )
        finally:
            for runner, _ in runners:
                await runner.cleanup()

    asyncio.run(scenario())


def test_disk_tier_serves_after_a_worker_restart_and_a_dead_redis_only_costs_misses(
    model_dir: Path, tmp_path: Path, expected: dict[str, list[int]]
) -> None:
    """Memory off, a disk directory, and a Redis URL nobody answers: requests still succeed, token-identical."""
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nobody listens on it
    tier = {
        "memory_bytes": 0,
        "disk_path": str(tmp_path / "l2"),
        "redis_url": dead,
        "redis_timeout_s": 0.5,
        "redis_connect_timeout_s": 0.5,
    }

    async def one_life() -> tuple[list[int], str]:
        w = worker(model_dir, "prefill", **tier)
        runner, url = await serve(w)
        try:
            async with aiohttp.ClientSession() as s:
                out = await (await s.post(url + "/v1/completions", json=body(BASE))).json()
                metrics = await (await s.get(url + "/metrics")).text()
        finally:
            await runner.cleanup()  # closes the worker: its queued disk writes are flushed first
        return out["choices"][0]["token_ids"], metrics

    first_tokens, first = asyncio.run(one_life())
    second_tokens, second = asyncio.run(one_life())
    assert first_tokens == second_tokens == expected["base"]
    assert metric(first, "pdkv_prompt_tokens_total", source="tier") == 0
    assert metric(first, "pdkv_tier_errors_total", tier="redis") >= 1
    assert metric(second, "pdkv_tier_hits_total", tier="disk") == 3
    assert metric(second, "pdkv_prompt_tokens_total", source="tier") == 96


def test_redis_shared_by_two_prefill_processes(
    model_dir: Path, tmp_path: Path, redis_server: LocalRedis, expected: dict[str, list[int]]
) -> None:
    """A prefix computed by one `pdkv launch` prefill worker is a Redis hit on another."""
    namespace = f"shared-{tmp_path.name}:"
    workers = []
    try:
        for i, extra in enumerate([{}, {"disk_path": str(tmp_path / "p2-disk")}]):
            cfg = {
                "model": str(model_dir),
                "num_blocks": 128,
                "transfer": {"chunk_size": CHUNK},
                "tier": {"redis_url": redis_server.url, "redis_namespace": namespace, **extra},
            }
            workers.append(start_configured("prefill", cfg, tmp_path / f"p{i}.yaml", timeout=120))
        p1, p2 = workers
        no_decode = {
            "do_remote_decode": True,
            "return_kv_digest": True,
        }  # no decode worker named: KV is computed, not sent
        first = post_json(p1.url + "/v1/completions", body(BASE, 1, **no_decode))
        import redis

        client = redis.Redis.from_url(redis_server.url)
        wait_until(
            lambda: len(client.keys(namespace + "*")) == 3,
            timeout=30,
            what="P1's three full chunks to be written behind to Redis",
        )
        second = post_json(p2.url + "/v1/completions", body(BASE, 1, **no_decode))
        assert second["kv_transfer_params"]["kv_digest"] == first["kv_transfer_params"]["kv_digest"]
        assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"] == expected["base"][:1]
        m2 = get_text(p2.url + "/metrics")
        assert metric(m2, "pdkv_tier_hits_total", tier="redis") == 3
        assert metric(m2, "pdkv_prompt_tokens_total", source="tier") == 96
        full = post_json(p2.url + "/v1/completions", body(BASE))  # promoted: now a memory hit on P2
        assert full["choices"][0]["token_ids"] == expected["base"]
        m2 = get_text(p2.url + "/metrics")
        assert metric(m2, "pdkv_tier_hits_total", tier="memory") == 3
        wait_until(
            lambda: metric(get_text(p2.url + "/metrics"), "pdkv_tier_entries", tier="disk") == 3,
            timeout=30,
            what="P2 to promote the chunks into its disk level",
        )
    finally:
        for w in workers:
            assert w.stop() == 0
