"""The router's own error answers, each counted in ``pdkv_router_errors_total{status, cause}``: a whole one (before
the client got a byte) or an in-band event ending a stream the client has bytes of. ``pdkv.router.failures`` says
which status tells a client what."""

from __future__ import annotations

from aiohttp import web

from pdkv.config import RouterConfig
from pdkv.errors import DeadlinePassed, UpstreamError
from pdkv.http.openai_routes import end_with_error
from pdkv.http.web import error_response
from pdkv.router.call import Call
from pdkv.router.failures import retry_after, time_left
from pdkv.router.metrics import RouterMetrics
from pdkv.router.pool import WorkerPool


class ErrorAnswers:
    """Error answers in OpenAI's shape, counted by status and cause."""

    def __init__(self, config: RouterConfig, pool: WorkerPool, metrics: RouterMetrics) -> None:
        self.config = config
        self.pool = pool
        self.metrics = metrics

    def error(self, status: int, cause: str, message: str) -> web.Response:
        """An error answer in OpenAI's shape, counted by status and cause; a 503 says when to come back."""
        self.metrics.errors.labels(str(status), cause).inc()
        resp = error_response(status, message)
        if status == 503:
            resp.headers["Retry-After"] = str(retry_after(self.pool, "decode", self.config))
        return resp

    async def end_in_band(self, call: Call, out: web.StreamResponse, exc: UpstreamError) -> None:
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
