"""Tensor parallel on the vLLM connector: what each rank's worker side is given, and what is refused.

At ``--tensor-parallel-size n`` vLLM runs n workers, each holding its ``1/n`` of the KV heads (MLA: the same
latent on every rank), and one scheduler. pdkv pairs rank ``r`` of a prefill instance with rank ``r`` of a decode
instance of the same size: each decode rank runs its own KV receiver on ``control_port + r`` (numbered as vLLM
numbers its own connectors' side channels), the router hands P every rank's receiver (``remote_ports``), and P's
rank ``r`` pushes its heads to D's rank ``r``, every rank's transfer in parallel. vLLM itself makes a request
done only when every rank reported it, and failed when any rank did (its ``KVOutputAggregator``): a rank whose
part did not land fails the whole request, which vLLM recomputes, never decoding from partial KV. Different
sizes on P and D are not paired yet: P's scheduler side sees a decode instance with another number of receivers
and does not push (D recomputes), saying which setting differs.
"""

from __future__ import annotations

import msgspec

from pdkv.config import PdkvConfig
from pdkv.errors import ConfigError


def check_parallel(tp_size: int, pp_size: int, config: PdkvConfig, consumer: bool) -> None:
    """Refuse the parallel settings the connector cannot serve, naming the setting to change."""
    if pp_size != 1:
        raise ConfigError(
            f"PdkvConnector runs pipeline parallel size 1 only (got --pipeline-parallel-size {pp_size}): use "
            "--tensor-parallel-size to spread the model"
        )
    if tp_size > 1 and config.tier.enabled and config.tier.redis_url:
        raise ConfigError(
            f"PdkvConnector at --tensor-parallel-size {tp_size}: the shared cache tier (tier.redis_url) keys a "
            "chunk of every KV head and each rank holds only its own; unset tier.redis_url or run tensor parallel "
            "size 1"
        )
    if tp_size > 1 and consumer and not config.control_port:
        raise ConfigError(
            f"PdkvConnector at --tensor-parallel-size {tp_size} on a decode instance: set control_port in "
            "kv_connector_extra_config (rank r's receiver listens on control_port + r, which the router reads from "
            "/pdkv/info); pdkv launch sets it"
        )
    if config.control_port + tp_size - 1 > 65535:
        raise ConfigError(f"field 'control_port': {config.control_port} + {tp_size} ranks runs past port 65535")


def rank_config(config: PdkvConfig, rank: int) -> PdkvConfig:
    """Tensor-parallel rank ``rank``'s config: its KV receiver listens on ``control_port + rank`` (0 stays 0:
    a port of the kernel's pick), as vLLM numbers its own connectors' side channels."""
    if rank == 0 or not config.control_port:
        return config
    return msgspec.structs.replace(config, control_port=config.control_port + rank)
