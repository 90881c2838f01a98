"""What the scheduler-side connector tells the worker-side one each step.

vLLM pickles this from the scheduler process to every worker, so it is
plain data: no tensors, no handles.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SendSpec:
    """Prefill: push ``num_tokens`` prompt tokens of ``req_id`` from ``block_ids``; ``ready_tokens`` are computed
    after this step. ``addresses``: D's receivers, one per tensor-parallel rank; P's rank ``r`` pushes its
    part of the KV (its heads) to ``addresses[r]``."""

    req_id: str
    transfer_id: str
    addresses: list[str]
    num_tokens: int
    block_ids: list[int]
    ready_tokens: int
    prompt_key: bytes = b""  # chained key of the prompt, sent in the Reserve: D adopts the KV only for this prompt


@dataclass(frozen=True)
class LoadSpec:
    """Load the first ``num_tokens`` prompt tokens into ``block_ids``, skipping ``skip_tokens`` already cached here.

    From transfer ``transfer_id`` (pushed by P), or, when ``tier_keys`` are
    given, from those chunks of the shared cache tier.
    """

    req_id: str
    transfer_id: str
    num_tokens: int
    skip_tokens: int
    block_ids: list[int]
    tier_keys: list[bytes] = field(default_factory=list)
    prompt_key: bytes = b""  # pushed: our own key of the prompt; the KV is loaded only if P reserved under it
    prefill_tp: int = 1  # pushed: P's tensor-parallel size (``parallel.pieces``: which of its ranks push to which)


@dataclass(frozen=True)
class SaveSpec:
    """Offer prompt chunks ``first_chunk .. len(keys) - 1``, computed in ``block_ids``, to the tier.

    ``keys`` are the prompt's chunk keys from chunk 0 (a ``PromptKeys`` prefix: the worker stores
    them with a mask that selects the chunks from ``first_chunk`` on).
    """

    req_id: str
    first_chunk: int
    keys: list[bytes]
    block_ids: list[int]


@dataclass(frozen=True)
class Discard:
    """A pushed transfer the decode request does not need (fully cached here, or its prompt differs): each rank
    cancels its parts of it, which P pushed from ``prefill_tp`` ranks (``parallel.pieces``)."""

    transfer_id: str
    prefill_tp: int = 1


@dataclass
class StepMetadata:
    sends: list[SendSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    # Transfers that landed for requests that no longer need them (fully cached here, or gone): free them.
    discards: list[Discard] = field(default_factory=list)
