"""Which worker a hop tries next, and what a failed try leaves behind: the retry and failover bookkeeping of both
hops of a request (``pdkv.router.proxy``'s docstring says when each hop is retried)."""

from __future__ import annotations

from pdkv.errors import UpstreamError
from pdkv.router.call import Call, log
from pdkv.router.metrics import RouterMetrics
from pdkv.router.policy import Policy, Prompt
from pdkv.router.pool import Role, WorkerPool, WorkerState


class Failover:
    """Picks each try's worker (the policy's choice among those not tried yet) and records each failed one."""

    def __init__(self, pool: WorkerPool, policy: Policy, metrics: RouterMetrics) -> None:
        self.pool = pool
        self.policy = policy
        self.metrics = metrics

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

    def next_try(
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

    def failed(self, call: Call, worker: WorkerState, exc: UpstreamError, failures: list[str]) -> None:
        """A hop's failure: added to ``failures`` (the request's error message), logged, and its worker marked down
        when the failure says it looks dead."""
        failures.append(str(exc))
        log.warning("request %s: %s", call.request_id, exc)
        if exc.worker_down:
            self.pool.mark_down(worker, str(exc))
