"""The vLLM connector at tensor parallel, on the CPU and without vLLM: each rank's heads go to the decode rank of
the same number, every rank's transfer on its own receiver, and a rank whose part does not land fails the request.

The worker sides move real bytes over the real tcp channel, each rank holding its slice of one model's KV heads
in tensors shaped like vLLM's CPU cache (``[blocks, heads / tp, block_size, 2 * head_dim]``), as vLLM's workers
hold them; tests/test_vllm_integration.py runs real vLLM servers at tensor parallel 2.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from test_vllm_connector import BS, FP, collect, request, sched_output, vllm_mla_cache

from pdkv.config import PdkvConfig, convert_config
from pdkv.errors import ConfigError
from pdkv.integration.vllm.kvcache import CPU_BACKEND, vllm_cache_layout
from pdkv.integration.vllm.metadata import Discard, LoadSpec, SendSpec, StepMetadata
from pdkv.integration.vllm.parallel import Piece, check_parallel, pieces, rank_config
from pdkv.integration.vllm.scheduler_side import SchedulerSide
from pdkv.integration.vllm.worker_side import WorkerSide
from pdkv.netaddr import HeldPort

from conftest import held_blocks

LAYERS, HEADS, HEAD_DIM, TP = 2, 4, 8, 2
P_TABLE, D_TABLE = [9, 2, 5, 11, 0], [3, 7, 1, 8, 6]  # 150 tokens: five 32-token blocks


def model_kv(num_blocks: int, seed: int | None) -> list[torch.Tensor]:
    """One model's whole KV, every head, per layer as vLLM's CPU backend holds it at tensor parallel size 1."""
    gen = torch.Generator().manual_seed(seed or 0)
    shape = (num_blocks, HEADS, BS, 2 * HEAD_DIM)
    return [
        (torch.randn(shape, generator=gen) if seed is not None else torch.zeros(shape)).to(torch.bfloat16)
        for _ in range(LAYERS)
    ]


def rank_cache(full: list[torch.Tensor], rank: int, tp: int = TP) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s cache at tensor parallel ``tp``: its contiguous slice of the KV heads, as vLLM shards them."""
    per = HEADS // tp
    return {
        f"model.layers.{i}.self_attn.attn": t[:, rank * per : (rank + 1) * per].contiguous() for i, t in enumerate(full)
    }


def tp_config(control_port: int = 0) -> PdkvConfig:
    return convert_config(
        {
            "control_port": control_port,
            "transfer": {"chunk_size": 64, "transfer_timeout_s": 3, "reserve_timeout_s": 2, "handshake_timeout_s": 2},
        }
    )


