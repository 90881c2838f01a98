"""What a client is told when the router cannot serve it, and what malformed headers get.

The router's error answers say what the client should do: 503 with ``Retry-After`` (no worker could serve; come
back then), 502 (the workers' answers were broken), 504 (the client's own ``X-Request-Timeout`` passed). The real
``openai`` client is the judge of the first: it retries a 503 after the router's ``Retry-After``. Headers are
fuzzed over a real socket against a router with tenants, served the way ``pdkv launch`` serves it: never a 5xx,
always OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pdkv.config import RouterConfig, convert_config
from pdkv.router.app import Router
from pdkv.router.failures import retry_after
from pdkv.router.pool import WorkerPool

from tests.test_http_input import Loop, serve
from tests.test_router_units import FakeWorker, cluster, post, router_metric, sse_data, wait_for

TENANT_KEY = "fuzz-tenant-key-0123456789"
ADMIN_TOKEN = "fuzz-admin-token"


def refused_url() -> str:
    """The URL of a port nothing listens on: a worker that is down, whose connections are refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def assert_error_shape(status: int, body: Any) -> None:
    """vLLM's (and OpenAI's) error object, its code the answer's status."""
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str), body
    assert error["code"] == status, body


# -- 503 + Retry-After, with the openai client's own retries ------------------------------------------------
def test_the_openai_client_retries_a_503_after_the_routers_retry_after() -> None:
    """Every worker down (connections refused): each attempt is a 503 whose Retry-After the client waits out."""
    seen: list[tuple[float, int, str | None]] = []  # per attempt the router saw: arrival, status, Retry-After

    async def scenario() -> None:
        health = {"health_interval_s": 1.0, "busy_health_interval_s": 0.5, "health_timeout_s": 0.5}
        async with cluster([refused_url()], [refused_url()], **health, retry_after_max_s=5) as (url, router):
            serve_request = router.proxy.generate

            async def recorded(http: web.Request, path: str, chat: bool) -> web.StreamResponse:
                arrived = time.monotonic()
                resp = await serve_request(http, path, chat)
                seen.append((arrived, resp.status, resp.headers.get("Retry-After")))
                return resp

            router.proxy.generate = recorded  # type: ignore[method-assign]
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=2)
            try:
                with pytest.raises(openai.APIStatusError) as err:
                    await client.completions.create(model="m", prompt="x" * 50, max_tokens=4)
            finally:
                await client.close()
            assert err.value.status_code == 503
            assert_error_shape(503, {"error": err.value.body})
            assert "every decode attempt failed" in err.value.message and "unreachable" in err.value.message
            assert router_metric(router, "pdkv_router_errors_total", status="503", cause="connect") == 3

    asyncio.run(scenario())
    assert [status for _, status, _ in seen] == [503, 503, 503]  # the first try and the client's 2 retries
    for (before, _, after), (then, _, _) in zip(seen, seen[1:], strict=False):
        assert after is not None and 1 <= int(after) <= 5
        assert then - before >= int(after)  # the client waited what the router said (its own backoff is < 1 s)


def test_a_worker_back_within_retry_after_serves_the_openai_clients_retry() -> None:
    """The decode worker starts right after the router's first 503: by the Retry-After the router gave, its health
    loop has seen it up, and the client's retry is served."""
    seen: list[tuple[int, bool]] = []  # per attempt: the answer's status, whether the worker was up at arrival

    async def scenario() -> None:
        url_d = refused_url()
        back = FakeWorker("decode")
        health = {"health_interval_s": 3.0, "busy_health_interval_s": 0.5, "health_timeout_s": 0.5}
        async with cluster([], [url_d], **health, retry_after_max_s=5) as (url, router):
            serve_request = router.proxy.generate

            async def recorded(http: web.Request, path: str, chat: bool) -> web.StreamResponse:
                was_up = router.pool.workers("decode")[0].healthy
                resp = await serve_request(http, path, chat)
                seen.append((resp.status, was_up))
                if resp.status == 503:
                    await back.start(int(url_d.rsplit(":", 1)[1]))  # the worker is back, the router not told
                return resp

            router.proxy.generate = recorded  # type: ignore[method-assign]
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=2)
            try:
                answer = await client.completions.create(model="m", prompt="x" * 50, max_tokens=4)
            finally:
                await client.close()
                await back.stop()
            assert answer.choices[0].text == "abc" and len(back.requests) == 1

    asyncio.run(scenario())
    assert seen == [(503, False), (200, True)]


