"""Prefill and decode workers: a real model's KV moved between processes over tcp.

The workers run as real ``pdkv launch`` processes (or, where a fault must be
injected at an exact point, as in-process workers on real sockets), and the
oracle is the same model generating in one process.
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from pdkv.config import convert_config
from pdkv.engine.reference import ReferenceEngine
from pdkv.engine.sampling import SamplingParams
from pdkv.testing.http import get_text as get
from pdkv.testing.http import metric
from pdkv.testing.http import post_json as post
from pdkv.testing.procs import WorkerProcess, start_configured
from pdkv.worker.server import Worker

from tests.conftest import serve_worker, wait_until

CHUNK = 32
PROMPTS = [
    list(range(5, 25)),
    [(i * 37) % 300 + 3 for i in range(100)],
    [(i * 11) % 290 + 7 for i in range(64)],
]  # 1 partial chunk; 3 chunks + 4; exactly 2


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> dict[int, list[int]]:
    engine = ReferenceEngine.load(str(model_dir), progress=False)
    return {
        i: engine.generate(p, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)).output_token_ids
        for i, p in enumerate(PROMPTS)
    }


def launch(role: str, model_dir: Path, tmp_path: Path, **settings: Any) -> WorkerProcess:
    cfg = {
        "model": str(model_dir),
        "channel": {"name": "tcp"},
        "num_blocks": 256,
        "transfer": {"chunk_size": CHUNK, "transfer_timeout_s": 30},
        **settings,
    }
    return start_configured(role, cfg, tmp_path / f"{role}.yaml", timeout=120)


def disaggregated(
    p_url: str, d_url: str, prompt: list[int], transfer_id: str, extra: dict[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    info = json.loads(get(d_url + "/pdkv/info"))
    base = {"prompt": prompt, "temperature": 0, "ignore_eos": True, "return_token_ids": True, **(extra or {})}
    p = post(
        p_url + "/v1/completions",
        {
            **base,
            "max_tokens": 1,
            "kv_transfer_params": {
                "do_remote_decode": True,
                "remote_host": info["remote_host"],
                "remote_port": info["remote_port"],
                "transfer_id": transfer_id,
                "return_kv_digest": True,
            },
        },
    )
    d = post(
        d_url + "/v1/completions",
        {**base, "max_tokens": 16, "kv_transfer_params": {**p["kv_transfer_params"], "return_kv_digest": True}},
    )
    return p, d


@pytest.mark.parametrize(
    "d_settings",
    [{}, {"block_size": 32, "kv_order": "HND"}, {"block_size": 8, "kv_kind": "cross_layer"}],
    ids=["same-layout-direct", "nhd16-to-hnd32", "to-cross-layer-bs8"],
)
def test_two_process_pipeline_is_token_and_kv_identical(
    model_dir: Path, tmp_path: Path, expected: dict[int, list[int]], d_settings: dict[str, Any]
) -> None:
    decode = launch("decode", model_dir, tmp_path, **d_settings)
    prefill = launch("prefill", model_dir, tmp_path)
    try:
        for i, prompt in enumerate(PROMPTS):
            p, d = disaggregated(prefill.url, decode.url, prompt, f"t{i}")
            assert p["kv_transfer_params"]["transfer_started"] is True
            tokens = d["choices"][0]["token_ids"]
            assert tokens == expected[i]
            assert tokens[0] == p["kv_transfer_params"]["first_token_id"]
            assert (
                d["kv_transfer_params"]["kv_digest"] == p["kv_transfer_params"]["kv_digest"]
            )  # per layer, bit-identical
            assert len(p["kv_transfer_params"]["kv_digest"]) == 2
        d_metrics = get(decode.url + "/metrics")
        assert metric(d_metrics, "pdkv_fallbacks_total") == 0
        assert metric(d_metrics, "pdkv_prompt_tokens_total", source="transferred") == sum(map(len, PROMPTS))
        assert metric(d_metrics, "pdkv_reservations") == 0
        assert metric(d_metrics, "pdkv_reserved_blocks") == 0
        assert metric(d_metrics, "pdkv_transfer_events_total", event="transfers_ready") == len(PROMPTS)
        assert metric(d_metrics, "pdkv_transfer_events_total", event="checksum_failures") == 0
        wait_until(
            lambda: metric(get(prefill.url + "/metrics"), "pdkv_open_transfers") == 0,
            what="the prefill side to settle its transfers",
        )
        p_metrics = get(prefill.url + "/metrics")
        assert metric(p_metrics, "pdkv_transfers_total", outcome="ok") == len(PROMPTS)
        assert metric(p_metrics, "pdkv_transfer_bytes_total") > 0
    finally:
        assert prefill.stop() == 0
        assert decode.stop() == 0


def test_openai_surface_on_a_worker(model_dir: Path, tmp_path: Path, expected: dict[int, list[int]]) -> None:
    decode = launch("decode", model_dir, tmp_path)
    try:
        base = {"prompt": PROMPTS[1], "temperature": 0, "ignore_eos": True, "max_tokens": 16, "return_token_ids": True}
        full = post(decode.url + "/v1/completions", base)
        assert full["choices"][0]["token_ids"] == expected[1]
        assert full["usage"] == {"prompt_tokens": 100, "completion_tokens": 16, "total_tokens": 116}
        req = urllib.request.Request(
            decode.url + "/v1/completions",
            json.dumps({**base, "stream": True}).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            events = [line[6:] for line in resp.read().decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == expected[1]
        assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
        chat = post(
            decode.url + "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "the quick brown fox"}], "max_tokens": 5, "temperature": 0},
        )
        assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["role"] == "assistant"
        assert json.loads(get(decode.url + "/v1/models"))["data"][0]["id"]
        assert json.loads(get(decode.url + "/health"))["status"] == "ok"
        for bad in [
            {"prompt": ""},
            {"prompt": [10**9]},
            {"prompt": "x", "max_tokens": 0},
            {"prompt": "x", "n": 2},
            {"prompt": "x", "max_tokens": 10**6},
        ]:
            with pytest.raises(urllib.error.HTTPError) as err:
                post(decode.url + "/v1/completions", bad)
            assert err.value.code == 400
            assert "message" in json.loads(err.value.read())["error"]
    finally:
        assert decode.stop() == 0


def test_transfer_killed_halfway_falls_back_to_the_same_tokens(model_dir: Path, expected: dict[int, list[int]]) -> None:
    """P's transfer path dies after two of four chunks, silently: D's lease expires and D recomputes."""

    async def scenario() -> None:
        settings = {
            "channel": {"name": "tcp"},
            "num_blocks": 256,
            "transfer": {"chunk_size": CHUNK, "lease_s": 1.0, "heartbeat_s": 0.2, "drain_timeout_s": 1.0},
        }
        p_worker = Worker(
            convert_config({**settings, "role": "prefill"}), ReferenceEngine.load(str(model_dir), progress=False)
        )
        d_worker = Worker(
            convert_config({**settings, "role": "decode"}),
            ReferenceEngine.load(str(model_dir), progress=False, block_size=32, order="HND"),
        )
        start_free = d_worker.engine.allocator.num_free
        assert p_worker.pusher is not None and p_worker.sender is not None
        real_push, pushed = p_worker.pusher.push, []

        def dying_push(xfer, index: int) -> None:  # noqa: ANN001
            pushed.append(index)
            if len(pushed) <= 2:
                real_push(xfer, index)
            elif len(pushed) == 3:  # the prefill side's transfer machinery dies without a word
                p_worker.sender.loop.stop()

        p_worker.pusher.push = dying_push  # type: ignore[method-assign]
        p_runner, p_url = await serve_worker(p_worker)
        d_runner, d_url = await serve_worker(d_worker)
        try:
            async with aiohttp.ClientSession() as s:
                info = await (await s.get(d_url + "/pdkv/info")).json()
                base = {"prompt": PROMPTS[1], "temperature": 0, "ignore_eos": True, "return_token_ids": True}
                p = await (
                    await s.post(
                        p_url + "/v1/completions",
                        json={
                            **base,
                            "max_tokens": 1,
                            "kv_transfer_params": {
                                "do_remote_decode": True,
                                "remote_host": info["remote_host"],
                                "remote_port": info["remote_port"],
                                "transfer_id": "dies",
                            },
                        },
                    )
                ).json()
                d = await (
                    await s.post(
                        d_url + "/v1/completions",
                        json={**base, "max_tokens": 16, "kv_transfer_params": p["kv_transfer_params"]},
                    )
                ).json()
                assert d["choices"][0]["token_ids"] == expected[1]
                metrics = await (await s.get(d_url + "/metrics")).text()
            assert metric(metrics, "pdkv_fallbacks_total", reason="transfer_failed") == 1
            assert metric(metrics, "pdkv_prompt_tokens_total", source="transferred") == 0
            assert d_worker.receiver is not None and d_worker.receiver.stats()["leases_expired"] == 1
            wait_until(  # free, or in P's pool (held between requests, not leaked)
                lambda: d_worker.engine.allocator.num_free + d_worker.kv_role.stats()["pooled_blocks"] == start_free,
                what="every decode block to be free",
            )
        finally:
            await p_runner.cleanup()
            await d_runner.cleanup()

    asyncio.run(scenario())


def test_health_reports_an_engine_that_stopped_making_progress(model_dir: Path) -> None:
    """/health is 503 while the engine has work and finished no step for stall_timeout_s (a hung kernel, a
    wedged device): the router's probes then route around the worker. Idle is not stalled."""

    async def scenario() -> None:
        w = Worker(
            convert_config({"role": "decode", "stall_timeout_s": 0.3, "num_blocks": 64}),
            ReferenceEngine.load(str(model_dir), progress=False),
        )
        hung, release, real_prefill = threading.Event(), threading.Event(), w.engine.prefill

        def hung_prefill(*args: Any) -> Any:
            hung.set()
            release.wait(30)  # the step hangs until the test lets it go
            return real_prefill(*args)

        w.engine.prefill = hung_prefill  # type: ignore[method-assign]
        runner, url = await serve_worker(w)
        try:
            async with aiohttp.ClientSession() as s:
                await asyncio.sleep(0.5)
                assert (await s.get(url + "/health")).status == 200  # idle for longer than stall_timeout_s: fine
                generation = asyncio.ensure_future(
                    s.post(url + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 2})
                )
                await asyncio.to_thread(hung.wait, 30)
                await asyncio.sleep(0.5)
                stalled = await s.get(url + "/health")
                assert stalled.status == 503 and "engine stalled" in (await stalled.json())["status"]
                release.set()
                assert (await generation).status == 200
                assert (await s.get(url + "/health")).status == 200
        finally:
            release.set()
            await runner.cleanup()

    asyncio.run(scenario())