def tp_instances(
    p_ranks: int | None = None, p_tp: int = TP, d_tp: int = TP
) -> tuple[list[WorkerSide], list[WorkerSide], list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    """A prefill instance at tensor parallel ``p_tp`` and a decode one at ``d_tp``: a worker side per rank, as vLLM
    builds one per worker, each rank given its config by ``rank_config`` (D's receivers on consecutive ports). Only
    the first ``p_ranks`` prefill ranks are started (fewer: a prefill rank that died)."""
    ports = HeldPort.run("127.0.0.1", d_tp)  # held until D's ranks have bound them, as the launcher does
    cfg = tp_config(ports[0].port)
    p_full = model_kv(12, seed=3)
    p_caches = [rank_cache(p_full, r, p_tp) for r in range(p_tp)]
    d_caches = [rank_cache(model_kv(10, None), r, d_tp) for r in range(d_tp)]
    ps = [
        WorkerSide(rank_config(cfg, r), FP, True, False, f"p-tp{r}", tp_rank=r, tp_size=p_tp, total_kv_heads=HEADS)
        for r in range(p_tp if p_ranks is None else p_ranks)
    ]
    ds = [
        WorkerSide(rank_config(cfg, r), FP, False, True, f"d-tp{r}", tp_rank=r, tp_size=d_tp, total_kv_heads=HEADS)
        for r in range(d_tp)
    ]
    try:
        for side, cache in [*zip(ps, p_caches, strict=False), *zip(ds, d_caches, strict=True)]:
            side.register(*vllm_cache_layout(cache, BS, CPU_BACKEND))
    except BaseException:
        close_all(*ps, *ds)
        raise
    finally:
        for hold in ports:
            hold.release()
    return ps, ds, p_caches, d_caches


def close_all(*sides: WorkerSide) -> None:
    for side in sides:
        side.close()


def test_each_prefill_rank_pushes_its_heads_to_the_decode_rank_of_the_same_number() -> None:
    ps, ds, p_caches, d_caches = tp_instances()
    try:
        addresses = [d.receiver.address for d in ds]  # type: ignore[union-attr]
        assert [a.rsplit(":", 1)[1] for a in addresses] == [str(ds[0].config.control_port + r) for r in range(TP)]
        for p in ps:  # vLLM broadcasts one step's metadata to every rank
            p.push(StepMetadata(sends=[SendSpec("r1", "t-1", addresses, 150, P_TABLE, 150)]))
        for d in ds:  # block 0 is D's own prefix hit: every rank skips it
            d.start_loads(StepMetadata(loads=[LoadSpec("r1", "t-1", 150, 32, D_TABLE, prefill_tp=TP)]))
        for d in ds:  # each rank reports the request (vLLM finishes it once every rank has)
            assert collect(d, set())[1:] == ({"r1"}, set())
        for p in ps:
            assert collect(p, {"r1"})[0] == {"r1"}
        for r in range(TP):  # rank r's heads, from prefill rank r, in decode rank r's own blocks
            for name, src in p_caches[r].items():
                assert torch.equal(d_caches[r][name][D_TABLE[1:]], src[P_TABLE[1:]]), (r, name)
                assert not d_caches[r][name][D_TABLE[0]].any()  # the hit's block: never written
        stats = [d.receiver.stats() for d in ds]  # type: ignore[union-attr]
        # each rank moved its half of the heads of the 118 tokens past the hit, over its own receiver
        assert [s["bytes_landed"] for s in stats] == [ds[0].layout.chunk_bytes(118)] * TP  # type: ignore[union-attr]
        assert ds[0].layout.num_kv_heads == HEADS // TP  # type: ignore[union-attr]
        assert [held_blocks(s, 10) for s in stats] == [0] * TP
        # every rank's transfer counts; the request's tokens count once, on rank 0 (vLLM sums the ranks' stats)
        assert [d.counters["load_ok"] for d in ds] == [1] * TP and [p.counters["push_ok"] for p in ps] == [1] * TP
        assert [d.counters["pushed_tokens_loaded"] for d in ds] == [118, 0]
        assert [p.counters["push_tokens"] for p in ps] == [118, 0]
    finally:
        close_all(*ps, *ds)


def test_a_rank_whose_part_never_lands_fails_the_request_within_the_timeout() -> None:
    ps, ds, _, d_caches = tp_instances(p_ranks=1)  # prefill rank 1 is gone: its heads never come
    try:
        addresses = [d.receiver.address for d in ds]  # type: ignore[union-attr]
        ps[0].push(StepMetadata(sends=[SendSpec("r1", "t-1", addresses, 150, P_TABLE, 150)]))
        for d in ds:
            d.start_loads(StepMetadata(loads=[LoadSpec("r1", "t-1", 150, 0, D_TABLE, prefill_tp=TP)]))
        assert collect(ds[0], set())[1:] == ({"r1"}, set())
        # rank 1 reports the request finished AND failed once transfer_timeout_s (3 s) ran out: vLLM's aggregator
        # fails the whole request and recomputes it, rank 0's landed half unused
        assert collect(ds[1], set(), timeout=15)[1:] == ({"r1"}, {"r1"})
        assert held_blocks(ds[1].receiver.stats(), 10) == 0  # type: ignore[union-attr]
        assert ds[1].counters["load_failed"] == 1 and not any(t.any() for t in d_caches[1].values())
    finally:
        close_all(*ps, *ds)


TARGET2 = {
    "do_remote_decode": True,
    "remote_host": "127.0.0.1",
    "remote_port": 5555,
    "remote_ports": [5555, 5556],
    "transfer_id": "t-1",
}


def test_the_scheduler_hands_every_rank_the_decode_ranks_receivers_and_tells_d_its_size() -> None:
    s = SchedulerSide(FP, 64, is_producer=True, is_consumer=False, tp_size=2)
    s.after_alloc(request("r1", list(range(100)), TARGET2), [7, 8], 0)
    step = s.build(sched_output(new=[("r1", [7, 8], 0)], scheduled={"r1": 100}))
    assert [x.addresses for x in step.sends] == [["tcp://127.0.0.1:5555", "tcp://127.0.0.1:5556"]]
    # a decode instance of one receiver (tensor parallel 1): pushed all the same, each rank its half of the heads
    one = {k: v for k, v in TARGET2.items() if k != "remote_ports"}
    s.after_alloc(request("r2", list(range(100)), one), [9, 10], 0)
    step = s.build(sched_output(new=[("r2", [9, 10], 0)], scheduled={"r2": 100}))
    assert [x.addresses for x in step.sends] == [["tcp://127.0.0.1:5555"]]
    held, params = s.finished(SimpleNamespace(request_id="r2", num_computed_tokens=100))
    assert held and params is not None and params["prefill_tp"] == 2
    d = SchedulerSide(FP, 64, is_producer=False, is_consumer=True)
    decode = request("r2", list(range(100)), params)
    assert d.num_new_matched_tokens(decode, 0) == (100, True)
    d.after_alloc(decode, [1, 2], 100)
    assert [spec.prefill_tp for spec in d.build(sched_output()).loads] == [2]


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2), (4, 2), (2, 4)])
def test_ranks_of_different_sizes_move_each_decode_rank_exactly_its_heads(p_tp: int, d_tp: int) -> None:
    """P at one size, D at another: every decode rank's heads come from the prefill ranks holding them, each part
    in its window of the rank's heads in the same blocks; the request is done once every part landed."""
    ps, ds, p_caches, d_caches = tp_instances(p_tp=p_tp, d_tp=d_tp)
    try:
        addresses = [d.receiver.address for d in ds]  # type: ignore[union-attr]
        for p in ps:
            p.push(StepMetadata(sends=[SendSpec("r1", "t-1", addresses, 150, P_TABLE, 150)]))
        for d in ds:  # block 0 is D's own prefix hit
            d.start_loads(StepMetadata(loads=[LoadSpec("r1", "t-1", 150, 32, D_TABLE, prefill_tp=p_tp)]))
        for d in ds:
            assert collect(d, set())[1:] == ({"r1"}, set())
        for p in ps:
            assert collect(p, {"r1"})[0] == {"r1"}
        for name in p_caches[0]:  # the model's heads, in order, on D as on P: whole blocks past the hit (packed)
            p_all = torch.cat([c[name] for c in p_caches], dim=1)
            d_all = torch.cat([c[name] for c in d_caches], dim=1)
            assert torch.equal(d_all[D_TABLE[1:]], p_all[P_TABLE[1:]]), name
            assert not d_all[D_TABLE[0]].any()  # the hit's block: never written
        stats = [d.receiver.stats() for d in ds]  # type: ignore[union-attr]
        # every rank's heads of four whole blocks (128 tokens: the last block's tail moves too, vLLM's CPU cache
        # being packed per block), over its own receiver
        assert [s["bytes_landed"] for s in stats] == [ds[0].layout.chunk_bytes(128)] * d_tp  # type: ignore[union-attr]
        assert [held_blocks(s, 10) for s in stats] == [0] * d_tp
        parts = max(p_tp, d_tp)  # transfers: one per pair of ranks sharing heads
        assert sum(p.counters["push_ok"] for p in ps) == parts and sum(d.counters["load_ok"] for d in ds) == d_tp
        assert [d.counters["pushed_tokens_loaded"] for d in ds] == [118] + [0] * (d_tp - 1)
        assert [p.counters["push_tokens"] for p in ps] == [118] + [0] * (p_tp - 1)
    finally:
        close_all(*ps, *ds)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2), (2, 2)])
