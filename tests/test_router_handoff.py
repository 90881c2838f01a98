"""A streamed request's first token from the prefill worker (``router.stream_first_token``), against stand-ins.

The stand-in prefill worker streams what a pdkv prefill worker streams when told ``stream_first`` (its token's
event, its ``kv_transfer_params`` with ``first_event``, ``[DONE]``), so that every way the handoff can go wrong runs
here deterministically: a broken prefill stream, a decode worker that fails once the client has P's token, none
left, a refusal. The real workers' side (the same answer as one worker's, the KV moved) is in test_router.py; how
the workers render the two halves of one stream is at the end.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from pdkv.config import convert_config
from pdkv.engine.reference import ReferenceEngine
from pdkv.engine.sampling import SamplingParams
from pdkv.errors import UpstreamError
from pdkv.router.handoff import split_prefill_stream
from pdkv.router.policy import describe_prompt
from pdkv.router.pool import WorkerState
from pdkv.testing.http import metric
from pdkv.worker.openai_api import GenerationRequest, Handoff, StreamEvents
from pdkv.worker.server import Worker

from tests.conftest import serve_worker
from tests.test_pd_fast_paths import PROMPT, SETTINGS
from tests.test_router_units import (
    FakeWorker,
    answering,
    cluster,
    decode_answer,
    post,
    router_metric,
    sse_data,
    wait_for,
)

P_EVENT = b'data: {"id":"cmpl-p","created":7,"choices":[{"index":0,"text":"P","finish_reason":null}]}\n\n'
STREAMED = {"prompt": "x" * 50, "max_tokens": 4, "stream": True}


def params_event(body: dict[str, Any], first_event: bool = True) -> bytes:
    kv: dict[str, Any] = {
        "do_remote_prefill": True,
        "transfer_id": body["kv_transfer_params"].get("transfer_id"),
        "first_token_id": 7,
        "transfer_started": True,
    }
    if first_event:
        kv["first_event"] = {"id": "cmpl-p", "created": 7}
    return b"data: " + json.dumps({"object": "kv_transfer_params", "kv_transfer_params": kv}).encode() + b"\n\n"


def streaming_prefill(*events: bytes | None, first_event: bool = True) -> Any:
    """A prefill stand-in streaming ``events`` (None: its params event), or a JSON answer when not streamed."""

    async def behave(w: FakeWorker, http: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        if not body.get("stream"):
            kv = json.loads(params_event(body, first_event=False)[6:])["kv_transfer_params"]
            return web.json_response({"choices": [{"index": 0, "text": "P"}], "kv_transfer_params": kv})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(http)
        for event in events:
            await resp.write(params_event(body, first_event) if event is None else event)
        await resp.write_eof()
        return resp

    return behave


HANDING = streaming_prefill(P_EVENT, None, b"data: [DONE]\n\n")


def test_the_client_gets_ps_token_first_and_the_decode_worker_streams_the_rest() -> None:
    async def scenario() -> None:
        p, d = FakeWorker("prefill", HANDING), FakeWorker("decode")
        async with cluster([p], [d]) as (url, router):
            status, text = await post(url + "/v1/completions", STREAMED)
            events = sse_data(text)
            assert status == 200 and events[0] == P_EVENT[6:-2].decode()
            assert [json.loads(e)["served_by"] for e in events[1:-1]] == [d.url] * 3 and events[-1] == "[DONE]"
            hop = p.requests[0]
            assert hop["stream"] is True and hop["max_tokens"] == 1 and hop["kv_transfer_params"]["stream_first"]
            told = d.requests[0]["kv_transfer_params"]
            assert told["first_event"] == {"id": "cmpl-p", "created": 7} and told["first_token_id"] == 7
            assert router_metric(router, "pdkv_router_first_token_handoffs_total") == 1
            assert router_metric(router, "pdkv_ttft_seconds_count", role="router") == 1
            assert router_metric(router, "pdkv_requests_total", outcome="ok") == 1

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "settings, body",
    [
        ({"stream_first_token": False}, STREAMED),
        ({}, {**STREAMED, "stream": False}),
        ({"mode": "vllm"}, STREAMED),
    ],
    ids=["turned-off", "not-streamed", "vllm-pairs"],
)
def test_without_the_handoff_the_prefill_hop_is_one_whole_answer(settings: dict[str, Any], body: Any) -> None:
    """vLLM's decode side sends its own first token; a whole answer has no first event; the switch turns it off."""

    async def scenario() -> None:
        p, d = FakeWorker("prefill", HANDING), FakeWorker("decode")
        async with cluster([p], [d], **settings) as (url, router):
            status, answer = await post(url + "/v1/completions", body)
            assert status == 200
            hop = p.requests[0]
            assert hop["stream"] is False and not hop["kv_transfer_params"].get("stream_first")
            assert "first_event" not in d.requests[0]["kv_transfer_params"]
            if body["stream"]:
                assert [json.loads(e)["served_by"] for e in sse_data(answer)[:-1]] == [d.url] * 3
            assert router_metric(router, "pdkv_router_first_token_handoffs_total") == 0

    asyncio.run(scenario())


