"""Worker-side data path of the pdkv vLLM connector: push on P, land and load on D.

Runs inside vLLM's worker process, beside the model. Nothing here may stall
the forward pass on the network:

* P: after each forward step (``wait_for_save``) the scheduler says how much
  of each pushing request's prompt is computed; a push thread opens the
  transfer on D's receiver (handshake + reservation, once per request) and
  posts each chunk as soon as its tokens are in vLLM's blocks, writing
  straight from them (pdkv ``KVSender`` over vLLM's own tensors). The
  request's blocks stay vLLM's until the writes have settled: only then is
  the request reported in ``finished_sending`` and its blocks freed.
* D: pushed chunks land in the request's own vLLM blocks, as
  ``landing.landing_path`` says (logged at start, kept on ``landing``:
  ``direct``, or ``staged`` through pinned host slots when the channel cannot
  address vLLM's memory), the receiver being built over vLLM's tensors and
  granting a transfer the blocks D's scheduler allocated to its request past
  D's own prefix hit: its Reserved tells P how many tokens that hit holds, and
  P pushes only the rest (the hit's blocks may be shared: never written). When
  the scheduler has allocated the request's blocks, a loader thread waits for the transfer
  (bounded by ``transfer_timeout_s``) and reports the request in
  ``finished_recving`` once its bytes are in vLLM's blocks; a transfer that
  failed, timed out or never came is reported in ``failed_recving`` too, so
  vLLM recomputes the prompt (its ``recompute`` load-failure policy), never
  decodes from blocks that were not filled, and only once no write of P's
  can still land in them.
* Any role, with a shared tier (``tier.redis_url``), through a
  ``pdkv.KVCacheEngine`` over Redis: full prompt chunks computed here are
  stored during the step (gathered out of vLLM's blocks, which may be freed
  right after it, and written to Redis behind, through a bounded queue: when
  Redis is slower than compute, chunks are dropped and counted, never waited
  for); a load the scheduler planned from the tier retrieves those chunks
  into the tokens past vLLM's own prefix cache.

Ordering on a GPU (``ordering.DeviceOrder``; run on an H200 by tests/gpu/vllm_connector.py, not inside vLLM): the
push thread waits for an event marked on vLLM's stream at the end of the step
before posting that step's chunks; a loader waits for an event marked when
vLLM handed it the blocks before anything may write them. No device-wide synchronize. On CPU the same calls run
with events that are done at once.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from pdkv.cache_engine import KVCacheEngine, suffix_mask
from pdkv.channels import create_channel
from pdkv.channels.base import Channel
from pdkv.config import PdkvConfig
from pdkv.errors import PdkvError, TransferError
from pdkv.integration.vllm import stats
from pdkv.integration.vllm.affinity import unpin_current_thread, unpinned
from pdkv.integration.vllm.landing import LandingPath, VllmBlocks, landing_path
from pdkv.integration.vllm.metadata import LoadSpec, SendSpec, StepMetadata
from pdkv.integration.vllm.ordering import DeviceOrder, StepEvent
from pdkv.integration.vllm.parallel import Piece, pieces
from pdkv.keys import PromptKeys
from pdkv.layout import KVLayout
from pdkv.memory import adopt_kv
from pdkv.transfer.outgoing import OutgoingTransfer
from pdkv.transfer.receiver import KVReceiver
from pdkv.transfer.sender import KVSender

log = logging.getLogger(__name__)


@dataclass
class _Push:
    """One request's push from this rank: a transfer per decode rank it sends heads to (``parallel.pieces``)."""

    spec: SendSpec
    transfers: list[OutgoingTransfer] | None = None  # once opened (empty: this rank sends no part)
    ready_event: StepEvent | None = None  # marked at the end of the latest step that computed its tokens
    failed: str = ""
    opening: bool = False  # its transfers are being opened (handshake, Reserve) on an opener thread
    finished: bool = False  # vLLM finished the request: no more compute will come
    unsettled: int = 0  # opened transfers whose writes may still read its blocks
    sent: set[tuple[int, int]] = field(default_factory=set)  # (transfer, chunk)

    @property
    def settled(self) -> bool:
        """No write of ours reads its blocks any more."""
        return self.transfers is not None and not self.unsettled

    @property
    def releasable(self) -> bool:
        return self.finished and (self.settled or (self.transfers is None and bool(self.failed)))


