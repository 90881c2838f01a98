"""Two tenants behind one router share workers and a Redis tier, and never each other's KV.

Real parts: a prefill and a decode ``pdkv launch`` process (tiny model; the
prefill worker's tier is memory + a real redis-server, with KV events on), a
``pdkv launch --role router`` process with two tenants, and HTTP. Timing is
asserted through what the workers count, never wall time: a cross-tenant
request computes every prompt token (as a cold one does) and loads none from
any level, which is what makes its first token no sooner than a cold one's.
The admission rules themselves (keys, gateway addresses, limits) are unit
tested at the end against the middleware.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import redis
import yaml
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from pdkv.config import convert_config
from pdkv.errors import ConfigError, RequestError
from pdkv.router.tenants import TENANT_KEY, Tenants, client_salt, tenant_salt
from pdkv.testing.http import get_text, metric, post_json
from pdkv.testing.procs import WorkerProcess, start_configured, start_worker
from pdkv.testing.redis import LocalRedis

from tests.conftest import wait_until

CHUNK = 32
PROMPT = [(i * 37) % 300 + 3 for i in range(100)]  # 3 full chunks + 4 tokens: 96 tokens loadable from the tier
ONLY_A = [(i * 11) % 280 + 7 for i in range(100)]
KEY_A, KEY_B = "tenant-a-key-0123456789", "tenant-b-key-9876543210"
SALT_SECRET = "salt-secret-for-the-test"
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


@dataclass
class Deployment:
    router: WorkerProcess
    prefill: WorkerProcess
    decode: WorkerProcess
    redis: redis.Redis
    namespace: str


@pytest.fixture(scope="module")
def deployment(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path, redis_server: LocalRedis
) -> Iterator[Deployment]:
    tmp = tmp_path_factory.mktemp("tenants")
    namespace = f"tenants-{tmp.name}:"
    common = {"model": str(model_dir), "num_blocks": 256, "transfer": {"chunk_size": CHUNK}}
    prefill_cfg = {
        **common,
        "tier": {"redis_url": redis_server.url, "redis_namespace": namespace},
        "kv_events": {"enable_kv_cache_events": True, "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"},
    }
    with ThreadPoolExecutor(2) as pool:
        p_future = pool.submit(
            start_configured, "prefill", prefill_cfg, tmp / "prefill.yaml", timeout=180, env=ONE_THREAD
        )
        d_future = pool.submit(
            start_configured,
            "decode",
            {**common, "tier": {"enabled": False}},
            tmp / "decode.yaml",
            timeout=180,
            env=ONE_THREAD,
        )
        p, d = p_future.result(), d_future.result()
    router_cfg = {
        "router": {
            "policy": "prefix",
            "tokenizer": str(model_dir),
            "prefix_chunk_tokens": CHUNK,
            "kv_events_check_s": 0.5,
            "tenant_salt_secret": SALT_SECRET,
            "tenants": [
                {"name": "a", "api_key": KEY_A},
                {"name": "b", "api_key_sha256": hashlib.sha256(KEY_B.encode()).hexdigest(), "max_tokens": 8},
            ],
            "tenant_header": "X-Tenant",
            "tenant_header_from": ["10.255.255.0/24"],  # the gateway is elsewhere: this host is not it
        }
    }
    (tmp / "router.yaml").write_text(yaml.safe_dump(router_cfg))
    router = start_worker(
        "router",
        "--config",
        str(tmp / "router.yaml"),
        "--port",
        "0",
        "--prefill",
        p.url,
        "--decode",
        d.url,
        timeout=120,
    )
    try:
        yield Deployment(router, p, d, redis.Redis.from_url(redis_server.url), namespace)
    finally:
        for proc in (router, p, d):
            proc.stop()


def complete(dep: Deployment, key: str, prompt: list[int], **extra: Any) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True, **extra}
    return post_json(dep.router.url + "/v1/completions", body, headers={"Authorization": f"Bearer {key}"})


def counts(dep: Deployment) -> dict[str, float]:
    """What the workers counted so far: prefill tier hits (every level) and prompt tokens by source, decode's
    transferred."""
    p, d = get_text(dep.prefill.url + "/metrics"), get_text(dep.decode.url + "/metrics")
    return {
        "hits": metric(p, "pdkv_tier_hits_total"),
        "tier_tokens": metric(p, "pdkv_prompt_tokens_total", source="tier"),
        "computed": metric(p, "pdkv_prompt_tokens_total", source="computed"),
        "transferred": metric(d, "pdkv_prompt_tokens_total", source="transferred"),
    }


def served(dep: Deployment, key: str, prompt: list[int], **extra: Any) -> dict[str, float]:
    """Send one request; what it cost the workers (deltas of ``counts``). Its KV must have come over the channel."""
    before = counts(dep)
    answer = complete(dep, key, prompt, **extra)
    after = counts(dep)
    delta = {k: after[k] - before[k] for k in after}
    assert answer["usage"]["prompt_tokens"] == len(prompt)
    assert delta["transferred"] == len(prompt)  # P computed or loaded it, and D got it over the channel
    return delta


def in_redis(dep: Deployment) -> int:
    return len(dep.redis.keys(dep.namespace + "*"))


def status_of(
    url: str, body: dict[str, Any] | None = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any]]:
    data = json.dumps(body or {"prompt": PROMPT, "max_tokens": 2}).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_tenants_share_workers_and_redis_but_no_kv(deployment: Deployment) -> None:
    dep = deployment
    cold = served(dep, KEY_A, PROMPT)
    assert (cold["hits"], cold["computed"]) == (0, len(PROMPT))
    wait_until(lambda: in_redis(dep) == 3, 30, "A's three full chunks written behind to Redis")
    cross = served(dep, KEY_B, PROMPT)  # the same tokens from B: nothing cached counts, at any level
    assert cross == cold
    wait_until(lambda: in_redis(dep) == 6, 30, "B's chunks in Redis under keys of their own")
    again = served(dep, KEY_A, PROMPT)  # A's own partition still serves A
    assert (again["hits"], again["tier_tokens"], again["computed"]) == (3, 96, len(PROMPT) - 96)
    # a client salt makes a partition inside the tenant: A's hits A's, and B copying it gets nothing of A's
    assert served(dep, KEY_A, ONLY_A, cache_salt="shared-words")["hits"] == 0
    assert served(dep, KEY_A, ONLY_A, cache_salt="shared-words")["hits"] == 3
    copied = served(dep, KEY_B, ONLY_A, cache_salt="shared-words")
    assert (copied["hits"], copied["computed"]) == (0, len(ONLY_A))
    # a client naming A's salt itself (which it cannot compute, the test can) is put in its own tenant's partition
    forged = served(dep, KEY_B, PROMPT, cache_salt=tenant_salt(SALT_SECRET, "a"))
    assert (forged["hits"], forged["computed"]) == (0, len(PROMPT))


def test_kv_index_answers_each_tenant_for_its_own_prompts(deployment: Deployment) -> None:
    dep = deployment
    only_a = ONLY_A[:70] + [5] * 30
    complete(dep, KEY_A, only_a)
    index = dep.router.url + "/pdkv/kv-index"

    def cached(key: str, prompt: list[int], **extra: Any) -> int:
        return int(
            post_json(index, {"prompt": prompt, **extra}, headers={"Authorization": f"Bearer {key}"})["cached_tokens"][
                dep.prefill.url
            ]
        )

    wait_until(lambda: cached(KEY_A, only_a) == 96, 30, "A's prompt in the router's index, for A")
    assert cached(KEY_B, only_a) == 0
    assert cached(KEY_A, only_a, cache_salt="another-partition") == 0
    assert status_of(index, {"prompt": only_a})[0] == 401  # no tenant, no answer
    assert status_of(index, {"prompt": only_a}, {"Authorization": "Bearer not-a-tenant-key-0000"})[0] == 401


def test_requests_without_a_tenant_are_refused_before_any_worker_sees_them(deployment: Deployment) -> None:
    dep = deployment
    url = dep.router.url + "/v1/completions"
    before = counts(dep)
    status, body = status_of(url)
    assert status == 401 and body["error"]["type"] == "AuthenticationError" and "Bearer" in body["error"]["message"]
    assert status_of(url, headers={"Authorization": "Bearer wrong-key-0123456789"})[0] == 401
    assert status_of(url, headers={"Authorization": KEY_A})[0] == 401  # not a Bearer
    # the gateway header is taken only from the gateway's network: from here it is refused, even with a valid key
    status, body = status_of(url, headers={"X-Tenant": "a", "Authorization": f"Bearer {KEY_A}"})
    assert status == 403 and "tenant_header_from" in body["error"]["message"]
    # B's bound on generated tokens
    status, body = status_of(url, {"prompt": PROMPT, "max_tokens": 9}, {"Authorization": f"Bearer {KEY_B}"})
    assert status == 400 and body["error"]["param"] == "max_tokens"
    assert counts(dep) == before  # no refused request reached a worker
    models = urllib.request.Request(dep.router.url + "/v1/models", headers={"Authorization": f"Bearer {KEY_A}"})
    assert urllib.request.urlopen(models, timeout=30).status == 200
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(dep.router.url + "/v1/models", timeout=30)
    assert err.value.code == 401
    assert urllib.request.urlopen(dep.router.url + "/health", timeout=30).status == 200  # health stays open


def test_decode_adopts_pushed_kv_only_under_the_salt_it_was_computed_for(deployment: Deployment) -> None:
    """Behind the router's back: P prefills under one salt and pushes; a decode request for the same tokens under
    another salt does not adopt that KV (the Reserve's prompt key is salted) and computes the prompt itself; under
    the same salt it adopts it."""
    dep = deployment
    info = json.loads(get_text(dep.decode.url + "/pdkv/info"))
    d_before = get_text(dep.decode.url + "/metrics")
    for tid, d_salt in (("t-other", "salt-b"), ("t-same", "salt-a")):
        push = {
            "do_remote_decode": True,
            "remote_host": info["remote_host"],
            "remote_port": info["remote_port"],
            "transfer_id": tid,
        }
        body = {"prompt": ONLY_A, "max_tokens": 1, "temperature": 0, "cache_salt": "salt-a", "kv_transfer_params": push}
        answer = post_json(dep.prefill.url + "/v1/completions", body)
        post_json(
            dep.decode.url + "/v1/completions",
            {**body, "max_tokens": 2, "cache_salt": d_salt, "kv_transfer_params": answer["kv_transfer_params"]},
        )
    d_after = get_text(dep.decode.url + "/metrics")

    def grew(name: str, **labels: str) -> float:
        return metric(d_after, name, **labels) - metric(d_before, name, **labels)

    assert grew("pdkv_fallbacks_total", reason="prompt_mismatch") == 1
    assert grew("pdkv_prompt_tokens_total", source="transferred") == len(ONLY_A)  # only the same-salt one
    assert grew("pdkv_prompt_tokens_total", source="computed") == len(ONLY_A)


# -- the admission rules, unit by unit ------------------------------------------------------------------
def tenants(**router: Any) -> Tenants:
    config = convert_config(
        {
            "secret": "s3cret",
            "router": {
                "tenants": [
                    {"name": "a", "api_key": KEY_A},
                    {"name": "b", "api_key": KEY_B, "max_concurrent_requests": 1},
                ],
                **router,
            },
        }
    )
    found = Tenants.of(config.router, config.secret)
    assert found is not None
    return found


def request(peer: str, **headers: str) -> web.Request:
    transport = mock.Mock()
    transport.get_extra_info.side_effect = lambda name, default=None: (peer, 40000) if name == "peername" else default
    return make_mocked_request("POST", "/v1/completions", headers=headers, transport=transport)


def test_keys_and_the_gateway_decide_the_tenant() -> None:
    t = tenants(tenant_header="X-Tenant", tenant_header_from=["10.0.0.0/8", "fd00::/8"])
    assert t.authenticate(request("127.0.0.1", Authorization=f"Bearer {KEY_B}")).name == "b"
    assert t.authenticate(request("10.1.2.3", **{"X-Tenant": "a"})).name == "a"
    assert (
        t.authenticate(request("::ffff:10.1.2.3", **{"X-Tenant": "b"})).name == "b"
    )  # a dual-stack socket's IPv4 peer
    assert t.authenticate(request("fd00::1", **{"X-Tenant": "a"})).name == "a"
    for req, status in (
        (request("127.0.0.1", **{"X-Tenant": "a"}), 403),
        (request("11.0.0.1", **{"X-Tenant": "a", "Authorization": f"Bearer {KEY_A}"}), 403),
        (request("10.1.2.3", **{"X-Tenant": "nobody"}), 401),
        (request("127.0.0.1", Authorization="Basic " + KEY_A), 401),
        (request("127.0.0.1", Authorization=f"Bearer {KEY_A}x"), 401),
    ):
        with pytest.raises(RequestError) as err:
            t.authenticate(req)
        assert err.value.status == status


def test_the_salt_is_the_routers_and_the_bounds_hold() -> None:
    t = tenants()
    req = request("127.0.0.1")
    req[TENANT_KEY] = t.tenants["a"]
    body: dict[str, Any] = {"prompt": [1], "cache_salt": "mine"}
    salt = t.scope(req, body)
    assert body["cache_salt"] == salt == client_salt(tenant_salt("s3cret", "a"), "mine")
    plain: dict[str, Any] = {"prompt": [1]}
    assert t.scope(req, plain) == plain["cache_salt"] == tenant_salt("s3cret", "a") != tenant_salt("s3cret", "b")
    with pytest.raises(RequestError, match="cache_salt"):
        t.scope(req, {"prompt": [1], "cache_salt": 5})

    async def limited() -> list[int]:
        release = asyncio.Event()

        async def handler(_: web.Request) -> web.StreamResponse:
            await release.wait()
            return web.Response()

        middleware = t.middleware(lambda _: True)
        first = asyncio.ensure_future(middleware(request("127.0.0.1", Authorization=f"Bearer {KEY_B}"), handler))
        await asyncio.sleep(0)
        second = await middleware(request("127.0.0.1", Authorization=f"Bearer {KEY_B}"), handler)
        release.set()
        return [(await first).status, second.status]

    assert asyncio.run(limited()) == [200, 429]
    assert t.tenants["b"].inflight == 0


def test_tenant_configs_that_cannot_work_are_refused() -> None:
    for router, message in (
        ({"tenants": [{"name": "a", "api_key": KEY_A}]}, "needs a secret"),
        (
            {
                "tenants": [
                    {"name": "a", "api_key": KEY_A},
                    {"name": "b", "api_key_sha256": hashlib.sha256(KEY_A.encode()).hexdigest()},
                ]
            },
            "same API key",
        ),
        ({"tenants": [{"name": "a"}]}, "no api_key"),
        ({"tenants": [{"name": "a", "api_key": KEY_A}], "tenant_header": "X-Tenant"}, "tenant_header_from"),
        (
            {
                "tenants": [{"name": "a", "api_key": KEY_A}],
                "tenant_header": "X-Tenant",
                "tenant_header_from": ["not-a-net"],
            },
            "not an IP address",
        ),
    ):
        raw: dict[str, Any] = {"router": router} if message == "needs a secret" else {"secret": "s", "router": router}
        with pytest.raises(ConfigError, match=message) as err:
            convert_config(raw)
        assert KEY_A not in str(err.value)  # a key never appears in an error message
