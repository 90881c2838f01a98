"""The router's HTTP surface: the OpenAI API, health, metrics and the admin endpoints.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (streamed or
not) go through ``Proxy``; ``GET /v1/models`` is a decode worker's.
``GET /health`` is 200 while at least one decode worker is healthy (a
router with none cannot answer anything), 503 otherwise.

Admin, for workers that come and go at run time (autoscaling, rolling
restarts), guarded by ``Authorization: Bearer <router.admin_token>`` when
one is set, else, with a ``secret``, by the secret's control token
(``pdkv.auth.control_token``, the one the workers' control endpoints want;
the router sends it when it cancels a transfer on a decode worker):

* ``GET /pdkv/workers``: every worker, its health and the router's load on it;
* ``POST /pdkv/workers`` ``{"role": "prefill"|"decode", "url": ...}``:
  register (checked at once; 201, or 200 if it was known);
* ``DELETE /pdkv/workers`` with the same body: deregister (404 if unknown);
  requests already on it finish.

With ``router.tenants`` (``pdkv.router.tenants``), ``/v1/`` and ``POST
/pdkv/kv-index`` want a tenant's key instead (or its trusted gateway), and
every request's KV stays in its tenant's cache partition.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from pdkv.auth import control_token
from pdkv.config import WORKER_URL_PATTERN, HttpConfig, RouterConfig
from pdkv.errors import ConfigError, RequestError
from pdkv.http.openai_routes import add_openai_routes
from pdkv.http.web import application, bearer_middleware, error_response, read_json
from pdkv.router.kv_aware import KVAwareness, KVCollector, load_tokenizer
from pdkv.router.metrics import RouterMetrics
from pdkv.router.modes import make_mode
from pdkv.router.policy import describe_prompt, make_policy
from pdkv.router.pool import ROLES, Role, WorkerPool
from pdkv.router.proxy import Proxy
from pdkv.router.tenants import Tenants, request_salt

# How long the router keeps an idle connection to a worker for its next request. Below the shortest keep-alive of the
# servers it talks to: vLLM's API server (uvicorn) closes an idle connection after 5 s, and a request the router
# sends on a connection the worker is closing fails as "server disconnected" (the worker is then marked down). A
# full CI run hit that between two tests of tests/test_vllm_integration.py.
UPSTREAM_KEEPALIVE_S = 4.0

if TYPE_CHECKING:
    from pdkv.modelfiles.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class Router:
    """The router's state and aiohttp application; build it with ``await Router.start(config)``."""

    def __init__(
        self, config: RouterConfig, session: aiohttp.ClientSession, http: HttpConfig | None = None, secret: str = ""
    ) -> None:
        self.config = config
        self.http = http or HttpConfig()
        self.session = session
        self.pool = WorkerPool(session, config)
        token = control_token(secret) if secret else ""
        worker_auth = {"Authorization": f"Bearer {token}"} if token else {}  # what the workers' /pdkv/ endpoints want
        self.kv = (
            KVAwareness(config, self.pool, worker_auth)
            if config.policy == "prefix" and (config.kv_events or config.kv_events_discover)
            else None
        )
        self.tokenizer: Tokenizer | None = None
        self.policy = make_policy(config, self.kv)
        self.mode = make_mode(config.mode, secret)
        self.metrics = RouterMetrics(self.pool)
        self.admin_token = config.admin_token or token
        self.tenants = Tenants.of(config, secret)
        self.proxy = Proxy(
            config, self.http, self.pool, self.policy, self.mode, self.metrics, self._spawn, worker_auth, self.tenants
        )
        self._tasks: set[asyncio.Task[None]] = set()

    @classmethod
    async def start(cls, config: RouterConfig, http: HttpConfig | None = None, secret: str = "") -> Router:
        """Register the configured workers, check them once, start the health loop.

        Workers that do not answer yet are registered as down, not refused:
        the router may well start before them, and the health loop picks
        them up when they come.
        """
        # No connection cap: each worker admits or refuses (503) work itself, and a
        # client-side cap would queue requests where no timeout or metric sees them.
        if config.kv_events and not config.tokenizer:
            raise ConfigError(
                "router.kv_events names event streams but router.tokenizer is not set: the KV-aware prefix policy "
                "matches token ids; "
                "set it to 'default' or the model's Hugging Face directory"
            )
        tokenizer = await asyncio.to_thread(load_tokenizer, config.tokenizer)
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=UPSTREAM_KEEPALIVE_S)
        router = cls(config, aiohttp.ClientSession(connector=connector), http, secret)
        router.tokenizer = router.proxy.tokenizer = tokenizer
        for role, urls in (("prefill", config.prefill), ("decode", config.decode)):
            for url in urls:
                router.pool.add(role, url)
        await router.pool.check_all()
        for role in ROLES:
            for worker in router.pool.workers(role):
                if not worker.healthy:
                    log.warning(
                        "%s worker %s is not answering yet (%s); the health loop will retry it",
                        role,
                        worker.url,
                        worker.error,
                    )
        if not config.decode:
            log.warning("no decode worker configured: requests get 503 until one is registered with POST /pdkv/workers")
        router._spawn(router.pool.health_loop())
        if router.kv is not None:
            router.metrics.registry.register(KVCollector(router.kv))
            router._spawn(router.kv.run())
        return router

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.session.close()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` in the background, owned by the router (cancelled at close), never by a request."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- HTTP ---------------------------------------------------------------------------
    def app(self) -> web.Application:
        hint = "router.admin_token" if self.config.admin_token else "pdkv.auth.control_token(secret)"
        tenants = self.tenants

        def tenant_path(http: web.Request) -> bool:  # a tenant's own: generation, models, its KV-index matches
            return tenants is not None and (
                http.path.startswith("/v1/") or (http.method == "POST" and http.path == "/pdkv/kv-index")
            )

        middlewares = [
            bearer_middleware(
                self.admin_token, lambda http: http.path.startswith("/pdkv/") and not tenant_path(http), hint
            )
        ]
        if tenants is not None:
            middlewares.append(tenants.middleware(tenant_path))
        app = application(self.http, middlewares)
        add_openai_routes(app, self)
        app.router.add_get("/pdkv/workers", self._list_workers)
        app.router.add_post("/pdkv/workers", self._add_worker)
        app.router.add_delete("/pdkv/workers", self._remove_worker)
        app.router.add_get("/pdkv/kv-index", self._kv_index)
        app.router.add_post("/pdkv/kv-index", self._kv_match)
        return app

    async def generate(self, http: web.Request, path: str, chat: bool) -> web.StreamResponse:
        return await self.proxy.generate(http, path, chat)

    async def models(self, _: web.Request) -> web.Response:
        return await self.proxy.models()

    async def health(self, _: web.Request) -> web.Response:
        counts = {
            role: {"healthy": len(self.pool.candidates(role)), "registered": len(self.pool.workers(role))}
            for role in ROLES
        }
        ok = counts["decode"]["healthy"] > 0
        return web.json_response(
            {"status": "ok" if ok else "no healthy decode worker", "role": "router", **counts},
            status=200 if ok else 503,
        )

    def render_metrics(self) -> bytes:
        return self.metrics.render()

    # -- admin ----------------------------------------------------------------------------
    async def _list_workers(self, _: web.Request) -> web.Response:
        listing: dict[str, Any] = {role: [w.snapshot() for w in self.pool.workers(role)] for role in ROLES}
        return web.json_response({"mode": self.mode.name, "policy": self.policy.name, **listing})

    async def _kv_index(self, _: web.Request) -> web.Response:
        """What the KV-aware prefix policy knows: blocks per worker, each event stream's state, the shared tier."""
        return web.json_response(self._kv().summary())

    async def _kv_match(self, http: web.Request) -> web.Response:
        """How many leading tokens of a prompt (a completions or chat body) each prefill worker caches, as the
        prefix policy would see it: which worker holds what, without sending the request. With tenants, a
        tenant asks with its own key and is answered within its partition only (its ``cache_salt`` folded in
        as for a generation): another tenant's prompts never count."""
        kv = self._kv()
        body = await read_json(http, self.http)
        if not isinstance(body, dict) or not ("prompt" in body or "messages" in body):
            raise RequestError(
                f'expected a JSON body with a "prompt" (text or token ids) or "messages", got {body!r:.200}'
            )
        salt = request_salt(self.tenants, http, body)
        prompt = await asyncio.to_thread(describe_prompt, body, "messages" in body, self.config, self.tokenizer, salt)
        if prompt.kind != "ids":
            raise RequestError(
                "the prompt is text and router.tokenizer is not set: send token ids, or configure the tokenizer",
                param="prompt",
            )
        return web.json_response(
            {
                "prompt_tokens": prompt.est_tokens,
                "cached_tokens": kv.cached_tokens(prompt.units, self.pool.workers("prefill"), prompt.salt),
            }
        )

    def _kv(self) -> KVAwareness:
        if self.kv is None:
            raise RequestError(
                "no KV event index: the router keeps one with policy 'prefix' (and router.kv_events or "
                "kv_events_discover)",
                status=404,
            )
        return self.kv

    async def _add_worker(self, http: web.Request) -> web.Response:
        ref = await _worker_ref(http, self.http)
        worker, created = self.pool.add(*ref)
        await self.pool.check(worker)
        return web.json_response({"worker": worker.snapshot()}, status=201 if created else 200)

    async def _remove_worker(self, http: web.Request) -> web.Response:
        ref = await _worker_ref(http, self.http)
        worker = self.pool.remove(*ref)
        if worker is None:
            return error_response(404, f"no {ref[0]} worker {ref[1]} is registered")
        return web.json_response({"removed": worker.snapshot()})


async def _worker_ref(http: web.Request, limits: HttpConfig) -> tuple[Role, str]:
    """``(role, url)`` from an admin request's JSON body; a ``RequestError`` says what is wrong."""
    body = await read_json(http, limits)
    role = body.get("role") if isinstance(body, dict) else None
    url = body.get("url") if isinstance(body, dict) else None
    if role not in ROLES or not isinstance(url, str) or not re.fullmatch(WORKER_URL_PATTERN, url):
        raise RequestError(
            f'expected a JSON body {{"role": "prefill"|"decode", "url": "http://HOST:PORT"}}, got {body!r:.200}'
        )
    return role, url
