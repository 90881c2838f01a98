"""What a worker's role does with a request's KV: the common base of the prefill and decode roles.

A worker's HTTP surface is the same in both roles (``pdkv.worker.server``);
what differs is what ``kv_transfer_params`` make it do and which end of a
transfer it owns: a prefill worker sends (``pdkv.worker.prefill``), a decode
worker receives (``pdkv.worker.decode``). The role is chosen once, at start,
so the request path asks its role object instead of testing the role name.
A request that asks nothing of the role (no ``kv_transfer_params`` it acts on)
is planned here the same way in both: computed locally, offered to the tier.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from pdkv.channels.base import Channel
from pdkv.config import PdkvConfig
from pdkv.engine.base import EngineAdapter, Request
from pdkv.engine.sampling import SamplingParams, TokenLogprobs
from pdkv.errors import RequestError
from pdkv.keys import chunk_keys
from pdkv.transfer.receiver import KVReceiver
from pdkv.transfer.sender import KVSender
from pdkv.worker.metrics import WorkerMetrics
from pdkv.worker.openai_api import GenerationRequest, Handoff
from pdkv.worker.push import ChunkPusher
from pdkv.worker.tiering import CachedPrefix, Tiering


@dataclasses.dataclass
class Plan:
    """What the engine will run for one HTTP request, and what to tell the client."""

    job_request: Request
    first_token: int | None = None
    first_logprobs: TokenLogprobs | None = None
    decode: bool = True
    on_chunk: Callable[[Request, int, int], None] | None = None
    release: Callable[[Request], None] | None = None
    kv_params: dict[str, Any] | None = None
    on_first_token: Callable[[int, TokenLogprobs | None], None] | None = None  # the engine produced the first token
    # a streamed answer handed from P to D (``pdkv.worker.openai_api.StreamEvents``): "first" on P, whose stream is
    # the answer's first event only, left open; "rest" on D, whose client has that event from P already
    handoff: Handoff = ""


class WorkerRole(abc.ABC):
    """One role's transfer endpoint and its planning of requests; see the module docstring."""

    name: ClassVar[str]
    # The transfer endpoint: a prefill role sends and pushes, a decode role receives.
    sender: KVSender | None = None
    pusher: ChunkPusher | None = None
    receiver: KVReceiver | None = None

    def __init__(
        self, config: PdkvConfig, engine: EngineAdapter, channel: Channel, tiering: Tiering, metrics: WorkerMetrics
    ) -> None:
        self.config = config
        self.engine = engine
        self.channel = channel
        self.tiering = tiering
        self.metrics = metrics
        self.chunk_size = config.transfer.chunk_size

    async def plan(self, req: GenerationRequest) -> Plan:
        """What the engine runs for ``req``: this role's transfer when the request asks for it, else a local
        generation."""
        if self.wants_transfer(req.kv_transfer_params):
            return await self.plan_transfer(req)
        request, cached = await self.new_request(req, req.sampling)
        return Plan(request, on_chunk=self.tiering.offer(cached, None))

    @abc.abstractmethod
    def wants_transfer(self, kv: dict[str, Any]) -> bool:
        """Whether a request's ``kv_transfer_params`` ask this role for its part of a transfer."""

    @abc.abstractmethod
    async def plan_transfer(self, req: GenerationRequest) -> Plan:
        """The plan of a request whose ``kv_transfer_params`` ask for this role's part of a transfer."""

    @abc.abstractmethod
    def stats(self) -> Mapping[str, int]:
        """The transfer endpoint's counters and gauges (``KVSender.stats`` or ``KVReceiver.stats``)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close the transfer endpoint (the channel is the worker's)."""

    def info(self) -> dict[str, Any]:
        """What this role adds to the worker's ``/pdkv/info``."""
        return {}

    def cancel_transfer(self, transfer_id: str) -> None:
        """``DELETE /pdkv/transfers/{transfer_id}``: only a decode worker holds transfers."""
        raise RequestError("only a decode worker holds transfers", status=404)

    async def new_request(self, req: GenerationRequest, sampling: SamplingParams) -> tuple[Request, CachedPrefix]:
        """A request whose prompt is computed here, after its cached prefix was loaded from the tier."""
        request = self.engine.new_request(req.prompt_token_ids, sampling, req.request_id, req.cache_salt)
        cached = await self.tiering.load(request)
        self.metrics.prompt_tokens.labels(self.name, "computed").inc(request.num_prompt_tokens - cached.tokens)
        return request, cached

    def prompt_key(self, prompt: list[int], salt: str) -> bytes:
        """The prompt's last chained chunk key under its cache salt: P reserves with it, D adopts KV only under
        the same key, so KV computed for a prompt of one tenant is never adopted for another's."""
        return chunk_keys(prompt, self.engine.fingerprint, self.chunk_size, salt)[-1]
