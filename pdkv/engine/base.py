"""What a prefill or decode worker needs from an engine, and nothing more.

A worker drives requests step by step, because the KV it moves is defined by
steps: P runs prefill chunk by chunk and ships each chunk's KV as soon as it
is in the paged buffer; D lands those chunks in its own buffer, declares them
present, and decodes. So the adapter exposes its buffer (layout + tensors +
block allocator + one block table per request) and the steps, and keeps the
request bookkeeping (which tokens have KV, which token is pending, when the
request is finished) here, shared by every engine, so every engine enforces
the same contract.

Threading: ``new_request``, ``free`` and reading attributes are safe from any
thread (the allocator is locked). ``prefill``, ``decode_step``, ``sample`` and
``append_token`` on one engine must come from one thread at a time: the
worker's engine loop. The transfer layer may gather/scatter a request's
blocks concurrently only for token ranges that no step is writing.
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
from collections.abc import Sequence
from typing import Literal

import torch

from pdkv.blocks import BlockAllocator
from pdkv.engine import sampling
from pdkv.engine.sampling import SamplingParams
from pdkv.errors import EngineError, InvalidRequestError
from pdkv.layout import KVLayout
from pdkv.modelfiles.tokenizer import Tokenizer

FinishReason = Literal["stop", "length"]
_ids = itertools.count()


@dataclasses.dataclass(eq=False)
class Request:
    """One generation's state: its tokens, its blocks, how far its KV goes.

    Invariants the engine keeps: the KV of tokens ``[0, num_computed)`` of
    ``token_ids`` is in ``block_table``'s blocks; at most one token (the last
    sampled one) lacks KV; ``block_table`` holds room for every token that
    will ever need KV, so a step never allocates.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    block_table: list[int]
    seed: int
    num_computed: int = 0
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: FinishReason | None = None
    freed: bool = False
    cache_salt: str = ""  # the cache partition its prompt's KV is stored and loaded under (pdkv.keys); "": unsalted
    generator: torch.Generator = dataclasses.field(default_factory=torch.Generator, repr=False)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def prefilled(self) -> bool:
        return self.num_computed >= self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineAdapter(abc.ABC):
    """An engine as a worker sees it: a paged KV buffer plus prefill/decode steps.

    Subclasses implement the two compute steps (``_prefill``, ``_decode``);
    everything else, validation included, lives here.
    """

    def __init__(
        self,
        *,
        layout: KVLayout,
        kv_buffer: list[torch.Tensor],
        tokenizer: Tokenizer,
        fingerprint: str,
        model_name: str,
        max_model_len: int,
        eos_token_ids: Sequence[int],
        vocab_size: int,
    ) -> None:
        self.layout = layout
        """How the KV buffer sits in memory; sent in Hello, used by gather/scatter."""
        self.kv_buffer = kv_buffer
        """The paged KV tensors (``layout.allocate``): what the channels register and the transfer layer
        reads/writes."""
        self.allocator = BlockAllocator(layout.validate_buffer(kv_buffer))
        """Blocks of ``kv_buffer``; requests take theirs all at once in ``new_request``."""
        self.tokenizer = tokenizer
        self.fingerprint = fingerprint
        """Same weights, config and KV dtype <=> same fingerprint; peers with another are refused."""
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = vocab_size

    # -- requests --------------------------------------------------------------
    def new_request(
        self,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str = "",
    ) -> Request:
        """Validate a prompt and reserve blocks for its whole life (prompt + max_tokens).

        All or nothing, so a request admitted never runs out of KV mid-way;
        raises ``OutOfBlocksError`` (nothing taken) when the buffer is full,
        ``InvalidRequestError`` for an empty, out-of-vocabulary or too long prompt.
        """
        prompt, params, total = self._validate(prompt_token_ids, sampling_params)
        # the last sampled token is never fed back, so it needs no KV slot
        blocks = self.allocator.allocate(self.layout.blocks_for(total - 1))
        seed = params.seed if params.seed is not None else sampling.new_seed()
        return Request(request_id or f"req-{next(_ids)}", prompt, params, blocks, seed, cache_salt=cache_salt)

    def adopt_request(
        self,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams | None,
        blocks: Sequence[int],
        request_id: str | None = None,
        cache_salt: str = "",
    ) -> Request:
        """A request whose first blocks are ``blocks`` (already allocated here, e.g. by a transfer's receiver).

        The decode worker's receiver reserves blocks for the prompt only; this
        adds the blocks the generation needs after it. On any error the
        caller still owns ``blocks`` (nothing else is taken); on success the
        request owns them and ``free`` returns them.
        """
        prompt, params, total = self._validate(prompt_token_ids, sampling_params)
        if len(blocks) < self.layout.blocks_for(len(prompt)):
            raise EngineError(
                f"{len(blocks)} blocks cannot hold a {len(prompt)}-token prompt (block size {self.layout.block_size})"
            )
        extra = self.allocator.allocate(max(0, self.layout.blocks_for(total - 1) - len(blocks)))
        seed = params.seed if params.seed is not None else sampling.new_seed()
        return Request(
            request_id or f"req-{next(_ids)}", prompt, params, [*blocks, *extra], seed, cache_salt=cache_salt
        )

    def free(self, request: Request) -> None:
        """Give the request's blocks back. Exactly once: a second free raises instead of corrupting the free list."""
        if request.freed:
            raise EngineError(f"request {request.request_id} was already freed")
        request.freed = True
        self.allocator.free(request.block_table)

    def mark_computed(self, request: Request, num_tokens: int) -> None:
        """Declare the KV of prompt tokens ``[0, num_tokens)`` present in the request's blocks.

        For KV that did not come from this engine's own prefill: chunks landed
        by a transfer, or loaded from the cache tier. ``prefill`` then continues
        from ``num_tokens``. To get the first token's logits, leave at least
        the last prompt token to ``prefill`` (or take the first token from P).
        """
        self._check_live(request)
        if not request.num_computed <= num_tokens <= request.num_prompt_tokens:
            raise EngineError(
                f"request {request.request_id}: can mark tokens [0, n) computed only for {request.num_computed} <= n "
                f"<= {request.num_prompt_tokens} (prompt length), got n={num_tokens}"
            )
        request.num_computed = num_tokens

    # -- compute steps -----------------------------------------------------------
    def prefill(self, request: Request, start: int, end: int) -> torch.Tensor | None:
        """Compute the KV of prompt tokens ``[start, end)`` into the request's blocks.

        Chunked prefill: call with consecutive ranges (``start`` must equal
        ``request.num_computed``); the KV of a chunk is in the buffer when this
        returns, ready to be gathered and sent. Returns float32 logits
        ``[vocab]`` of the last prompt token when ``end`` is the prompt length,
        else None.
        """
        self._check_live(request)
        if start != request.num_computed or not start < end <= request.num_prompt_tokens:
            raise EngineError(
                f"request {request.request_id}: prefill range [{start}, {end}) must start at "
                f"num_computed={request.num_computed} and end within the prompt (1..{request.num_prompt_tokens} "
                "tokens)"
            )
        logits = self._prefill(request, start, end)
        request.num_computed = end
        return logits[0] if end == request.num_prompt_tokens else None

    def decode_step(self, requests: Sequence[Request]) -> torch.Tensor:
        """Feed each request's pending token (its last one) and return float32 logits ``[len(requests), vocab]``.

        One batched forward for all requests; each must be prefilled, not
        finished, and have exactly one token without KV (sampled or appended).
        """
        if not requests:
            raise EngineError("decode_step needs at least one request")
        for r in requests:
            self._check_live(r)
            if r.finished or not r.prefilled or r.num_computed != r.num_tokens - 1:
                raise EngineError(
                    f"request {r.request_id} is not ready to decode: finished={r.finished}, {r.num_computed} of "
                    f"{r.num_tokens} tokens have KV (need all but the last, the prompt included)"
                )
        logits = self._decode(requests)
        for r in requests:
            r.num_computed += 1
        return logits

    def sample(self, request: Request, logits: torch.Tensor) -> int:
        """Pick the next token from ``logits`` ``[vocab]`` with the request's sampling settings (does not append it)."""
        return sampling.sample(logits, request.sampling, request.seed, len(request.output_token_ids), request.generator)

    def append_token(self, request: Request, token_id: int) -> None:
        """Record a generated token (sampled here, or P's first token on D) and update ``finish_reason``."""
        self._check_live(request)
        if request.finished:
            raise EngineError(f"request {request.request_id} already finished ({request.finish_reason})")
        if request.output_token_ids and request.num_computed != request.num_tokens:
            raise EngineError(
                f"request {request.request_id} already has a pending token; run decode_step before appending another"
            )
        self._check_token_ids([token_id])
        request.output_token_ids.append(int(token_id))
        stops = set(request.sampling.stop_token_ids) | (set() if request.sampling.ignore_eos else self.eos_token_ids)
        if token_id in stops:
            request.finish_reason = "stop"
        elif len(request.output_token_ids) >= request.sampling.max_tokens:
            request.finish_reason = "length"

    def generate(
        self, prompt_token_ids: Sequence[int], sampling_params: SamplingParams | None = None, chunk_size: int = 256
    ) -> Request:
        """Whole generation in this process, built only on the steps above: the reference a disaggregated run
        must equal.

        Returns the finished (and already freed) request.
        """
        request = self.new_request(prompt_token_ids, sampling_params)
        try:
            logits = None
            for start in range(0, request.num_prompt_tokens, chunk_size):
                logits = self.prefill(request, start, min(start + chunk_size, request.num_prompt_tokens))
            assert logits is not None
            self.append_token(request, self.sample(request, logits))
            while not request.finished:
                self.append_token(request, self.sample(request, self.decode_step([request])[0]))
        finally:
            self.free(request)
        return request

    # -- for subclasses ----------------------------------------------------------
    @abc.abstractmethod
    def _prefill(self, request: Request, start: int, end: int) -> torch.Tensor:
        """Compute prompt tokens ``[start, end)`` into the blocks; float32 logits ``[1, vocab]`` of token ``end
        - 1``."""

    @abc.abstractmethod
    def _decode(self, requests: Sequence[Request]) -> torch.Tensor:
        """Feed each request's token at position ``num_computed``; float32 logits ``[len(requests), vocab]``."""

    def _validate(
        self, prompt_token_ids: Sequence[int], sampling_params: SamplingParams | None
    ) -> tuple[list[int], SamplingParams, int]:
        """(prompt, params, prompt + max_tokens) of a request that fits this engine, or InvalidRequestError."""
        params = sampling_params or SamplingParams()
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise InvalidRequestError("the prompt is empty; at least one token is needed")
        self._check_token_ids(prompt)
        total = len(prompt) + params.max_tokens
        if total > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds this engine's "
                f"context of {self.max_model_len} tokens"
            )
        return prompt, params, total

    def _check_live(self, request: Request) -> None:
        if request.freed:
            raise EngineError(f"request {request.request_id} was freed; it cannot be used again")

    def _check_token_ids(self, ids: Sequence[int]) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"token ids out of the vocabulary [0, {self.vocab_size}): {bad[:8]}")
