"""Which worker gets a request: round-robin, least-loaded and prefix-aware policies.

Without ``router.tokenizer`` the router has no tokenizer (loading one ties
it to a model and costs the memory of one), so a prompt is seen as a
sequence of integers: the client's token ids when it sent ids, else the
Unicode code points of its text (for chat, the tools and every message's
role and content in order). With one, prompts are the token ids the
workers compute (``describe_prompt``), which the KV-aware prefix policy
needs to match them against the workers' KV events.
Prefix keys are ``pdkv.keys.chunk_keys`` over that sequence in fixed-size
chunks, ``prefix_chunk_tokens`` ids or ``prefix_chunk_tokens *
chars_per_token`` characters: two prompts that share a leading chunk of
text share its key, which is all prefix affinity needs, and a conversation
that grows by a message keeps every full chunk of its past. Lengths are
estimated the same way (``len(text) / chars_per_token``); policies only
compare them with each other and with the short-prompt threshold.
"""

from __future__ import annotations

import abc
import collections
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from pdkv.config import RouterConfig
from pdkv.errors import PdkvError
from pdkv.keys import chunk_keys
from pdkv.router.pool import Role, WorkerState

if TYPE_CHECKING:
    from pdkv.modelfiles.tokenizer import Tokenizer
    from pdkv.router.kv_aware import KVAwareness


@dataclass
class Prompt:
    """What a policy knows of a request's prompt."""

    units: np.ndarray  # token ids, or the code points of the prompt's text
    est_tokens: int
    chunk: int  # units per prefix chunk
    kind: str  # "ids" or "text": keys of the two never collide
    salt: str = ""  # the request's cache salt: prefixes match only prompts of the same salt (tenant)

    @cached_property
    def keys(self) -> list[bytes]:
        """Chained keys of the prompt's chunks (the partial last one included), computed on first use."""
        return chunk_keys(self.units, f"pdkv-router/{self.kind}", self.chunk, self.salt) if len(self.units) else []


def describe_prompt(
    body: dict[str, Any], chat: bool, config: RouterConfig, tokenizer: Tokenizer | None = None, salt: str = ""
) -> Prompt:
    """A request body's prompt under cache salt ``salt`` as a policy sees it; a body with no usable prompt gives
    an empty one (the worker, not the router, tells the client what is wrong with it)."""
    ids = None if chat else _token_ids(body.get("prompt"))
    if ids is None and tokenizer is not None:
        ids = _tokenize(body, chat, tokenizer)
    if ids is not None:
        return Prompt(np.asarray(ids, dtype=np.int64), len(ids), config.prefix_chunk_tokens, "ids", salt)
    text = _chat_text(body) if chat else _prompt_text(body.get("prompt"))
    # surrogatepass: a lone surrogate is the worker's to refuse (a 400), not a reason for the router to fail
    units = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")
    chunk = max(1, round(config.prefix_chunk_tokens * config.chars_per_token))
    return Prompt(units, math.ceil(len(text) / config.chars_per_token), chunk, "text", salt)


def _token_ids(prompt: Any) -> list[int] | None:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]  # a batch of one
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 63 for t in prompt)
    ):
        return prompt
    return None  # not token ids the router can key (the worker says what is wrong with them)


def _tokenize(body: dict[str, Any], chat: bool, tokenizer: Tokenizer) -> list[int] | None:
    """The token ids a worker computes for this body (as the workers' OpenAI parsing does), or None when it has no
    prompt the tokenizer takes (the worker will say what is wrong)."""
    try:
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
                return None
            return tokenizer.encode_chat(messages)
        text = _prompt_text(body.get("prompt"))
        return tokenizer.encode(text) if text else None
    except (PdkvError, TypeError, ValueError):
        return None


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else ""


def _chat_text(body: dict[str, Any]) -> str:
    """Tools first, then each message, in the order a chat template renders them."""
    parts = [json.dumps(body["tools"], sort_keys=True)] if body.get("tools") else []
    for message in body.get("messages") or []:
        if isinstance(message, dict):
            parts.append(f"{message.get('role', '')}\n{_content_text(message.get('content'))}\n")
    return "".join(parts)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: the text parts, in order
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return "" if content is None else json.dumps(content, sort_keys=True)


class Policy(abc.ABC):
    """Chooses one of the candidate workers of a role for a prompt.

    ``choose`` gets a non-empty list of healthy workers and returns the pick
    and a short reason (a metric label). ``served`` is told after a prefill
    succeeded, for policies that learn from what ran where.
    """

    name: ClassVar[str]

    @abc.abstractmethod
    def choose(self, role: Role, candidates: Sequence[WorkerState], prompt: Prompt) -> tuple[WorkerState, str]: ...

    def served(self, worker: WorkerState, prompt: Prompt) -> None:  # noqa: B027 - optional: only policies that learn from a success override it
        """A prefill of ``prompt`` succeeded on ``worker``."""


