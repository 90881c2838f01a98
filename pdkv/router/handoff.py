"""A streamed request's first token, sent to the client from the prefill worker (``router.stream_first_token``).

Without it, the client's first token waits for the whole pair: P's answer back to the router, the decode hop's
request, D's wait for the KV's tail and D's own first event. With it, P's prefill hop is streamed
(``stream_first``): P's first event is the client's first, relayed the moment P's answer is in, and D, told so
(``first_event`` in its params), continues that same stream (its id and creation time) from the second token.
The time D adds moves from the first token to the second, where ``pdkv bench pd`` reports it.

P's answer is read whole before its token is relayed (P writes its token, its ``kv_transfer_params`` and
``[DONE]`` back to back): a P that fails before it ends is retried as any failed prefill hop, and the client never
holds a token whose decode hop cannot be sent.

What changes once the client has P's token: the pair cannot be tried again whole. A decode worker that fails
before its first event is replaced by another, told ``transfer_started: false``: it computes the prompt itself and
continues from P's token (the KV went to the failed one, whose transfer is abandoned). With none left, or a decode
worker's refusal, the stream ends with an in-band error, as a failure mid-answer does.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from pdkv.config import RouterConfig
from pdkv.errors import DeadlinePassed, UpstreamError, UpstreamRejected
from pdkv.http.openai_routes import sse_response
from pdkv.http.openai_wire import SSE_DONE
from pdkv.router.abandoning import Abandoner
from pdkv.router.answers import ErrorAnswers
from pdkv.router.call import Call, log
from pdkv.router.decode_hop import DecodeHop
from pdkv.router.failover import Failover
from pdkv.router.metrics import RouterMetrics
from pdkv.router.pool import WorkerState
from pdkv.router.upstream import message


def split_prefill_stream(worker: WorkerState, data: bytes) -> tuple[dict[str, Any], bytes | None]:
    """P's streamed prefill answer: what its JSON answer would hold (``{"kv_transfer_params": ...}``) and the
    client's first event; None for the event when P did not hand it on (no ``first_event`` in its params: D sends
    the first token, as without the handoff). A broken stream is the prefill hop's ``UpstreamError``."""
    events = [event + b"\n\n" for event in data.split(b"\n\n") if event.strip()]
    if not events or events[-1] != SSE_DONE:
        raise UpstreamError(
            f"prefill worker {worker.url} ended its stream without [DONE]: {data[-200:]!r}", "truncated"
        )
    tokens, params = [], []
    for event in events[:-1]:
        try:
            body = json.loads(event.removeprefix(b"data: ")) if event.startswith(b"data: ") else None
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise UpstreamError(f"prefill worker {worker.url} streamed a broken event: {event[:200]!r}", "bad_answer")
        if "error" in body:  # an in-band error: the hop failed after its headers
            raise UpstreamError(
                f"prefill worker {worker.url} ended its answer with an error: {message(event[6:])}", "http_500"
            )
        (params if body.get("object") == "kv_transfer_params" else tokens).append((event, body))
    if len(tokens) != 1 or len(params) != 1:
        raise UpstreamError(
            f"prefill worker {worker.url} streamed {len(tokens)} token events and {len(params)} kv_transfer_params "
            "events, not one of each",
            "bad_answer",
        )
    kv = params[0][1].get("kv_transfer_params")
    handed = isinstance(kv, dict) and kv.get("first_event") is not None and bool(tokens[0][1].get("choices"))
    return {"kv_transfer_params": kv}, tokens[0][0] if handed else None


class Handoff:
    """Sends the client P's first event, then the rest of the answer from a decode worker; see the module
    docstring for what a failure does once the client has that event."""

    def __init__(
        self,
        config: RouterConfig,
        metrics: RouterMetrics,
        decode_hop: DecodeHop,
        failover: Failover,
        abandoner: Abandoner,
        answers: ErrorAnswers,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.decode_hop = decode_hop
        self.failover = failover
        self.abandoner = abandoner
        self.answers = answers

    async def answer(
        self,
        call: Call,
        decode: WorkerState,
        params: dict[str, Any],
        first_event: bytes,
        transfer_id: str | None,
        failures: list[str],
    ) -> web.StreamResponse:
        """The client's answer: ``first_event`` (P's) at once, then the decode hop's stream on ``decode`` or, should
        it fail before its first event, on another decode worker that computes the prompt. Never raises a hop's
        failure: the client has bytes."""
        out = sse_response()
        try:
            await out.prepare(call.http)
            await self.decode_hop.send(call, out, first_event)
        except ConnectionResetError:
            call.outcome = "cancelled"
            if transfer_id is not None:
                self.abandoner.abandon(decode, transfer_id)
            return out
        self.metrics.handoffs.inc()
        tried = [decode]
        last: UpstreamError | None = None
        try:
            while True:
                retry = decode is not tried[0]  # the first one's load is counted by the pair (``Proxy._pair``)
                decode.inflight_requests += retry
                try:
                    return await self.decode_hop.answer(call, decode, params, out)
                except UpstreamError as exc:  # before the decode worker's first event: another may continue
                    self.failover.failed(call, decode, exc, failures)
                    last = exc
                finally:
                    decode.inflight_requests -= retry
                if transfer_id is not None:  # its KV is of no use to the next one
                    self.abandoner.abandon(decode, transfer_id)
                    transfer_id = None
                params = {**params, "transfer_started": False}  # the next one computes the prompt, then P's token on
                if len(tried) > self.config.max_retries:
                    break
                nxt = self.failover.next_try("decode", call.prompt, tried, last)
                if nxt is None:
                    break
                decode = nxt
        except UpstreamRejected as exc:
            last = UpstreamError(f"decode worker {decode.url} refused: {message(exc.body)}", f"http_{exc.status}")
        except DeadlinePassed as exc:
            last = UpstreamError(str(exc), "deadline")
        log.warning("request %s: no decode worker continued the answer the client had P's token of", call.request_id)
        try:
            await self.answers.end_in_band(call, out, last or UpstreamError("no decode worker left", "no_worker"))
            await out.write_eof()
        except ConnectionResetError:
            call.outcome = "cancelled"
        return out
