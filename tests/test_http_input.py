"""Bad HTTP input against real workers and the router: a 4xx in vLLM's error shape, never a 500, never a stall.

One stack serves the module: an in-process prefill and decode worker (tiny
model, tcp channel, a shared secret) and a router in front of them, each on
a real socket, run by one event loop on a background thread; the tests talk
to them with plain HTTP clients and raw sockets. A second decode worker with
a long context serves the tests that need prompts of megabytes.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.parse
from collections.abc import Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
from aiohttp import web

from pdkv.auth import control_token
from pdkv.config import convert_config
from pdkv.engine.reference import ReferenceEngine
from pdkv.http.web import runner
from pdkv.router.app import Router
from pdkv.testing.http import metric, request
from pdkv.testing.model import write_tiny_model
from pdkv.transfer.params import sign_push
from pdkv.worker.server import Worker

from tests.conftest import wait_until

T = TypeVar("T")
SECRET = "http-input-secret"
HTTP_LIMITS = {"max_body_bytes": 256 << 10, "body_timeout_s": 1.0}
PROMPT = (
    "The quick brown fox jumps over the lazy dog. Prefill computes the prompt; decode generates one token at a time."
)


class Loop:
    """An event loop on a thread of its own, so in-process servers keep serving while a test blocks."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


async def serve(app: web.Application, settings: dict[str, Any]) -> tuple[web.AppRunner, str]:
    app_runner = runner(app, convert_config({"http": settings}).http)
    await app_runner.setup()
    await web.TCPSite(app_runner, "127.0.0.1", 0).start()
    return app_runner, f"http://127.0.0.1:{app_runner.addresses[0][1]}"


@dataclass
class Stack:
    loop: Loop
    prefill: Worker
    decode: Worker
    router: Router
    urls: dict[str, str]  # prefill, decode, router


def worker(model: Path, role: str, **settings: Any) -> Worker:
    config = convert_config(
        {
            "role": role,
            "model": str(model),
            "secret": SECRET,
            "channel": {"name": "tcp"},
            "num_blocks": 128,
            "transfer": {"chunk_size": 32, "transfer_timeout_s": 30},
            "http": HTTP_LIMITS,
            **settings,
        }
    )
    return Worker(
        config, ReferenceEngine.load(str(model), progress=False, max_kv_tokens=config.num_blocks * config.block_size)
    )


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def stack(model: Path) -> Iterator[Stack]:
    loop = Loop()
    p, d = worker(model, "prefill"), worker(model, "decode")
    runners = []
    urls = {}
    for role, w in (("prefill", p), ("decode", d)):
        r, urls[role] = loop.run(serve(w.app(), HTTP_LIMITS))
        runners.append(r)
    router_config = convert_config(
        {
            "role": "router",
            "secret": SECRET,
            "router": {"prefill": [urls["prefill"]], "decode": [urls["decode"]], "health_interval_s": 60},
        }
    )
    router_http = convert_config({"http": {**HTTP_LIMITS, "idle_timeout_s": 2.0}}).http
    router = loop.run(Router.start(router_config.router, router_http, SECRET))
    r, urls["router"] = loop.run(serve(router.app(), {**HTTP_LIMITS, "idle_timeout_s": 2.0}))
    runners.append(r)
    try:
        yield Stack(loop, p, d, router, urls)
    finally:
        for r in reversed(runners):
            loop.run(r.cleanup())
        loop.run(router.close())
        loop.close()


def post(url: str, body: dict[str, Any] | bytes) -> tuple[int, Any]:
    status, data = request("POST", url, body)
    return status, json.loads(data)


