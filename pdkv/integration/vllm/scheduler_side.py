"""Scheduler-side bookkeeping of the pdkv vLLM connector.

Runs in vLLM's scheduler process and decides, per request, what the worker
side does: on a prefill instance, which requests push their prompt's KV to
which decode receiver and how much of it is computed after each step; on a
decode instance, which requests load a pushed prefix instead of computing it.

Duck-typed against vLLM's ``Request``, ``KVCacheBlocks`` and
``SchedulerOutput`` (only the attributes read here), so it is tested without
vLLM installed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from pdkv.integration.vllm.metadata import LoadSpec, SendSpec, StepMetadata
from pdkv.integration.vllm.params import PushTo, Pushed, prompt_key, push_target, pushed

log = logging.getLogger(__name__)


@dataclass
class _Send:
    target: PushTo
    num_tokens: int
    key: str
    block_ids: list[int] = field(default_factory=list)
    emitted: bool = False  # the worker has seen it: it may have written from our blocks


@dataclass
class _Match:
    pushed: Pushed
    local_tokens: int


class SchedulerSide:
    """See the module docstring. ``fingerprint``/``chunk_size`` must match the prefill side's (both derive them from the model)."""

    def __init__(self, fingerprint: str, chunk_size: int, is_producer: bool, is_consumer: bool) -> None:
        self.fingerprint = fingerprint
        self.chunk_size = chunk_size
        self.is_producer = is_producer
        self.is_consumer = is_consumer
        self._sends: dict[str, _Send] = {}
        self._matches: dict[str, _Match] = {}
        self._attempted: set[str] = set()  # decode requests whose load was planned: never again (a failure recomputes)
        self._loads: list[LoadSpec] = []
        self._discards: list[str] = []
        self.rejected_prompts = 0  # decode requests whose prompt did not hash like the prefilled one

    # -- decode ---------------------------------------------------------------------
    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens past the local prefix cache that arrive pushed from P (loaded asynchronously)."""
        if not self.is_consumer or request.request_id in self._attempted:
            return 0, False
        match = self._match(request)
        if match is None:
            return 0, False
        match.local_tokens = num_computed_tokens
        return max(0, match.pushed.num_tokens - num_computed_tokens), num_computed_tokens < match.pushed.num_tokens

    def _match(self, request: Any) -> _Match | None:
        req_id = request.request_id
        if req_id in self._matches:
            return self._matches[req_id]
        info = pushed(getattr(request, "kv_transfer_params", None), req_id)
        if info is None:
            return None
        prompt = list(request.prompt_token_ids or [])
        if info.num_tokens > len(prompt) or prompt_key(prompt[: info.num_tokens], self.fingerprint, self.chunk_size) != info.prompt_key:
            self.rejected_prompts += 1
            self._attempted.add(req_id)
            self._discards.append(info.transfer_id)
            log.warning("request %s: its prompt is not the one prefilled for transfer %s (tokenizer, chat template or model differ between P and D?); recomputing it", req_id, info.transfer_id)
            return None
        match = self._matches[req_id] = _Match(info, 0)
        return match

    # -- both ------------------------------------------------------------------------
    def after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        req_id = request.request_id
        if self.is_producer and req_id not in self._sends:
            target = push_target(getattr(request, "kv_transfer_params", None), req_id)
            if target is not None:
                prompt = list(request.prompt_token_ids or [])
                self._sends[req_id] = _Send(target, len(prompt), prompt_key(prompt, self.fingerprint, self.chunk_size))
        match = self._matches.get(req_id)
        if match is None or req_id in self._attempted:
            return
        self._attempted.add(req_id)
        if num_external_tokens > 0:
            self._loads.append(LoadSpec(req_id, match.pushed.transfer_id, match.pushed.num_tokens, match.local_tokens, list(block_ids)))
        else:  # the local prefix cache covered it: the pushed copy is not needed
            self._discards.append(match.pushed.transfer_id)

    def build(self, scheduler_output: Any) -> StepMetadata:
        meta = StepMetadata(loads=self._loads, discards=self._discards)
        self._loads, self._discards = [], []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            send = self._sends.get(new.req_id)
            if send is not None:
                send.block_ids = list(new.block_ids[0])
                self._emit(meta, new.req_id, send, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            send = self._sends.get(req_id)
            if send is None:
                continue
            added = cached.new_block_ids[i]
            if added is not None:
                send.block_ids = list(added[0]) if req_id in cached.resumed_req_ids else send.block_ids + list(added[0])
            self._emit(meta, req_id, send, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return meta

    def _emit(self, meta: StepMetadata, req_id: str, send: _Send, computed: int) -> None:
        send.emitted = True
        meta.sends.append(SendSpec(req_id, send.target.transfer_id, send.target.address, send.num_tokens, list(send.block_ids), min(computed, send.num_tokens)))

    def finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished``: hold a pushing request's blocks until its writes settle; tell D what was pushed."""
        req_id = request.request_id
        self._attempted.discard(req_id)
        self._matches.pop(req_id, None)
        send = self._sends.pop(req_id, None)
        if send is None or not send.emitted:
            return False, None
        if request.num_computed_tokens < send.num_tokens:  # aborted mid-prefill: the worker cancels the push
            return True, None
        out = Pushed(send.target.transfer_id, send.num_tokens, send.key)
        return True, {**{f: getattr(out, f) for f in out.__struct_fields__}, "remote_host": send.target.remote_host, "remote_port": send.target.remote_port}
