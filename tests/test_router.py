"""The router in front of real pdkv workers (tiny model, tcp channel), driven by the official openai client.

One set of worker processes serves the whole module: two prefill and two
decode workers behind a ``pdkv launch --role router`` process, plus a
spare prefill worker that a test registers at run time and then kills, and
one that a test registers and then freezes (SIGSTOP). The oracle is a
decode worker answering the same request alone.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import yaml
from aiohttp import web

from pdkv.config import convert_config
from pdkv.engine.reference import ReferenceEngine
from pdkv.testing.http import get_text as get
from pdkv.testing.http import metric
from pdkv.testing.model import write_tiny_model
from pdkv.testing.procs import WorkerProcess, start_worker
from pdkv.worker.server import Worker

from tests.conftest import wait_until
from tests.test_router_units import FakeWorker, answering, router_metric, wait_for
from tests.test_router_units import cluster as router_over

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. " * 3,  # about 3 chunks of 32 tokens
    "Paris is the capital of France, Berlin of Germany and Rome of Italy. 0123456789",
    "A key-value cache moves from the prefill worker to the decode worker, chunk by chunk. " * 2,
    "Prefill computes the prompt; decode generates one token at a time.",
]
GREEDY = {"temperature": 0, "max_tokens": 16, "extra_body": {"ignore_eos": True, "return_token_ids": True}}
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # a tiny model gains nothing from threads; five processes share two cores


@dataclass
class Cluster:
    router: WorkerProcess
    prefill: list[WorkerProcess]
    decode: list[WorkerProcess]
    spare: WorkerProcess  # a prefill worker the router does not know yet
    frozen: WorkerProcess  # another one, for the test that SIGSTOPs it
    model: Path

    def client(self, url: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=(url or self.router.url) + "/v1", api_key="unused", max_retries=0, timeout=120)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.router.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def admin(method: str, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"}, method=method)
    with urllib.request.urlopen(req, timeout=30) as resp:
        return resp.status, json.loads(resp.read())


def total(workers: list[WorkerProcess], name: str, **labels: str) -> float:
    return sum(metric(get(w.url + "/metrics"), name, **labels) for w in workers)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("router")
    model = write_tiny_model(tmp / "tiny")
    worker_cfg = tmp / "worker.yaml"
    worker_cfg.write_text(
        yaml.safe_dump(
            {
                "model": str(model),
                "channel": {"name": "tcp"},
                "num_blocks": 512,
                # short lease and drain: a killed prefill worker's reservations go in seconds
                "transfer": {
                    "chunk_size": 32,
                    "transfer_timeout_s": 30,
                    "lease_s": 2,
                    "heartbeat_s": 0.5,
                    "drain_timeout_s": 2,
                },
            }
        )
    )
    with ThreadPoolExecutor(6) as pool:
        roles = ("prefill", "prefill", "prefill", "prefill", "decode", "decode")
        futures = [
            pool.submit(start_worker, role, "--config", str(worker_cfg), "--port", "0", timeout=180, env=ONE_THREAD)
            for role in roles
        ]
        procs = [f.result() for f in futures]
    p1, p2, spare, frozen, d1, d2 = procs
    router_cfg = tmp / "router.yaml"
    # No background health checks during the module: a dead worker must be found by the requests themselves.
    router_cfg.write_text(
        yaml.safe_dump(
            {
                "router": {
                    "policy": "round-robin",
                    "health_interval_s": 600,
                    "max_retries": 2,
                    "prefill_timeout_s": 60,
                    "decode_timeout_s": 120,
                }
            }
        )
    )
    router = start_worker(
        "router",
        "--config",
        str(router_cfg),
        "--port",
        "0",
        "--prefill",
        p1.url,
        "--prefill",
        p2.url,
        "--decode",
        d1.url,
        "--decode",
        d2.url,
        timeout=60,
    )
    try:
        yield Cluster(router, [p1, p2], [d1, d2], spare, frozen, model)
    finally:
        for proc in (router, *procs):
            proc.stop()


@pytest.fixture(scope="module")
def expected(cluster: Cluster) -> dict[str, list[int]]:
    """Each prompt's greedy tokens from a decode worker alone, no router, no transfer."""
    direct = cluster.client(cluster.decode[0].url)
    return {p: direct.completions.create(model="tiny", prompt=p, **GREEDY).choices[0].token_ids for p in PROMPTS}


