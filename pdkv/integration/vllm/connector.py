"""``PdkvConnector``: pdkv's data path behind vLLM's ``KVConnectorBase_V1``.

vLLM builds one instance in its scheduler process (role SCHEDULER) and one
per worker (role WORKER); this class only routes vLLM's calls to
``SchedulerSide`` or ``WorkerSide``, which hold the logic. Configure it with
``--kv-transfer-config``::

    {"kv_connector": "PdkvConnector",
     "kv_connector_module_path": "pdkv.integration.vllm.connector",
     "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
     "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {<a pdkv config: host, control_port, secret,
                                   channel, transfer>}}

On a consumer, ``host``/``control_port`` are where its KV receiver listens
(the router learns them from the server's ``/pdkv/info``); pushed KV lands in
vLLM's own blocks past D's prefix hit (README.md here). With ``tier.redis_url`` set, every
instance (any ``kv_role``) offers the full prompt chunks it computes to that
shared Redis tier and loads a prefix found there instead of computing it;
the tier's memory and disk levels are per process, so vLLM, whose scheduler
and workers are separate processes, uses only the shared one.
``pdkv launch --engine vllm`` writes all of this.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
from vllm.platforms import current_platform
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from pdkv.cache_engine import KVCacheEngine
from pdkv.config import convert_config
from pdkv.errors import LayoutError
from pdkv.integration.vllm import stats
from pdkv.integration.vllm.info import SECRET_ENV
from pdkv.integration.vllm.kvcache import check_platform_fp8, kv_dtype, vllm_cache_layout
from pdkv.integration.vllm.metadata import StepMetadata
from pdkv.integration.vllm.parallel import check_parallel, rank_config
from pdkv.integration.vllm.scheduler_side import SchedulerSide
from pdkv.integration.vllm.worker_side import WorkerSide, agent_name
from pdkv.keys import model_fingerprint
from pdkv.layout import KVLayout
from pdkv.transfer.params import PushGuard

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass
class PdkvConnectorMetadata(StepMetadata, KVConnectorMetadata):
    """One step's plan, pickled from the scheduler to the workers."""


def vllm_fingerprint(vllm_config: VllmConfig) -> str:
    """Same model, same config, same KV dtype => same fingerprint, on P and D alike (paths excluded).

    The KV dtype keeps an fp8 instance's chunks in a shared tier apart from a bf16 one's. P and D that differ in
    it are refused at the Hello with ``--kv-cache-dtype`` named (the layout's dtype), besides the fingerprint."""
    mc = vllm_config.model_config
    hf = {
        k: v
        for k, v in mc.hf_config.to_dict().items()
        if k not in ("_name_or_path", "transformers_version", "torch_dtype", "dtype")
    }
    name = os.path.basename(str(mc.model).rstrip("/"))
    return model_fingerprint(
        name, json.loads(json.dumps(hf, default=str)), f"{mc.dtype}/{vllm_config.cache_config.cache_dtype}"
    )


def vllm_layout(vllm_config: VllmConfig) -> KVLayout:
    """The wire fields of the layout ``vllm_cache_layout`` will find, from the config alone (the scheduler never
    sees the tensors, and only looks chunk keys up: the order, the attention backend's, is not needed there)."""
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    return KVLayout(
        num_layers=mc.get_num_layers(pc),
        num_kv_heads=mc.get_num_kv_heads(pc),  # 1 under MLA
        head_dim=mc.get_head_size(),  # MLA: kv_lora_rank + qk_rope_head_dim
        block_size=cc.block_size,
        dtype=kv_dtype(cc.cache_dtype, mc.dtype),
        kind="per_layer",
        order="NHD" if mc.use_mla else "HKND",
        mla=mc.use_mla,
    )


def attention_backend(vllm_config: VllmConfig) -> str:
    """The name of the one attention backend of this worker's layers: it decides where K and V sit in a cache row."""
    names = sorted({backend.get_name() for backend in get_current_attn_backends(vllm_config)})
    if len(names) != 1:
        raise LayoutError(f"PdkvConnector needs one attention backend for every layer, vLLM uses {names}")
    return names[0]