def test_retry_after_is_when_the_health_loop_may_next_find_a_decode_worker_up() -> None:
    async def scenario() -> None:
        config = RouterConfig(health_interval_s=10.0, busy_health_interval_s=1.0, health_timeout_s=2.0)
        async with aiohttp.ClientSession() as session:
            pool = WorkerPool(session, config)
            assert retry_after(pool, "decode", config) == config.retry_after_max_s  # none registered: none comes back
            down, _ = pool.add("decode", "http://127.0.0.1:1")
            down.probed_at = now = time.monotonic()
            # due 10 s after its last probe, started within a tick (1 s), answered within health_timeout_s (2 s)
            assert retry_after(pool, "decode", config, now) == 13
            assert retry_after(pool, "decode", config, now + 4.5) == 9
            assert retry_after(pool, "decode", RouterConfig(health_interval_s=10.0, retry_after_max_s=5), now) == 5
            down.inflight_requests = 1  # a worker with requests on it is probed each busy_health_interval_s
            assert retry_after(pool, "decode", config, now) == 4
            down.probing = True  # a probe under way answers within health_timeout_s of its start
            assert retry_after(pool, "decode", config, now + 0.5) == 2
            up, _ = pool.add("decode", "http://127.0.0.1:2")
            up.healthy = True  # up in the router's view (busy, or failing this request only): at once, or the floor
            assert retry_after(pool, "decode", config, now) == config.retry_after_min_s == 1
            assert retry_after(pool, "decode", RouterConfig(retry_after_min_s=3), now) == 3

    asyncio.run(scenario())


def test_a_floor_above_the_cap_fails_at_start_naming_both() -> None:
    with pytest.raises(ValueError, match="retry_after_min_s.*retry_after_max_s"):
        convert_config({"router": {"retry_after_min_s": 40, "retry_after_max_s": 30}})


# -- 502: broken answers ------------------------------------------------------------------------------------
async def not_json(_w: FakeWorker, _http: web.Request, _body: dict[str, Any]) -> web.Response:
    return web.Response(body=b'{"choices": [', content_type="application/json")


async def html(_w: FakeWorker, _http: web.Request, _body: dict[str, Any]) -> web.Response:
    return web.Response(text="<html>a proxy's error page</html>", content_type="text/html")


async def no_done(_w: FakeWorker, http: web.Request, _body: dict[str, Any]) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(http)
    await resp.write(b'data: {"choices":[{"index":0,"text":"a"}]}\n\n')
    await resp.write_eof()  # a clean end, but no [DONE]: the answer was cut short
    return resp


def test_broken_answers_from_every_decode_worker_are_a_502_and_a_missing_worker_makes_it_a_503() -> None:
    async def scenario() -> None:
        async with cluster([], [FakeWorker("decode", not_json), FakeWorker("decode", html)], max_retries=1) as (
            url,
            router,
        ):
            async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json={"prompt": "hi"}) as resp:
                status, body = resp.status, await resp.json()
                assert "Retry-After" not in resp.headers  # nothing to wait for: the workers answer, badly
            assert status == 502
            assert_error_shape(502, body)
            assert "invalid JSON" in body["error"]["message"] and "Content-Type 'text/html'" in body["error"]["message"]
            assert router_metric(router, "pdkv_router_errors_total", status="502", cause="bad_content_type") == 1
            # a stream request to the same workers: an HTML answer is no stream either
            status, body = await post(url + "/v1/completions", {"prompt": "hi", "stream": True})
            assert status == 502 and body["error"]["type"] == "BadGatewayError"
        async with cluster([], [FakeWorker("decode", not_json), refused_url()], max_retries=1) as (url, router):
            async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json={"prompt": "hi"}) as resp:
                assert resp.status == 503 and int(resp.headers["Retry-After"]) >= 1  # one may be back: try later
                assert_error_shape(503, await resp.json())

    asyncio.run(scenario())


def test_a_stream_that_ends_without_done_ends_with_an_in_band_502() -> None:
    async def scenario() -> None:
        async with cluster([], [FakeWorker("decode", no_done)]) as (url, router):
            status, text = await post(url + "/v1/completions", {"prompt": "hi", "stream": True})
            events = sse_data(text)
            assert status == 200 and events[0] == '{"choices":[{"index":0,"text":"a"}]}' and events[-1] == "[DONE]"
            error = json.loads(events[1])
            assert_error_shape(502, error)
            assert "without [DONE]" in error["error"]["message"] and len(events) == 3
            assert router_metric(router, "pdkv_router_errors_total", status="502", cause="truncated") == 1
            assert router_metric(router, "pdkv_requests_total", outcome="broken") == 1

    asyncio.run(scenario())


# -- 504: the client's deadline -----------------------------------------------------------------------------
async def stall(_w: FakeWorker, _http: web.Request, _body: dict[str, Any]) -> web.Response:
    await asyncio.sleep(30)
    raise AssertionError("unreachable")