def test_an_mla_latent_goes_to_every_decode_rank_from_one_prefill_rank(p_tp: int, d_tp: int) -> None:
    """MLA (DeepSeek): every rank holds the whole latent, so decode rank d receives it, whole, from prefill rank
    d mod p, written in place (no window); a prefill rank with no decode rank of its own pushes nothing."""
    ports = HeldPort.run("127.0.0.1", d_tp)
    cfg = tp_config(ports[0].port)
    p_cache = vllm_mla_cache(12, seed=5)  # the same latent on every prefill rank, as vLLM holds it
    d_caches = [vllm_mla_cache(10) for _ in range(d_tp)]
    ps = [WorkerSide(rank_config(cfg, r), FP, True, False, f"p-mla{r}", tp_rank=r, tp_size=p_tp) for r in range(p_tp)]
    ds = [WorkerSide(rank_config(cfg, r), FP, False, True, f"d-mla{r}", tp_rank=r, tp_size=d_tp) for r in range(d_tp)]
    try:
        for side in ps:
            side.register(*vllm_cache_layout({k: t.clone() for k, t in p_cache.items()}, BS, "CPU_MLA"))
        for side, cache in zip(ds, d_caches, strict=True):
            side.register(*vllm_cache_layout(cache, BS, "CPU_MLA"))
        for hold in ports:
            hold.release()
        addresses = [d.receiver.address for d in ds]  # type: ignore[union-attr]
        for p in ps:
            p.push(StepMetadata(sends=[SendSpec("r1", "t-1", addresses, 150, P_TABLE, 150)]))
        for d in ds:
            d.start_loads(StepMetadata(loads=[LoadSpec("r1", "t-1", 150, 0, D_TABLE, prefill_tp=p_tp)]))
        for d in ds:
            assert collect(d, set())[1:] == ({"r1"}, set())
        for p in ps:  # settled: every part's counters in (a rank with no decode rank of its own has none)
            assert collect(p, {"r1"})[0] == {"r1"}
        for cache in d_caches:
            for name, src in p_cache.items():
                assert torch.equal(cache[name][D_TABLE], src[P_TABLE]), name
        # one whole latent per decode rank, from the prefill rank of its number mod P's size
        assert [p.counters["push_ok"] for p in ps] == [sum(d % p_tp == r for d in range(d_tp)) for r in range(p_tp)]
        assert [d.receiver.stats()["bytes_landed"] for d in ds] == [ds[0].layout.chunk_bytes(150)] * d_tp  # type: ignore[union-attr]
    finally:
        for hold in ports:
            hold.release()
        close_all(*ps, *ds)


