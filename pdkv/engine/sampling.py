"""How a request picks its next token: greedy, or temperature/top-p with a seed.

A seeded request must give the same tokens whether one process generates it
or P samples the first token and D the rest. So the random stream is not one
generator carried along the request (D would start it fresh and diverge from
a single process): output token ``i`` is drawn from the request's generator
reseeded with ``hash(seed, i)``, which any process can reproduce.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import secrets

import torch

from pdkv.errors import InvalidRequestError


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings (the OpenAI request fields the engine acts on).

    ``temperature == 0`` is greedy. ``seed`` None draws a random one when the
    request is created. ``stop_token_ids`` stop in addition to the model's EOS
    ids, which ``ignore_eos`` disables (benchmarks want exact lengths).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidRequestError(
                f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", param="max_tokens"
            )
        if not (isinstance(self.temperature, (int, float)) and 0 <= self.temperature < math.inf):
            raise InvalidRequestError(
                f"temperature must be a finite number >= 0 (0 is greedy), got {self.temperature!r}", param="temperature"
            )
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}", param="top_p")
        if self.seed is not None and not (_is_int(self.seed) and -(1 << 63) <= self.seed < 1 << 63):
            raise InvalidRequestError(f"seed must be a 64-bit integer, got {self.seed!r}", param="seed")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """A chosen token's log-probability and the ``top`` most likely tokens' ``(id, logprob)``, best first.

    Taken from the model's raw distribution (log-softmax of the logits, before temperature or
    top-p), as vLLM reports them by default, so they are the same whatever the sampling settings.
    """

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


# vLLM's floor for a log-probability in JSON: -inf is not a JSON number.
MIN_LOGPROB = -9999.0


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """``token``'s log-probability under ``logits`` ``[vocab]`` and the ``top`` best tokens'."""
    logprobs = torch.log_softmax(logits.detach().float().cpu(), dim=-1)
    best = torch.topk(logprobs, top) if top else None
    pairs = (
        ()
        if best is None
        else tuple(
            (int(i), max(float(v), MIN_LOGPROB))
            for v, i in zip(best.values.tolist(), best.indices.tolist(), strict=True)
        )
    )
    return TokenLogprobs(max(float(logprobs[token]), MIN_LOGPROB), pairs)


def new_seed() -> int:
    """A random 63-bit seed for a request that did not ask for one."""
    return secrets.randbits(63)


def step_seed(seed: int, step: int) -> int:
    """The seed of output token ``step``: stable across processes, uncorrelated between steps."""
    digest = hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def sample(logits: torch.Tensor, params: SamplingParams, seed: int, step: int, generator: torch.Generator) -> int:
    """One token id from ``logits`` ``[vocab]``.

    Sampling runs on the CPU whatever device produced the logits: the
    generator is a CPU one, and the same logits then give the same token on
    every machine.
    """
    logits = logits.detach().float().cpu()
    if params.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the top token always stays)
        keep = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) < params.top_p
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
    generator.manual_seed(step_seed(seed, step))
    return int(torch.multinomial(probs, 1, generator=generator))