def chat(content: Any, role: Any = "user", **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": role, "content": content}], "max_tokens": 2, **extra}


DEEP = 100_000
# (name, path, body, status, param): every one of these was a 500, a 200 that ignored the field, or a stall.
BAD = [
    (
        "content-image-part",
        "chat",
        chat([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]),
        400,
        "messages",
    ),
    ("content-int", "chat", chat(5), 400, "messages"),
    ("content-null", "chat", chat(None), 400, "messages"),
    ("role-int", "chat", chat("hi", role=3), 400, "messages"),
    ("lone-surrogate-prompt", "completions", b'{"prompt": "abc \\ud800 def", "max_tokens": 2}', 400, "prompt"),
    (
        "lone-surrogate-chat",
        "chat",
        b'{"messages": [{"role": "user", "content": "x\\udfff"}], "max_tokens": 2}',
        400,
        "messages",
    ),
    ("nested-100000", "completions", b'{"prompt": ' + b"[" * DEEP + b"]" * DEEP + b"}", 400, None),
    ("token-2**80", "completions", {"prompt": [5, 2**80, 7], "max_tokens": 2}, 400, None),
    ("max-tokens-true", "completions", {"prompt": PROMPT, "max_tokens": True}, 400, "max_tokens"),
    ("temperature-Infinity", "completions", b'{"prompt": "hi", "max_tokens": 2, "temperature": Infinity}', 400, None),
    ("temperature-1e400", "completions", b'{"prompt": "hi", "max_tokens": 2, "temperature": 1e400}', 400, None),
    ("stream-string", "completions", {"prompt": "hi", "max_tokens": 2, "stream": "yes"}, 400, "stream"),
    ("logprobs-21", "completions", {"prompt": "hi", "max_tokens": 2, "logprobs": 21}, 400, "logprobs"),
    ("top-logprobs-alone", "chat", chat("hi", top_logprobs=2), 400, "top_logprobs"),
    (
        "presence-penalty",
        "completions",
        {"prompt": "hi", "max_tokens": 2, "presence_penalty": 0.5},
        400,
        "presence_penalty",
    ),
    ("unknown-model", "completions", {"prompt": "hi", "max_tokens": 2, "model": "gpt-5"}, 404, "model"),
    ("cache-salt-int", "completions", {"prompt": "hi", "max_tokens": 2, "cache_salt": 7}, 400, "cache_salt"),
    ("cache-salt-empty", "chat", chat("hi", cache_salt=""), 400, "cache_salt"),
    ("not-json", "completions", b'{"prompt": "hi",', 400, None),
    ("prompt-past-the-context", "completions", {"prompt": "x" * 100_000, "max_tokens": 2}, 400, "prompt"),
    ("body-too-large", "completions", {"prompt": "x" * (300 << 10)}, 413, None),
]


@pytest.mark.parametrize("target", ["prefill", "decode", "router"])
@pytest.mark.parametrize(("name", "path", "body", "status", "param"), BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_a_4xx_in_vllm_error_shape(
    stack: Stack, target: str, name: str, path: str, body: dict[str, Any] | bytes, status: int, param: str | None
) -> None:
    got, answer = post(f"{stack.urls[target]}/v1/{'chat/' if path == 'chat' else ''}completions", body)
    assert got == status, answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert error["type"] == {400: "BadRequestError", 404: "NotFoundError", 413: "RequestTooLargeError"}[status]
    assert "Traceback" not in error["message"] and error["message"] and error["param"] == param


def test_text_content_parts_are_joined_as_vllm_does_and_null_assistant_content_is_empty(stack: Stack) -> None:
    greedy = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    parts = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "the quick"}, {"type": "text", "text": "brown fox"}]}
        ],
        **greedy,
    }
    joined = {"messages": [{"role": "user", "content": "the quick\nbrown fox"}], **greedy}
    for target in ("decode", "router"):
        status, a = post(stack.urls[target] + "/v1/chat/completions", parts)
        assert status == 200, a
        assert (
            a["choices"][0]["prompt_token_ids"]
            == post(stack.urls["decode"] + "/v1/chat/completions", joined)[1]["choices"][0]["prompt_token_ids"]
        )
    with_tool_turn = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": []},
            {"role": "user", "content": "and?"},
        ],
        **greedy,
    }
    assert post(stack.urls["decode"] + "/v1/chat/completions", with_tool_turn)[0] == 200


def sse_events(data: bytes) -> list[dict[str, Any]]:
    lines = [line[6:] for line in data.decode().splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1] if json.loads(line).get("choices")]


