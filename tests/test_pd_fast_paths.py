"""The short cuts of a P/D request's path keep its behaviour (issue 28: the PD overhead on short prompts).

What a short prompt no longer pays for: a full collection over start-up's objects (frozen), the hop to
a parser thread for a short body, the hop to a waiting thread for KV that already landed. Each test
shows the short cut is taken where it should be, and that what comes out is what the long way gave.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from pdkv.config import convert_config
from pdkv.engine.reference import ReferenceEngine
from pdkv.engine.sampling import SamplingParams
from pdkv.errors import PromptMismatchError, TransferError
from pdkv.launch.main import freeze_startup_heap
from pdkv.testing.http import metric
from pdkv.worker import server
from pdkv.worker.server import INLINE_PARSE_BYTES, Worker

from tests.conftest import MakePair, serve_worker, wait_until

PROMPT = [(i * 37) % 300 + 3 for i in range(100)]  # 3 chunks of 32 and a partial one
SETTINGS = {"channel": {"name": "tcp"}, "num_blocks": 256, "transfer": {"chunk_size": 32}}


class _Node:
    """A collectable object (``object()`` is not tracked by the collector)."""

    ref: _Node | None = None


def test_freeze_startup_heap_collects_startups_garbage_and_takes_the_rest_out_of_every_collection() -> None:
    alive = _Node()
    cycle = _Node()
    cycle.ref = cycle  # garbage only a collection finds
    dead = weakref.ref(cycle)
    del cycle
    try:
        freeze_startup_heap()
        assert dead() is None  # collected, not frozen for the process's life
        assert gc.get_freeze_count() > 0
        assert not any(o is alive for o in gc.get_objects())  # no generation holds it: no collection walks it
    finally:
        gc.unfreeze()
    assert any(o is alive for o in gc.get_objects())


def test_try_claim_hands_over_landed_kv_and_never_blocks(make_pair: MakePair) -> None:
    pair = make_pair()
    assert pair.receiver.try_claim("r1") is None  # not announced: nothing yet, and nothing cancelled
    xfer = pair.sender.open("r1", pair.receiver.address, 40, list(range(3)), prompt_key=b"K" * 16)
    xfer.send_all()
    xfer.wait(10)
    held, release = threading.Event(), threading.Event()

    def hold_the_book() -> None:
        with pair.receiver.book.lock:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold_the_book)
    holder.start()
    held.wait(10)
    try:
        assert pair.receiver.try_claim("r1", b"K" * 16) is None  # the book is busy: None at once, no wait
    finally:
        release.set()
        holder.join(10)
    got = pair.receiver.try_claim("r1", b"K" * 16)
    assert got is not None and got.num_tokens == 40 and got.prompt_key == b"K" * 16
    pair.allocator.free(got.blocks)
    with pytest.raises(TransferError, match="claimed"):  # claimed once, as ``wait`` hands it over once
        pair.receiver.try_claim("r1")
    xfer = pair.sender.open("r2", pair.receiver.address, 40, list(range(3)), prompt_key=b"K" * 16)
    xfer.send_all()
    xfer.wait(10)
    with pytest.raises(PromptMismatchError):  # another prompt's KV is freed, never handed over
        pair.receiver.try_claim("r2", b"Q" * 16)
    assert pair.held_blocks() == 0  # every block free, or in the sender's pool


def _expected(model_dir: Path, max_tokens: int) -> list[int]:
    engine = ReferenceEngine.load(str(model_dir), progress=False)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return list(engine.generate(PROMPT, params).output_token_ids)


def test_decode_claims_kv_that_already_landed_on_its_event_loop(model_dir: Path) -> None:
    """The decode request comes after P's transfer settled: D adopts the transferred KV without ever calling the
    blocking ``wait`` (made to fail here), and decodes the same tokens as one engine doing it all."""
    expected = _expected(model_dir, 8)

    async def scenario() -> None:
        p_worker = Worker(
            convert_config({**SETTINGS, "role": "prefill"}), ReferenceEngine.load(str(model_dir), progress=False)
        )
        d_worker = Worker(
            convert_config({**SETTINGS, "role": "decode"}), ReferenceEngine.load(str(model_dir), progress=False)
        )
        assert d_worker.receiver is not None

        def no_wait(*_: Any, **__: Any) -> Any:
            raise AssertionError("the decode worker waited on a thread for KV that had landed")

        d_worker.receiver.wait = no_wait  # type: ignore[method-assign]
        p_runner, p_url = await serve_worker(p_worker)
        d_runner, d_url = await serve_worker(d_worker)
        try:
            async with aiohttp.ClientSession() as s:
                info = await (await s.get(d_url + "/pdkv/info")).json()
                base = {"prompt": PROMPT, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
                push = {"do_remote_decode": True, "remote_host": info["remote_host"]}
                push.update(remote_port=info["remote_port"], transfer_id="landed")
                p = await (
                    await s.post(p_url + "/v1/completions", json={**base, "max_tokens": 1, "kv_transfer_params": push})
                ).json()
                assert p["kv_transfer_params"]["transfer_started"] is True
                wait_until(lambda: p_worker._stat("open_transfers") == 0, what="P's transfer to settle (KV landed)")
                d = await s.post(
                    d_url + "/v1/completions",
                    json={**base, "max_tokens": 8, "kv_transfer_params": p["kv_transfer_params"]},
                )
                assert d.status == 200, await d.text()
                assert (await d.json())["choices"][0]["token_ids"] == expected
                metrics = await (await s.get(d_url + "/metrics")).text()
            assert metric(metrics, "pdkv_fallbacks_total") == 0
            assert metric(metrics, "pdkv_prompt_tokens_total", source="transferred") == len(PROMPT)
        finally:
            await p_runner.cleanup()
            await d_runner.cleanup()

    asyncio.run(scenario())


def test_a_short_body_is_parsed_on_the_event_loop_and_a_long_one_on_a_parser_thread(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = _expected(model_dir, 4)
    parsed_on: list[str] = []
    real_parse = server.api.parse_request

    def parse(*args: Any) -> Any:
        parsed_on.append(threading.current_thread().name)
        return real_parse(*args)

    monkeypatch.setattr(server.api, "parse_request", parse)

    async def scenario() -> None:
        worker = Worker(
            convert_config({**SETTINGS, "role": "decode"}), ReferenceEngine.load(str(model_dir), progress=False)
        )
        runner, url = await serve_worker(worker)
        body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        try:
            async with aiohttp.ClientSession() as s:
                # ``user`` changes nothing but the body's size
                for extra in ({}, {"user": "u" * INLINE_PARSE_BYTES}, {"prompt": "not a prompt", "max_tokens": 0}):
                    resp = await s.post(url + "/v1/completions", json={**body, **extra})
                    if "user" in extra or not extra:
                        assert resp.status == 200, await resp.text()
                        assert (await resp.json())["choices"][0]["token_ids"] == expected
                    else:  # a bad short body is refused as before, naming the field
                        assert resp.status == 400
                        assert (await resp.json())["error"]["param"] == "max_tokens"
        finally:
            await runner.cleanup()

    asyncio.run(scenario())
    assert parsed_on[0] == threading.main_thread().name
    assert parsed_on[1].startswith("pdkv-parse")
    assert parsed_on[2] == threading.main_thread().name