def test_decode_never_adopts_kv_computed_for_another_prompt(model_dir: Path, expected: dict[int, list[int]]) -> None:
    """Issue 17's repro: P prefills prompt A (its Reserve carries A's key); a decode request for prompt B of the
    same length names A's transfer. D must compute B itself, never continue A's KV, and leak nothing."""

    async def scenario() -> None:
        settings = {"channel": {"name": "tcp"}, "num_blocks": 256, "transfer": {"chunk_size": CHUNK}}
        p_worker = Worker(
            convert_config({**settings, "role": "prefill"}), ReferenceEngine.load(str(model_dir), progress=False)
        )
        d_worker = Worker(
            convert_config({**settings, "role": "decode"}), ReferenceEngine.load(str(model_dir), progress=False)
        )
        start_free = d_worker.engine.allocator.num_free
        p_runner, p_url = await serve_worker(p_worker)
        d_runner, d_url = await serve_worker(d_worker)
        other = [(t * 7 + 3) % 290 + 5 for t in PROMPTS[0]]  # prompt B: as long as A, other tokens
        try:
            async with aiohttp.ClientSession() as s:
                info = await (await s.get(d_url + "/pdkv/info")).json()
                base = {"temperature": 0, "ignore_eos": True, "return_token_ids": True, "max_tokens": 16}
                want = await (await s.post(d_url + "/v1/completions", json={**base, "prompt": other})).json()
                p = await (
                    await s.post(
                        p_url + "/v1/completions",
                        json={
                            **base,
                            "prompt": PROMPTS[0],
                            "max_tokens": 1,
                            "kv_transfer_params": {
                                "do_remote_decode": True,
                                "remote_host": info["remote_host"],
                                "remote_port": info["remote_port"],
                                "transfer_id": "a",
                            },
                        },
                    )
                ).json()
                d = await (
                    await s.post(
                        d_url + "/v1/completions",
                        json={**base, "prompt": other, "kv_transfer_params": p["kv_transfer_params"]},
                    )
                ).json()
                metrics = await (await s.get(d_url + "/metrics")).text()
            assert p["kv_transfer_params"]["transfer_started"] is True
            assert d["choices"][0]["token_ids"] == want["choices"][0]["token_ids"] != expected[0]
            assert metric(metrics, "pdkv_fallbacks_total", reason="prompt_mismatch") == 1
            assert metric(metrics, "pdkv_prompt_tokens_total", source="transferred") == 0
            assert metric(metrics, "pdkv_transfer_events_total", event="prompt_mismatches") == 1
            wait_until(  # free, or in P's pool (held between requests, not leaked)
                lambda: d_worker.engine.allocator.num_free + d_worker.kv_role.stats()["pooled_blocks"] == start_free,
                what="every decode block to be free",
            )
        finally:
            await p_runner.cleanup()
            await d_runner.cleanup()

    asyncio.run(scenario())