@pytest.fixture(scope="module")
def prompt_tokens(cluster: Cluster) -> dict[str, int]:
    """Each prompt's length in tokens."""
    direct = cluster.client(cluster.decode[0].url)
    return {p: direct.completions.create(model="tiny", prompt=p, max_tokens=1).usage.prompt_tokens for p in PROMPTS}


class KVSources:
    """Where the decode workers' prompt KV came from, counted between ``__init__`` and ``assert_all_transferred``.

    Token equality alone cannot tell a transfer from a decode worker that
    silently recomputed the prompt (the same tokens, only slower).
    """

    def __init__(self, cluster: Cluster) -> None:
        self.decode = cluster.decode
        self.before = self.read()

    def read(self) -> dict[str, float]:
        return {
            "transferred": total(self.decode, "pdkv_prompt_tokens_total", source="transferred"),
            "recomputed": total(self.decode, "pdkv_prompt_tokens_total", source="computed")
            + total(self.decode, "pdkv_prompt_tokens_total", source="tier"),
            "fallbacks": total(self.decode, "pdkv_fallbacks_total"),
        }

    def delta(self) -> dict[str, float]:
        now = self.read()
        return {k: now[k] - self.before[k] for k in now}

    def assert_all_transferred(self, prompt_tokens: int) -> None:
        assert self.delta() == {"transferred": prompt_tokens, "recomputed": 0, "fallbacks": 0}


def stream_tokens(chunks: Any) -> tuple[list[int], str]:
    ids, text = [], []
    for chunk in chunks:
        for choice in chunk.choices:
            ids.extend(choice.token_ids)
            text.append(choice.text)
    return ids, "".join(text)


def test_streamed_and_whole_answers_through_the_router_match_decode_alone(
    cluster: Cluster, expected: dict[str, list[int]], prompt_tokens: dict[str, int]
) -> None:
    router, direct = cluster.client(), cluster.client(cluster.decode[0].url)
    texts = {p: direct.completions.create(model="tiny", prompt=p, **GREEDY).choices[0].text for p in PROMPTS[:2]}
    streamed_texts = {
        p: stream_tokens(direct.completions.create(model="tiny", prompt=p, stream=True, **GREEDY))[1]
        for p in PROMPTS[:2]
    }
    sources = KVSources(cluster)
    for prompt in PROMPTS[:2]:
        whole = router.completions.create(model="tiny", prompt=prompt, **GREEDY)
        assert whole.choices[0].token_ids == expected[prompt]
        assert whole.choices[0].text == texts[prompt]
        ids, text = stream_tokens(router.completions.create(model="tiny", prompt=prompt, stream=True, **GREEDY))
        assert ids == expected[prompt]
        assert text == streamed_texts[prompt]
    sources.assert_all_transferred(2 * sum(prompt_tokens[p] for p in PROMPTS[:2]))  # the KV really moved, every time
    text = get(cluster.router.url + "/metrics")
    assert (
        metric(text, "pdkv_ttft_seconds_count", role="router") >= 2
        and metric(text, "pdkv_router_picks_total", role="prefill") >= 4
    )