class WorkerSide:
    """See the module docstring. ``register`` must run before anything else (vLLM calls it at start)."""

    def __init__(
        self,
        config: PdkvConfig,
        fingerprint: str,
        is_producer: bool,
        is_consumer: bool,
        agent_name: str,
        cache: Callable[[KVLayout], KVCacheEngine | None] | None = None,
        make_event: Callable[[], StepEvent] | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        total_kv_heads: int = 0,
    ) -> None:
        """``make_event``: the events ``DeviceOrder`` marks (tests pass fakes; default: CUDA events on a GPU).
        ``tp_rank`` of ``tp_size``: this worker's tensor-parallel rank. Its cache holds that rank's KV heads of the
        model's ``total_kv_heads`` (0: this rank's, at size 1); it pushes them to, or receives them on, the other
        instance's ranks as ``parallel.pieces`` pairs them (``config.control_port`` is already this rank's), and
        only rank 0 counts a request's tokens (every rank moves the same tokens)."""
        self.config = config
        self.tp_rank, self.tp_size, self.total_kv_heads = tp_rank, tp_size, total_kv_heads
        self.fingerprint = fingerprint
        self.is_producer = is_producer
        self.is_consumer = is_consumer
        self.agent_name = agent_name
        self.sender: KVSender | None = None
        self.channel: Channel | None = None  # the sender's and/or receiver's: closed after them
        self.receiver: KVReceiver | None = None
        self.layout: KVLayout | None = None
        self._vllm_kv: list[torch.Tensor] = []
        self.landing: LandingPath | None = None  # where pushed KV lands on this consumer, once registered
        self._blocks: VllmBlocks | None = None  # the receiver's allocator: vLLM's blocks, per transfer
        self._make_event = make_event
        self._order: DeviceOrder | None = None
        self._lock = threading.Lock()
        self._pushes: dict[str, _Push] = {}
        self._push_queue: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._push_thread: threading.Thread | None = None
        self._opener: ThreadPoolExecutor | None = None
        self._loader: ThreadPoolExecutor | None = None
        self._recv_done: set[str] = set()
        self._recv_failed: set[str] = set()
        self._make_cache = cache
        self.cache: KVCacheEngine | None = None
        self.counters: Counter[str] = Counter()
        self._reported: dict[str, int] = {}  # ``counters`` and events as of the last ``stats_delta``
        self._observed: list[stats.Observation] = []  # transfers' times since the last ``stats_delta``

    # -- setup --------------------------------------------------------------------------
    def register(self, layout: KVLayout, vllm_kv: list[torch.Tensor]) -> None:
        """Take vLLM's cache (already viewed in ``layout``) and start the sender and/or receiver."""
        with unpinned():  # every thread started here (and by those threads) runs off vLLM's pinned core
            self._start(layout, vllm_kv)

    def _start(self, layout: KVLayout, vllm_kv: list[torch.Tensor]) -> None:
        vllm_kv = adopt_kv(vllm_kv)  # emulated device memory under PDKV_EMULATE_DEVICE, before any path is chosen
        self.layout, self._vllm_kv = layout, vllm_kv
        self._order = DeviceOrder(vllm_kv[0].device, self._make_event)
        if self._make_cache is not None:
            self.cache = self._make_cache(layout)
        if not (self.is_producer or self.is_consumer):
            return
        channel = self.channel = create_channel(
            self.config.channel.name, self.agent_name, self.config.channel_options()
        )
        if self.is_producer:
            self.sender = KVSender(
                channel, layout, vllm_kv, self.fingerprint, self.config.transfer, secret=self.config.secret
            )
            self._opener = ThreadPoolExecutor(
                max_workers=8, thread_name_prefix="pdkv-vllm-open", initializer=unpin_current_thread
            )
            self._push_thread = threading.Thread(target=self._push_loop, name="pdkv-vllm-push", daemon=True)
            self._push_thread.start()
        if self.is_consumer:
            self._start_receiver(channel, layout, vllm_kv)

    def _start_receiver(self, channel: Channel, layout: KVLayout, vllm_kv: list[torch.Tensor]) -> None:
        """The receiver over vLLM's own tensors, its allocator vLLM's blocks; ``landing_path`` says direct or staged."""
        self.landing = landing_path(vllm_kv[0], channel.memory)
        self._blocks = VllmBlocks(layout.validate_buffer(vllm_kv))
        where = (
            f"straight in vLLM's blocks past its own prefix hit ({self.landing}: the {channel.name} channel "
            f"{'writes' if self.landing == 'direct' else 'cannot address'} vLLM's {vllm_kv[0].device} cache"
            f"{'' if self.landing == 'direct' else ', so chunks go through pinned host staging'})"
        )
        self.receiver = KVReceiver(
            channel,
            layout,
            vllm_kv,
            self._blocks,
            self.fingerprint,
            self.config.transfer,
            host=self.config.host,
            port=self.config.control_port,
            secret=self.config.secret,
            advertise_host=self.config.advertise_host,
        )
        log.info("pdkv receiver for vLLM listening on %s: pushed KV lands %s", self.receiver.address, where)

    # -- prefill: push ----------------------------------------------------------------------
    def push(self, meta: StepMetadata) -> None:
        """After a forward step: queue this step's newly computed chunks for pushing (never blocks)."""
        if not meta.sends:
            return
        assert self._order is not None
        event = self._order.mark()  # this step's kernels, all layers queued: its chunks go once they ran
        with self._lock:
            for spec in meta.sends:
                p = self._pushes.get(spec.req_id)
                if p is None:
                    p = self._pushes[spec.req_id] = _Push(spec)
                p.spec, p.ready_event = spec, event
        for spec in meta.sends:
            self._push_queue.put(spec.req_id)

    def _push_loop(self) -> None:
        while (req_id := self._push_queue.get()) is not None:
            with self._lock:
                p = self._pushes.get(req_id)
            if p is not None:
                try:
                    self._advance(p)
                except Exception:  # a bug here must not kill the thread that frees every request's blocks
                    log.exception("request %s: push failed unexpectedly", req_id)
                    self._give_up(p, "internal error (see the log)")

    def _advance(self, p: _Push) -> None:
        """Open the transfer once all blocks are known, post every computed chunk, cancel if the request ended early."""
        assert self.sender is not None and self.layout is not None
        spec = p.spec
        if p.failed or p.settled:
            return
        if p.ready_event is not None:
            p.ready_event.synchronize()
        if p.transfers is None:
            if p.opening:
                return  # ``_open`` queues the request again once its transfers are open
            if p.finished and spec.ready_tokens < spec.num_tokens:
                self._give_up(p, "the request ended before its prompt was computed")
                return
            if len(spec.block_ids) < self.layout.blocks_for(spec.num_tokens):
                return  # chunked prefill: the rest of the prompt's blocks come with a later step
            p.opening = True
            self._opener.submit(self._open, p)  # type: ignore[union-attr]
            return
        for k, t in enumerate(p.transfers):
            try:
                for i, (start, length) in enumerate(t.spans):
                    if (k, i) not in p.sent and start + length <= spec.ready_tokens:
                        t.send_chunk(i)
                        p.sent.add((k, i))
            except PdkvError as exc:
                log.warning(
                    "request %s: push to %s failed: %s (D recomputes the prompt)", spec.req_id, t.peer.address, exc
                )
                self._cancel_all(p, str(exc))
                return
        if p.finished and len(p.sent) < sum(t.num_chunks for t in p.transfers):
            self._cancel_all(p, "the request ended before its prompt was computed")

    def _pieces(self, prefill_tp: int, decode_tp: int) -> list[Piece]:
        """Every part of a request between the two sizes, one of them ours (``parallel.pieces``). Raises
        ``ConfigError`` for sizes the model's KV heads do not divide by."""
        assert self.layout is not None
        total = self.total_kv_heads or self.layout.num_kv_heads * self.tp_size
        return pieces(total, prefill_tp, decode_tp, self.layout.mla)

    def _parts(self, spec: SendSpec) -> list[Piece]:
        """What this rank sends for ``spec``: its parts of the request to D's ranks, one receiver each."""
        return [piece for piece in self._pieces(self.tp_size, len(spec.addresses)) if piece.p == self.tp_rank]

    def _cancel_all(self, p: _Push, why: str) -> None:
        for t in p.transfers or []:
            t.cancel(why)

    def _open(self, p: _Push) -> None:
        """Handshake and Reserve on an opener thread: a receiver that lands in vLLM's own blocks grants a transfer
        only once D's scheduler allocated them, and other requests' chunks must not wait behind that."""
        assert self.sender is not None
        spec = p.spec
        opened: list[OutgoingTransfer] = []
        why = ""
        try:
            for piece in self._parts(spec):
                transfer_id = piece.transfer_id(spec.transfer_id, self.tp_size, len(spec.addresses))
                opened.append(
                    self.sender.open(
                        transfer_id,
                        spec.addresses[piece.d],
                        spec.num_tokens,
                        spec.block_ids,
                        spec.prompt_key,
                        heads=piece.heads,
                    )
                )
        except PdkvError as exc:
            why = str(exc)
        except Exception:  # as in the push loop: the request's blocks must still be released
            log.exception("request %s: opening its transfers failed unexpectedly", spec.req_id)
            why = "internal error (see the log)"
        with self._lock:
            p.transfers, p.unsettled = opened, len(opened)
        for t in opened:
            t.on_settled(lambda t, p=p: self._settled(p, t))
        if why:
            self._give_up(p, why)  # the parts already open are cancelled: all or none
        self._push_queue.put(spec.req_id)

    def _give_up(self, p: _Push, why: str) -> None:
        log.warning(
            "request %s: not pushing its KV to %s: %s (D recomputes the prompt)",
            p.spec.req_id,
            ", ".join(p.spec.addresses) or "(no receiver)",
            why,
        )
        with self._lock:
            p.failed = why
            if not p.transfers:  # else counted as each settles
                self.counters["push_failed"] += 1
        self._cancel_all(p, why)

    def _settled(self, p: _Push, t: OutgoingTransfer) -> None:
        with self._lock:
            p.unsettled -= 1
            if t.complete:
                self._observed += [(series, "prefill", value) for series, value in t.completion.wire_times()]
                self.counters["push_ok"] += 1
                self.counters["push_bytes"] += t.bytes_sent
            else:
                self.counters["push_failed"] += 1
            if p.settled and self.tp_rank == 0 and p.transfers and all(x.complete for x in p.transfers):
                self.counters["push_tokens"] += sum(length for _, length in p.transfers[0].spans)

    # -- any role: offer computed chunks to the tier -------------------------------------------
    def save(self, meta: StepMetadata) -> None:
        """During the step: store newly computed full chunks (gathered now, written to Redis behind)."""
        if self.cache is None:
            return
        size = self.config.transfer.chunk_size
        for spec in meta.saves:
            keys = PromptKeys(tuple(spec.keys), len(spec.keys) * size, size, self.fingerprint)
            try:
                self.cache.store(
                    keys, self._vllm_kv, spec.block_ids, suffix_mask(keys.num_tokens, spec.first_chunk * size)
                )
            except Exception as exc:  # noqa: BLE001 - a tier that fails costs a future miss, never the step
                log.warning("request %s: chunks not offered to the cache tier: %s", spec.req_id, exc)

    def _load_from_tier(self, spec: LoadSpec) -> None:
        """Retrieve the tier's chunks of ``spec`` into vLLM's blocks, tokens past ``skip_tokens`` only."""
        if self.cache is None:
            raise TransferError("this instance has no cache tier (tier.redis_url is not set)")
        keys = PromptKeys(tuple(spec.tier_keys), spec.num_tokens, self.config.transfer.chunk_size, self.fingerprint)
        # vLLM's own prefix-cache blocks (tokens < skip_tokens) are shared with other requests: never written
        loaded = int(
            self.cache.retrieve(
                keys, self._vllm_kv, spec.block_ids, suffix_mask(spec.num_tokens, spec.skip_tokens)
            ).sum()
        )
        if loaded < spec.num_tokens - spec.skip_tokens:
            raise TransferError(
                f"the cache tier served {loaded} of the {spec.num_tokens - spec.skip_tokens} tokens planned (evicted "
                "since the lookup?)"
            )
        with self._lock:
            self.counters["tier_tokens_loaded"] += loaded

    # -- decode: land and load --------------------------------------------------------------
    def start_loads(self, meta: StepMetadata) -> None:
        """Hand this step's loads to the loader threads; free landed transfers nobody needs."""
        if self.receiver is not None:
            for discard in meta.discards:
                try:
                    ids = self._part_ids(discard.transfer_id, discard.prefill_tp)
                except PdkvError as exc:  # sizes never paired: nothing of it can have come
                    log.warning("transfer %s not discarded: %s", discard.transfer_id, exc)
                    continue
                for transfer_id in ids:
                    self.receiver.cancel(transfer_id, "the decode request does not need it")
        if meta.loads and self._loader is None:
            self._loader = ThreadPoolExecutor(
                max_workers=16, thread_name_prefix="pdkv-vllm-load", initializer=unpin_current_thread
            )
        if meta.loads:
            assert self._order is not None
            ready = self._order.mark()  # vLLM's work queued so far, on the blocks it just allocated included
            for spec in meta.loads:
                self._loader.submit(self._load, spec, ready)  # type: ignore[union-attr]

    def _load(self, spec: LoadSpec, ready: StepEvent) -> None:
        ok = False
        try:
            if spec.tier_keys:
                self._load_from_tier(spec)
            else:
                self._load_pushed(spec, ready)
            ok = True
        except PdkvError as exc:
            log.warning(
                "request %s: KV of %s not loaded: %s; vLLM recomputes the prompt",
                spec.req_id,
                "the cache tier" if spec.tier_keys else f"transfer {spec.transfer_id}",
                exc,
            )
        except Exception:  # the request must still be reported, or vLLM waits for it forever
            log.exception("request %s: loading its KV failed unexpectedly; vLLM recomputes the prompt", spec.req_id)
        with self._lock:
            (self._recv_done if ok else self._recv_failed).add(spec.req_id)
            self.counters[("tier_" if spec.tier_keys else "") + ("load_ok" if ok else "load_failed")] += 1

    def _load_pushed(self, spec: LoadSpec, ready: StepEvent) -> None:
        """Let P's Reserve be granted the request's own blocks past vLLM's local prefix hit (``skip_tokens``: whole
        blocks, which may be shared with other requests, so never granted), and wait for its chunks to land in
        them; P pushes only the tokens past the hit."""
        if self.receiver is None or self.layout is None or self._blocks is None:
            raise TransferError("this instance has no KV receiver (kv_role is not a consumer)")
        n = self.layout.blocks_for(spec.num_tokens)
        first = spec.skip_tokens // self.layout.block_size
        why = ""
        if len(spec.block_ids) < n:
            why = f"vLLM allocated {len(spec.block_ids)} blocks to a request of {spec.num_tokens} tokens ({n} blocks)"
        elif spec.skip_tokens % self.layout.block_size or spec.skip_tokens >= spec.num_tokens:
            why = (
                f"its local prefix hit of {spec.skip_tokens} tokens is not whole {self.layout.block_size}-token "
                f"blocks short of its {spec.num_tokens}"
            )
        ids = self._part_ids(spec.transfer_id, spec.prefill_tp)
        if why:
            for transfer_id in ids:
                self.receiver.cancel(transfer_id, why)
            raise TransferError(f"transfer {spec.transfer_id!r} not loaded: {why}")
        ready.synchronize()  # vLLM's queued work on these blocks (their previous owner's) ran: they may be written
        blocks, held = self._blocks, spec.skip_tokens
        for transfer_id in ids:  # every part lands its heads in the request's blocks
            blocks.expect(transfer_id, spec.block_ids[first:n], held_tokens=held, group=spec.req_id)
        waited = time.monotonic()
        deadline = waited + self.config.transfer.transfer_timeout_s
        try:
            for transfer_id in ids:
                got = self.receiver.wait(transfer_id, max(0.0, deadline - time.monotonic()), spec.prompt_key)
                blocks.free(got.blocks)  # handed over, bytes visible (the channel's completion or the scatter's event)
                if (got.num_tokens, got.held_tokens) != (spec.num_tokens, held):
                    raise TransferError(
                        f"transfer {transfer_id!r} carries tokens {got.held_tokens} to {got.num_tokens}; the request "
                        f"needs {held} to {spec.num_tokens}"
                    )
        except PdkvError:
            self._withdraw(ids, "a part of it failed")
            raise
        with self._lock:
            self._observed.append(("pdkv_transfer_wait_seconds", "decode", time.monotonic() - waited))
            if self.tp_rank == 0:
                self.counters["pushed_tokens_loaded"] += spec.num_tokens - held
            self.counters["load_bytes"] += self.layout.chunk_bytes(spec.num_tokens - held)  # all parts: our heads

    def _part_ids(self, transfer_id: str, prefill_tp: int) -> list[str]:
        """The transfers in which this decode rank receives its heads of ``transfer_id`` from ``prefill_tp`` prefill
        ranks (``parallel.pieces``). Raises ``ConfigError`` for sizes the model's KV heads do not divide by."""
        parts = self._pieces(prefill_tp, self.tp_size)
        return [p.transfer_id(transfer_id, prefill_tp, self.tp_size) for p in parts if p.d == self.tp_rank]

    def _withdraw(self, transfer_ids: list[str], why: str) -> None:
        """Fail every part of a request that is still coming, and wait until none of them can write into its blocks:
        vLLM recomputes into them once told, not before a late write of P's can no longer land."""
        assert self.receiver is not None and self._blocks is not None
        release_s = 2 * self.config.transfer.drain_timeout_s + 1.0
        for transfer_id in transfer_ids:
            self.receiver.cancel(transfer_id, f"the decode request gave up on it: {why}")
        for transfer_id in transfer_ids:
            if not self._blocks.withdraw(transfer_id, release_s):
                log.error(
                    "transfer %s: its vLLM blocks were not released within %.3gs of its failure", transfer_id, release_s
                )

    # -- completions ------------------------------------------------------------------------
    def results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving incl. failed, failed receiving) since the last call."""
        wake: list[str] = []
        with self._lock:
            for req_id in finished_req_ids:
                p = self._pushes.get(req_id)
                if p is not None and not p.finished:
                    p.finished = True
                    wake.append(req_id)
            sending = {req_id for req_id, p in self._pushes.items() if p.releasable}
            for req_id in sending:
                del self._pushes[req_id]
            failed, self._recv_failed = self._recv_failed, set()
            done, self._recv_done = self._recv_done, set()
        for req_id in wake:
            self._push_queue.put(req_id)
        return sending, done | failed, failed

    def stats_delta(self) -> dict[str, Any]:
        """What the counters vLLM exports (``stats.COUNTER_SERIES``, ``stats.EVENTS``) gained since the last call,
        and the transfers' times observed since (``stats.HISTOGRAMS``): vLLM asks every step and sums what it gets,
        so each increment and each observation is handed over once."""
        with self._lock:
            now = dict(self.counters)
            observed, self._observed = self._observed, []
        now |= self._events()
        out: dict[str, Any] = {**stats.delta(now, self._reported), **stats.observations(observed)}
        self._reported = now
        return out

    def _events(self) -> dict[str, int]:
        """The sender's and receiver's own counters (their channel's with the receiver's, or the sender's on a
        prefill-only instance), as the reference workers export them (``stats.EVENTS``)."""
        channel = self.channel.stats() if self.channel is not None else {}
        out: dict[str, int] = {}
        if self.sender is not None:
            out |= stats.event_counts("prefill", self.sender.stats(), {} if self.receiver else channel)
        if self.receiver is not None:
            out |= stats.event_counts("decode", self.receiver.stats(), channel)
        return out

    def close(self) -> None:
        if self._push_thread is not None:
            self._push_queue.put(None)
            self._push_thread.join(timeout=5)
        if self._opener is not None:
            self._opener.shutdown(wait=False, cancel_futures=True)
        if self.cache is not None:
            self.cache.close()  # queued writes get tier.flush_timeout_s, then are dropped
        if self._loader is not None:
            self._loader.shutdown(wait=False, cancel_futures=True)
        for side in (self.sender, self.receiver):
            if side is not None:
                side.close()
        if self.channel is not None:  # its threads and sockets: a worker that restarts its connector leaks none
            self.channel.close()


def agent_name(role: str) -> str:
    """A channel agent name unique per process: a restarted worker is a new peer."""
    return f"vllm-{role}-{os.getpid()}-{os.urandom(3).hex()}"
