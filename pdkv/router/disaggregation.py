"""Whether moving a prompt's KV pays, per request (``router.disaggregate``).

A prefill/decode pair beats letting the decode worker compute the prompt
itself only while the prompt's KV crosses the link faster than D recomputes
it (P's prefill overlaps the transfer, chunk by chunk). On RDMA that is
always; on a 1 Gbit link with a small model, often not. The router cannot
know the KV bytes per token, the link rate to each decode worker, P's and D's
compute rates or what a codec saves, but it sees their sum on every streamed
request: the time to the answer's second event of each way it served a
prompt (the first decode step's token: the first may be P's, sent before the
KV moved, ``pdkv.router.handoff``, which would make a slow link look free). So each decode
worker keeps, per way (``transfer``, ``transfer_codec`` when a codec is
configured, ``local``), the observed seconds per prompt token (an
exponentially weighted mean), and ``auto`` takes the way with the lowest
prediction for this prompt's length.

Every way is tried before it is trusted, and each is tried again every
``disaggregate_explore_every`` requests, so a link that got faster (or a
decode worker that got busier) is noticed: the price is one request in that
many served the slower way. Short prompts (``short_prompt_tokens``) stay
local whatever the mode but ``always``' s own rule: the router's extra hop
costs more than their KV saves.

``decide`` is pure, so the policy is tested on numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Mode = Literal["always", "never", "auto"]
Way = Literal["transfer", "transfer_codec", "local"]


@dataclass
class WayCost:
    """Observed seconds per prompt token of one way to an answer's second event (exponentially weighted)."""

    per_token: float | None = None
    samples: int = 0

    def observe(self, seconds: float, tokens: int, weight: float) -> None:
        if tokens <= 0 or seconds < 0:
            return
        rate = seconds / tokens
        self.per_token = rate if self.per_token is None else (1 - weight) * self.per_token + weight * rate
        self.samples += 1


@dataclass
class DecodeCosts:
    """What one decode worker's requests showed, per way, and how many requests it has decided."""

    ways: dict[str, WayCost] = field(default_factory=dict)
    decided: int = 0

    def cost(self, way: Way) -> WayCost:
        return self.ways.setdefault(way, WayCost())


@dataclass(frozen=True)
class Decision:
    way: Way
    reason: str  # counted in pdkv_router_disaggregation_total{way, reason}

    @property
    def transfer(self) -> bool:
        return self.way != "local"


def decide(
    mode: Mode, tokens: int, short_prompt_tokens: int, costs: DecodeCosts, with_codec: bool, explore_every: int
) -> Decision:
    """How to serve a prompt of ``tokens`` tokens on the decode worker whose record is ``costs``."""
    if mode == "never":
        return Decision("local", "never")
    if tokens < short_prompt_tokens:
        return Decision("local", "short_prompt")
    if mode == "always":
        return Decision("transfer", "always")
    ways: list[Way] = ["transfer", "transfer_codec", "local"] if with_codec else ["transfer", "local"]
    for way in ways:  # every way measured once before any is trusted
        if costs.cost(way).per_token is None:
            return Decision(way, "unmeasured")
    if explore_every and costs.decided % explore_every == explore_every - 1:
        stalest = min(ways, key=lambda w: costs.cost(w).samples)
        return Decision(stalest, "explore")
    best = min(ways, key=lambda w: costs.cost(w).per_token or 0.0)
    return Decision(best, "faster")
