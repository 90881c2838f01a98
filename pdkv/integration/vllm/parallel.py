"""Tensor parallel on the vLLM connector: which rank sends which heads to which, and what is refused.

At ``--tensor-parallel-size n`` vLLM runs n workers, each holding its ``1/n`` of the KV heads (MLA: the same
latent on every rank), and one scheduler. Each decode rank runs its own KV receiver on ``control_port + r``
(numbered as vLLM numbers its own connectors' side channels); the router hands P every rank's receiver
(``remote_ports``), P tells D its size (``Pushed.prefill_tp``), and ``pieces`` says, from the two sizes and the
model's KV heads, what every pair of ranks moves:

* equal sizes: P's rank ``r`` pushes all its heads to D's rank ``r``, written in place;
* P larger (P at 4, D at 2): each decode rank gathers its heads from the ``4 / 2`` prefill ranks that hold them,
  each landing in its window of the decode rank's heads, in the same blocks;
* P smaller (P at 1, D at 2): each prefill rank sends each decode rank the window of its heads that rank holds;
* MLA: every rank holds the whole latent; decode rank ``d`` receives it from prefill rank ``d mod p``.

Every part moves in parallel on its own connection, each chunk verified. vLLM makes a request done only when
every rank reported it, and failed when any rank did (its ``KVOutputAggregator``); a decode rank reports its part
only once every transfer it expects landed, and fails it when any did not: vLLM recomputes, never decoding from
partial KV. A window is staged (gathered and scattered through strided views of the heads), so sizes that differ
cost a copy on each side that equal sizes do not. Refused: pipeline parallel, and sizes that differ where a
model's KV heads do not divide by both (vLLM then replicates heads across ranks).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from pdkv.config import PdkvConfig
from pdkv.errors import ConfigError
from pdkv.layout import HeadWindow


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


@dataclass(frozen=True)
class Piece:
    """What prefill rank ``p`` sends decode rank ``d``: its heads ``p_heads`` into D's ``d_heads`` (None: all of
    them on both sides, written in place)."""

    p: int
    d: int
    p_heads: HeadWindow | None = None
    d_heads: HeadWindow | None = None

    def transfer_id(self, request_transfer: str, tp_p: int, tp_d: int) -> str:
        """The wire's id of this part: the request's when each rank has one part, else one per pair of ranks
        (a decode rank may receive two parts, a prefill rank send two)."""
        return request_transfer if tp_p == tp_d else f"{request_transfer}/p{self.p}d{self.d}"

    @property
    def heads(self) -> tuple[HeadWindow, HeadWindow] | None:
        """``KVSender.open``'s ``heads``."""
        return None if self.p_heads is None or self.d_heads is None else (self.p_heads, self.d_heads)


def pieces(total_kv_heads: int, tp_p: int, tp_d: int, mla: bool = False) -> list[Piece]:
    """Every part of a request between a prefill instance at ``tp_p`` ranks and a decode one at ``tp_d``, in order
    of decode rank. Raises ``ConfigError`` for sizes that differ where ``total_kv_heads`` does not divide by both."""
    if tp_p < 1 or tp_d < 1:
        raise ConfigError(f"tensor-parallel sizes must be positive (prefill {tp_p}, decode {tp_d})")
    if tp_p == tp_d:
        return [Piece(r, r) for r in range(tp_d)]
    if mla:
        return [Piece(d % tp_p, d) for d in range(tp_d)]
    if total_kv_heads < max(tp_p, tp_d) or total_kv_heads % tp_p or total_kv_heads % tp_d:
        raise ConfigError(
            f"prefill at --tensor-parallel-size {tp_p} and decode at {tp_d}: the model's {total_kv_heads} KV heads do "
            "not divide by both sizes (vLLM replicates heads across ranks then); run both with the same "
            "--tensor-parallel-size, or sizes that divide the KV heads"
        )
    hp, hd = total_kv_heads // tp_p, total_kv_heads // tp_d
    out = []
    for d in range(tp_d):
        for p in range(tp_p):
            first, end = max(p * hp, d * hd), min((p + 1) * hp, (d + 1) * hd)
            if first < end:
                out.append(
                    Piece(p, d, HeadWindow(first - p * hp, end - first), HeadWindow(first - d * hd, end - first))
                )
    return out