def test_a_prefill_worker_that_does_not_hand_its_token_on_leaves_the_first_token_to_the_decode_worker() -> None:
    """A P whose params carry no ``first_event`` (one that ignores ``stream_first``): its event is not relayed."""

    async def scenario() -> None:
        p = FakeWorker("prefill", streaming_prefill(P_EVENT, None, b"data: [DONE]\n\n", first_event=False))
        d = FakeWorker("decode")
        async with cluster([p], [d]) as (url, router):
            status, text = await post(url + "/v1/completions", STREAMED)
            assert status == 200 and [json.loads(e)["served_by"] for e in sse_data(text)[:-1]] == [d.url] * 3
            assert "first_event" not in d.requests[0]["kv_transfer_params"]
            assert router_metric(router, "pdkv_router_first_token_handoffs_total") == 0

    asyncio.run(scenario())


BROKEN_PREFILL_STREAMS = {
    "no-done": (P_EVENT, None),
    "in-band-error": (P_EVENT, b'data: {"error":{"message":"engine died","code":500}}\n\n', b"data: [DONE]\n\n"),
    "two-tokens": (P_EVENT, P_EVENT, None, b"data: [DONE]\n\n"),
    "no-params": (P_EVENT, b"data: [DONE]\n\n"),
    "not-json": (b"data: {oops\n\n", None, b"data: [DONE]\n\n"),
    "not-data": (b"event: x\n\n", None, b"data: [DONE]\n\n"),
}


@pytest.mark.parametrize("events", BROKEN_PREFILL_STREAMS.values(), ids=BROKEN_PREFILL_STREAMS)
def test_a_broken_prefill_stream_is_a_failed_prefill_hop_and_the_next_one_serves(events: tuple[Any, ...]) -> None:
    """Nothing of a broken P's stream reaches the client: the next P hands its token on instead."""

    async def scenario() -> None:
        broken, good = FakeWorker("prefill", streaming_prefill(*events)), FakeWorker("prefill", HANDING)
        d = FakeWorker("decode")
        async with cluster([broken, good], [d]) as (url, router):
            status, text = await post(url + "/v1/completions", STREAMED)
            events_out = sse_data(text)
            assert status == 200 and events_out[0] == P_EVENT[6:-2].decode() and len(events_out) == 5
            assert len(broken.requests) == 1 and len(good.requests) == 1 and len(d.requests) == 1
            assert router_metric(router, "pdkv_router_first_token_handoffs_total") == 1
            first_tid = broken.requests[0]["kv_transfer_params"]["transfer_id"]
            assert d.requests[0]["kv_transfer_params"]["transfer_id"] != first_tid

    asyncio.run(scenario())