class RoundRobin(Policy):
    """Each role's workers in turn."""

    name = "round-robin"

    def __init__(self) -> None:
        self._turn: dict[Role, int] = collections.defaultdict(int)

    def choose(self, role: Role, candidates: Sequence[WorkerState], prompt: Prompt) -> tuple[WorkerState, str]:
        turn = self._turn[role]
        self._turn[role] = turn + 1
        return candidates[turn % len(candidates)], "round_robin"


class LeastLoaded(RoundRobin):
    """The worker the router has the least in flight on: prefill by prompt tokens, decode by sequences.

    Ties go round-robin, so an idle pool still spreads its load.
    """

    name = "least-loaded"

    def choose(self, role: Role, candidates: Sequence[WorkerState], prompt: Prompt) -> tuple[WorkerState, str]:
        start = self._turn[role] % len(candidates)
        self._turn[role] += 1
        rotated = [*candidates[start:], *candidates[:start]]
        return min(rotated, key=lambda w: load(role, w)), "least_loaded"


def load(role: Role, worker: WorkerState) -> tuple[int, int]:
    """What least-loaded minimizes: prefill (prompt tokens, requests), decode (sequences, 0)."""
    if role == "prefill":
        return worker.inflight_tokens, worker.inflight_requests
    return worker.inflight_requests, 0


class PrefixAware(LeastLoaded):
    """Prefill goes where the prompt's prefix is cached; decode is least-loaded.

    Where the prefix is cached comes from two places:

    * the workers' KV events (``kv``, pdkv.router.kv_aware), when the prompt
      is token ids and at least one candidate publishes them: each candidate
      costs the prompt tokens it does not cache plus ``load_weight`` times
      the prompt tokens the router has in flight on it, and the cheapest
      wins (ties go round-robin). A candidate without a stream is costed by
      the guess below. This is what the worker really holds, evictions and
      the shared tier included;
    * otherwise the router's own guess: the worker that last prefilled each
      chunk key, in a bounded LRU (``prefix_cache_entries`` keys). That
      owner is taken unless it is not a candidate (down, deregistered) or
      runs more than ``prefix_max_imbalance`` requests beyond the
      least-loaded worker: a hot prefix must not pile every request onto one.
    """

    name = "prefix"

    def __init__(
        self, max_entries: int, max_imbalance: int, kv: KVAwareness | None = None, load_weight: float = 1.0
    ) -> None:
        super().__init__()
        self.max_entries = max_entries
        self.max_imbalance = max_imbalance
        self.kv = kv
        self.load_weight = load_weight
        self._owner: collections.OrderedDict[bytes, str] = collections.OrderedDict()

    def choose(self, role: Role, candidates: Sequence[WorkerState], prompt: Prompt) -> tuple[WorkerState, str]:
        start = self._turn[role] % len(candidates)
        least, _ = super().choose(role, candidates, prompt)
        if role != "prefill":
            return least, "least_loaded"
        if self.kv is not None and prompt.kind == "ids" and len(prompt.units):
            cached = self.kv.cached_tokens(prompt.units, candidates, prompt.salt)
            if cached:
                return self._cheapest([*candidates[start:], *candidates[:start]], prompt, cached)
        by_url = {w.url: w for w in candidates}
        for key in reversed(prompt.keys):
            owner = by_url.get(self._owner.get(key, ""))
            if owner is not None:
                if owner.inflight_requests > least.inflight_requests + self.max_imbalance:
                    return least, "prefix_overloaded"
                return owner, "prefix_hit"
        return least, "prefix_miss"

    def _cheapest(
        self, candidates: Sequence[WorkerState], prompt: Prompt, cached: dict[str, int]
    ) -> tuple[WorkerState, str]:
        """The candidate (in round-robin order, so ties rotate) with the least prefill work: see the class docstring."""
        guessed = self._guess(prompt)
        tokens = {w.url: min(prompt.est_tokens, cached.get(w.url, guessed.get(w.url, 0))) for w in candidates}
        best = min(candidates, key=lambda w: prompt.est_tokens - tokens[w.url] + self.load_weight * w.inflight_tokens)
        if tokens[best.url] == 0:
            return best, "kv_miss"
        return best, "kv_hit" if tokens[best.url] == max(tokens.values()) else "kv_load_balanced"

    def _guess(self, prompt: Prompt) -> dict[str, int]:
        """Prompt tokens the router's own record says each worker computed last (workers without a stream)."""
        out: dict[str, int] = {}
        for i, key in enumerate(prompt.keys):
            owner = self._owner.get(key)
            if owner is not None:
                out[owner] = (i + 1) * prompt.chunk
        return out

    def served(self, worker: WorkerState, prompt: Prompt) -> None:
        for key in prompt.keys:
            self._owner[key] = worker.url
            self._owner.move_to_end(key)
        while len(self._owner) > self.max_entries:
            self._owner.popitem(last=False)


def make_policy(config: RouterConfig, kv: KVAwareness | None = None) -> Policy:
    if config.policy == "least-loaded":
        return LeastLoaded()
    if config.policy == "prefix":
        return PrefixAware(config.prefix_cache_entries, config.prefix_max_imbalance, kv, config.prefix_load_weight)
    return RoundRobin()