@dataclass
class PdkvConnectorStats(KVConnectorStats):
    """The worker side's counter increments (``stats.delta``) on their way to the scheduler, which sums them over
    steps and workers, and on to the metrics logger (``PdkvPromMetrics``)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self.data = stats.merged(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        """vLLM's periodic log line: the counters' increments over its interval, and each histogram's count and
        mean."""
        out: dict[str, int | float] = {}
        for k, v in self.data.items():
            if k.startswith("events|"):
                continue  # the sender's and receiver's own counters: on /metrics, too many for a log line
            if isinstance(v, list):
                out[f"{k} n"], out[f"{k} mean"] = len(v), sum(v) / len(v) if v else 0.0
            else:
                out[k] = v
        return out

    def is_empty(self) -> bool:
        return not self.data


class PdkvPromMetrics(KVConnectorPromMetrics):
    """The reference workers' ``pdkv_*`` counters (``stats.SERIES``) on vLLM's ``/metrics``, with vLLM's labels
    (model, engine) besides ours."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(name=name, documentation=doc, labelnames=[*labelnames, "role", *extra])
            for name, (doc, extra) in stats.SERIES.items()
        }
        self._histograms = {
            name: self._histogram_cls(
                name=name, documentation=doc, buckets=list(buckets), labelnames=[*labelnames, "role"]
            )
            for name, (doc, buckets) in stats.HISTOGRAMS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine = dict(zip(self._labelnames, self.per_engine_labelvalues[engine_idx], strict=True))
        for name, labels, value in stats.series(transfer_stats_data):
            self._counters[name].labels(**engine, **labels).inc(value)
        for name, labels, values in stats.histogram_series(transfer_stats_data):
            histogram = self._histograms[name].labels(**engine, **labels)
            for v in values:
                histogram.observe(v)


class PdkvConnector(KVConnectorBase_V1):
    """Push-mode P/D over pdkv: P pushes chunks as they are computed, D lands and loads them."""

    _cache_hit_source = CacheHitSource.P2P  # vllm:prompt_tokens_cached_by_source{source="p2p"}

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        extra = dict(ktc.kv_connector_extra_config or {})
        if SECRET_ENV in os.environ and not extra.get("secret"):
            extra["secret"] = os.environ[
                SECRET_ENV
            ]  # how pdkv launch hands it over: never on a command line `ps` shows
        self.config = convert_config(extra, "kv_transfer_config.kv_connector_extra_config")
        pc = vllm_config.parallel_config
        self.tp_size = pc.tensor_parallel_size
        self.block_size = vllm_config.cache_config.block_size
        self.fingerprint = vllm_fingerprint(vllm_config)
        producer, consumer = bool(ktc.is_kv_producer), bool(ktc.is_kv_consumer)
        check_parallel(self.tp_size, pc.pipeline_parallel_size, self.config, consumer)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        self._cache: KVCacheEngine | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._cache = self._shared_cache(vllm_layout(vllm_config))
            lookup = self._cache.lookup if self._cache is not None else None
            self.scheduler = SchedulerSide(
                self.fingerprint,
                self.config.transfer.chunk_size,
                producer,
                consumer,
                lookup,
                self.tp_size,
                PushGuard.of(self.config.secret, self.config.transfer.allowed_receivers),
            )
        else:
            rank = get_tensor_model_parallel_rank() if self.tp_size > 1 else 0
            self.worker = WorkerSide(
                rank_config(self.config, rank),
                self.fingerprint,
                producer,
                consumer,
                agent_name(f"{'producer' if producer else 'consumer'}-tp{rank}"),
                self._shared_cache,
                tp_rank=rank,
                tp_size=self.tp_size,
                total_kv_heads=vllm_config.model_config.get_total_num_kv_heads(),
            )

    def _shared_cache(self, layout: KVLayout) -> KVCacheEngine | None:
        """The config's Redis level alone, or None: memory and disk levels are per process, and vLLM's scheduler
        and workers are separate processes."""
        t = self.config.tier
        if not (t.enabled and t.redis_url):
            return None
        return KVCacheEngine(
            layout,
            msgspec.structs.replace(t, memory_bytes=0, disk_path=""),
            self.config.transfer.chunk_size,
            fingerprint=self.fingerprint,
        )

    # -- scheduler side --------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.after_alloc(request, list(blocks.get_block_ids()[0]), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        step = self.scheduler.build(scheduler_output)
        return PdkvConnectorMetadata(sends=step.sends, loads=step.loads, saves=step.saves, discards=step.discards)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.finished(request)

    # -- worker side -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        backend = attention_backend(self._vllm_config)
        cache_dtype = self._vllm_config.cache_config.cache_dtype
        check_platform_fp8(cache_dtype, current_platform.fp8_dtype())
        layout, views = vllm_cache_layout(kv_caches, self.block_size, backend, cache_dtype)
        log.info(
            "vLLM KV cache (%s, %s, %s): pdkv %s %s, %d layers",
            backend,
            views[0].device,
            views[0].dtype,
            layout.kind,
            layout.order,
            layout.num_layers,
        )
        self.worker.register(layout, views)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, PdkvConnectorMetadata)
        self.worker.start_loads(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads complete between steps (the request waits in WAITING_FOR_REMOTE_KVS): nothing to wait for here."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        """The wire unit is a chunk of all layers, so pushing starts in ``wait_for_save``, once the step's
        layers are all written."""

    def wait_for_save(self) -> None:
        assert self.worker is not None
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, PdkvConnectorMetadata)
            self.worker.save(meta)
            self.worker.push(meta)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self.worker is not None
        sending, recving, failed = self.worker.results(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This step's counter increments; the scheduler side counts nothing (None there)."""
        data = self.worker.stats_delta() if self.worker is not None else {}
        return PdkvConnectorStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return PdkvConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return PdkvPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self._cache is not None:
            self._cache.close()