def test_split_prefill_stream_names_what_is_wrong() -> None:
    worker = WorkerState("http://p", "prefill")
    body = {"kv_transfer_params": {"transfer_id": "t"}}
    good = P_EVENT + params_event(body) + b"data: [DONE]\n\n"
    answer, first = split_prefill_stream(worker, good)
    assert first == P_EVENT and answer["kv_transfer_params"]["first_event"] == {"id": "cmpl-p", "created": 7}
    reasons = {}
    for name, events in BROKEN_PREFILL_STREAMS.items():
        with pytest.raises(UpstreamError) as err:
            split_prefill_stream(worker, b"".join(params_event(body) if e is None else e for e in events))
        reasons[name] = err.value.reason
    assert reasons == {
        "no-done": "truncated",
        "in-band-error": "http_500",
        "two-tokens": "bad_answer",
        "no-params": "bad_answer",
        "not-json": "bad_answer",
        "not-data": "bad_answer",
    }


def test_a_decode_worker_failing_after_the_handoff_is_replaced_by_one_that_computes_the_prompt() -> None:
    """The client has P's token: the pair is not tried again whole (no second prefill); the next decode worker is
    told the transfer did not start (its KV went to the failed one, which is told to drop it) and continues from
    P's token."""

    async def scenario() -> None:
        p, busy, d2 = (
            FakeWorker("prefill", HANDING),
            FakeWorker("decode", answering(503, "no room")),
            FakeWorker("decode"),
        )
        async with cluster([p], [busy, d2]) as (url, router):
            status, text = await post(url + "/v1/completions", STREAMED)
            events = sse_data(text)
            assert status == 200 and events[0] == P_EVENT[6:-2].decode()
            assert [json.loads(e)["served_by"] for e in events[1:-1]] == [d2.url] * 3 and events[-1] == "[DONE]"
            assert len(p.requests) == 1 and len(busy.requests) == 1
            first, then = busy.requests[0]["kv_transfer_params"], d2.requests[0]["kv_transfer_params"]
            assert first["transfer_started"] is True and then["transfer_started"] is False
            assert then["first_token_id"] == 7 and then["first_event"] == first["first_event"]
            await wait_for(
                lambda: busy.cancelled_transfers == [first["transfer_id"]], "the failed one's transfer cancel"
            )
            assert router_metric(router, "pdkv_router_retries_total", hop="decode", reason="http_503") == 1
            assert router_metric(router, "pdkv_requests_total", outcome="ok") == 1
            assert all(w.inflight_requests == 0 for w in router.pool.workers("decode"))

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "behavior, cause, says",
    [
        (answering(503, "no room"), "http_503", "no room"),
        (answering(400, "first_event needs first_token_id"), "http_400", "first_event needs first_token_id"),
    ],
    ids=["every-one-failed", "refused"],
)
def test_with_no_decode_worker_to_continue_ps_token_the_stream_ends_with_an_in_band_error(
    behavior: Any, cause: str, says: str
) -> None:
    async def scenario() -> None:
        p = FakeWorker("prefill", HANDING)
        decodes = [FakeWorker("decode", behavior), FakeWorker("decode", behavior)]
        async with cluster([p], decodes) as (url, router):
            status, text = await post(url + "/v1/completions", STREAMED)
            events = sse_data(text)
            assert status == 200 and events[0] == P_EVENT[6:-2].decode() and events[-1] == "[DONE]"
            error = json.loads(events[1])["error"]
            assert says in error["message"] and error["code"] == 502 and len(events) == 3
            assert router_metric(router, "pdkv_requests_total", outcome="broken") == 1
            assert router_metric(router, "pdkv_router_errors_total", status="502", cause=cause) == 1
            tried = sum(len(w.requests) for w in decodes)
            assert tried == (2 if cause == "http_503" else 1)  # a refusal is the request's, not the worker's

    asyncio.run(scenario())