def test_logprobs_through_prefill_and_decode_equal_one_process(stack: Stack) -> None:
    """logprobs (completions) and logprobs/top_logprobs (chat), whole and streamed, via P -> D with the KV moved,
    match the decode worker computing the prompt itself: P/D fidelity, measured per token."""

    def d_metrics() -> str:
        return request("GET", stack.urls["decode"] + "/metrics")[1].decode()

    transferred, fallbacks = (
        metric(d_metrics(), "pdkv_prompt_tokens_total", source="transferred"),
        metric(d_metrics(), "pdkv_fallbacks_total"),
    )
    greedy = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    cases = [
        ("completions", {"prompt": PROMPT, "logprobs": 3, **greedy}),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": PROMPT}], "logprobs": True, "top_logprobs": 2, **greedy},
        ),
    ]
    prompt_tokens = 0
    for path, body in cases:
        alone = post(f"{stack.urls['decode']}/v1/{path}", body)[1]
        via = post(f"{stack.urls['router']}/v1/{path}", body)[1]
        prompt_tokens += via["usage"]["prompt_tokens"]
        assert (
            via["choices"][0]["logprobs"] == alone["choices"][0]["logprobs"]
            and via["choices"][0]["logprobs"] is not None
        )
        status, streamed = request(
            "POST", f"{stack.urls['router']}/v1/{path}", json.dumps({**body, "stream": True}).encode()
        )
        prompt_tokens += via["usage"]["prompt_tokens"]
        blocks = [e["choices"][0]["logprobs"] for e in sse_events(streamed)]
        lp = alone["choices"][0]["logprobs"]
        if path == "chat/completions":
            assert [c for b in blocks for c in b["content"]] == lp["content"]
            assert len(lp["content"]) == 6 and all(len(c["top_logprobs"]) == 2 for c in lp["content"])
            assert all(
                c["logprob"] == c["top_logprobs"][0]["logprob"] <= 0 for c in lp["content"]
            )  # greedy: the top token
        else:
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                assert [x for b in blocks for x in b[key]] == lp[key]
            assert len(lp["tokens"]) == 6 and all(
                1 <= len(t) <= 4 for t in lp["top_logprobs"]
            )  # the 3 best and the chosen one
            assert all(lp["tokens"][i] in lp["top_logprobs"][i] and lp["token_logprobs"][i] <= 0 for i in range(6))
    assert (
        metric(d_metrics(), "pdkv_prompt_tokens_total", source="transferred") == transferred + prompt_tokens
    )  # the KV moved every time
    assert metric(d_metrics(), "pdkv_fallbacks_total") == fallbacks


def open_socket(url: str) -> socket.socket:
    parts = urllib.parse.urlsplit(url)
    return socket.create_connection((parts.hostname, parts.port), timeout=10)


def read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


@pytest.mark.parametrize("target", ["decode", "router"])
def test_a_half_sent_body_is_answered_408_and_its_connection_closed(stack: Stack, target: str) -> None:
    started = time.monotonic()
    with ThreadPoolExecutor(8) as pool:

        def half_sent(_: int) -> bytes:
            with open_socket(stack.urls[target]) as sock:
                sock.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                    b'1000\r\n\r\n{"prompt": "a'
                )
                return read_until_closed(sock)  # the socket's own 10 s timeout fails the test if the server waits on

        answers = list(pool.map(half_sent, range(8)))
    assert time.monotonic() - started < 9  # body_timeout_s is 1 s: no one waited for a body that never came
    for answer in answers:
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and json.loads(body)["error"]["type"] == "RequestTimeoutError"


@pytest.mark.parametrize("target", ["decode", "router"])
def test_a_client_that_hangs_up_mid_body_is_not_an_error(
    stack: Stack, target: str, caplog: pytest.LogCaptureFixture
) -> None:
    with open_socket(stack.urls[target]) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
            b'1000\r\n\r\n{"prompt": "a'
        )
        time.sleep(0.2)
    time.sleep(0.3)
    assert [
        r.getMessage() for r in caplog.records if r.levelno >= 40
    ] == []  # no traceback logged for the client's choice
    assert request("GET", stack.urls[target] + "/health")[0] == 200


def test_half_sent_headers_are_closed_after_idle_timeout(stack: Stack) -> None:
    with open_socket(stack.urls["router"]) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
        assert (
            read_until_closed(sock) == b""
        )  # closed (idle_timeout_s 2 s), not held open (aiohttp's default is an hour)


