"""The short cuts of a P/D request's path keep its behaviour (issue 28: the PD overhead on short prompts).

What a short prompt no longer pays for: a full collection over start-up's objects (frozen), the hop to
a parser thread for a short body, the hop to a waiting thread for its KV, landed or still on its way. Each test
shows the short cut is taken where it should be, and that what comes out is what the long way gave.
"""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import weakref
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from pdkv.config import TransferConfig, convert_config
from pdkv.engine.reference import ReferenceEngine
from pdkv.engine.sampling import SamplingParams
from pdkv.errors import NotAnnouncedError, PromptMismatchError, TransferError
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


def _no_wait(*_: Any, **__: Any) -> Any:
    raise AssertionError("the decode side waited on a thread for its KV")


def test_claim_waits_for_kv_on_the_event_loop_and_gives_up_as_wait_does(make_pair: MakePair) -> None:
    """``claim`` takes KV that is still on its way without a thread (``wait`` made to fail), once, only for its
    prompt; a claim that is never announced ends after ``announce_timeout_s``, and a cancelled one cancels its
    transfer: nothing leaks either way."""
    pair = make_pair(config=TransferConfig(announce_timeout_s=0.3))
    pair.receiver.wait = _no_wait  # type: ignore[method-assign]

    async def scenario() -> None:
        claiming = asyncio.ensure_future(pair.receiver.claim("r1", 10, b"K" * 16))
        await asyncio.sleep(0.05)
        assert not claiming.done()  # not announced yet: waiting on the loop
        xfer = pair.sender.open("r1", pair.receiver.address, 40, list(range(3)), prompt_key=b"K" * 16)
        xfer.send_all()
        got = await asyncio.wait_for(claiming, 10)  # woken by the book, not by the 10 s timeout
        assert got.num_tokens == 40 and got.prompt_key == b"K" * 16
        pair.allocator.free(got.blocks)
        xfer.wait(10)
        with pytest.raises(TransferError, match="claimed"):  # handed over once, as ``wait`` does
            await pair.receiver.claim("r1", 1)
        xfer = pair.sender.open("r2", pair.receiver.address, 40, list(range(3)), prompt_key=b"K" * 16)
        xfer.send_all()
        xfer.wait(10)
        with pytest.raises(PromptMismatchError):  # another prompt's KV is freed, never handed over
            await pair.receiver.claim("r2", 10, b"Q" * 16)
        with pytest.raises(NotAnnouncedError):
            await asyncio.wait_for(pair.receiver.claim("r3", 10), 5)
        claiming = asyncio.ensure_future(pair.receiver.claim("r4", 10))
        await asyncio.sleep(0.05)
        claiming.cancel()
        with pytest.raises(asyncio.CancelledError):
            await claiming
        # a thread holds the book (as one landing a chunk does): the loop goes on, the claim waits for it
        xfer = pair.sender.open("r5", pair.receiver.address, 40, list(range(3)), prompt_key=b"K" * 16)
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
            claiming = asyncio.ensure_future(pair.receiver.claim("r5", 10, b"K" * 16))
            # the loop is free while the book is held: were the claim to block on the lock, this sleep would end
            # only once the holder gave up (10 s), with the claim done by then
            await asyncio.sleep(0.1)
            assert not claiming.done()
        finally:
            release.set()
            holder.join(10)
        got = await asyncio.wait_for(claiming, 10)
        assert got.num_tokens == 40
        pair.allocator.free(got.blocks)
        assert not pair.receiver.book.lock.wakers  # every claim took its waker away

    asyncio.run(scenario())
    assert "r4" in pair.receiver.book.gone  # the cancelled claim's transfer: a sender opening it now is refused
    assert pair.held_blocks() == 0  # every block free, or in the sender's pool


def _expected(model_dir: Path, max_tokens: int) -> list[int]:
    engine = ReferenceEngine.load(str(model_dir), progress=False)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return list(engine.generate(PROMPT, params).output_token_ids)