# -- the two halves of one stream, on the workers (pdkv.worker.openai_api.StreamEvents) ----------------------------
class ByteTokens:
    """A tokenizer whose tokens are single bytes: a two-byte character splits over two tokens."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", "replace")


def _request(chat: bool) -> GenerationRequest:
    return GenerationRequest("cmpl-1", chat, "m", [1], SamplingParams(max_tokens=9), True, False, True)


def _events(handoff: Handoff, tokens: list[int], chat: bool) -> list[dict[str, Any]]:
    stream = StreamEvents(_request(chat), ByteTokens(), handoff)  # type: ignore[arg-type]
    finishes = [None] * (len(tokens) - 1) + ["length"]
    events = [stream.next(t, f, None) for t, f in zip(tokens, finishes, strict=True)]
    assert stream.count == len(tokens)  # D counts P's token too: its usage is the answer's
    return [json.loads(e[6:]) for e in events if e is not None]


def _text(events: list[dict[str, Any]], chat: bool) -> str:
    return "".join(c["delta"]["content"] if chat else c["text"] for e in events for c in e["choices"])


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
@pytest.mark.parametrize("answer", [[0xC3, 0xA9, 0x61], [0x61, 0xC3, 0xA9], [0xC3], [0x61], [0xC3, 0xA9]], ids=repr)
def test_ps_first_event_and_ds_rest_read_as_one_workers_stream(answer: list[int], chat: bool) -> None:
    """P renders the first token as if more followed (a split character held back, no finish reason); D renders
    it again unsent and goes on: together the same text, finish reasons, role and token ids as one worker's."""
    alone = _events("", answer, chat)
    first = _events("first", answer[:1], chat)
    rest = _events("rest", answer, chat)
    assert len(first) == 1 and first[0]["choices"][0]["finish_reason"] is None
    assert _text(first + rest, chat) == _text(alone, chat)
    finishes = [c["finish_reason"] for e in first + rest for c in e["choices"]]
    assert finishes == [None] * (len(finishes) - 1) + ["length"]
    ids = [t for e in first + rest for c in e["choices"] for t in c.get("token_ids", [])]
    assert ids == answer  # P's token once
    if chat:
        roles = [c["delta"].get("role") for e in first + rest for c in e["choices"]]
        assert roles == ["assistant"] + [None] * (len(roles) - 1)


# -- the decode worker's side of a handoff, on a real worker ----------------------------------------------------------
@pytest.mark.parametrize("why", ["not-started", "prompt-mismatch"])
def test_a_decode_worker_that_computes_the_prompt_still_continues_from_ps_token(model_dir: Path, why: str) -> None:
    """The client has P's token, so a decode worker whose KV did not come (the transfer never started: the router's
    retry after a failed decode worker; or it was computed for another prompt) still decodes on from that token, not
    from one of its own, and does not send it again; the engine steps on at once (``first_token_yield_s`` 600 here:
    had it waited for a first event that is never written, the client's 60 s timeout would end the test)."""
    engine = ReferenceEngine.load(str(model_dir), progress=False)
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    own_first = engine.generate(PROMPT, greedy).output_token_ids[0]
    p_token = (own_first + 1) % engine.vocab_size  # not the token D would pick: what it decodes on from shows
    then = engine.generate(PROMPT + [p_token], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    jobs: list[Any] = []

    async def scenario() -> None:
        settings = {**SETTINGS, "first_token_yield_s": 600}
        p_worker = Worker(convert_config({**SETTINGS, "role": "prefill"}), engine)
        d_worker = Worker(convert_config({**settings, "role": "decode"}), ReferenceEngine.load(str(model_dir)))
        submit = d_worker.loop.submit
        d_worker.loop.submit = lambda job: (jobs.append(job), submit(job))[1]  # type: ignore[method-assign]
        p_runner, p_url = await serve_worker(p_worker)
        d_runner, d_url = await serve_worker(d_worker)
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
                kv: dict[str, Any] = {"do_remote_prefill": True, "transfer_id": "t", "transfer_started": False}
                if why == "prompt-mismatch":  # P pushed another prompt's KV under this transfer id
                    info = await (await s.get(d_url + "/pdkv/info")).json()
                    push = {"do_remote_decode": True, "remote_host": info["remote_host"]}
                    push.update(remote_port=info["remote_port"], transfer_id="t")
                    other = {"prompt": PROMPT[::-1], "max_tokens": 1, "kv_transfer_params": push}
                    answer = await (await s.post(p_url + "/v1/completions", json=other)).json()
                    kv = {**answer["kv_transfer_params"]}
                kv.update(first_token_id=p_token, first_event={"id": "cmpl-from-p", "created": 5})
                body = {"prompt": PROMPT, "max_tokens": 4, "stream": True, "return_token_ids": True, **greedy_body()}
                body["stream_options"] = {"include_usage": True}
                resp = await s.post(d_url + "/v1/completions", json={**body, "kv_transfer_params": kv})
                assert resp.status == 200
                chunks = [json.loads(line[6:]) async for line in resp.content if line.startswith(b"data: {")]
                refused = await s.post(
                    d_url + "/v1/completions",
                    json={**body, "kv_transfer_params": {**kv, "first_token_id": None}},
                )
                assert refused.status == 400 and "first_token_id" in (await refused.json())["error"]["message"]
                metrics = await (await s.get(d_url + "/metrics")).text()
        finally:
            await p_runner.cleanup()
            await d_runner.cleanup()
        assert jobs[0].first_token == p_token and len(jobs) == 1
        tokens = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])]
        assert tokens == then.output_token_ids  # on from P's token, which the client has already
        assert {(c["id"], c["created"]) for c in chunks} == {("cmpl-from-p", 5)}
        assert chunks[-1]["usage"]["completion_tokens"] == 4  # P's token counted: one answer
        reason = "not_started" if why == "not-started" else "prompt_mismatch"
        assert metric(metrics, "pdkv_fallbacks_total", reason=reason) == 1

    asyncio.run(scenario())