async def stall_after_one(w: FakeWorker, http: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(http)
    await resp.write(b'data: {"choices":[{"index":0,"text":"a"}]}\n\n')
    await asyncio.sleep(30)
    raise AssertionError("unreachable")


def test_the_clients_deadline_bounds_every_hop_and_is_answered_504() -> None:
    async def scenario() -> None:
        slow_p, slow_d, spare = FakeWorker("prefill", stall), FakeWorker("decode", stall), FakeWorker("decode")
        async with cluster([slow_p], [slow_d, spare]) as (url, router):
            deadline = {"X-Request-Timeout": "0.6"}
            status, body = await post(url + "/v1/completions", {"prompt": "x" * 50}, headers=deadline)
            assert status == 504
            assert_error_shape(504, body)
            assert body["error"]["type"] == "GatewayTimeoutError" and "X-Request-Timeout" in body["error"]["message"]
            # the prefill hop and the decode hop shared the 0.6 s; no retry on the spare once it was spent
            assert len(slow_p.requests) == 1 and len(slow_d.requests) + len(spare.requests) <= 1
            await wait_for(lambda: slow_p.handlers_cancelled == 1, "the timed-out prefill hop to be cancelled")
            assert router_metric(router, "pdkv_router_errors_total", status="504", cause="deadline") == 1
            assert router_metric(router, "pdkv_requests_total", outcome="deadline") == 1
            assert all(w.healthy for w in router.pool.workers("decode"))  # slow for this client, not dead
            for bad in ("soon", "0", "-1", "1e3", "inf"):
                status, body = await post(url + "/v1/completions", {"prompt": "hi"}, headers={"X-Request-Timeout": bad})
                assert status == 400 and body["error"]["param"] == "X-Request-Timeout", bad
        async with cluster([], [FakeWorker("decode", stall_after_one)]) as (url, router):
            status, text = await post(
                url + "/v1/completions", {"prompt": "hi", "stream": True}, headers={"X-Request-Timeout": "0.5"}
            )
            events = sse_data(text)
            assert status == 200 and events[-1] == "[DONE]" and len(events) == 3
            assert_error_shape(504, json.loads(events[1]))
            assert router_metric(router, "pdkv_router_errors_total", status="504", cause="deadline") == 1
        async with cluster([], [FakeWorker("decode")]) as (url, _):  # a deadline that holds changes nothing
            status, body = await post(url + "/v1/completions", {"prompt": "hi"}, headers={"X-Request-Timeout": "30"})
            assert status == 200 and body["choices"][0]["text"] == "abc"

    asyncio.run(scenario())


# -- malformed headers ----------------------------------------------------------------------------------------
class HeaderTarget:
    """A router with tenants (keys and a gateway header), served as ``pdkv launch`` serves it, over stand-ins."""

    def __init__(self, url: str) -> None:
        self.port = int(url.rsplit(":", 1)[1])

    def send(self, raw: bytes) -> tuple[int, dict[str, str], bytes]:
        """One raw request over a socket; (status, headers, body) of the answer, read until the router closes."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=10) as sock:
            sock.sendall(raw)  # a Content-Length longer than the body: answered 408 after http.body_timeout_s
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
        return int(lines[0].split(" ")[1]), {k.lower(): v for k, v in headers.items()}, body


@pytest.fixture(scope="module")
def header_target() -> Iterator[HeaderTarget]:
    loop = Loop()
    p, d = FakeWorker("prefill"), FakeWorker("decode")
    loop.run(p.start())
    loop.run(d.start())
    config = convert_config(
        {
            "role": "router",
            "router": {
                "prefill": [p.url],
                "decode": [d.url],
                "health_interval_s": 60,
                "admin_token": ADMIN_TOKEN,
                "tenants": [{"name": "a", "api_key": TENANT_KEY}],
                "tenant_header": "X-Tenant",
                "tenant_header_from": ["127.0.0.1"],
                "tenant_salt_secret": "fuzz-salt-secret",
            },
        }
    )
    http = {"body_timeout_s": 0.5, "linger_s": 0.5}
    router = loop.run(Router.start(config.router, convert_config({"http": http}).http))
    app_runner, url = loop.run(serve(router.app(), http))
    try:
        yield HeaderTarget(url)
    finally:
        loop.run(app_runner.cleanup())
        loop.run(router.close())
        loop.run(p.stop())
        loop.run(d.stop())
        loop.close()


BODY = b'{"prompt": "hi", "max_tokens": 2}'


def raw_request(path: str, headers: list[tuple[bytes, bytes]], body: bytes = BODY, method: bytes = b"POST") -> bytes:
    """A request with exactly these header lines (a Content-Length only if they name none, or Transfer-Encoding)."""
    names = {name.lower() for name, _ in headers}
    if not names & {b"content-length", b"transfer-encoding"}:
        headers = [*headers, (b"Content-Length", str(len(body)).encode())]
    lines = b"".join(name + b": " + value + b"\r\n" for name, value in headers)
    start = method + b" " + path.encode() + b" HTTP/1.1\r\nHost: router\r\nConnection: close\r\n"
    return start + lines + b"\r\n" + body


def assert_4xx_in_error_shape(answer: tuple[int, dict[str, str], bytes]) -> None:
    status, headers, body = answer
    assert 400 <= status < 500, answer
    assert headers.get("content-type", "").startswith("application/json"), answer
    assert_error_shape(status, json.loads(body))


def test_an_authorization_header_that_is_not_utf8_is_a_401_not_a_500(header_target: HeaderTarget) -> None:
    for path, method in (("/v1/completions", b"POST"), ("/pdkv/workers", b"GET")):  # a tenant's key, the admin's
        for value in (b"Bearer \xff\xfe\xfd", b"Bearer " + TENANT_KEY.encode() + b"\xc3", b"\xe9t\xe9 key"):
            answer = header_target.send(raw_request(path, [(b"Authorization", value)], method=method))
            assert answer[0] == 401, answer
            assert_4xx_in_error_shape(answer)
    for name in (b"X-Tenant", b"X-Request-Timeout"):
        answer = header_target.send(raw_request("/v1/completions", [(name, b"\xff\xfe")]))
        assert_4xx_in_error_shape(answer)
    ok = header_target.send(raw_request("/v1/completions", [(b"Authorization", b"Bearer " + TENANT_KEY.encode())]))
    assert ok[0] == 200 and json.loads(ok[2])["choices"][0]["text"] == "abc"  # the same request, well formed


HEADER_NAMES = [
    b"Authorization",
    b"X-Tenant",
    b"X-Request-Timeout",
    b"X-Request-Id",
    b"Content-Type",
    b"Content-Length",
    b"Transfer-Encoding",
    b"Accept",
]
# any byte but CR and LF, which would end the header line (the request's framing is what is fuzzed, not its end)
RAW_BYTES = st.binary(max_size=40).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))
# what a header value may hold (visible ASCII, space, tab, obs-text), so the parser passes it to the router
VALUE_BYTES = st.lists(st.one_of(st.integers(0x20, 0x7E), st.integers(0x80, 0xFF), st.just(9)), max_size=40).map(bytes)
NAMES = st.one_of(
    st.sampled_from(HEADER_NAMES),
    st.from_regex(rb"\AX-[A-Za-z0-9-]{1,20}\Z"),  # headers the router does not read must not matter either
    RAW_BYTES.filter(bool),
)


@st.composite
def header_value(draw: st.DrawFn, name: bytes) -> bytes:
    """Raw bytes, bytes a parser takes, or something close to what the header means (to reach past the first
    check)."""
    near = {
        b"Authorization": st.sampled_from([b"Bearer ", b"bearer ", b"Basic ", b""]).map(
            lambda scheme: scheme + TENANT_KEY.encode()
        ),
        b"X-Tenant": st.sampled_from([b"a", b"b", b""]),
        b"X-Request-Timeout": st.sampled_from([b"5", b"0.001", b"1e9", b"999999999.5", b"-0", b" 2 "]),
        b"Content-Length": st.sampled_from([b"0", b"3", str(len(BODY)).encode(), b"-1", b"1" * 30, b"0x10"]),
        b"Transfer-Encoding": st.sampled_from([b"chunked", b"gzip", b"chunked, chunked", b"identity"]),
        b"Content-Type": st.sampled_from([b"application/json", b"text/plain; charset=\xff", b"multipart/form-data"]),
    }.get(name, st.nothing())
    value: bytes = draw(
        st.one_of(near, near.flatmap(lambda v: VALUE_BYTES.map(lambda b: v + b)), VALUE_BYTES, RAW_BYTES)
    )
    return value


@st.composite
def header_sets(draw: st.DrawFn) -> list[tuple[bytes, bytes]]:
    """Up to five fuzzed headers; a tenant's valid key unless they set Authorization, so the rest are read too."""
    names = draw(st.lists(NAMES, max_size=5))
    headers = [(name, draw(header_value(name))) for name in names]
    if b"authorization" not in {name.lower() for name in names}:
        headers.append((b"Authorization", b"Bearer " + TENANT_KEY.encode()))
    return headers


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(headers=header_sets(), path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/pdkv/kv-index"]))
def test_fuzzed_headers_never_get_a_5xx_and_always_the_error_shape(
    header_target: HeaderTarget, headers: list[tuple[bytes, bytes]], path: str
) -> None:
    status, _, _ = answer = header_target.send(raw_request(path, headers))
    event(f"answered {status}")  # --hypothesis-show-statistics: how far the examples got
    assert status < 500, answer
    if status >= 400:
        assert_4xx_in_error_shape(answer)
