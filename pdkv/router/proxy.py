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
* decode fails after the client got bytes: the stream ends with an in-band
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
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import aiohttp
from aiohttp import web

from pdkv.config import HttpConfig, RouterConfig
from pdkv.errors import DeadlinePassed, UpstreamError, UpstreamRejected
from pdkv.http.openai_routes import end_with_error, sse_response
from pdkv.http.openai_wire import SSE_DONE
from pdkv.http.web import error_response, forwardable_header, read_json
from pdkv.router.disaggregation import DecodeCosts, WayCost, decide
from pdkv.router.failures import failed_status, hop_timeout, request_deadline, retry_after, time_left
from pdkv.router.metrics import ROLE, RouterMetrics
from pdkv.router.modes import PairMode, decode_body, prefill_body
from pdkv.router.policy import Policy, Prompt, describe_prompt
from pdkv.router.pool import Role, WorkerPool, WorkerState, describe
from pdkv.router.tenants import Tenants, request_salt

if TYPE_CHECKING:
    from pdkv.modelfiles.tokenizer import Tokenizer

log = logging.getLogger(__name__)

T = TypeVar("T")

# 408 and 429 are the worker's state, not the request's fault: another worker may take it.
_RETRYABLE_4XX = (408, 429)


@dataclass
class _Call:
    """One client request as it goes through the router."""

    http: web.Request
    path: str
    body: dict[str, Any]
    prompt: Prompt
    stream: bool
    request_id: str
    arrived: float
    headers: dict[str, str]
    deadline: float | None = None  # monotonic; the client's X-Request-Timeout after arrival
    outcome: str = "cancelled"  # what pdkv_requests_total counts; stays so if the client goes away
    way_cost: WayCost | None = None  # the way it was served, to learn from its first token (router.disaggregate)


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
        self.control_headers = control_headers  # what a worker's control endpoints want (its secret's token)
        self.tenants = tenants  # router.tenants: each request's cache partition and bounds
        self.pool = pool
        self.policy = policy
        self.mode = mode
        self.metrics = metrics
        self.spawn = spawn  # runs a coroutine that must outlive a cancelled handler
        self.tokenizer: Tokenizer | None = None  # router.tokenizer: prompts become the workers' token ids
        self._transfer_ids = itertools.count()
        self._costs: dict[str, DecodeCosts] = {}  # per decode worker URL: what each way cost (router.disaggregate)

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
        call = _Call(
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
                resp = await self._guard(
                    worker, "models", self.pool.session.get(worker.url + "/v1/models", timeout=timeout)
                )
                async with resp:
                    data = await self._guard(worker, "models", resp.read())
            except UpstreamError as exc:
                errors.append(str(exc))
                continue
            if resp.status == 200:
                return web.Response(body=data, content_type="application/json")
            errors.append(f"{worker.url} answered {resp.status}")
        return self._error(
            503, "no_worker", f"no worker answered /v1/models ({'; '.join(errors) or 'no healthy worker registered'})"
        )

    # -- the flow -------------------------------------------------------------------
    async def _serve(self, call: _Call) -> web.StreamResponse:
        failures: list[str] = []  # every hop's, prefill included, for the message
        reasons: list[str] = []  # the decode attempts', for the status
        tried: list[WorkerState] = []
        last: UpstreamError | None = None
        try:
            for _ in range(self.config.max_retries + 1):
                decode = self._next_try("decode", call.prompt, tried, last)
                if decode is None:
                    break
                try:
                    return await self._pair(call, decode, failures)
                except UpstreamError as exc:
                    self._failed(call, decode, exc, failures)
                    reasons.append(exc.reason)
                    last = exc
                    time_left(call.deadline)  # a hop cut short by the deadline: no retry, a 504
        except UpstreamRejected as exc:
            call.outcome = "rejected"
            return web.Response(status=exc.status, body=exc.body, content_type=exc.content_type or "application/json")
        except DeadlinePassed as exc:
            call.outcome = "deadline"
            return self._error(504, "deadline", f"{exc}; {'; '.join(failures) or 'no hop had failed'}")
        if last is None:
            call.outcome = "unavailable"
            return self._error(
                503,
                "no_worker",
                f"no decode worker is registered or healthy ({len(self.pool.workers('decode'))} registered); register "
                "one with POST /pdkv/workers",
            )
        call.outcome = "failed"
        return self._error(failed_status(reasons), last.reason, f"every decode attempt failed: {'; '.join(failures)}")

    def _error(self, status: int, cause: str, message: str) -> web.Response:
        """An error answer in OpenAI's shape, counted by status and cause; a 503 says when to come back."""
        self.metrics.errors.labels(str(status), cause).inc()
        resp = error_response(status, message)
        if status == 503:
            resp.headers["Retry-After"] = str(retry_after(self.pool, "decode", self.config))
        return resp

    async def _pair(self, call: _Call, decode: WorkerState, failures: list[str]) -> web.StreamResponse:
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
            if decision.transfer:
                codec = cfg.disaggregate_codec if decision.way == "transfer_codec" else None
                params, transfer_id = await self._prefill(call, decode, failures, codec)
            if params is not None or not decision.transfer:  # a fallback to local is no sample of either way
                call.way_cost = costs.cost(decision.way)
            response = await self._decode(call, decode, params)
            done = True
            return response
        finally:
            decode.inflight_requests -= 1
            if transfer_id is not None and not done:
                self._abandon(decode, transfer_id)

    async def _prefill(
        self, call: _Call, decode: WorkerState, failures: list[str], codec: str | None = None
    ) -> tuple[dict[str, Any] | None, str | None]:
        """The decode hop's ``kv_transfer_params`` and transfer id; (None, None): decode alone."""
        tried: list[WorkerState] = []
        last: UpstreamError | None = None
        for _ in range(self.config.max_retries + 1):
            prefill = self._next_try("prefill", call.prompt, tried, last)
            if prefill is None:
                break
            transfer_id = f"{call.request_id}-{next(self._transfer_ids)}"
            params = await self.mode.prefill_params(
                self.pool, decode, transfer_id, codec
            )  # an UpstreamError here is the decode worker's
            done = False
            try:
                answer = await self._prefill_hop(call, prefill, params)
                done = True
            except UpstreamError as exc:
                self._failed(call, prefill, exc, failures)
                last = exc
                continue
            finally:
                if not done:
                    self._abandon(decode, transfer_id)
            kv, why = self.mode.decode_params(answer)
            if why is not None:
                self.metrics.fallbacks.labels(why).inc()
            self.policy.served(prefill, call.prompt)
            return kv, transfer_id
        self.metrics.fallbacks.labels("prefill_failed" if tried else "no_prefill").inc()
        return None, None

    async def _prefill_hop(self, call: _Call, prefill: WorkerState, params: dict[str, Any]) -> Any:
        timeout = aiohttp.ClientTimeout(
            total=hop_timeout(call.deadline, self.config.prefill_timeout_s), sock_connect=self.config.connect_timeout_s
        )
        started = time.monotonic()
        prefill.inflight_requests += 1
        prefill.inflight_tokens += call.prompt.est_tokens
        try:
            async with self._post(prefill, "prefill", call, prefill_body(call.body, params), timeout) as resp:
                data = await self._guard(prefill, "prefill", resp.read())
                _check_status(prefill, "prefill", resp, data)
        finally:
            prefill.inflight_requests -= 1
            prefill.inflight_tokens -= call.prompt.est_tokens
        answer = _parse_json(prefill, "prefill", data)
        self.metrics.hop.labels("prefill").observe(time.monotonic() - started)
        return answer

    async def _decode(self, call: _Call, decode: WorkerState, params: dict[str, Any] | None) -> web.StreamResponse:
        sock_read = self.config.read_timeout_s if call.stream else None  # a whole answer comes at once: total bounds it
        timeout = aiohttp.ClientTimeout(
            total=hop_timeout(call.deadline, self.config.decode_timeout_s),
            sock_connect=self.config.connect_timeout_s,
            sock_read=sock_read,
        )
        started = time.monotonic()
        async with self._post(decode, "decode", call, decode_body(call.body, params), timeout) as resp:
            if resp.status == 200 and call.stream:
                _check_content_type(decode, resp, "text/event-stream")
                response: web.StreamResponse = await self._relay(call, decode, resp)
            else:
                data = await self._guard(decode, "decode", resp.read())
                _check_status(decode, "decode", resp, data)
                _check_content_type(decode, resp, "application/json")
                _parse_json(decode, "decode", data)  # relayed as bytes, but never a broken answer as a 200
                call.outcome = "ok"
                response = web.Response(body=data, content_type="application/json")
        self.metrics.hop.labels("decode").observe(time.monotonic() - started)
        return response

    async def _relay(self, call: _Call, decode: WorkerState, resp: aiohttp.ClientResponse) -> web.StreamResponse:
        """Stream the decode worker's events to the client; until the first is sent, a failure is retryable.

        A client that hangs up makes a write to it raise ``ConnectionResetError`` (upstream failures
        are ``UpstreamError`` by then, see ``_guard``). That is the client's choice, not a fault:
        one line is logged, and leaving here closes the upstream stream unread, which stops the
        decode worker's generation and frees its blocks. Its transfer was claimed before its first
        event, so nothing is left to cancel on the decode side.
        """
        async with contextlib.aclosing(_sse_events(resp.content)) as events:
            first = await self._next_event(decode, events, abandon=True)
            if first is None:
                raise UpstreamError(
                    f"decode worker {decode.url} ended its stream before the first event", "empty_stream"
                )
            out = sse_response()
            try:
                await out.prepare(call.http)
                await out.write(first)
                ttft = time.monotonic() - call.arrived
                self.metrics.ttft.labels(ROLE).observe(ttft)
                if call.way_cost is not None:
                    call.way_cost.observe(ttft, call.prompt.est_tokens, self.config.disaggregate_weight)
                try:
                    # the client has bytes: a worker marked down mid-answer is waited for (a frozen one
                    # may thaw) until read_timeout_s; a retry could only end the answer with an error
                    last = first
                    while (event := await self._next_event(decode, events, abandon=False)) is not None:
                        await out.write(event)
                        last = event
                    if last != SSE_DONE:
                        raise UpstreamError(f"decode worker {decode.url} ended its stream without [DONE]", "truncated")
                    call.outcome = "ok"
                except UpstreamError as exc:  # the client has bytes already: say it in-band, as the workers do
                    self._failed(call, decode, exc, [])
                    await self._end_in_band(call, out, exc)
                await out.write_eof()
            except ConnectionResetError:
                call.outcome = "cancelled"
                log.info(
                    "request %s: the client disconnected mid-stream; closing the stream from decode worker %s",
                    call.request_id,
                    decode.url,
                )
        return out

    async def _end_in_band(self, call: _Call, out: web.StreamResponse, exc: UpstreamError) -> None:
        """End a stream the client has bytes of with an error event: 504 once its deadline passed, else 502."""
        try:
            time_left(call.deadline)
        except DeadlinePassed as passed:
            call.outcome = "deadline"
            self.metrics.errors.labels("504", "deadline").inc()
            await end_with_error(out, f"{passed} (mid-answer: {exc})", 504)
            return
        call.outcome = "broken"
        self.metrics.errors.labels("502", exc.reason).inc()
        await end_with_error(out, f"the decode worker failed mid-answer: {exc}", 502)

    async def _next_event(self, decode: WorkerState, events: AsyncIterator[bytes], abandon: bool) -> bytes | None:
        """The next whole event of the stream (None at its end); one cut short is a ``truncated`` failure."""
        try:
            event = await self._guard(decode, "decode", anext(events), abandon)
        except StopAsyncIteration:
            return None
        if not event.endswith(b"\n\n"):
            raise UpstreamError(f"decode worker {decode.url} cut its stream mid-event: {event[:200]!r}", "truncated")
        return event

    # -- helpers --------------------------------------------------------------------
    def _pick(self, role: Role, prompt: Prompt, exclude: list[WorkerState]) -> WorkerState | None:
        """The policy's choice among healthy workers not yet tried for this request.

        With no healthy decode worker left, the ones marked down are tried too:
        health is a view that may be stale, and refusing costs more than a
        failed connect. Prefill has decode-alone to fall back on instead.
        """
        candidates = self.pool.candidates(role, exclude)
        if not candidates and role == "decode":
            candidates = [w for w in self.pool.workers(role) if w not in exclude]
        if not candidates:
            return None
        worker, reason = self.policy.choose(role, candidates, prompt)
        self.metrics.decisions.labels(self.policy.name, role, reason).inc()
        return worker

    def _next_try(
        self, role: Role, prompt: Prompt, tried: list[WorkerState], last: UpstreamError | None
    ) -> WorkerState | None:
        """The next worker of ``role`` to try for a hop (None: none is left), added to ``tried``; a retry is
        counted under the failure (``last``) that caused it."""
        worker = self._pick(role, prompt, tried)
        if worker is None:
            return None
        if last is not None:
            self.metrics.retries.labels(role, last.reason).inc()
        tried.append(worker)
        return worker

    def _failed(self, call: _Call, worker: WorkerState, exc: UpstreamError, failures: list[str]) -> None:
        failures.append(str(exc))
        log.warning("request %s: %s", call.request_id, exc)
        if exc.worker_down:
            self.pool.mark_down(worker, str(exc))

    @contextlib.asynccontextmanager
    async def _post(
        self, worker: WorkerState, hop: str, call: _Call, body: dict[str, Any], timeout: aiohttp.ClientTimeout
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """POST one hop; the response is released (its connection closed if unread) on exit."""
        self.metrics.picks.labels(hop, worker.url).inc()
        resp = await self._guard(
            worker,
            hop,
            self.pool.session.post(worker.url + call.path, json=body, headers=call.headers, timeout=timeout),
        )
        async with resp:
            yield resp

    def _worth_abandoning(self, worker: WorkerState) -> bool:
        """Whether a hop waiting on ``worker``, just marked down, has somewhere better to go.

        A prefill hop always has (another prefill worker, or the decode worker computing alone); a
        decode hop only if another decode worker is healthy: retried on the same worker it would
        start over, for nothing.
        """
        return worker.role == "prefill" or bool(self.pool.candidates(worker.role, [worker]))

    async def _guard(self, worker: WorkerState, hop: str, step: Awaitable[T], abandon: bool = True) -> T:
        """Await one upstream step; its failures become ``UpstreamError`` (down: the worker looks dead).

        With ``abandon`` (every step before the client got a byte), the step is abandoned the moment
        the worker is marked down (a refused connection elsewhere, failed health probes) if the
        request has somewhere better to go: a frozen worker never answers, and waiting for the
        hop's own timeout would hold the request for minutes. Abandoned as ``asyncio.timeout`` does
        it, by cancelling this task at its await (no task per step: that would delay each step by a
        loop iteration, and aiohttp drops what a stream had buffered once its connection is lost).
        """
        if not abandon:
            return await _result(worker, hop, step)
        task = asyncio.current_task()
        assert task is not None
        down = worker.down_signal()
        state = {"waiting": True, "fired": False}

        def abort(_: asyncio.Future[str]) -> None:
            # the callback may run after the step finished: then it must not cancel
            if state["waiting"] and self._worth_abandoning(worker):
                state["fired"] = True
                task.cancel()

        down.add_done_callback(abort)
        try:
            return await _result(worker, hop, step)
        except asyncio.CancelledError:
            # Ours: turned into the hop's failure. Someone else's too (the client went away; only
            # Python >= 3.11 can tell): passed on.
            uncancel = getattr(task, "uncancel", None)
            if not state["fired"] or (uncancel is not None and uncancel() > 0):
                raise
            raise UpstreamError(
                f"{hop} worker {worker.url} was marked down while this hop waited on it: {down.result()}",
                "unhealthy",
                worker_down=True,
            ) from None
        finally:
            state["waiting"] = False
            down.remove_done_callback(abort)

    async def _cancel_transfer(self, url: str) -> None:
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
        try:
            async with self.pool.session.delete(url, timeout=timeout, headers=self.control_headers) as resp:
                data = await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:  # best effort: the receiver's lease frees it anyway
            self.metrics.cancels.labels("unanswered").inc()
            log.info("could not cancel %s: %s", url, describe(exc))
            return
        self.metrics.cancels.labels("ok" if resp.status == 200 else "refused").inc()
        if resp.status != 200:  # 401: the router's secret is not the decode worker's
            log.warning("cancelling %s: the decode worker answered %s: %s", url, resp.status, _message(data))

    def _abandon(self, decode: WorkerState, transfer_id: str) -> None:
        """Cancel a transfer on the decode worker, in the background: the caller may itself be cancelled."""
        url = self.mode.cancel_url(decode, transfer_id)
        if url is not None:
            self.spawn(self._cancel_transfer(url))


async def _result(worker: WorkerState, hop: str, step: Awaitable[T]) -> T:
    """A finished upstream step's result; its failures as ``UpstreamError``."""
    try:
        return await step
    except TimeoutError as exc:
        raise UpstreamError(f"{hop} worker {worker.url} timed out ({describe(exc)})", "timeout") from exc
    except aiohttp.ClientConnectorError as exc:
        raise UpstreamError(
            f"{hop} worker {worker.url} is unreachable: {describe(exc)}", "connect", worker_down=True
        ) from exc
    except aiohttp.ClientPayloadError as exc:  # the answer began and was cut short: a broken answer, not a missing one
        raise UpstreamError(
            f"{hop} worker {worker.url} cut its answer short: {describe(exc)}", "truncated", worker_down=True
        ) from exc
    except aiohttp.ClientError as exc:
        raise UpstreamError(
            f"{hop} worker {worker.url} dropped the connection: {describe(exc)}", "disconnected", worker_down=True
        ) from exc


def _check_status(worker: WorkerState, hop: str, resp: aiohttp.ClientResponse, data: bytes) -> None:
    if resp.status == 200:
        return
    if 400 <= resp.status < 500 and resp.status not in _RETRYABLE_4XX:
        raise UpstreamRejected(resp.status, data, resp.content_type)
    raise UpstreamError(f"{hop} worker {worker.url} answered {resp.status}: {_message(data)}", f"http_{resp.status}")


def _check_content_type(worker: WorkerState, resp: aiohttp.ClientResponse, expected: str) -> None:
    """A 200 whose Content-Type is not what the request asked for (a stream, or JSON) is a broken answer."""
    if resp.content_type != expected:
        raise UpstreamError(
            f"decode worker {worker.url} answered 200 with Content-Type {resp.content_type!r}, not {expected!r}",
            "bad_content_type",
        )


def _parse_json(worker: WorkerState, hop: str, data: bytes) -> Any:
    """A hop's JSON answer; one that is not JSON is a broken answer (``bad_answer``)."""
    try:
        return json.loads(data)
    except ValueError:
        raise UpstreamError(
            f"{hop} worker {worker.url} answered with invalid JSON: {data[:200]!r}", "bad_answer"
        ) from None


def _message(data: bytes) -> str:
    """An error body's message, or its first bytes."""
    try:
        return str(json.loads(data)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return repr(data[:200])


async def _sse_events(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """Whole server-sent events (``...\\n\\n``), so a failure never leaves half an event at the client."""
    buf = b""
    async for chunk in content.iter_any():
        buf += chunk
        while (end := buf.find(b"\n\n")) >= 0:
            yield buf[: end + 2]
            buf = buf[end + 2 :]
    if buf:
        yield buf