def test_a_decode_rank_missing_one_prefill_ranks_heads_fails_the_request_and_frees_its_blocks() -> None:
    """P at TP 2 -> D at TP 1, prefill rank 1 gone: the half that landed is not decoded from."""
    ps, ds, _, _ = tp_instances(p_ranks=1, p_tp=2, d_tp=1)
    try:
        addresses = [ds[0].receiver.address]  # type: ignore[union-attr]
        ps[0].push(StepMetadata(sends=[SendSpec("r1", "t-1", addresses, 150, P_TABLE, 150)]))
        ds[0].start_loads(StepMetadata(loads=[LoadSpec("r1", "t-1", 150, 0, D_TABLE, prefill_tp=2)]))
        assert collect(ds[0], set(), timeout=15)[1:] == ({"r1"}, {"r1"})  # finished and failed: vLLM recomputes
        assert collect(ps[0], {"r1"})[0] == {"r1"} and ps[0].counters["push_ok"] == 1  # its own part did land
        stats = ds[0].receiver.stats()  # type: ignore[union-attr]
        assert held_blocks(stats, 10) == 0 and ds[0]._blocks.num_free == 10  # type: ignore[union-attr]
        assert ds[0].counters["load_failed"] == 1 and ds[0].counters["pushed_tokens_loaded"] == 0
    finally:
        close_all(*ps, *ds)


def test_a_discarded_push_from_more_prefill_ranks_is_refused_for_every_part(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """D's prefix cache held the whole prompt: the discard reaches each of the parts P's two ranks push to D's one
    (their own transfer ids), so each Reserve is refused at once rather than retried until reserve_timeout_s."""
    ps, ds, _, d_caches = tp_instances(p_tp=2, d_tp=1)
    try:
        ds[0].start_loads(StepMetadata(discards=[Discard("t-1", prefill_tp=2)]))
        with caplog.at_level(logging.WARNING):
            for p in ps:
                p.push(StepMetadata(sends=[SendSpec("r1", "t-1", [ds[0].receiver.address], 150, P_TABLE, 150)]))  # type: ignore[union-attr]
            for p in ps:
                assert collect(p, {"r1"})[0] == {"r1"} and p.counters["push_failed"] == 1
        for part in ("t-1/p0d0", "t-1/p1d0"):
            assert f"refused transfer '{part}': transfer id '{part}' was already used" in caplog.text
        assert not any(t.any() for t in d_caches[0].values())
    finally:
        close_all(*ps, *ds)


def test_sizes_the_kv_heads_do_not_divide_by_are_refused_by_name() -> None:
    assert pieces(4, 2, 2) == [Piece(0, 0), Piece(1, 1)]
    assert pieces(1, 1, 2, mla=True) == [Piece(0, 0), Piece(0, 1)]  # MLA: the one latent to every decode rank
    assert pieces(1, 4, 2, mla=True) == [Piece(0, 0), Piece(1, 1)]
    with pytest.raises(ConfigError, match="8 KV heads do not divide by both sizes"):
        pieces(8, 2, 16)
    with pytest.raises(ConfigError, match="6 KV heads do not divide"):
        pieces(6, 4, 2)


@pytest.mark.parametrize(
    ("tp", "pp", "raw", "consumer", "message"),
    [
        (1, 2, {}, False, "pipeline parallel size 1 only"),
        (2, 1, {"control_port": 7000, "tier": {"redis_url": "redis://x"}}, True, "unset tier.redis_url"),
        (2, 1, {}, True, "set control_port in kv_connector_extra_config"),
        (4, 1, {"control_port": 65533}, True, "runs past port 65535"),
    ],
)
def test_parallel_settings_the_connector_cannot_serve_are_refused_by_name(
    tp: int, pp: int, raw: dict, consumer: bool, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        check_parallel(tp, pp, convert_config(raw), consumer)


def test_rank_configs_number_the_receivers_from_control_port() -> None:
    cfg = tp_config(7000)
    check_parallel(4, 1, cfg, consumer=True)
    assert [rank_config(cfg, r).control_port for r in range(4)] == [7000, 7001, 7002, 7003]
    assert rank_config(tp_config(0), 3).control_port == 0  # a prefill instance listens nowhere
