"""What the scheduler-side connector tells the worker-side one each step.

vLLM pickles this from the scheduler process to every worker, so it is
plain data: no tensors, no handles.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SendSpec:
    """Prefill: push ``num_tokens`` prompt tokens of ``req_id`` from ``block_ids``; ``ready_tokens`` are computed after this step."""

    req_id: str
    transfer_id: str
    address: str
    num_tokens: int
    block_ids: list[int]
    ready_tokens: int


@dataclass(frozen=True)
class LoadSpec:
    """Decode: land transfer ``transfer_id`` (``num_tokens`` tokens) in ``block_ids``, skipping ``skip_tokens`` already cached here."""

    req_id: str
    transfer_id: str
    num_tokens: int
    skip_tokens: int
    block_ids: list[int]


@dataclass
class StepMetadata:
    sends: list[SendSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    # Transfers that landed for requests that no longer need them (fully cached here, or gone): free them.
    discards: list[str] = field(default_factory=list)