def test_chat_stays_chat_through_the_router(cluster: Cluster) -> None:
    router, direct = cluster.client(), cluster.client(cluster.decode[1].url)
    messages = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Which city is the capital of France?"},
    ]
    tools = [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "description": "look a city up",
                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
            },
        }
    ]
    args = {"model": "tiny", "messages": messages, "tools": tools, **GREEDY}
    alone = direct.chat.completions.create(**args)
    sources = KVSources(cluster)
    via = router.chat.completions.create(**args)
    assert via.object == "chat.completion" and via.choices[0].message.role == "assistant"
    assert (
        via.choices[0].token_ids == alone.choices[0].token_ids
        and via.choices[0].message.content == alone.choices[0].message.content
    )
    chunks = list(router.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    # one answer, though P sent its first chunk and D the rest: one id, and the role said once, first
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert [ch.delta.role for c in chunks for ch in c.choices] == ["assistant"] + [None] * 15
    assert [t for c in chunks for ch in c.choices for t in ch.token_ids] == alone.choices[0].token_ids
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16
    assert via.usage is not None and via.usage.prompt_tokens == alone.usage.prompt_tokens
    sources.assert_all_transferred(2 * via.usage.prompt_tokens)
    assert [m.id for m in router.models.list().data] == ["tiny"]


def test_a_streamed_answer_starts_with_ps_token_and_reads_as_one_workers_answer(
    cluster: Cluster, prompt_tokens: dict[str, int]
) -> None:
    """P's first event goes to the client (``router.stream_first_token``), D's carry on the same answer: tokens,
    text, log-probabilities and their text offsets, finish reasons, usage and the id are one worker's, while the
    decode worker still adopted the transferred KV (it did not recompute the prompt)."""
    router, direct = cluster.client(), cluster.client(cluster.decode[0].url)
    prompt = PROMPTS[1]
    args = {"model": "tiny", "prompt": prompt, "stream": True, "logprobs": 2, **GREEDY}
    args["stream_options"] = {"include_usage": True}
    alone = list(direct.completions.create(**args))
    handoffs = metric(get(cluster.router.url + "/metrics"), "pdkv_router_first_token_handoffs_total")
    sources = KVSources(cluster)
    via = list(router.completions.create(**args))
    sources.assert_all_transferred(prompt_tokens[prompt])
    assert metric(get(cluster.router.url + "/metrics"), "pdkv_router_first_token_handoffs_total") == handoffs + 1
    assert len({c.id for c in via}) == 1 and len({c.created for c in via}) == 1

    def answer(chunks: list[Any]) -> dict[str, Any]:
        choices = [ch for c in chunks for ch in c.choices]
        return {
            "ids": [t for ch in choices for t in ch.token_ids],
            "text": "".join(ch.text for ch in choices),
            "finish": [ch.finish_reason for ch in choices],
            "tokens": [t for ch in choices for t in ch.logprobs.tokens],
            "offsets": [o for ch in choices for o in ch.logprobs.text_offset],
            "usage": chunks[-1].usage,
        }

    got, want = answer(via), answer(alone)
    assert got == want and want["finish"] == [None] * 15 + ["length"]
    logprobs = [lp for c in via for ch in c.choices for lp in ch.logprobs.token_logprobs]
    assert logprobs == pytest.approx([lp for c in alone for ch in c.choices for lp in ch.logprobs.token_logprobs])


def test_a_one_token_streamed_answer_is_ps_token_and_ds_finish(cluster: Cluster, prompt_tokens: dict[str, int]) -> None:
    """The answer ends at P's token: the client gets it from P, then the finish reason from D, and nothing twice."""
    args = {"model": "tiny", "prompt": PROMPTS[3], "stream": True, "temperature": 0, "max_tokens": 1}
    args["extra_body"] = {"return_token_ids": True}
    alone = list(cluster.client(cluster.decode[1].url).completions.create(**args))
    sources = KVSources(cluster)
    via = list(cluster.client().completions.create(**args))
    sources.assert_all_transferred(prompt_tokens[PROMPTS[3]])
    ids = [[t for c in chunks for ch in c.choices for t in getattr(ch, "token_ids", [])] for chunks in (alone, via)]
    texts = ["".join(ch.text for c in chunks for ch in c.choices) for chunks in (alone, via)]
    assert ids[0] == ids[1] and len(ids[0]) == 1 and texts[0] == texts[1]
    assert [ch.finish_reason for c in via for ch in c.choices] == [None, "length"]


class ForwardingDecode(FakeWorker):
    """A decode stand-in that names a real decode worker's receiver (P pushes there) and fails every decode hop;
    the router's cancel of its transfer is passed on to that worker, so the reservation is freed as it would be."""

    def __init__(self, real: WorkerProcess) -> None:
        info = json.loads(get(real.url + "/pdkv/info"))
        super().__init__("decode", answering(503, "no room"), info={k: info[k] for k in ("remote_host", "remote_port")})
        self.real = real

    async def _cancel(self, http: web.Request) -> web.Response:
        async with aiohttp.ClientSession() as s:
            await s.delete(f"{self.real.url}/pdkv/transfers/{http.match_info['tid']}")
        return await super()._cancel(http)


def test_a_decode_worker_failing_after_ps_token_is_replaced_and_the_answer_is_still_one_workers(
    cluster: Cluster, expected: dict[str, list[int]]
) -> None:
    """The client has P's token when its decode worker fails (a 503 before its first event): the next decode
    worker computes the prompt (the KV went to the failed one) and continues from P's token, so the answer is
    the one a worker alone gives; the transfer nobody claims is cancelled."""
    real = cluster.decode[0]
    prompt = PROMPTS[2]

    async def scenario() -> None:
        failing = ForwardingDecode(real)
        async with router_over([cluster.prefill[0].url], [failing, real.url], max_retries=2) as (url, router):
            fallbacks = total([real], "pdkv_fallbacks_total", reason="not_started")
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
                chunks = [
                    c async for c in await client.completions.create(model="tiny", prompt=prompt, stream=True, **GREEDY)
                ]
            assert [t for c in chunks for ch in c.choices for t in ch.token_ids] == expected[prompt]
            assert len({c.id for c in chunks}) == 1 and len(failing.requests) == 1
            assert router_metric(router, "pdkv_router_first_token_handoffs_total") == 1
            assert router_metric(router, "pdkv_router_retries_total", hop="decode", reason="http_503") == 1
            assert total([real], "pdkv_fallbacks_total", reason="not_started") == fallbacks + 1
            tid = failing.requests[0]["kv_transfer_params"]["transfer_id"]
            await wait_for(lambda: failing.cancelled_transfers == [tid], "the unclaimed transfer's cancel")

    asyncio.run(scenario())
    wait_until(lambda: total([real], "pdkv_reservations") == 0, 30, "the unclaimed transfer to be freed")


def test_32_concurrent_requests_succeed_and_leave_no_reservation(
    cluster: Cluster, expected: dict[str, list[int]], prompt_tokens: dict[str, int]
) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> list[int]:
        prompt = PROMPTS[i % len(PROMPTS)]
        if i % 2:
            ids: list[int] = []
            async for chunk in await client.completions.create(model="tiny", prompt=prompt, stream=True, **GREEDY):
                ids.extend(t for choice in chunk.choices for t in choice.token_ids)
            return ids
        return (await client.completions.create(model="tiny", prompt=prompt, **GREEDY)).choices[0].token_ids

    async def run() -> list[list[int]]:
        async with cluster.async_client() as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    sources = KVSources(cluster)
    results = asyncio.run(run())
    assert results == [expected[PROMPTS[i % len(PROMPTS)]] for i in range(32)]
    sources.assert_all_transferred(sum(prompt_tokens[PROMPTS[i % len(PROMPTS)]] for i in range(32)))
    for d in cluster.decode:
        wait_until(
            lambda d=d: metric(get(d.url + "/metrics"), "pdkv_reservations") == 0, 30, f"{d.url} to hold no reservation"
        )
        assert metric(get(d.url + "/metrics"), "pdkv_reserved_blocks") == 0
    listing = json.loads(get(cluster.router.url + "/pdkv/workers"))
    assert all(w["inflight_requests"] == 0 and w["healthy"] for role in ("prefill", "decode") for w in listing[role])


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_client_that_hangs_up_cancels_both_sides(cluster: Cluster, stream: bool) -> None:
    everyone = [*cluster.decode, *cluster.prefill]
    ok_before = total(cluster.decode, "pdkv_requests_total", outcome="ok")
    cancelled_before = metric(get(cluster.router.url + "/metrics"), "pdkv_requests_total", outcome="cancelled")

    async def hang_up() -> None:
        async with aiohttp.ClientSession() as s:
            body = {
                "model": "tiny",
                "prompt": PROMPTS[0],
                "max_tokens": 400,
                "ignore_eos": True,
                "temperature": 0,
                "stream": stream,
            }
            request = asyncio.ensure_future(s.post(cluster.router.url + "/v1/completions", json=body))
            if stream:
                assert (await (await request).content.readline()).startswith(
                    b"data: "
                )  # the decode worker is generating
            else:  # nothing comes back before the end: watch the decode workers start instead
                await asyncio.to_thread(
                    wait_until,
                    lambda: total(cluster.decode, "pdkv_running_requests") > 0,
                    60,
                    "the decode worker to start",
                )
            request.cancel()
            if stream:
                (await request).close()

    asyncio.run(hang_up())
    wait_until(lambda: total(everyone, "pdkv_running_requests") == 0, 30, "every worker to stop the request")
    wait_until(
        lambda: total(cluster.decode, "pdkv_reservations") == 0 and total(cluster.prefill, "pdkv_open_transfers") == 0,
        30,
        "transfers to settle",
    )
    assert (
        total(cluster.decode, "pdkv_requests_total", outcome="ok") == ok_before
    )  # cancelled, not generated to the end
    wait_until(
        lambda: (
            metric(get(cluster.router.url + "/metrics"), "pdkv_requests_total", outcome="cancelled")
            == cancelled_before + 1
        ),
        10,
        "the router to count it cancelled",
    )


def test_a_prefill_worker_killed_mid_run_costs_no_request(
    cluster: Cluster, expected: dict[str, list[int]], prompt_tokens: dict[str, int]
) -> None:
    spare = cluster.spare
    status, added = admin("POST", cluster.router.url + "/pdkv/workers", {"role": "prefill", "url": spare.url})
    assert status == 201 and added["worker"]["healthy"] is True

    async def one(client: openai.AsyncOpenAI, i: int) -> list[int]:
        prompt = PROMPTS[i % len(PROMPTS)]
        return (await client.completions.create(model="tiny", prompt=prompt, **GREEDY)).choices[0].token_ids

    async def killed_mid_run() -> list[list[int]]:
        async with cluster.async_client() as client:
            tasks = [asyncio.ensure_future(one(client, i)) for i in range(12)]
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            await asyncio.to_thread(spare.kill)  # SIGKILL, mid-run: no goodbye to anyone
            return await asyncio.gather(*tasks)

    async def afterwards() -> list[list[int]]:
        async with cluster.async_client() as client:
            return [await one(client, i) for i in range(6)]

    sources = KVSources(cluster)
    assert asyncio.run(killed_mid_run()) == [expected[PROMPTS[i % len(PROMPTS)]] for i in range(12)]
    # A request whose KV the dead worker was still pushing is recomputed on D (a counted fallback); every other
    # one's KV came over the channel: no prompt is lost, none is counted twice.
    moved, lengths = sources.delta(), [prompt_tokens[PROMPTS[i % len(PROMPTS)]] for i in range(12)]
    assert moved["transferred"] + moved["recomputed"] == sum(lengths)
    assert moved["fallbacks"] * min(lengths) <= moved["recomputed"] <= moved["fallbacks"] * max(lengths)
    sources = KVSources(cluster)
    assert asyncio.run(afterwards()) == [expected[PROMPTS[i % len(PROMPTS)]] for i in range(6)]
    sources.assert_all_transferred(
        sum(prompt_tokens[PROMPTS[i % len(PROMPTS)]] for i in range(6))
    )  # the router no longer picks the dead one
    text = get(cluster.router.url + "/metrics")
    assert metric(text, "pdkv_router_retries_total", hop="prefill") >= 1
    listing = json.loads(get(cluster.router.url + "/pdkv/workers"))
    assert {w["url"]: w["healthy"] for w in listing["prefill"]}[spare.url] is False
    for d in cluster.decode:
        wait_until(
            lambda d=d: metric(get(d.url + "/metrics"), "pdkv_reserved_blocks") == 0,
            30,
            f"{d.url} to free the dead worker's reservations",
        )
    status, _ = admin("DELETE", cluster.router.url + "/pdkv/workers", {"role": "prefill", "url": spare.url})
    assert status == 200
    assert spare.url not in [w["url"] for w in json.loads(get(cluster.router.url + "/pdkv/workers"))["prefill"]]


def test_a_frozen_prefill_worker_is_routed_around_within_seconds(
    cluster: Cluster, expected: dict[str, list[int]]
) -> None:
    """A prefill worker SIGSTOPped with requests on it: they are retried elsewhere within seconds, not after
    prefill_timeout_s (60 s here), new requests skip it, and the KV of every answer still moved."""
    frozen = cluster.frozen
    status, added = admin("POST", cluster.router.url + "/pdkv/workers", {"role": "prefill", "url": frozen.url})
    assert status == 201 and added["worker"]["healthy"] is True
    transferred, fallbacks = (
        total(cluster.decode, "pdkv_prompt_tokens_total", source="transferred"),
        total(cluster.decode, "pdkv_fallbacks_total"),
    )
    os.kill(frozen.proc.pid, signal.SIGSTOP)
    try:

        async def timed(client: openai.AsyncOpenAI, i: int) -> tuple[list[int], int, float]:
            started = time.monotonic()
            answer = await client.completions.create(model="tiny", prompt=PROMPTS[i % len(PROMPTS)], **GREEDY)
            return answer.choices[0].token_ids, answer.usage.prompt_tokens, time.monotonic() - started

        async def run(n: int) -> list[tuple[list[int], int, float]]:
            async with cluster.async_client() as client:
                return await asyncio.gather(*(timed(client, i) for i in range(n)))

        first = asyncio.run(run(6))  # round robin over three prefill workers: two of these wait on the frozen one
        text = get(cluster.router.url + "/metrics")
        assert metric(text, "pdkv_router_retries_total", hop="prefill", reason="unhealthy") >= 1
        picks = metric(text, "pdkv_router_picks_total", role="prefill", worker=frozen.url)
        listing = json.loads(get(cluster.router.url + "/pdkv/workers"))
        assert {w["url"]: w["healthy"] for w in listing["prefill"]}[frozen.url] is False
        later = asyncio.run(run(3))
        assert (
            metric(get(cluster.router.url + "/metrics"), "pdkv_router_picks_total", role="prefill", worker=frozen.url)
            == picks
        )  # skipped
    finally:
        os.kill(frozen.proc.pid, signal.SIGCONT)
    assert [ids for ids, _, _ in first + later] == [expected[PROMPTS[i % len(PROMPTS)]] for i in [*range(6), *range(3)]]
    assert (
        max(seconds for _, _, seconds in first + later) < 30
    )  # a request that waited for the frozen worker's hop timeout took 60 s
    assert total(cluster.decode, "pdkv_prompt_tokens_total", source="transferred") == transferred + sum(
        n for _, n, _ in first + later
    )
    assert total(cluster.decode, "pdkv_fallbacks_total") == fallbacks
    for (
        d
    ) in cluster.decode:  # the transfers the frozen worker had opened were cancelled, and it woke up to find them gone
        wait_until(
            lambda d=d: metric(get(d.url + "/metrics"), "pdkv_reserved_blocks") == 0,
            30,
            f"{d.url} to hold no reservation",
        )
    wait_until(
        lambda: metric(get(frozen.url + "/metrics"), "pdkv_running_requests") == 0,
        30,
        "the thawed worker to drop the abandoned requests",
    )
    assert admin("DELETE", cluster.router.url + "/pdkv/workers", {"role": "prefill", "url": frozen.url})[0] == 200


def test_a_prefill_cancelled_while_opening_its_transfer_frees_both_sides(cluster: Cluster) -> None:
    """The router's hop is cancelled while P is still reserving on D: P's blocks and D's reservation both come back.

    In-process workers, so the open can be slowed to make the cancel land inside it.
    """
    settings = {"channel": {"name": "tcp"}, "num_blocks": 64, "transfer": {"chunk_size": 32}}

    async def serve(worker: Worker) -> tuple[web.AppRunner, str]:
        runner = web.AppRunner(worker.app(), handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"

    async def scenario(model_dir: str) -> None:
        p = Worker(convert_config({**settings, "role": "prefill"}), ReferenceEngine.load(model_dir, progress=False))
        d = Worker(convert_config({**settings, "role": "decode"}), ReferenceEngine.load(model_dir, progress=False))
        assert p.sender is not None and d.receiver is not None
        opening, real_open = asyncio.Event(), p.sender.open
        loop = asyncio.get_running_loop()

        def slow_open(*args: Any) -> Any:
            loop.call_soon_threadsafe(opening.set)
            time.sleep(0.5)
            return real_open(*args)

        p.sender.open = slow_open  # type: ignore[method-assign]
        free_p, free_d = p.engine.allocator.num_free, d.engine.allocator.num_free
        (p_runner, p_url), (d_runner, d_url) = await serve(p), await serve(d)
        try:
            async with aiohttp.ClientSession() as s:
                info = await (await s.get(d_url + "/pdkv/info")).json()
                kv = {"do_remote_decode": True, "remote_host": info["remote_host"], "remote_port": info["remote_port"]}
                hop = asyncio.ensure_future(
                    s.post(
                        p_url + "/v1/completions",
                        json={"prompt": PROMPTS[0], "max_tokens": 1, "kv_transfer_params": {**kv, "transfer_id": "t1"}},
                    )
                )
                await opening.wait()
                hop.cancel()  # the router gave up on this hop (client gone, hop timeout)
                await asyncio.to_thread(
                    wait_until,
                    lambda: (
                        p.engine.allocator.num_free == free_p
                        and d.engine.allocator.num_free + d.receiver.stats()["pooled_blocks"] == free_d
                    ),  # or in P's pool
                    30,
                    "both sides to free the request",
                )
                assert d.receiver.stats()["reservations"] == 0 and p.sender.stats()["open_transfers"] == 0
                # DELETE /pdkv/transfers/ID, the router's cancel: a late prefill can no longer reserve that transfer.
                assert (await s.delete(d_url + "/pdkv/transfers/t2")).status == 200
                p.sender.open = real_open  # type: ignore[method-assign]
                late = await (
                    await s.post(
                        p_url + "/v1/completions",
                        json={"prompt": PROMPTS[0], "max_tokens": 1, "kv_transfer_params": {**kv, "transfer_id": "t2"}},
                    )
                ).json()
                assert late["kv_transfer_params"]["transfer_started"] is False
        finally:
            await p_runner.cleanup()
            await d_runner.cleanup()

    asyncio.run(scenario(str(cluster.model)))