def greedy_body() -> dict[str, Any]:
    return {"temperature": 0, "ignore_eos": True}


def test_the_clients_deadline_ends_a_handed_off_stream_in_band_with_a_504() -> None:
    """The client has P's token when its deadline passes on a stalled decode worker: no retry on the spare (the
    deadline is spent), the stream ends with a 504 event."""

    async def stall(_w: FakeWorker, _http: web.Request, _body: dict[str, Any]) -> web.Response:
        await asyncio.sleep(30)
        raise AssertionError("unreachable")

    async def scenario() -> None:
        p, stalled, spare = FakeWorker("prefill", HANDING), FakeWorker("decode", stall), FakeWorker("decode")
        async with cluster([p], [stalled, spare]) as (url, router):
            status, text = await post(url + "/v1/completions", STREAMED, headers={"X-Request-Timeout": "0.5"})
            events = sse_data(text)
            assert status == 200 and events[0] == P_EVENT[6:-2].decode() and events[-1] == "[DONE]"
            assert json.loads(events[1])["error"]["code"] == 504 and len(events) == 3
            assert len(stalled.requests) == 1 and not spare.requests
            assert router_metric(router, "pdkv_router_errors_total", status="504", cause="deadline") == 1
            assert router_metric(router, "pdkv_requests_total", outcome="deadline") == 1

    asyncio.run(scenario())


def test_disaggregate_auto_learns_a_way_from_the_decode_workers_first_event_not_ps_token() -> None:
    """P's token reaches the client before the decode hop runs: were the transfer way's cost taken there, a slow link
    (here a decode worker 0.3 s from its first event) would look free. Both ways learn from the answer's second
    event: the transfer way's cost holds D's 0.3 s."""

    async def slow_decode(w: FakeWorker, http: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        await asyncio.sleep(0.3)  # the KV's tail on a slow link
        return await decode_answer(w, http, body)

    async def scenario() -> None:
        p, d = FakeWorker("prefill", HANDING), FakeWorker("decode", slow_decode)
        async with cluster([p], [d], disaggregate="auto") as (url, router):
            status, text = await post(url + "/v1/completions", STREAMED)  # the first way tried: transfer
            assert status == 200 and sse_data(text)[0] == P_EVENT[6:-2].decode()
            transfer = router.proxy._costs[d.url].cost("transfer")
            assert transfer.samples == 1 and transfer.per_token is not None
            tokens = describe_prompt(STREAMED, False, router.config).est_tokens
            assert transfer.per_token * tokens >= 0.3

    asyncio.run(scenario())