def test_worker_control_endpoints_want_the_secrets_token(stack: Stack) -> None:
    """Without the token a DELETE changes nothing (the transfer id still works); with it the transfer is cancelled."""

    def delete(tid: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        return request("DELETE", f"{stack.urls['decode']}/pdkv/transfers/{tid}", headers=headers)

    info = json.loads(
        request("GET", stack.urls["decode"] + "/pdkv/info")[1]
    )  # reads stay open: the router needs no token for them
    kv = {"do_remote_decode": True, "remote_host": info["remote_host"], "remote_port": info["remote_port"]}

    def prefill(tid: str) -> bool:
        status, answer = post(
            stack.urls["prefill"] + "/v1/completions",
            {"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": sign_push({**kv, "transfer_id": tid}, SECRET)},
        )
        assert status == 200
        stack.decode.receiver.cancel(tid, "test cleanup")  # type: ignore[union-attr]
        return bool(answer["kv_transfer_params"]["transfer_started"])

    for headers in (None, {"Authorization": "Bearer " + SECRET}, {"Authorization": "Bearer wrong"}):
        status, answer = delete("t-open", headers)
        assert status == 401 and json.loads(answer)["error"]["type"] == "AuthenticationError"
    assert prefill("t-open") is True  # the refused cancels did nothing
    status, _ = delete("t-closed", {"Authorization": "Bearer " + control_token(SECRET)})
    assert status == 200
    assert prefill("t-closed") is False  # cancelled before it began: the late prefill cannot take the id
    wait_until(
        lambda: stack.decode.receiver.stats()["reservations"] == 0, what="the decode worker to free every reservation"
    )  # type: ignore[union-attr]


def test_the_router_cancels_abandoned_transfers_with_the_token(stack: Stack) -> None:
    """A prefill hop refused (here: a 404) leaves a transfer on D that the router cancels, authorized."""

    def router_metrics() -> str:
        return request("GET", stack.urls["router"] + "/metrics")[1].decode()

    before = metric(router_metrics(), "pdkv_router_transfer_cancels_total", outcome="ok")
    status, _ = post(stack.urls["router"] + "/v1/completions", {"prompt": PROMPT, "model": "not-served"})
    assert status == 404
    wait_until(
        lambda: metric(router_metrics(), "pdkv_router_transfer_cancels_total", outcome="ok") == before + 1,
        what="the router's cancel to be accepted",
    )
    assert metric(router_metrics(), "pdkv_router_transfer_cancels_total", outcome="refused") == 0
    # and the admin endpoints, with no admin_token of their own, want the same token
    assert request("GET", stack.urls["router"] + "/pdkv/workers")[0] == 401
    assert (
        request(
            "GET", stack.urls["router"] + "/pdkv/workers", headers={"Authorization": "Bearer " + control_token(SECRET)}
        )[0]
        == 200
    )


@pytest.fixture(scope="module")
def long_context(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Loop, str]]:
    """A decode worker whose context is 64k tokens: megabyte prompts pass the length bound and are tokenized."""
    model = write_tiny_model(tmp_path_factory.mktemp("long") / "tiny", max_position_embeddings=1 << 16)
    loop = Loop()
    w = worker(model, "decode", num_blocks=4096, http={})
    app_runner, url = loop.run(serve(w.app(), {}))
    try:
        yield loop, url
    finally:
        loop.run(app_runner.cleanup())
        loop.close()


def test_a_long_prompt_is_tokenized_off_the_event_loop(long_context: tuple[Loop, str]) -> None:
    """While a prompt of ~250k tokens is tokenized (and then refused: past the context), /health keeps answering."""
    _, url = long_context
    text = (PROMPT + " ") * 6500  # ~750 KB, just under the length bound of 64k tokens x 13 bytes
    with ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        big = pool.submit(post, url + "/v1/completions", {"prompt": text, "max_tokens": 1})
        pings = []
        while not big.done():
            t = time.monotonic()
            assert request("GET", url + "/health")[0] == 200
            pings.append(time.monotonic() - t)
            time.sleep(0.02)
        took = time.monotonic() - started
    status, answer = big.result()
    assert status == 400 and "exceeds this engine's context" in answer["error"]["message"]
    assert len(pings) >= 3 and max(pings) < took / 2, (
        max(pings),
        took,
    )  # tokenizing on the loop held /health for all of it


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def test_ten_megabyte_prompts_are_refused_before_tokenizing(long_context: tuple[Loop, str]) -> None:
    """Tokenizing 10 MB took 14 s and ~1 GB that the allocator kept: now the length bound refuses it first."""
    _, url = long_context
    before = rss_mib()
    for _ in range(3):
        status, answer = post(
            url + "/v1/completions", {"prompt": "lorem ipsum dolor sit amet " * 400_000, "max_tokens": 1}
        )
        assert status == 400 and "at least" in answer["error"]["message"] and answer["error"]["param"] == "prompt"
    assert rss_mib() - before < 200
