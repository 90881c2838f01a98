"""One client request through the router: pick a pair, prefill, decode, relay the answer.

Failure handling, hop by hop (every hop has its own timeout, see
``RouterConfig``):

* prefill fails (unreachable, timed out, 5xx, broken answer): the next
  prefill worker is tried with a fresh transfer id, up to ``max_retries``
  more; when none is left the decode worker computes the prompt alone. A
  prefill worker is never worth failing a request for.
* decode fails before the client got a byte (unreachable, 5xx, timed out,
  the stream broke before its first event; for a non-streamed answer, any
  failure before the whole answer arrived): the whole pair is tried again
  with another decode worker, up to ``max_retries`` more.
* decode fails after the client got P's first token (``router.stream_first_token``,
  ``pdkv.router.handoff``) and before its own first event: another decode worker
  computes the prompt and continues from P's token, up to ``max_retries`` more.
* decode fails after the client got bytes from it: the stream ends with an in-band
  error event and ``[DONE]``, as the workers themselves do.
* every decode attempt failed: 503 with ``Retry-After``, or 502 when every
  answer was broken (``pdkv.router.failures``); 504 once the client's own
  deadline (``X-Request-Timeout``) passed, which also bounds every hop.
* a worker's 4xx is the client's fault: passed back unchanged, no retry.
* the client goes away: the handler is cancelled, which closes the open
  upstream connection, which cancels the worker's job (the workers run with
  handler cancellation): prefill stops and cancels its transfer, decode
  stops waiting or generating and frees its blocks. A transfer whose pair
  attempt did not complete is also cancelled on the decode worker directly
  (pdkv mode), so its reservation is freed now rather than at lease expiry.

A worker found unreachable is marked down at once (passive health); one
that stops answering its health probes is marked down within seconds (see
``pdkv.router.pool``). Either way every hop waiting on it before the client
got a byte fails at once, as a timeout would, and is retried as above (a
decode hop only if another decode worker is healthy): a frozen prefill
worker costs its requests a few seconds, not ``prefill_timeout_s``. The
background health loop brings it back.

The rooms it runs each request through: ``failover`` (which worker a hop tries next, what a failed try
leaves), ``prefill_hop`` and ``decode_hop`` (the two hops), ``handoff`` (P's first token to the client at once),
``upstream`` (each step awaited on a worker,
and the checks of its answer), ``answers`` (the router's own error answers) and ``abandoning`` (transfers
whose decode hop never ran).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from pdkv.config import HttpConfig, RouterConfig
from pdkv.errors import DeadlinePassed, UpstreamError, UpstreamRejected
from pdkv.http.web import error_response, forwardable_header, read_json
from pdkv.router.abandoning import Abandoner
from pdkv.router.answers import ErrorAnswers
from pdkv.router.call import Call
from pdkv.router.decode_hop import DecodeHop
from pdkv.router.disaggregation import DecodeCosts, decide
from pdkv.router.failover import Failover
from pdkv.router.failures import failed_status, request_deadline, time_left
from pdkv.router.handoff import Handoff
from pdkv.router.metrics import ROLE, RouterMetrics
from pdkv.router.modes import PairMode
from pdkv.router.policy import Policy, describe_prompt
from pdkv.router.pool import WorkerPool, WorkerState
from pdkv.router.prefill_hop import PrefillHop
from pdkv.router.tenants import Tenants, request_salt
from pdkv.router.upstream import Upstream

if TYPE_CHECKING:
    from pdkv.modelfiles.tokenizer import Tokenizer


class Proxy:
    """The request flow; see the module docstring for what happens when a hop fails."""

    def __init__(
        self,
        config: RouterConfig,
        http: HttpConfig,
        pool: WorkerPool,
        policy: Policy,
        mode: PairMode,
        metrics: RouterMetrics,
        spawn: Callable[[Coroutine[Any, Any, None]], None],
        control_headers: dict[str, str],
        tenants: Tenants | None = None,
    ) -> None:
        self.config = config
        self.http = http
        self.tenants = tenants  # router.tenants: each request's cache partition and bounds
        self.pool = pool
        self.policy = policy
        self.metrics = metrics
        self.tokenizer: Tokenizer | None = None  # router.tokenizer: prompts become the workers' token ids
        self._costs: dict[str, DecodeCosts] = {}  # per decode worker URL: what each way cost (router.disaggregate)
        self.upstream = Upstream(pool, metrics)
        self.failover = Failover(pool, policy, metrics)
        self.answers = ErrorAnswers(config, pool, metrics)
        self.abandoner = Abandoner(config, pool, mode, metrics, spawn, control_headers)
        self.prefill = PrefillHop(config, pool, policy, mode, metrics, self.upstream, self.failover, self.abandoner)
        self.decode = DecodeHop(config, metrics, self.upstream, self.failover, self.answers)
        self.handoff = Handoff(config, metrics, self.decode, self.failover, self.abandoner, self.answers)

    async def generate(self, http: web.Request, path: str, chat: bool) -> web.StreamResponse:
        arrived = time.monotonic()
        deadline = request_deadline(http, arrived)
        body = await read_json(http, self.http)
        if not isinstance(body, dict):
            return error_response(400, "the request body must be a JSON object")
        headers = {"X-Request-Id": uuid.uuid4().hex}
        salt = request_salt(self.tenants, http, body)  # with tenants, the body's cache_salt is the router's now
        # workers started with an API key (vLLM's --api-key) want the client's; a tenant's key never goes to a worker
        authorization = forwardable_header(http, "Authorization") if self.tenants is None else None
        if authorization is not None:
            headers["Authorization"] = authorization
        if self.tokenizer is None:
            prompt = describe_prompt(body, chat, self.config, salt=salt)
        else:  # a long prompt takes milliseconds to encode: off the event loop
            prompt = await asyncio.to_thread(describe_prompt, body, chat, self.config, self.tokenizer, salt)
        call = Call(
            http, path, body, prompt, body.get("stream") is True, headers["X-Request-Id"], arrived, headers, deadline
        )
        try:
            return await self._serve(call)
        finally:
            self.metrics.requests.labels(ROLE, call.outcome).inc()
            self.metrics.e2e.labels(ROLE).observe(time.monotonic() - arrived)

    async def models(self) -> web.Response:
        """/v1/models of the first worker that answers (decode first: it is the one that generates)."""
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
        errors = []
        for worker in [*self.pool.candidates("decode"), *self.pool.candidates("prefill")]:
            try:
                resp = await self.upstream.guard(
                    worker, "models", self.pool.session.get(worker.url + "/v1/models", timeout=timeout)
                )
                async with resp:
                    data = await self.upstream.guard(worker, "models", resp.read())
            except UpstreamError as exc:
                errors.append(str(exc))
                continue
            if resp.status == 200:
                return web.Response(body=data, content_type="application/json")
            errors.append(f"{worker.url} answered {resp.status}")
        return self.answers.error(
            503, "no_worker", f"no worker answered /v1/models ({'; '.join(errors) or 'no healthy worker registered'})"
        )

    # -- the flow -------------------------------------------------------------------
    async def _serve(self, call: Call) -> web.StreamResponse:
        failures: list[str] = []  # every hop's, prefill included, for the message
        reasons: list[str] = []  # the decode attempts', for the status
        tried: list[WorkerState] = []
        last: UpstreamError | None = None
        try:
            for _ in range(self.config.max_retries + 1):
                decode = self.failover.next_try("decode", call.prompt, tried, last)
                if decode is None:
                    break
                try:
                    return await self._pair(call, decode, failures)
                except UpstreamError as exc:
                    self.failover.failed(call, decode, exc, failures)
                    reasons.append(exc.reason)
                    last = exc
                    time_left(call.deadline)  # a hop cut short by the deadline: no retry, a 504
        except UpstreamRejected as exc:
            call.outcome = "rejected"
            return web.Response(status=exc.status, body=exc.body, content_type=exc.content_type or "application/json")
        except DeadlinePassed as exc:
            call.outcome = "deadline"
            return self.answers.error(504, "deadline", f"{exc}; {'; '.join(failures) or 'no hop had failed'}")
        if last is None:
            call.outcome = "unavailable"
            return self.answers.error(
                503,
                "no_worker",
                f"no decode worker is registered or healthy ({len(self.pool.workers('decode'))} registered); register "
                "one with POST /pdkv/workers",
            )
        call.outcome = "failed"
        return self.answers.error(
            failed_status(reasons), last.reason, f"every decode attempt failed: {'; '.join(failures)}"
        )

    async def _pair(self, call: Call, decode: WorkerState, failures: list[str]) -> web.StreamResponse:
        """One attempt on one decode worker: prefill (unless the prompt is short), then decode."""
        params: dict[str, Any] | None = None
        transfer_id: str | None = None
        done = False
        decode.inflight_requests += 1  # from the pick on: a burst must not all pick the same idle worker
        try:
            cfg = self.config
            costs = self._costs.setdefault(decode.url, DecodeCosts())
            decision = decide(
                cfg.disaggregate,
                call.prompt.est_tokens,
                cfg.short_prompt_tokens,
                costs,
                bool(cfg.disaggregate_codec),
                cfg.disaggregate_explore_every,
            )
            costs.decided += 1
            self.metrics.disaggregation.labels(decision.way, decision.reason).inc()
            if decision.reason == "short_prompt":
                self.metrics.decisions.labels(self.policy.name, "prefill", "short_prompt").inc()
            first_event = None
            if decision.transfer:
                codec = cfg.disaggregate_codec if decision.way == "transfer_codec" else None
                params, transfer_id, first_event = await self.prefill.transfer_params(call, decode, failures, codec)
            if params is not None or not decision.transfer:  # a fallback to local is no sample of either way
                call.way_cost = costs.cost(decision.way)
            if params is not None and first_event is not None:
                response = await self.handoff.answer(call, decode, params, first_event, transfer_id, failures)
            else:
                response = await self.decode.answer(call, decode, params)
            done = True
            return response
        finally:
            decode.inflight_requests -= 1
            if transfer_id is not None and not done:
                self.abandoner.abandon(decode, transfer_id)