@pytest.mark.parametrize(
    ("decode_first", "waiting"),
    [(False, 0), (True, 0), (True, 8)],
    ids=["kv-landed-first", "decode-request-first", "behind-8-waiting"],
)
def test_decode_claims_its_kv_on_its_event_loop(model_dir: Path, decode_first: bool, waiting: int) -> None:
    """D adopts the transferred KV without ever calling the blocking ``wait`` (made to fail here), whether the KV
    landed before the decode request came or the request came first and waited for it (not even announced yet),
    and decodes the same tokens as one engine doing it all.

    ``waiting``: that many decode requests already wait for transfers no prefill worker will announce. Each
    used to hold a thread of the event loop's default executor (6 on two cores) until it gave up, so whatever
    came behind them on that executor (another request's wait; here P's too, which shares this loop) waited for
    their ``announce_timeout_s`` (30 s here)."""
    expected = _expected(model_dir, 8)

    async def scenario() -> None:
        p_worker = Worker(
            convert_config({**SETTINGS, "role": "prefill"}), ReferenceEngine.load(str(model_dir), progress=False)
        )
        d_settings = {**SETTINGS, "transfer": {**SETTINGS["transfer"], "announce_timeout_s": 30}}
        d_worker = Worker(
            convert_config({**d_settings, "role": "decode"}), ReferenceEngine.load(str(model_dir), progress=False)
        )
        assert d_worker.receiver is not None

        d_worker.receiver.wait = _no_wait  # type: ignore[method-assign]
        p_runner, p_url = await serve_worker(p_worker)
        d_runner, d_url = await serve_worker(d_worker)
        try:
            async with aiohttp.ClientSession() as s:
                info = await (await s.get(d_url + "/pdkv/info")).json()
                base = {"prompt": PROMPT, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
                push = {"do_remote_decode": True, "remote_host": info["remote_host"]}
                push.update(remote_port=info["remote_port"], transfer_id="t")

                async def decode(kv: dict[str, Any]) -> list[int]:
                    d = await s.post(
                        d_url + "/v1/completions", json={**base, "max_tokens": 8, "kv_transfer_params": kv}
                    )
                    assert d.status == 200, await d.text()
                    return list((await d.json())["choices"][0]["token_ids"])

                stuck = [
                    asyncio.ensure_future(decode({"do_remote_prefill": True, "transfer_id": f"never-{i}"}))
                    for i in range(waiting)
                ]
                await asyncio.sleep(0.2 if waiting else 0)
                early = None
                if decode_first:  # D's params as P will answer them, sent before P has even reserved the transfer
                    kv = {"do_remote_prefill": True, "transfer_id": "t", "first_token_id": expected[0]}
                    early = asyncio.ensure_future(decode(kv))
                    await asyncio.sleep(0.2)
                    assert not early.done()
                p = await (
                    await s.post(p_url + "/v1/completions", json={**base, "max_tokens": 1, "kv_transfer_params": push})
                ).json()
                assert p["kv_transfer_params"]["transfer_started"] is True
                assert p["kv_transfer_params"]["first_token_id"] == expected[0]
                if early is not None:
                    assert await asyncio.wait_for(early, 60) == expected
                    # done while those in front still wait: not behind their 30 s (each held an executor thread)
                    assert not any(task.done() for task in stuck)
                    for task in stuck:
                        task.cancel()
                else:
                    wait_until(lambda: p_worker._stat("open_transfers") == 0, what="P's transfer to settle (KV landed)")
                    assert await decode(p["kv_transfer_params"]) == expected
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


def test_a_streamed_answer_lets_the_engine_step_on_once_its_first_token_is_sent(model_dir: Path) -> None:
    """The worker sets the job's ``first_out`` once the first event is written: with ``first_token_yield_s`` at
    600 s, a streamed answer of 4 tokens whose engine waited out the bound instead would outlast the client's 60 s
    timeout."""
    expected = _expected(model_dir, 4)
    jobs: list[Any] = []

    async def scenario() -> None:
        config = convert_config({**SETTINGS, "role": "decode", "first_token_yield_s": 600})
        worker = Worker(config, ReferenceEngine.load(str(model_dir), progress=False))
        submit = worker.loop.submit
        worker.loop.submit = lambda job: (jobs.append(job), submit(job))[1]  # type: ignore[method-assign]
        runner, url = await serve_worker(worker)
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
                body = {"prompt": PROMPT, "temperature": 0, "ignore_eos": True, "max_tokens": 4, "stream": True}
                resp = await s.post(url + "/v1/completions", json={**body, "return_token_ids": True})
                assert resp.status == 200
                tokens = []
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        tokens += json.loads(line[6:])["choices"][0]["token_ids"]
            assert tokens == expected
            assert len(jobs) == 1 and jobs[0].first_out is not None and jobs[0].first_out.is_set()
        finally:
            await runner.cleanup()

    asyncio.run(scenario())
