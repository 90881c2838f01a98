"""The router against in-process stand-in workers: request shaping, policies, failure handling, admin.

Stand-ins record what each hop carried and fail exactly where a test says
(a 5xx, a refused connection, a stall, a stream cut after one event), so
every failure path runs deterministically and in milliseconds. The real
pdkv workers are in test_router.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from multidict import CIMultiDict

from pdkv.cli import build_parser
from pdkv.config import RouterConfig, convert_config, load_config
from pdkv.errors import ConfigError
from pdkv.launch.main import config_from_args
from pdkv.router.app import Router
from pdkv.router.modes import decode_body, prefill_body
from pdkv.router.policy import LeastLoaded, PrefixAware, RoundRobin, describe_prompt
from pdkv.router.pool import WorkerState
from pdkv.testing.http import metric
from pdkv.transfer.params import PushGuard, push_target

Behavior = Callable[["FakeWorker", web.Request, dict[str, Any]], Awaitable[web.StreamResponse]]

VLLM_PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
VLLM_ANSWER_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [3, 9, 4],
    "remote_engine_id": "engine-p0",
    "remote_host": "10.0.0.7",
    "remote_port": 5600,
    "tp_size": 1,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


class FakeWorker:
    """A stand-in prefill or decode worker: records requests, answers as its ``behavior`` says."""

    def __init__(
        self,
        role: str,
        behavior: Behavior | None = None,
        kv_params: dict[str, Any] | None = None,
        serves_info: bool = True,
        info: dict[str, Any] | None = None,
    ) -> None:
        self.role = role
        self.info = info or {}  # more /pdkv/info fields (a vLLM decode at tensor parallel: its remote_ports)
        self.serves_info = serves_info  # False: a stock vLLM decode (no pdkv connector), which has no /pdkv/info
        self.behavior = behavior
        self.kv_params = kv_params  # a prefill worker's answer params (default: pdkv's, echoing the transfer id)
        self.requests: list[dict[str, Any]] = []
        self.headers: list[CIMultiDict[str]] = []
        self.cancelled_transfers: list[str] = []
        self.handlers_cancelled = 0
        self.healthy = True
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self, port: int = 0) -> FakeWorker:
        app = web.Application()
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        if self.serves_info:
            app.router.add_get("/pdkv/info", self._info)
        app.router.add_delete("/pdkv/transfers/{tid}", self._cancel)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"}, status=200 if self.healthy else 503)

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": f"fake-{self.role}", "object": "model"}]})

    async def _info(self, _: web.Request) -> web.Response:
        return web.json_response({"role": self.role, "remote_host": "127.0.0.1", "remote_port": 5555, **self.info})

    async def _cancel(self, http: web.Request) -> web.Response:
        self.cancelled_transfers.append(http.match_info["tid"])
        return web.json_response({"cancelled": http.match_info["tid"]})

    async def _generate(self, http: web.Request) -> web.StreamResponse:
        body = await http.json()
        self.requests.append(body)
        self.headers.append(http.headers.copy())
        try:
            if self.behavior is not None:
                return await self.behavior(self, http, body)
            return await (prefill_answer if self.role == "prefill" else decode_answer)(self, http, body)
        except asyncio.CancelledError:
            self.handlers_cancelled += 1
            raise


async def prefill_answer(worker: FakeWorker, _http: web.Request, body: dict[str, Any]) -> web.Response:
    kv = (
        worker.kv_params
        if worker.kv_params is not None
        else {
            "do_remote_prefill": True,
            "transfer_id": body["kv_transfer_params"].get("transfer_id"),
            "first_token_id": 7,
            "transfer_started": True,
        }
    )
    return web.json_response(
        {"object": "text_completion", "choices": [{"index": 0, "text": "a"}], "kv_transfer_params": kv}
    )


async def decode_answer(
    worker: FakeWorker, http: web.Request, body: dict[str, Any], events: int = 3, delay: float = 0.0
) -> web.StreamResponse:
    if not body.get("stream"):
        return web.json_response(
            {
                "object": "text_completion",
                "choices": [{"index": 0, "text": "abc", "finish_reason": "length"}],
                "served_by": worker.url,
            }
        )
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(http)
    for i in range(events):
        await resp.write(
            b"data: "
            + json.dumps({"choices": [{"index": 0, "text": str(i)}], "served_by": worker.url}).encode()
            + b"\n\n"
        )
        await asyncio.sleep(delay)
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def answering(status: int, message: str = "nope") -> Behavior:
    async def behave(_w: FakeWorker, _http: web.Request, _body: dict[str, Any]) -> web.Response:
        return web.json_response({"error": {"message": message, "type": "x", "code": status}}, status=status)

    return behave


@contextlib.asynccontextmanager
async def cluster(
    prefill: list[FakeWorker | str], decode: list[FakeWorker | str], **settings: Any
) -> AsyncIterator[tuple[str, Router]]:
    """A router in this process over the given stand-ins (or plain URLs), served on a real socket."""
    fakes = [w for w in (*prefill, *decode) if isinstance(w, FakeWorker)]
    for w in fakes:
        await w.start()
    urls = {
        role: [w.url if isinstance(w, FakeWorker) else w for w in ws]
        for role, ws in (("prefill", prefill), ("decode", decode))
    }
    config = RouterConfig(**{"health_interval_s": 60.0, **urls, **settings})
    router = await Router.start(config)
    runner = web.AppRunner(router.app(), handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", router
    finally:
        await runner.cleanup()
        await router.close()
        for w in fakes:
            await w.stop()


async def post(url: str, body: dict[str, Any], **kw: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body, **kw) as resp:
        text = await resp.text()
        return resp.status, (json.loads(text) if resp.content_type == "application/json" else text)


def sse_data(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


def router_metric(router: Router, name: str, **labels: str) -> float:
    return metric(router.metrics.render().decode(), name, **labels)


async def wait_for(pred: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


# -- config ---------------------------------------------------------------------------------
def test_router_config_errors_name_field_value_and_expectation() -> None:
    cases = [
        ({"router": {"prefill": ["localhost:8100"]}}, "router.prefill[0]", "localhost:8100"),
        ({"router": {"policy": "random"}}, "router.policy", "random"),
        ({"router": {"max_retries": -1}}, "router.max_retries", "-1"),
        ({"router": {"prefill_timeout_s": 0}}, "router.prefill_timeout_s", "0"),
        ({"router": {"mode": "sglang"}}, "router.mode", "sglang"),
        ({"router": {"decode_urls": []}}, "router.decode_urls", "unknown field"),
    ]
    for raw, field, value in cases:
        with pytest.raises(ConfigError) as err:
            convert_config(raw)
        assert field in str(err.value) and value in str(err.value)


def test_shipped_router_configs_are_valid() -> None:
    for name in ("router.yaml", "xpyd-router.yaml", "tenants-router.yaml"):
        cfg = load_config(Path(__file__).parent.parent / "launch" / "configs" / name, {"role": "router"}).router
        assert cfg.prefill and cfg.decode


def test_router_flags_replace_the_config_lists(tmp_path: Any) -> None:
    path = tmp_path / "router.yaml"
    path.write_text(
        "router:\n  policy: prefix\n  prefill: [http://127.0.0.1:1]\n  decode: [http://127.0.0.1:2]\n  "
        "short_prompt_tokens: 32\n"
    )
    args = build_parser().parse_args(
        [
            "launch",
            "--role",
            "router",
            "--config",
            str(path),
            "--prefill",
            "http://127.0.0.1:3",
            "--prefill",
            "http://127.0.0.1:4",
        ]
    )
    cfg = config_from_args(args).router
    assert cfg.prefill == ["http://127.0.0.1:3", "http://127.0.0.1:4"]
    assert cfg.decode == ["http://127.0.0.1:2"] and cfg.policy == "prefix" and cfg.short_prompt_tokens == 32
    args = build_parser().parse_args(["launch", "--role", "router", "--config", str(path), "--policy", "least-loaded"])
    assert config_from_args(args).router.policy == "least-loaded"


# -- prompts and policies ---------------------------------------------------------------------
def test_prompt_description_without_a_tokenizer() -> None:
    cfg = RouterConfig(chars_per_token=4.0, prefix_chunk_tokens=4)  # 16-character chunks
    text = describe_prompt({"prompt": "x" * 40}, chat=False, config=cfg)
    assert text.est_tokens == 10 and len(text.keys) == 3
    ids = describe_prompt({"prompt": list(range(10))}, chat=False, config=cfg)
    assert ids.est_tokens == 10 and len(ids.keys) == 3  # 4-token chunks
    assert describe_prompt({"prompt": [list(range(10))]}, chat=False, config=cfg).keys == ids.keys  # a batch of one
    assert not set(ids.keys) & set(
        describe_prompt({"prompt": "".join(map(chr, range(10)))}, chat=False, config=cfg).keys
    )
    convo = [
        {"role": "system", "content": "You are terse. " * 4},
        {"role": "user", "content": "Hello there, how are you?"},
    ]
    short = describe_prompt({"messages": convo}, chat=True, config=cfg)
    longer = describe_prompt(
        {"messages": [*convo, {"role": "assistant", "content": "fine"}, {"role": "user", "content": "and then?"}]},
        chat=True,
        config=cfg,
    )
    full = len(short.keys) - 1  # every full chunk of the shorter conversation is a prefix of the longer one's
    assert full >= 3 and longer.keys[:full] == short.keys[:full]
    other = describe_prompt(
        {"messages": [{"role": "user", "content": "Something else entirely, at length."}]}, chat=True, config=cfg
    )
    assert other.keys[0] != short.keys[0]
    parts = describe_prompt(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hello there, how are you?"}]}]},
        chat=True,
        config=cfg,
    )
    assert (
        parts.keys
        == describe_prompt(
            {"messages": [{"role": "user", "content": "Hello there, how are you?"}]}, chat=True, config=cfg
        ).keys
    )
    with_tools = describe_prompt({"messages": convo, "tools": TOOLS}, chat=True, config=cfg)
    assert with_tools.keys[0] != short.keys[0] and with_tools.est_tokens > short.est_tokens
    assert describe_prompt({"prompt": None}, chat=False, config=cfg).keys == []


def workers(role: str, n: int) -> list[WorkerState]:
    return [WorkerState(role, f"http://127.0.0.1:{9000 + i}", healthy=True) for i in range(n)]  # type: ignore[arg-type]


def test_round_robin_takes_each_role_in_turn() -> None:
    policy, ps, ds = RoundRobin(), workers("prefill", 3), workers("decode", 2)
    prompt = describe_prompt({"prompt": "hi"}, chat=False, config=RouterConfig())
    assert [policy.choose("prefill", ps, prompt)[0] for _ in range(4)] == [ps[0], ps[1], ps[2], ps[0]]
    assert [policy.choose("decode", ds, prompt)[0] for _ in range(3)] == [ds[0], ds[1], ds[0]]


def test_least_loaded_counts_prefill_tokens_and_decode_sequences() -> None:
    policy, ps, ds = LeastLoaded(), workers("prefill", 3), workers("decode", 3)
    prompt = describe_prompt({"prompt": "hi"}, chat=False, config=RouterConfig())
    ps[0].inflight_tokens, ps[0].inflight_requests = 100, 1
    ps[1].inflight_tokens, ps[1].inflight_requests = 10, 3  # more requests, fewer tokens: prefill cost is tokens
    ps[2].inflight_tokens, ps[2].inflight_requests = 50, 1
    assert policy.choose("prefill", ps, prompt) == (ps[1], "least_loaded")
    ds[0].inflight_requests, ds[1].inflight_requests, ds[2].inflight_requests = 2, 0, 1
    assert policy.choose("decode", ds, prompt)[0] is ds[1]
    idle = workers("decode", 3)
    assert {policy.choose("decode", idle, prompt)[0].url for _ in range(3)} == {w.url for w in idle}  # ties rotate


def test_prefix_aware_follows_the_longest_known_prefix() -> None:
    cfg = RouterConfig(prefix_chunk_tokens=4, chars_per_token=1.0)
    policy, ps = PrefixAware(max_entries=64, max_imbalance=2), workers("prefill", 3)
    doc_a, doc_b = "A" * 12, "B" * 12
    first = describe_prompt({"prompt": doc_a + "question one"}, chat=False, config=cfg)
    owner, reason = policy.choose("prefill", ps, first)
    assert reason == "prefix_miss"
    policy.served(owner, first)
    again = describe_prompt({"prompt": doc_a + "another question"}, chat=False, config=cfg)
    assert policy.choose("prefill", ps, again) == (owner, "prefix_hit")
    elsewhere = next(w for w in ps if w is not owner)  # a longer known prefix wins over a shorter one
    deeper = describe_prompt({"prompt": doc_a + "another question, longer"}, chat=False, config=cfg)
    policy.served(elsewhere, again)
    assert policy.choose("prefill", ps, deeper) == (elsewhere, "prefix_hit")
    assert policy.choose("prefill", ps, describe_prompt({"prompt": doc_b}, chat=False, config=cfg))[1] == "prefix_miss"
    elsewhere.inflight_requests = 3  # 3 > 0 + max_imbalance: the owner is skipped for the least loaded
    picked, reason = policy.choose("prefill", ps, deeper)
    assert reason == "prefix_overloaded" and picked is not elsewhere
    others = [w for w in ps if w is not elsewhere]  # the owner is no candidate (down, deregistered): least loaded
    assert policy.choose("prefill", others, deeper)[1] == "prefix_miss"
    small = PrefixAware(max_entries=2, max_imbalance=2)
    small.served(ps[0], describe_prompt({"prompt": "C" * 16}, chat=False, config=cfg))
    assert (
        small.choose("prefill", ps, describe_prompt({"prompt": "C" * 4}, chat=False, config=cfg))[1] == "prefix_miss"
    )  # evicted
    assert policy.choose("decode", workers("decode", 2), again)[1] == "least_loaded"


# -- request shaping --------------------------------------------------------------------------------
def test_hop_bodies_keep_every_field_but_the_ones_a_hop_must_change() -> None:
    client = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": TOOLS,
        "tool_choice": "auto",
        "max_completion_tokens": 50,
        "stream": True,
        "stream_options": {"include_usage": True},
        "min_tokens": 5,
        "temperature": 0.3,
        "x_custom": [1, {"a": None}],
        "kv_transfer_params": {"transfer_id": "someone-elses"},
    }
    params = {"do_remote_decode": True, "transfer_id": "t1"}
    p = prefill_body(client, params)
    assert (
        p["max_tokens"] == 1
        and p["max_completion_tokens"] == 1
        and p["stream"] is False
        and p["kv_transfer_params"] == params
    )
    assert "stream_options" not in p and "min_tokens" not in p
    assert {k: p[k] for k in ("messages", "tools", "tool_choice", "temperature", "x_custom")} == {
        k: client[k] for k in ("messages", "tools", "tool_choice", "temperature", "x_custom")
    }
    d = decode_body(client, {"do_remote_prefill": True})
    assert d == {**client, "kv_transfer_params": {"do_remote_prefill": True}}
    alone = decode_body(client, None)
    assert (
        "kv_transfer_params" not in alone and alone["tools"] == TOOLS
    )  # a client never smuggles its own params through
    assert (
        client["kv_transfer_params"] == {"transfer_id": "someone-elses"} and client["stream"] is True
    )  # the client's body is untouched


def test_vllm_pair_mode_speaks_vllms_kv_transfer_params() -> None:
    async def scenario() -> None:
        # A stock vLLM decode (NixlConnector pulls from P): no /pdkv/info, so P gets vLLM's null params.
        p, d = FakeWorker("prefill", kv_params=VLLM_ANSWER_PARAMS), FakeWorker("decode", serves_info=False)
        async with cluster([p], [d], mode="vllm") as (url, router):
            body = {
                "model": "m",
                "messages": [{"role": "user", "content": "weather in Paris?"}],
                "tools": TOOLS,
                "max_tokens": 20,
                "min_tokens": 2,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            status, text = await post(url + "/v1/chat/completions", body)
            assert status == 200 and sse_data(text)[-1] == "[DONE]"
            [pb], [db] = p.requests, d.requests
            assert pb["kv_transfer_params"] == VLLM_PREFILL_PARAMS
            assert (
                pb["max_tokens"] == 1
                and pb["stream"] is False
                and "stream_options" not in pb
                and "min_tokens" not in pb
            )
            assert pb["tools"] == TOOLS and pb["messages"] == body["messages"]
            assert db == {
                **body,
                "kv_transfer_params": VLLM_ANSWER_PARAMS,
            }  # exactly what P answered, nothing else changed
            assert p.headers[0]["X-Request-Id"] == d.headers[0]["X-Request-Id"]
            assert router_metric(router, "pdkv_router_fallbacks_total") == 0
            # A vLLM prefill that answers without kv_transfer_params (a prompt under one block): D computes alone.
            p.kv_params = {}
            status, _ = await post(url + "/v1/completions", {"prompt": "hi", "max_tokens": 3})
            assert status == 200 and "kv_transfer_params" not in d.requests[-1]
            assert router_metric(router, "pdkv_router_fallbacks_total", reason="no_kv_transfer_params") == 1

        # A vLLM decode with pdkv's connector serves /pdkv/info: P is told where to push, under a fresh transfer id.
        p, d = FakeWorker("prefill", kv_params=VLLM_ANSWER_PARAMS), FakeWorker("decode")
        async with cluster([p], [d], mode="vllm") as (url, router):
            for _ in range(2):
                status, _ = await post(url + "/v1/completions", {"prompt": "tell me", "max_tokens": 3})
                assert status == 200
            first, second = (r["kv_transfer_params"] for r in p.requests)
            assert {k: v for k, v in first.items() if k != "transfer_id"} == {
                **VLLM_PREFILL_PARAMS,
                "remote_host": "127.0.0.1",
                "remote_port": 5555,
                "remote_ports": [5555],
            }
            assert first["transfer_id"] and second["transfer_id"] and first["transfer_id"] != second["transfer_id"]
            assert [r["kv_transfer_params"] for r in d.requests] == [VLLM_ANSWER_PARAMS] * 2
            assert router_metric(router, "pdkv_router_fallbacks_total") == 0

        # A decode vLLM at tensor parallel 2: one receiver per rank, every one handed to P, in rank order.
        p, d = FakeWorker("prefill", kv_params=VLLM_ANSWER_PARAMS), FakeWorker("decode", info={"remote_ports": [7, 9]})
        async with cluster([p], [d], mode="vllm") as (url, router):
            status, _ = await post(url + "/v1/completions", {"prompt": "tell me", "max_tokens": 3})
            assert status == 200 and p.requests[0]["kv_transfer_params"]["remote_ports"] == [7, 9]
            assert push_target(p.requests[0]["kv_transfer_params"], "r", PushGuard()).addresses == [  # type: ignore[union-attr]
                "tcp://127.0.0.1:7",
                "tcp://127.0.0.1:9",
            ]

    asyncio.run(scenario())


def test_pdkv_pair_mode_names_the_decode_receiver_and_passes_the_answer_on() -> None:
    async def scenario() -> None:
        p, d = FakeWorker("prefill"), FakeWorker("decode")
        async with cluster([p], [d]) as (url, _router):
            body = {
                "model": "m",
                "prompt": "tell me",
                "max_tokens": 9,
                "logit_bias": {"5": 1},
                "kv_transfer_params": {"transfer_id": "injected"},
            }
            status, answer = await post(url + "/v1/completions", body, headers={"Authorization": "Bearer k"})
            assert status == 200 and answer["choices"][0]["text"] == "abc"
            [pb], [db] = p.requests, d.requests
            kv = pb["kv_transfer_params"]
            assert kv["do_remote_decode"] is True and (kv["remote_host"], kv["remote_port"]) == ("127.0.0.1", 5555)
            assert kv["transfer_id"] != "injected" and pb["logit_bias"] == {"5": 1}
            assert db["kv_transfer_params"] == {
                "do_remote_prefill": True,
                "transfer_id": kv["transfer_id"],
                "first_token_id": 7,
                "transfer_started": True,
            }
            assert {k: v for k, v in db.items() if k != "kv_transfer_params"} == {
                k: v for k, v in body.items() if k != "kv_transfer_params"
            }
            assert p.headers[0]["Authorization"] == d.headers[0]["Authorization"] == "Bearer k"
            assert d.cancelled_transfers == []  # a completed pair leaves its transfer to the decode worker

    asyncio.run(scenario())


# -- failure handling ---------------------------------------------------------------------------
def test_failed_prefills_are_retried_then_the_decode_worker_computes_alone() -> None:
    async def scenario() -> None:
        broken, dead, d = (
            FakeWorker("prefill", answering(500, "engine on fire")),
            FakeWorker("prefill"),
            FakeWorker("decode"),
        )
        async with cluster([broken, dead], [d], max_retries=3) as (url, router):
            await dead.stop()  # gone since its last health check: found out by the request itself
            status, answer = await post(url + "/v1/completions", {"prompt": "x" * 50, "max_tokens": 4})
            assert status == 200 and answer["choices"][0]["text"] == "abc"
            assert len(broken.requests) == 1 and "kv_transfer_params" not in d.requests[0]
            assert router_metric(router, "pdkv_router_retries_total", hop="prefill") == 1
            assert router_metric(router, "pdkv_router_fallbacks_total", reason="prefill_failed") == 1
            await wait_for(
                lambda: len(d.cancelled_transfers) == 2, "both abandoned transfers to be cancelled on the decode worker"
            )
            assert [w.healthy for w in router.pool.workers("prefill")] == [True, False]  # refused: marked down
            status, _ = await post(url + "/v1/completions", {"prompt": "y" * 50, "max_tokens": 4})
            assert status == 200 and len(broken.requests) == 2  # the dead one is skipped now, no retry needed
            assert router_metric(router, "pdkv_router_retries_total", hop="prefill") == 1

    asyncio.run(scenario())


def test_decode_failing_before_the_first_byte_moves_the_request_to_another_pair() -> None:
    async def scenario() -> None:
        p, busy, d2 = FakeWorker("prefill"), FakeWorker("decode", answering(503, "no room")), FakeWorker("decode")
        async with cluster([p], [busy, d2]) as (url, router):
            status, text = await post(url + "/v1/completions", {"prompt": "x" * 50, "max_tokens": 4, "stream": True})
            events = sse_data(text)
            assert (
                status == 200
                and events[-1] == "[DONE]"
                and [json.loads(e)["served_by"] for e in events[:-1]] == [d2.url] * 3
            )
            assert (
                len(busy.requests) == 1 and len(p.requests) == 2
            )  # the new pair prefilled again, for the new decode worker
            first_tid = busy.requests[0]["kv_transfer_params"]["transfer_id"]
            assert d2.requests[0]["kv_transfer_params"]["transfer_id"] != first_tid
            await wait_for(lambda: busy.cancelled_transfers == [first_tid], "the first pair's transfer to be cancelled")
            assert router_metric(router, "pdkv_router_retries_total", hop="decode", reason="http_503") == 1
            assert router.pool.workers("decode")[0].healthy  # busy is not down

    asyncio.run(scenario())


def test_decode_dying_mid_stream_ends_the_stream_with_an_error_event() -> None:
    async def cut_after_one(_w: FakeWorker, http: web.Request, _body: dict[str, Any]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(http)
        await resp.write(b'data: {"choices":[{"index":0,"text":"a"}]}\n\ndata: {"choi')
        assert http.transport is not None
        http.transport.close()  # the worker dies mid-event
        return resp

    async def scenario() -> None:
        d = FakeWorker("decode", cut_after_one)
        async with cluster([], [d]) as (url, router):
            status, text = await post(url + "/v1/completions", {"prompt": "hi", "stream": True})
            events = sse_data(text)
            assert status == 200 and events[0] == '{"choices":[{"index":0,"text":"a"}]}'
            assert "failed mid-answer" in json.loads(events[1])["error"]["message"] and events[2:] == ["[DONE]"]
            assert router_metric(router, "pdkv_requests_total", outcome="broken") == 1
            assert router_metric(router, "pdkv_router_fallbacks_total", reason="no_prefill") == 1

    asyncio.run(scenario())


def test_every_hop_has_a_timeout_and_a_timed_out_hop_is_cancelled_upstream() -> None:
    async def stall(_w: FakeWorker, _http: web.Request, _body: dict[str, Any]) -> web.Response:
        await asyncio.sleep(30)
        raise AssertionError("unreachable")

    async def scenario() -> None:
        slow_p, slow_d, d = FakeWorker("prefill", stall), FakeWorker("decode", stall), FakeWorker("decode")
        async with cluster([slow_p], [slow_d, d], prefill_timeout_s=0.3, decode_timeout_s=0.3, max_retries=1) as (
            url,
            router,
        ):
            status, answer = await post(url + "/v1/completions", {"prompt": "x" * 50})
            assert status == 200 and answer["served_by"] == d.url
            # slow_d stalled (decode retried on d); on each pair slow_p stalled (decode alone)
            assert router_metric(router, "pdkv_router_fallbacks_total", reason="prefill_failed") == 2
            assert router_metric(router, "pdkv_router_retries_total", hop="decode", reason="timeout") == 1
            await wait_for(
                lambda: slow_p.handlers_cancelled == 2 and slow_d.handlers_cancelled == 1,
                "the timed-out hops' handlers to be cancelled",
            )
            assert all(w.healthy for w in router.pool.workers("prefill")) and all(
                w.healthy for w in router.pool.workers("decode")
            )  # slow, not dead

    asyncio.run(scenario())


def test_a_worker_that_stops_answering_health_probes_loses_its_waiting_hops_and_a_slow_one_keeps_them() -> None:
    """Probes while a hop waits: failing ones (twice in a row) mark the worker down and the hop is retried at
    once; a worker that is slow but answers its probes keeps its request until it answers."""

    async def hang(w: FakeWorker, http: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        w.healthy = False  # from now on /health answers 503, as a stalled engine's does
        await asyncio.sleep(30)
        raise AssertionError("unreachable")

    async def slow(w: FakeWorker, http: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        await asyncio.sleep(1.5)
        return await prefill_answer(w, http, body)

    async def scenario() -> None:
        hung, good, d = FakeWorker("prefill", hang), FakeWorker("prefill"), FakeWorker("decode")
        settings = {
            "busy_health_interval_s": 0.1,
            "health_timeout_s": 0.5,
            "health_failures": 2,
            "prefill_timeout_s": 30,
        }
        async with cluster([hung, good], [d], **settings) as (url, router):
            status, answer = await post(url + "/v1/completions", {"prompt": "x" * 50})
            assert status == 200 and len(hung.requests) == 1 and len(good.requests) == 1  # retried on the good one
            assert router_metric(router, "pdkv_router_retries_total", hop="prefill", reason="unhealthy") == 1
            assert router_metric(router, "pdkv_router_fallbacks_total") == 0
            hung_state = router.pool.workers("prefill")[0]
            assert not hung_state.healthy and "2 failed probe(s) in a row" in hung_state.error
            await wait_for(lambda: hung.handlers_cancelled == 1, "the abandoned hop's handler to be cancelled")
            await wait_for(
                lambda: d.cancelled_transfers == [hung.requests[0]["kv_transfer_params"]["transfer_id"]],
                "its transfer to be cancelled",
            )
        lagging, d = FakeWorker("prefill", slow), FakeWorker("decode")
        async with cluster([lagging], [d], **settings) as (url, router):
            assert (await post(url + "/v1/completions", {"prompt": "x" * 50}))[0] == 200
            assert len(lagging.requests) == 1 and router_metric(router, "pdkv_router_retries_total") == 0
            assert (
                router_metric(router, "pdkv_router_fallbacks_total") == 0 and router.pool.workers("prefill")[0].healthy
            )
        # the only decode worker stops answering its probes, then answers: with nowhere better to go, its hop waits
        routers: list[Router] = []

        async def thawing(w: FakeWorker, http: web.Request, body: dict[str, Any]) -> web.StreamResponse:
            w.healthy = False
            await wait_for(
                lambda: not routers[0].pool.workers("decode")[0].healthy, "the router to mark the decode worker down"
            )
            w.healthy = True
            return await decode_answer(w, http, body)

        p, only = FakeWorker("prefill"), FakeWorker("decode", thawing)
        async with cluster([p], [only], **settings) as (url, router):
            routers.append(router)
            status, answer = await post(url + "/v1/completions", {"prompt": "x" * 50})
            assert status == 200 and answer["served_by"] == only.url and len(only.requests) == 1
            assert router_metric(router, "pdkv_router_retries_total") == 0

    asyncio.run(scenario())


def test_a_client_that_goes_away_cancels_the_upstream_hop() -> None:
    async def endless(w: FakeWorker, http: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        return await decode_answer(w, http, body, events=500, delay=0.02)

    async def scenario() -> None:
        d = FakeWorker("decode", endless)
        async with cluster([], [d]) as (url, router):
            async with aiohttp.ClientSession() as s:
                resp = await s.post(url + "/v1/completions", json={"prompt": "hi", "stream": True})
                assert (await resp.content.readline()).startswith(b"data: ")
                resp.close()  # the client hangs up after the first event
            await wait_for(lambda: d.handlers_cancelled == 1, "the decode worker's handler to be cancelled")
            await wait_for(
                lambda: router_metric(router, "pdkv_requests_total", outcome="cancelled") == 1,
                "the request to count as cancelled",
            )
            assert router.pool.workers("decode")[0].inflight_requests == 0

    asyncio.run(scenario())


def test_client_errors_come_back_unchanged_and_are_not_retried() -> None:
    async def scenario() -> None:
        p, p2, d = FakeWorker("prefill", answering(400, "'n' must be 1")), FakeWorker("prefill"), FakeWorker("decode")
        async with cluster([p, p2], [d]) as (url, router):
            status, answer = await post(url + "/v1/completions", {"prompt": "x" * 50, "n": 2})
            assert status == 400 and answer == {"error": {"message": "'n' must be 1", "type": "x", "code": 400}}
            assert len(p.requests) == 1 and p2.requests == [] and d.requests == []
            assert router_metric(router, "pdkv_requests_total", outcome="rejected") == 1
            async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", data=b"{not json") as resp:
                assert resp.status == 400 and "not valid JSON" in (await resp.json())["error"]["message"]

    asyncio.run(scenario())


def test_short_prompts_skip_prefill() -> None:
    async def scenario() -> None:
        p, d = FakeWorker("prefill"), FakeWorker("decode")
        async with cluster([p], [d], short_prompt_tokens=8, chars_per_token=4.0) as (url, router):
            assert (await post(url + "/v1/completions", {"prompt": "x" * 28}))[0] == 200  # 7 estimated tokens
            assert p.requests == [] and "kv_transfer_params" not in d.requests[0]
            assert router_metric(router, "pdkv_router_decisions_total", reason="short_prompt") == 1
            assert (await post(url + "/v1/completions", {"prompt": "x" * 32}))[0] == 200  # 8: disaggregated
            assert len(p.requests) == 1 and d.requests[1]["kv_transfer_params"]["do_remote_prefill"] is True

    asyncio.run(scenario())


def test_admin_endpoints_register_and_deregister_workers_at_run_time() -> None:
    async def scenario() -> None:
        d, p = FakeWorker("decode"), FakeWorker("prefill")
        await p.start()
        try:
            async with cluster([], [], admin_token="s3cret") as (url, router), aiohttp.ClientSession() as s:
                auth = {"Authorization": "Bearer s3cret"}
                assert (await s.get(url + "/health")).status == 503
                assert (await post(url + "/v1/completions", {"prompt": "hi"}))[0] == 503
                assert (
                    await s.post(url + "/pdkv/workers", json={"role": "decode", "url": "http://127.0.0.1:1"})
                ).status == 401
                assert (await s.get(url + "/pdkv/workers", headers={"Authorization": "Bearer wrong"})).status == 401
                await d.start()
                resp = await s.post(url + "/pdkv/workers", json={"role": "decode", "url": d.url + "/"}, headers=auth)
                assert resp.status == 201 and (await resp.json())["worker"]["healthy"] is True
                assert (
                    await s.post(url + "/pdkv/workers", json={"role": "decode", "url": d.url}, headers=auth)
                ).status == 200
                assert (
                    await s.post(url + "/pdkv/workers", json={"role": "prefill", "url": p.url}, headers=auth)
                ).status == 201
                for bad in (
                    {"role": "cache", "url": d.url},
                    {"role": "decode", "url": "127.0.0.1:80"},
                    {"role": "decode"},
                ):
                    assert (await s.post(url + "/pdkv/workers", json=bad, headers=auth)).status == 400
                assert (await s.get(url + "/health")).status == 200
                assert (await post(url + "/v1/completions", {"prompt": "x" * 50}))[0] == 200 and len(p.requests) == 1
                assert (await (await s.get(url + "/v1/models")).json())["data"][0]["id"] == "fake-decode"
                listing = await (await s.get(url + "/pdkv/workers", headers=auth)).json()
                assert (
                    [w["url"] for w in listing["decode"]] == [d.url]
                    and listing["policy"] == "round-robin"
                    and listing["mode"] == "pdkv"
                )
                assert (
                    await s.delete(url + "/pdkv/workers", json={"role": "prefill", "url": p.url}, headers=auth)
                ).status == 200
                assert (
                    await s.delete(url + "/pdkv/workers", json={"role": "prefill", "url": p.url}, headers=auth)
                ).status == 404
                assert (await post(url + "/v1/completions", {"prompt": "x" * 50}))[0] == 200 and len(
                    p.requests
                ) == 1  # deregistered: unused
                text = router.metrics.render().decode()
                assert (
                    metric(text, "pdkv_router_worker_up", role="decode") == 1
                    and metric(text, "pdkv_router_worker_up", role="prefill") == 0
                )
        finally:
            await p.stop()

    asyncio.run(scenario())


def test_health_loop_marks_workers_down_and_up() -> None:
    async def scenario() -> None:
        d = FakeWorker("decode")
        async with cluster([], [d], health_interval_s=0.05) as (url, router):
            worker = router.pool.workers("decode")[0]
            assert worker.healthy
            d.healthy = False
            await wait_for(lambda: not worker.healthy, "the health loop to see the worker fail")
            assert (await post(url + "/v1/completions", {"prompt": "hi"}))[
                0
            ] == 200  # down in our view, tried as a last resort
            d.healthy = True
            await wait_for(lambda: worker.healthy, "the health loop to see the worker back")

    asyncio.run(scenario())
