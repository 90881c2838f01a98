"""Scheduler-side bookkeeping of the pdkv vLLM connector.

Runs in vLLM's scheduler process and decides, per request, what the worker
side does:

* push: on a prefill instance, which requests push their prompt's KV to which
  decode receiver, and how much of it is computed after each step;
* load: which requests load a prefix instead of computing it, either pushed
  from P (``kv_transfer_params`` name the transfer) or found in the shared
  cache tier (Redis: the one level the scheduler and every worker process,
  on every instance, can all see), keyed by pdkv's chained chunk keys
  under the request's own ``cache_salt`` (vLLM's field: a salted request
  loads and saves only in its salt's partition, and a pushed prefill is
  adopted only for a prompt of the same salt);
* save: which full prompt chunks the worker offers to that tier once they
  are computed here, so the next instance that sees the prefix loads it.

Duck-typed against vLLM's ``Request``, ``KVCacheBlocks`` and
``SchedulerOutput`` (only the attributes read here), so it is tested without
vLLM installed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdkv.integration.vllm.metadata import Discard, LoadSpec, SaveSpec, SendSpec, StepMetadata
from pdkv.keys import PromptKeys
from pdkv.transfer.params import Pushed, PushGuard, PushTo, cache_salt, prompt_key, push_target, pushed

log = logging.getLogger(__name__)

TierLookup = Callable[[PromptKeys], int]
"""How many leading tokens of a keyed prompt the shared tier holds (``KVCacheEngine.lookup``)."""


@dataclass
class _Track:
    """A scheduled request whose computed KV leaves this instance (pushed, saved, or both)."""

    num_tokens: int
    target: PushTo | None = None
    key: bytes = b""  # the prompt's chained key: the push's Reserve carries it, D adopts the KV only under it
    save_keys: list[bytes] = field(default_factory=list)
    saved: int = 0  # chunks before this one were handed to the worker to save (each chunk is saved once)
    block_ids: list[int] = field(default_factory=list)
    emitted: bool = False  # the worker has seen it: it may be writing from our blocks


@dataclass
class _Match:
    tokens: int  # prompt tokens the load covers, from token 0
    transfer_id: str = ""  # pushed from P, or...
    tier_keys: list[bytes] = field(default_factory=list)  # ...these chunks from the tier
    local_tokens: int = 0
    prompt_key: bytes = b""  # pushed: our own key of the prompt, which P's Reserve must carry
    prefill_tp: int = 1  # pushed: by this many prefill ranks


class SchedulerSide:
    """See the module docstring. ``fingerprint``/``chunk_size`` must match the other instances' (all derive them
    from the model)."""

    def __init__(
        self,
        fingerprint: str,
        chunk_size: int,
        is_producer: bool,
        is_consumer: bool,
        tier_lookup: TierLookup | None = None,
        tp_size: int = 1,
        guard: PushGuard | None = None,
    ) -> None:
        """``tp_size``: this instance's tensor-parallel size, told to D with a push (``Pushed.prefill_tp``).
        ``guard``: where a push may go (the config's secret and ``transfer.allowed_receivers``); None: anywhere."""
        self.fingerprint = fingerprint
        self.guard = guard or PushGuard()
        self.tp_size = tp_size
        self.chunk_size = chunk_size
        self.is_producer = is_producer
        self.is_consumer = is_consumer
        self.tier_lookup = tier_lookup
        self._tracks: dict[str, _Track] = {}
        self._matches: dict[str, _Match | None] = {}
        self._keys: dict[str, PromptKeys] = {}
        self._attempted: set[str] = set()  # requests whose load was planned: never again (a failure recomputes)
        self._loads: list[LoadSpec] = []
        self._discards: list[Discard] = []
        self.rejected_prompts = 0  # decode requests whose prompt did not hash like the prefilled one

    # -- loads -----------------------------------------------------------------------
    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens past the local prefix cache that can be loaded (asynchronously) instead of computed."""
        if request.request_id in self._attempted:
            return 0, False
        match = self._match(request)
        if match is None:
            return 0, False
        match.local_tokens = num_computed_tokens
        return max(0, match.tokens - num_computed_tokens), num_computed_tokens < match.tokens

    def _match(self, request: Any) -> _Match | None:
        req_id = request.request_id
        if req_id not in self._matches:  # vLLM may ask every step while the request waits: look once
            self._matches[req_id] = self._pushed_match(request) or self._tier_match(request)
        return self._matches[req_id]

    def _pushed_match(self, request: Any) -> _Match | None:
        if not self.is_consumer:
            return None
        info = pushed(getattr(request, "kv_transfer_params", None), request.request_id)
        if info is None:
            return None
        prompt = list(request.prompt_token_ids or [])
        own = (
            prompt_key(prompt[: info.num_tokens], self.fingerprint, self.chunk_size, cache_salt(request))
            if info.num_tokens <= len(prompt)
            else ""
        )
        if own != info.prompt_key:  # early out; the binding that counts is P's Reserve, checked when the KV is claimed
            self.rejected_prompts += 1
            self._discards.append(Discard(info.transfer_id, info.prefill_tp))
            log.warning(
                "request %s: its prompt is not the one prefilled for transfer %s (tokenizer, chat template or model "
                "differ between P and D?); recomputing it",
                request.request_id,
                info.transfer_id,
            )
            return None
        return _Match(
            info.num_tokens, transfer_id=info.transfer_id, prompt_key=bytes.fromhex(own), prefill_tp=info.prefill_tp
        )

    def _tier_match(self, request: Any) -> _Match | None:
        if self.tier_lookup is None:
            return None
        keys = self._full_chunk_keys(request)
        try:
            cached = self.tier_lookup(keys) if keys.num_tokens else 0
        except Exception as exc:  # noqa: BLE001 - a tier that cannot answer is a miss, never a failed request
            log.warning("request %s: cache tier lookup failed (%s); computing the prompt", request.request_id, exc)
            return None
        return _Match(cached, tier_keys=list(keys.prefix(cached).keys)) if cached else None

    def _prompt_keys(self, request: Any) -> PromptKeys:
        """Chained keys of every chunk of the prompt, a partial last one included: hashed once per request
        (the tier lookup, the saves and the push's ``prompt_key`` all read them)."""
        keys = self._keys.get(request.request_id)
        if keys is None:
            keys = self._keys[request.request_id] = PromptKeys.of(
                list(request.prompt_token_ids or []), self.fingerprint, self.chunk_size, cache_salt(request)
            )
        return keys

    def _full_chunk_keys(self, request: Any) -> PromptKeys:
        """The prompt's full chunks (a partial last chunk is never cached: its key would not be reused)."""
        return self._prompt_keys(request).prefix(
            len(request.prompt_token_ids or []) // self.chunk_size * self.chunk_size
        )

    def after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        req_id = request.request_id
        if req_id not in self._tracks:
            self._track(request)
        match = self._matches.get(req_id)
        if match is None or req_id in self._attempted:
            return
        self._attempted.add(req_id)
        if num_external_tokens > 0:
            self._loads.append(
                LoadSpec(
                    req_id,
                    match.transfer_id,
                    match.tokens,
                    match.local_tokens,
                    list(block_ids),
                    match.tier_keys,
                    match.prompt_key,
                    match.prefill_tp,
                )
            )
        elif match.transfer_id:  # the local prefix cache covered it: the pushed copy is not needed
            self._discards.append(Discard(match.transfer_id, match.prefill_tp))

    # -- pushes and saves ------------------------------------------------------------------
    def _track(self, request: Any) -> None:
        target = (
            push_target(getattr(request, "kv_transfer_params", None), request.request_id, self.guard)
            if self.is_producer
            else None
        )
        save_keys = list(self._full_chunk_keys(request).keys) if self.tier_lookup is not None else []
        if target is not None or save_keys:
            key = self._prompt_keys(request).keys[-1] if target is not None else b""  # prompt_key(prompt)
            self._tracks[request.request_id] = _Track(len(request.prompt_token_ids or []), target, key, save_keys)

    def build(self, scheduler_output: Any) -> StepMetadata:
        meta = StepMetadata(loads=self._loads, discards=self._discards)
        self._loads, self._discards = [], []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            track = self._tracks.get(new.req_id)
            if track is not None:
                track.block_ids = list(new.block_ids[0])
                self._emit(meta, new.req_id, track, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            track = self._tracks.get(req_id)
            if track is None:
                continue
            added = cached.new_block_ids[i]
            if added is not None:
                track.block_ids = (
                    list(added[0]) if req_id in cached.resumed_req_ids else track.block_ids + list(added[0])
                )
            self._emit(meta, req_id, track, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return meta

    def _emit(self, meta: StepMetadata, req_id: str, track: _Track, computed: int) -> None:
        ready = min(computed, track.num_tokens)
        if track.target is not None:
            track.emitted = True
            meta.sends.append(
                SendSpec(
                    req_id,
                    track.target.transfer_id,
                    track.target.addresses,
                    track.num_tokens,
                    list(track.block_ids),
                    ready,
                    track.key,
                )
            )
        match = self._matches.get(req_id)
        loaded = match.tokens if match is not None and req_id in self._attempted else 0
        first, end = (
            max(-(-loaded // self.chunk_size), track.saved),
            min(ready // self.chunk_size, len(track.save_keys)),
        )
        if first < end:  # computed here, not loaded, not offered before: offer them
            meta.saves.append(SaveSpec(req_id, first, track.save_keys[:end], list(track.block_ids)))
            track.saved = end

    def finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished``: hold a pushing request's blocks until its writes settle; tell D what was pushed."""
        req_id = request.request_id
        self._attempted.discard(req_id)
        self._matches.pop(req_id, None)
        self._keys.pop(req_id, None)
        track = self._tracks.pop(req_id, None)
        if track is None or track.target is None or not track.emitted:
            return False, None  # saves are copied out during the step: nothing to hold
        if request.num_computed_tokens < track.num_tokens:  # aborted mid-prefill: the worker cancels the push
            return True, None
        out = Pushed(track.target.transfer_id, track.num_tokens, track.key.hex(), prefill_tp=self.tp_size)
        return True, {
            **{f: getattr(out, f) for f in out.__struct_fields__},
            "remote_host": track.target.remote_host,
            "remote_port": track.target.remote_port,
        }
