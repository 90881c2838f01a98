"""The vLLM connector's parts, on the CPU and without vLLM: layout mapping, params, scheduler and worker sides.

The worker-side tests move real bytes over the real tcp channel between two
``WorkerSide`` objects holding tensors shaped like vLLM's CPU KV cache; the
end-to-end test against a real vLLM is tests/test_vllm_integration.py.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pdkv.config import convert_config
from pdkv.errors import ConfigError, LayoutError, OutOfBlocksError
from pdkv.integration.vllm import stats
from pdkv.integration.vllm.kvcache import (
    CPU_BACKEND,
    MLA_BACKENDS,
    check_platform_fp8,
    vllm_cache_layout,
)
from pdkv.integration.vllm.landing import VllmBlocks, landing_path
from pdkv.integration.vllm.metadata import Discard, LoadSpec, SendSpec, StepMetadata
from pdkv.integration.vllm.ordering import StepEvent
from pdkv.integration.vllm.scheduler_side import SchedulerSide
from pdkv.integration.vllm.worker_side import WorkerSide
from pdkv.keys import PromptKeys, chunk_keys
from pdkv.layout import KVLayout, gather
from pdkv.memory import emulate_device
from pdkv.tier.base import HEADER_BYTES, leading
from pdkv.transfer.gauges import GAUGES
from pdkv.transfer.outgoing import OutgoingTransfer
from pdkv.transfer.params import Pushed, PushGuard, cache_salt, prompt_key, push_target, pushed, sign_push

from conftest import KV_MEMORIES, held_blocks, wait_until

FP = "fp-test"
BS = 32  # vLLM CPU block sizes are multiples of 32
LAYERS, HEADS, HEAD_DIM = 3, 2, 8


def filled(shape: tuple[int, ...], seed: int | None, cache_dtype: str) -> torch.Tensor:
    """A vLLM cache allocation: random KV (zeros if ``seed`` is None) as ``--kv-cache-dtype cache_dtype`` holds it,
    bf16 or fp8 bytes (vLLM's torch.uint8)."""
    gen = torch.Generator().manual_seed(seed or 0)
    values = torch.randn(shape, generator=gen) if seed is not None else torch.zeros(shape)
    fp8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
    return values.to(fp8[cache_dtype]).view(torch.uint8) if cache_dtype in fp8 else values.to(torch.bfloat16)


def vllm_cpu_cache(num_blocks: int, seed: int | None = None, cache_dtype: str = "auto") -> dict[str, torch.Tensor]:
    """Per-layer tensors shaped like vLLM's CPU backend: [blocks, kv_heads, block_size, 2 * head_dim]."""
    return {
        f"model.layers.{i}.self_attn.attn": filled(
            (num_blocks, HEADS, BS, 2 * HEAD_DIM), seed and seed + i, cache_dtype
        )
        for i in range(LAYERS)
    }


def vllm_gpu_cache(
    num_blocks: int, kv_cache_layout: str, seed: int | None = None, cache_dtype: str = "auto"
) -> dict[str, torch.Tensor]:
    """Per-layer views as vLLM 0.32's GPU workers register them: logical [blocks, kv_heads, block_size,
    2 * head_dim] over one allocation in the physical order ``VLLM_KV_CACHE_LAYOUT`` names (L layers, B blocks,
    H heads, N block offsets, C a row's K then V)."""
    physical = {
        "LBNHC": ((LAYERS, num_blocks, BS, HEADS, 2 * HEAD_DIM), lambda raw, i: raw[i].transpose(1, 2)),
        "LBHNC": ((LAYERS, num_blocks, HEADS, BS, 2 * HEAD_DIM), lambda raw, i: raw[i]),
        "BLNHC": ((num_blocks, LAYERS, BS, HEADS, 2 * HEAD_DIM), lambda raw, i: raw[:, i].transpose(1, 2)),
    }
    shape, layer_view = physical[kv_cache_layout]
    raw = filled(shape, seed, cache_dtype)
    return {f"model.layers.{i}.self_attn.attn": layer_view(raw, i) for i in range(LAYERS)}


LATENT = 20  # kv_lora_rank + qk_rope_head_dim (DeepSeek: 512 + 64)


def vllm_mla_cache(num_blocks: int, seed: int | None = None, cache_dtype: str = "auto") -> dict[str, torch.Tensor]:
    """Per-layer views as vLLM 0.32's MLA backends register them: [blocks, 1, block_size, latent] (one head slot,
    no K/V split: ``MLAAttentionSpec.head_size_v == 0``) over one layer-compact allocation."""
    raw = filled((LAYERS, num_blocks, 1, BS, LATENT), seed, cache_dtype)
    return {f"model.layers.{i}.self_attn.attn": raw[i] for i in range(LAYERS)}


# what a cache spec names: an attention backend, on a GPU VLLM_KV_CACHE_LAYOUT, and after ":" --kv-cache-dtype
CACHES = ("CPU_ATTN", "FLASH_ATTN/LBNHC", "FLASHINFER/LBHNC", "TRITON_ATTN/LBNHC")
FP8_CACHES = ("CPU_ATTN:fp8", "FLASH_ATTN/LBNHC:fp8_e5m2", "TRITON_ATTN/LBHNC:fp8_e4m3")
MLA_CACHES = ("TRITON_MLA", "CPU_MLA:fp8")


def vllm_cache(spec: str, num_blocks: int, seed: int | None = None) -> dict[str, torch.Tensor]:
    spec, _, cache_dtype = spec.partition(":")
    backend, _, kv_cache_layout = spec.partition("/")
    if backend in MLA_BACKENDS:
        return vllm_mla_cache(num_blocks, seed, cache_dtype or "auto")
    if backend == CPU_BACKEND:
        return vllm_cpu_cache(num_blocks, seed, cache_dtype or "auto")
    return vllm_gpu_cache(num_blocks, kv_cache_layout, seed, cache_dtype or "auto")


def mapped(spec: str, cache: dict[str, torch.Tensor]) -> tuple[KVLayout, list[torch.Tensor]]:
    spec, _, cache_dtype = spec.partition(":")
    return vllm_cache_layout(cache, BS, spec.partition("/")[0], cache_dtype or "auto")


def keys_and_values(spec: str, cache: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's K and V as ``[blocks, block_size, heads, head_dim]``, read the way the backend's own forward
    reads its cache (not through pdkv)."""
    out = []
    for t in cache.values():
        if spec.startswith(CPU_BACKEND):  # cpu_attn: view(blocks, heads, 2 * block_size, head_dim), K then V rows
            k, v = t.view(t.shape[0], HEADS, 2 * BS, HEAD_DIM).split(BS, dim=2)
            out.append((k.transpose(1, 2), v.transpose(1, 2)))
        else:  # flash_attn / flashinfer / triton_attn: kv_cache.transpose(1, 2).split(head_size, dim=-1)
            k, v = t.transpose(1, 2).split(HEAD_DIM, dim=-1)
            out.append((k, v))
    return out


def tokens_of(spec: str, cache: dict[str, torch.Tensor], table: list[int], num_tokens: int) -> torch.Tensor:
    """``[layers, kv, tokens, heads, head_dim]`` of a request's first tokens, read as the backend reads them."""
    pos = torch.arange(num_tokens)
    blocks, offsets = torch.tensor(table)[pos // BS], pos % BS
    if spec.split(":")[0] in MLA_BACKENDS:  # bind_kv_cache: kv_cache.squeeze(1), [blocks, block_size, latent]
        return torch.stack([t.squeeze(1)[blocks, offsets][None, :, None] for t in cache.values()])
    return torch.stack([torch.stack([k[blocks, offsets], v[blocks, offsets]]) for k, v in keys_and_values(spec, cache)])


@pytest.mark.parametrize("spec", CACHES + FP8_CACHES + MLA_CACHES)
def test_each_backend_layout_reads_k_and_v_where_its_attention_does(spec: str) -> None:
    cache = vllm_cache(spec, 6, seed=1)
    layout, views = mapped(spec, cache)
    backend_layout, _, cache_dtype = spec.partition(":")
    mla = backend_layout in MLA_BACKENDS
    order = "NHD" if mla else {"CPU_ATTN": "HKND", "LBNHC": "NHKD", "LBHNC": "HNKD"}[backend_layout.split("/")[-1]]
    dtype = {"": "bfloat16", "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
    assert (layout.kind, layout.order, layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.mla) == (
        "per_layer",
        order,
        LAYERS,
        1 if mla else HEADS,
        LATENT if mla else HEAD_DIM,
        mla,
    )
    assert layout.dtype == dtype[cache_dtype]
    assert {v.untyped_storage().data_ptr() for v in views} == {t.untyped_storage().data_ptr() for t in cache.values()}
    table = [4, 0, 5]
    chunk = gather(layout, views, table, 0, 80)
    assert torch.equal(chunk.view(torch.uint8), tokens_of(spec, cache, table, 80).contiguous().view(torch.uint8))


@pytest.mark.parametrize(
    ("cache", "backend", "message"),
    [
        (lambda: vllm_gpu_cache(4, "BLNHC"), "FLASH_ATTN", "VLLM_KV_CACHE_LAYOUT=LBNHC"),  # block-outermost
        (lambda: vllm_gpu_cache(4, "LBNHC"), "CPU_ATTN", "not contiguous in the HKND order"),
        (lambda: vllm_cpu_cache(4), "FLEX_ATTENTION", "attention backend 'FLEX_ATTENTION'"),
        (
            lambda: {**vllm_gpu_cache(4, "LBNHC"), "x": vllm_gpu_cache(4, "LBHNC")["model.layers.0.self_attn.attn"]},
            "FLASHINFER",
            "expected every layer like the first",
        ),
    ],
    ids=["block-outermost", "gpu-strides-as-cpu", "unmapped-backend", "layers-disagree"],
)
def test_unmapped_gpu_caches_are_refused_by_name(
    cache: Callable[[], dict[str, torch.Tensor]], backend: str, message: str
) -> None:
    with pytest.raises(LayoutError, match=message):
        vllm_cache_layout(cache(), BS, backend)


@pytest.mark.parametrize(
    ("cache", "backend", "cache_dtype", "message"),
    [
        (lambda: vllm_cpu_cache(4), CPU_BACKEND, "fp8", "--kv-cache-dtype fp8\\) is torch.bfloat16, not bytes"),
        (lambda: vllm_cpu_cache(4, cache_dtype="fp8"), CPU_BACKEND, "nvfp4", "--kv-cache-dtype nvfp4 .* not a KV"),
        (lambda: vllm_cpu_cache(4, cache_dtype="fp8"), CPU_BACKEND, "auto", "--kv-cache-dtype auto \\(torch.uint8"),
        (lambda: vllm_cpu_cache(4), "TRITON_MLA", "auto", "pdkv maps only vLLM's \\[blocks, 1, block_size, latent\\]"),
        (lambda: vllm_mla_cache(4), "FLASHMLA_SPARSE", "auto", "attention backend 'FLASHMLA_SPARSE'"),
        (lambda: vllm_mla_cache(4, cache_dtype="fp8"), "FLASHMLA", "fp8_ds_mla", "--kv-cache-dtype fp8_ds_mla"),
    ],
    ids=["fp8-not-bytes", "nvfp4", "bytes-as-auto", "mla-with-heads", "sparse-mla", "fp8-ds-mla"],
)
def test_unmapped_kv_dtypes_and_mla_caches_are_refused_by_name(
    cache: Callable[[], dict[str, torch.Tensor]], backend: str, cache_dtype: str, message: str
) -> None:
    with pytest.raises(LayoutError, match=message):
        vllm_cache_layout(cache(), BS, backend, cache_dtype)


def test_an_e4m3_cache_is_refused_where_the_platforms_fp8_is_another_type() -> None:
    check_platform_fp8("fp8", torch.float8_e4m3fn)  # CUDA
    check_platform_fp8("fp8_e5m2", torch.float8_e4m3fnuz)  # e5m2 names its own type
    with pytest.raises(LayoutError, match="fp8_e4m3 is torch.float8_e4m3fnuz on this platform.*fp8_e5m2 or auto"):
        check_platform_fp8("fp8_e4m3", torch.float8_e4m3fnuz)  # ROCm MI300


def test_hknd_layout_reads_k_and_v_where_vllm_cpu_attention_does() -> None:
    caches = vllm_cpu_cache(4, seed=1)
    layout, views = vllm_cache_layout(caches, BS, CPU_BACKEND)
    assert (layout.order, layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype) == (
        "HKND",
        LAYERS,
        HEADS,
        HEAD_DIM,
        "bfloat16",
    )
    chunk = gather(layout, views, [2, 0], 0, 40)  # token 35 = block 0 offset 3
    for layer, t in enumerate(caches.values()):
        as_vllm = t.view(4, HEADS, 2 * BS, HEAD_DIM)  # vLLM's own reinterpretation, then .chunk(2, dim=2)
        key, value = as_vllm[:, :, :BS], as_vllm[:, :, BS:]
        for head in range(HEADS):
            assert torch.equal(chunk[layer, 0, 35, head], key[0, head, 3])
            assert torch.equal(chunk[layer, 1, 35, head], value[0, head, 3])
            assert torch.equal(chunk[layer, 1, 2, head], value[2, head, 2])


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ((2, 4, BS, HEADS, HEAD_DIM), "pdkv maps only"),
        ((4, HEADS, 16, 2 * HEAD_DIM), "block_size=32"),
        ((4, HEADS, BS, 2 * HEAD_DIM + 1), "pdkv maps only"),
    ],
)
def test_unmapped_vllm_layouts_are_refused_by_name(shape: tuple[int, ...], message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        vllm_cache_layout({"layer0": torch.zeros(shape, dtype=torch.bfloat16)}, BS, CPU_BACKEND)


def test_layers_must_agree() -> None:
    caches = vllm_cpu_cache(4)
    caches["model.layers.9.self_attn.attn"] = torch.zeros((5, HEADS, BS, 2 * HEAD_DIM), dtype=torch.bfloat16)
    with pytest.raises(LayoutError, match="layers.9"):
        vllm_cache_layout(caches, BS, CPU_BACKEND)


# -- params -------------------------------------------------------------------------------
def test_push_target_parses_what_the_router_sends() -> None:
    t = push_target(
        {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_host": "127.0.0.1",
            "remote_port": 5555,
            "transfer_id": "x",
        },
        "r",
        PushGuard(),
    )
    assert t is not None and t.address == "tcp://127.0.0.1:5555"
    assert (
        push_target(
            {"do_remote_decode": True, "remote_host": "::1", "remote_port": 1, "transfer_id": "x"}, "r", PushGuard()
        ).address
        == "tcp://[::1]:1"
    )  # type: ignore[union-attr]


def test_vllm_nixl_style_and_absent_params_mean_no_push() -> None:
    assert push_target({"do_remote_decode": True, "remote_host": None, "remote_port": None}, "r", PushGuard()) is None
    assert push_target(None, "r", PushGuard()) is None
    assert pushed({"do_remote_prefill": False}, "r") is None


@pytest.mark.parametrize(
    "params",
    [
        {"do_remote_decode": True, "remote_host": "h", "remote_port": 70000, "transfer_id": "x"},
        {"do_remote_decode": True, "remote_host": "h", "remote_port": "80", "transfer_id": "x"},
        {"do_remote_decode": True, "remote_host": "h", "remote_port": 80, "transfer_id": ""},
        {"do_remote_decode": True, "remote_host": "h", "remote_port": 80, "transfer_id": "x" * 300},
    ],
)
def test_malformed_push_params_are_ignored_with_a_warning(params: dict, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert push_target(params, "req-7", PushGuard()) is None
    assert "req-7" in caplog.text and "malformed" in caplog.text


def test_malformed_pushed_params_are_ignored() -> None:
    assert pushed({"do_remote_prefill": True, "transfer_id": "x", "num_tokens": 0, "prompt_key": "k"}, "r") is None
    assert pushed({"do_remote_prefill": True, "transfer_id": "x", "num_tokens": 5}, "r") is None


# -- scheduler side ----------------------------------------------------------------------------
def request(req_id: str, prompt: list[int], params: dict | None, computed: int = 0) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=req_id, prompt_token_ids=prompt, kv_transfer_params=params, num_computed_tokens=computed
    )


def sched_output(
    new: list[tuple[str, list[int], int]] = (),
    cached: list[tuple[str, list[int] | None, int]] = (),
    scheduled: dict[str, int] | None = None,
) -> SimpleNamespace:
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(b,), num_computed_tokens=c) for r, b, c in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _, _ in cached],
            new_block_ids=[None if b is None else (b,) for _, b, _ in cached],
            num_computed_tokens=[c for _, _, c in cached],
            resumed_req_ids=set(),
        ),
        num_scheduled_tokens=scheduled or {},
    )


TARGET = {"do_remote_decode": True, "remote_host": "127.0.0.1", "remote_port": 5555, "transfer_id": "t-1"}


def test_prefill_side_tracks_chunked_prefill_and_holds_blocks_until_sent() -> None:
    s = SchedulerSide(FP, 64, is_producer=True, is_consumer=False)
    prompt = list(range(100))
    req = request("r1", prompt, TARGET)
    s.after_alloc(req, [7, 8], 0)
    step1 = s.build(sched_output(new=[("r1", [7, 8], 0)], scheduled={"r1": 64}))
    assert [(x.transfer_id, x.addresses, x.num_tokens, x.block_ids, x.ready_tokens) for x in step1.sends] == [
        ("t-1", ["tcp://127.0.0.1:5555"], 100, [7, 8], 64)
    ]
    step2 = s.build(sched_output(cached=[("r1", [9, 10], 64)], scheduled={"r1": 36}))
    assert step2.sends[0].block_ids == [7, 8, 9, 10] and step2.sends[0].ready_tokens == 100
    req.num_computed_tokens = 100
    hold, params = s.finished(req)
    assert hold is True and params is not None
    got = pushed(params, "d")
    assert got == Pushed("t-1", 100, prompt_key(prompt, FP, 64))


def test_prefill_side_ignores_requests_without_a_target_and_never_scheduled_ones() -> None:
    s = SchedulerSide(FP, 64, is_producer=True, is_consumer=False)
    plain = request("plain", [1, 2, 3], None)
    s.after_alloc(plain, [1], 0)
    assert s.build(sched_output(new=[("plain", [1], 0)], scheduled={"plain": 3})).sends == []
    assert s.finished(plain) == (False, None)
    unscheduled = request("u", [1, 2, 3], TARGET)
    s.after_alloc(unscheduled, [2], 0)
    assert s.finished(unscheduled) == (False, None)  # the worker never saw it: nothing to wait for


def test_prefill_side_with_a_secret_pushes_only_to_targets_the_router_signed(caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's P dials what the scheduler side hands its workers: a target not signed with P's secret (posted
    straight to P's port, or changed on the way) is served without a push, and logged; a listed-only receiver
    (``transfer.allowed_receivers``) bounds even signed ones."""
    tp_target = {**TARGET, "remote_ports": [5555, 5556]}  # a decode vLLM at tensor parallel 2

    def sends(guard: PushGuard, params: dict) -> list[list[str]]:
        s = SchedulerSide(FP, 64, is_producer=True, is_consumer=False, guard=guard)
        s.after_alloc(request("r1", list(range(10)), params), [7], 0)
        return [x.addresses for x in s.build(sched_output(new=[("r1", [7], 0)], scheduled={"r1": 10})).sends]

    guard = PushGuard.of("s3cret", [])
    with caplog.at_level(logging.WARNING):
        assert sends(guard, tp_target) == []
        assert "push target not signed by the router" in caplog.text and "r1" in caplog.text
        assert sends(guard, {**sign_push(tp_target, "s3cret"), "remote_ports": [5555, 6000]}) == []
        assert sends(guard, sign_push(tp_target, "other")) == []
    assert sends(guard, sign_push(tp_target, "s3cret")) == [["tcp://127.0.0.1:5555", "tcp://127.0.0.1:5556"]]
    listed = PushGuard.of("s3cret", ["127.0.0.1:5555"])
    assert sends(listed, sign_push(tp_target, "s3cret")) == []  # rank 1's receiver is not listed
    assert sends(PushGuard.of("", ["127.0.0.1"]), tp_target) == [["tcp://127.0.0.1:5555", "tcp://127.0.0.1:5556"]]


def test_prefill_aborted_mid_prompt_holds_blocks_but_tells_d_nothing() -> None:
    s = SchedulerSide(FP, 64, is_producer=True, is_consumer=False)
    req = request("r1", list(range(100)), TARGET)
    s.after_alloc(req, [1, 2], 0)
    s.build(sched_output(new=[("r1", [1, 2], 0)], scheduled={"r1": 64}))
    req.num_computed_tokens = 64
    assert s.finished(req) == (True, None)


def pushed_params(prompt: list[int], n: int | None = None, chunk: int = 64) -> dict:
    n = len(prompt) if n is None else n
    return {
        "do_remote_prefill": True,
        "transfer_id": "t-9",
        "num_tokens": n,
        "prompt_key": prompt_key(prompt[:n], FP, chunk),
    }


def test_decode_side_loads_past_the_local_prefix_once() -> None:
    s = SchedulerSide(FP, 64, is_producer=False, is_consumer=True)
    prompt = list(range(100))
    req = request("d1", prompt, pushed_params(prompt))
    assert s.num_new_matched_tokens(req, 32) == (68, True)
    s.after_alloc(req, [4, 5, 6, 7], 68)
    step = s.build(sched_output())
    assert [(x.req_id, x.transfer_id, x.num_tokens, x.skip_tokens, x.block_ids) for x in step.loads] == [
        ("d1", "t-9", 100, 32, [4, 5, 6, 7])
    ]
    # vLLM asks again after a failed load (recompute): never a second load
    assert s.num_new_matched_tokens(req, 0) == (0, False)
    assert s.build(sched_output()).loads == []


def test_decode_side_refuses_kv_of_another_prompt_and_frees_it() -> None:
    s = SchedulerSide(FP, 64, is_producer=False, is_consumer=True)
    prompt = list(range(100))
    other = request("d2", [5] + prompt[1:], pushed_params(prompt))
    assert s.num_new_matched_tokens(other, 0) == (0, False)
    assert s.rejected_prompts == 1
    assert s.build(sched_output()).discards == [Discard("t-9")]
    longer = request("d3", prompt[:50], pushed_params(prompt))  # claims more tokens than the prompt has
    assert s.num_new_matched_tokens(longer, 0) == (0, False)


def test_vllm_cache_salt_partitions_the_tier_and_the_pushed_prompt() -> None:
    """vLLM's ``Request.cache_salt`` keys the request's chunks: the tier is asked under that salt only, and KV
    pushed for the same tokens under another salt (or none) is not adopted."""
    asked: list[PromptKeys] = []
    s = SchedulerSide(FP, 64, is_producer=False, is_consumer=True, tier_lookup=lambda pk: asked.append(pk) or 0)
    prompt = list(range(130))
    salted = request("s1", prompt, None)
    salted.cache_salt = "tenant-a"
    s.num_new_matched_tokens(salted, 0)
    assert [pk.keys for pk in asked] == [tuple(chunk_keys(prompt, FP, 64, "tenant-a")[:2])]
    cross = request("s2", prompt, pushed_params(prompt))  # P prefilled it unsalted
    cross.cache_salt = "tenant-b"
    assert s.num_new_matched_tokens(cross, 0) == (0, False)
    assert s.rejected_prompts == 1
    same = request("s3", prompt, {**pushed_params(prompt), "prompt_key": prompt_key(prompt, FP, 64, "tenant-b")})
    same.cache_salt = "tenant-b"
    assert s.num_new_matched_tokens(same, 0) == (130, True)
    long = request("s4", prompt, None)  # vLLM bounds no salt: a long one is keyed by its digest, never dropped
    long.cache_salt = "x" * 1000
    assert cache_salt(long).startswith("sha256:") and cache_salt(long) != cache_salt(request("s5", prompt, None)) == ""


def test_decode_side_fully_cached_locally_discards_the_pushed_copy() -> None:
    s = SchedulerSide(FP, 64, is_producer=False, is_consumer=True)
    prompt = list(range(64))
    req = request("d4", prompt, pushed_params(prompt))
    assert s.num_new_matched_tokens(req, 64) == (0, False)
    s.after_alloc(req, [1, 2], 0)
    step = s.build(sched_output())
    assert step.loads == [] and step.discards == [Discard("t-9")]


# -- worker side over the real tcp channel -------------------------------------------------------
def worker_pair(
    transfer: dict | None = None,
    memory: str = "host",
    p_events: Callable[[], StepEvent] | None = None,
    d_events: Callable[[], StepEvent] | None = None,
    caches: tuple[str, str] = (CPU_BACKEND, CPU_BACKEND),
) -> tuple[WorkerSide, WorkerSide, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """P and D over tcp (D lands in vLLM's own blocks, its prefix caching on or off); both caches in ``memory``
    (``KV_MEMORIES``), shaped as the ``caches`` specs (``CACHES``) say."""
    cfg = convert_config(
        {
            "num_blocks": 16,
            "transfer": {
                "chunk_size": 64,
                "transfer_timeout_s": 3,
                "reserve_timeout_s": 2,
                "handshake_timeout_s": 2,
                **(transfer or {}),
            },
        }
    )
    p_cache, d_cache = vllm_cache(caches[0], 12, seed=3), vllm_cache(caches[1], 10)
    if memory == "emulated":  # device memory the tcp channel cannot read through a host view, as a GPU's
        for t in (*p_cache.values(), *d_cache.values()):
            emulate_device(t)
    p = WorkerSide(cfg, FP, is_producer=True, is_consumer=False, agent_name="p-test", make_event=p_events)
    d = WorkerSide(
        cfg,
        FP,
        is_producer=False,
        is_consumer=True,
        agent_name="d-test",
        make_event=d_events,
    )
    p.register(*mapped(caches[0], p_cache))
    d.register(*mapped(caches[1], d_cache))
    return p, d, p_cache, d_cache


def collect(side: WorkerSide, finished: set[str], timeout: float = 10.0) -> tuple[set[str], set[str], set[str]]:
    """Poll ``results`` like vLLM does each step until something is reported."""
    out: tuple[set[str], set[str], set[str]] = (set(), set(), set())
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = side.results(finished)
        finished = set()
        out = (out[0] | got[0], out[1] | got[1], out[2] | got[2])
        if any(out):
            return out
        time.sleep(0.01)
    return out


@pytest.mark.parametrize("spec", CACHES + FP8_CACHES + MLA_CACHES)
def test_prefill_pushes_from_vllm_blocks_and_decode_loads_them_into_its_own(spec: str) -> None:
    p, d, p_cache, d_cache = worker_pair(caches=(spec, spec))
    try:
        assert d.receiver is not None
        address = d.receiver.address
        # 150 tokens over P blocks [9, 2, 5, 11, 0]; pushed in two steps as chunked prefill computes them
        p.push(StepMetadata(sends=[SendSpec("r1", "t-1", [address], 150, [9, 2, 5, 11, 0], 64)]))
        p.push(StepMetadata(sends=[SendSpec("r1", "t-1", [address], 150, [9, 2, 5, 11, 0], 150)]))
        # D: vLLM allocated blocks [3, 7, 1, 8, 6]; block 0 of the prompt is in its local prefix cache (skip 32 tokens)
        before = {name: t.clone() for name, t in d_cache.items()}
        d.start_loads(StepMetadata(loads=[LoadSpec("r1", "t-1", 150, 32, [3, 7, 1, 8, 6])]))
        _, recving, failed = collect(d, set())
        assert recving == {"r1"} and failed == set()
        # vLLM says the request finished; its blocks are released once the writes settle
        assert collect(p, {"r1"})[0] == {"r1"}
        for name in p_cache:
            src, dst = p_cache[name], d_cache[name]
            for p_block, d_block in zip([2, 5, 11, 0], [7, 1, 8, 6], strict=True):
                assert torch.equal(dst[d_block], src[p_block]), (name, p_block, d_block)
            # the locally cached block (vLLM's, shared) and every block not the request's: never written
            assert torch.equal(dst[[0, 2, 3, 4, 5, 9]], before[name][[0, 2, 3, 4, 5, 9]])
        assert d.landing == "direct"  # in vLLM's own blocks with its prefix caching on: no buffer, no copy
        assert held_blocks(d.receiver.stats(), 10) == 0 and d.receiver.stats()["reservations"] == 0
        assert p.counters["push_ok"] == 1 and d.counters["load_ok"] == 1
        assert d.counters["pushed_tokens_loaded"] == d.receiver.stats()["tokens_landed"] == 150 - 32
        # only the blocks past D's own prefix came over the channel: 118 tokens in two chunks (64 + 54)
        assert d.receiver.stats()["bytes_landed"] == p.sender.stats()["bytes_raw"] == d.layout.chunk_bytes(118)
    finally:
        p.close()
        d.close()


SAME_DTYPE = "start both with the same KV cache dtype (vLLM: the same --kv-cache-dtype"


@pytest.mark.parametrize(
    ("caches", "message"),
    [
        (
            ("CPU_ATTN:fp8", CPU_BACKEND),
            "prefill's KV cache is float8_e4m3fn, this decode's is bfloat16: " + SAME_DTYPE,
        ),
        (("TRITON_ATTN/LBNHC:fp8_e5m2", "FLASH_ATTN/LBNHC:fp8"), "is float8_e5m2, this decode's is float8_e4m3fn"),
        (("TRITON_MLA", CPU_BACKEND), "prefill's KV cache is MLA (one latent per layer), this decode's is K and V"),
    ],
    ids=["fp8-to-bf16", "e5m2-to-e4m3", "mla-to-kv"],
)
def test_decode_refuses_kv_of_another_dtype_or_form_at_the_handshake(
    caches: tuple[str, str], message: str, caplog: pytest.LogCaptureFixture
) -> None:
    """P and D started with different --kv-cache-dtype (or MLA and not): the Hello is refused with the setting to
    change; no byte lands, nothing is converted, and D recomputes."""
    p, d, _, d_cache = worker_pair(caches=caches)
    try:
        assert d.receiver is not None
        before = {name: t.clone() for name, t in d_cache.items()}
        with caplog.at_level(logging.WARNING):
            p.push(StepMetadata(sends=[SendSpec("r1", "t-1", [d.receiver.address], 64, [1, 2], 64)]))
            sending, _, _ = collect(p, {"r1"})
            assert sending == {"r1"}
            wait_until(lambda: p.counters["push_failed"] == 1, 5, "the push to fail")
        assert any(message in r.getMessage() and r.name.endswith("worker_side") for r in caplog.records)
        assert d.receiver.stats()["handshake_failures"] == 1 and d.receiver.stats().get("bytes_landed", 0) == 0
        assert all(torch.equal(t, before[name]) for name, t in d_cache.items())
    finally:
        p.close()
        d.close()


def test_decode_loads_pushed_kv_only_for_the_prompt_p_computed_it_from() -> None:
    """P's Reserve carries its prompt's key; D's load names its own: another prompt's KV is never decoded from (the
    load fails, vLLM recomputes)."""
    p, d, _, _ = worker_pair()
    try:
        assert d.receiver is not None
        p.push(StepMetadata(sends=[SendSpec("r1", "t-1", [d.receiver.address], 64, [1, 2], 64, b"A" * 16)]))
        d.start_loads(StepMetadata(loads=[LoadSpec("r1", "t-1", 64, 0, [3, 4], prompt_key=b"B" * 16)]))
        _, recving, failed = collect(d, set())
        assert recving == failed == {"r1"}  # vLLM recomputes the prompt
        assert collect(p, {"r1"})[0] == {"r1"}
        assert d.receiver.stats()["prompt_mismatches"] == 1
        assert held_blocks(d.receiver.stats(), 10) == 0 and d.receiver.stats()["reservations"] == 0
    finally:
        p.close()
        d.close()


def _affinity(tid: int, default: set[int]) -> set[int]:
    try:
        return os.sched_getaffinity(tid)
    except ProcessLookupError:  # exited since it was listed
        return default


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs two CPUs to pin a thread to one",
)
def test_connector_threads_run_off_the_core_vllm_pins_its_worker_to() -> None:
    """vLLM's CPU worker pins its main thread to one core before it registers the cache, and threads inherit it:
    inside vLLM on two cores the receiver then answered handshakes 5-10 s late and transfers timed out."""
    every = os.sched_getaffinity(0)
    core = {min(every)}
    made: dict[str, object] = {}

    cfg = convert_config({"num_blocks": 16, "transfer": {"chunk_size": 64, "transfer_timeout_s": 3}})
    p = WorkerSide(cfg, FP, is_producer=True, is_consumer=False, agent_name="p-test")
    d = WorkerSide(cfg, FP, is_producer=False, is_consumer=True, agent_name="d-test")
    p_cache, d_cache = (
        vllm_cpu_cache(12, seed=3),
        vllm_cpu_cache(10),
    )  # vLLM's (its OpenMP threads are its own business)

    def as_vllm_worker() -> None:  # everything vLLM's worker thread would call on us: register, push, load
        os.sched_setaffinity(0, core)
        p.register(*vllm_cache_layout(p_cache, BS, CPU_BACKEND))
        d.register(*vllm_cache_layout(d_cache, BS, CPU_BACKEND))
        assert d.receiver is not None
        p.push(StepMetadata(sends=[SendSpec("r1", "t-1", [d.receiver.address], 150, [9, 2, 5, 11, 0], 150)]))
        d.start_loads(StepMetadata(loads=[LoadSpec("r1", "t-1", 150, 0, [3, 7, 1, 8, 6])]))
        made["recving"] = collect(d, set())[1]
        made["sending"] = collect(p, {"r1"})[0]
        made["own"] = os.sched_getaffinity(0)

    worker = threading.Thread(target=as_vllm_worker)
    worker.start()
    worker.join(60)
    try:
        assert (
            made["sending"] == {"r1"} and made["recving"] == {"r1"} and made["own"] == core
        )  # vLLM's thread keeps its pinning
        # Every thread of this process, native ones (zmq I/O, channel sockets) included, may run on any CPU.
        others = [
            int(tid) for tid in os.listdir("/proc/self/task") if int(tid) != worker.native_id
        ]  # it may linger a moment after join
        pinned = {str(tid): mask for tid in others if (mask := _affinity(tid, every)) != every}
        names = {str(t.native_id): t.name for t in threading.enumerate()}
        assert pinned == {}, {
            tid: names.get(tid, Path(f"/proc/self/task/{tid}/comm").read_text().strip()) for tid in pinned
        }
        assert d.counters["load_ok"] == 1
    finally:
        p.close()
        d.close()


# -- D lands in vLLM's own blocks ---------------------------------------------------------------
def test_landing_path_rule() -> None:
    host, emulated = torch.zeros(4), emulate_device(torch.zeros(4))
    assert landing_path(host, ("host",)) == "direct"  # tcp, ucx, mock and a CPU cache
    assert landing_path(emulated, ("host", "cuda")) == "staged"  # emulated: never reachable
    assert landing_path(emulated, ("host", "emulated")) == "direct"
    assert landing_path(emulated, ("host",)) == "staged"  # tcp and a GPU cache


def test_vllm_blocks_grant_a_transfer_its_requests_blocks_only_once_expected() -> None:
    blocks = VllmBlocks(10)
    with pytest.raises(OutOfBlocksError, match="has not allocated"):  # retryable: P asks again
        blocks.allocate_for("t-1", 2)
    blocks.expect("t-1", [7, 3, 5])
    with pytest.raises(OutOfBlocksError, match="needs 4 blocks"):
        blocks.allocate_for("t-1", 4)
    assert blocks.held_for("t-1") == 0 and blocks.allocate_for("t-1", 2) == [7, 3] and blocks.num_free == 8
    blocks.expect("t-2", [3, 4])
    with pytest.raises(OutOfBlocksError, match="1 of them held by another request.s transfer"):
        blocks.allocate_for("t-2", 2)
    assert not blocks.withdraw("t-1", 0.01)  # granted and not freed: a late write may still land
    threading.Timer(0.05, blocks.free, ([7, 3],)).start()
    assert blocks.withdraw("t-1", 5.0) and blocks.num_free == 10
    with pytest.raises(LayoutError, match="double free"):
        blocks.free([7, 3])
    with pytest.raises(LayoutError, match="distinct"):
        blocks.expect("t-3", [1, 1])
    with pytest.raises(LayoutError, match="in \\[0, 10\\)"):
        blocks.expect("t-3", [10])
    blocks.expect("t-4", [2, 6], held_tokens=32)  # past a local hit of 32 tokens: its blocks are not the transfer's
    assert blocks.held_for("t-4") == 32
    with pytest.raises(OutOfBlocksError, match="past 0 tokens"):  # admitted before the loader's word: asked again
        blocks.allocate_for("t-4", 2)
    assert blocks.allocate_for("t-4", 2, held=32) == [2, 6]


def test_vllm_blocks_grant_one_requests_head_windows_the_same_blocks_until_each_freed_them() -> None:
    """P at TP 2 -> D at TP 1: two transfers land their heads in one request's blocks; another request's may not."""
    blocks = VllmBlocks(10)
    for tid in ("r/p0d0", "r/p1d0"):
        blocks.expect(tid, [4, 8], group="r")
    assert blocks.allocate_for("r/p0d0", 2) == [4, 8] and blocks.allocate_for("r/p1d0", 2) == [4, 8]
    assert blocks.num_free == 8
    blocks.expect("other", [8, 9])
    with pytest.raises(OutOfBlocksError, match="1 of them held by another request.s transfer"):
        blocks.allocate_for("other", 2)
    blocks.free([4, 8])
    assert blocks.num_free == 8  # the other window still holds them: a late write of its sender may land
    assert blocks.withdraw("r/p0d0", 0.01) != blocks.withdraw("r/p1d0", 0.01)  # one of the two freed its grant
    blocks.free([4, 8])
    assert blocks.num_free == 10 and blocks.withdraw("r/p0d0", 0.01) and blocks.withdraw("r/p1d0", 0.01)
    with pytest.raises(LayoutError, match="double free"):
        blocks.free([4, 8])


@pytest.mark.parametrize(
    "caches",
    [
        (CPU_BACKEND, CPU_BACKEND),
        ("FLASH_ATTN/LBNHC", "FLASH_ATTN/LBNHC"),  # vLLM's default GPU backend and layout on both sides
        ("FLASHINFER/LBHNC", "TRITON_ATTN/LBNHC"),  # two GPU orders: converted through staging
        ("FLASH_ATTN/LBNHC:fp8", "FLASHINFER/LBHNC:fp8_e4m3"),  # fp8 bytes, unconverted, between two orders
        ("TRITON_MLA:fp8_e5m2", "CPU_MLA:fp8_e5m2"),  # DeepSeek's latent, in fp8
    ],
    ids=["cpu-cpu", "fa-fa", "flashinfer-hnd-triton", "fa-hnd-fp8", "mla-fp8"],
)
@pytest.mark.parametrize("memory", KV_MEMORIES)
def test_decode_lands_pushed_kv_straight_in_vllm_blocks(
    memory: str, caches: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    """D's receiver is built over vLLM's own tensors (its prefix caching on or off) and grants the transfer the
    request's blocks past D's local prefix hit (here its first block); host memory: the tcp channel writes into them
    (direct); emulated device memory or layouts that differ: through pinned slots, scattered into them (staged). No
    landing buffer, no copy, the hit's block never written. Each K and V lands where D's attention backend reads it,
    whichever backend P's came from."""
    caplog.set_level(logging.INFO, logger="pdkv.integration.vllm.worker_side")
    p, d, p_cache, d_cache = worker_pair(memory=memory, caches=caches)
    try:
        assert d.receiver is not None
        path = "direct" if memory == "host" else "staged"
        assert d.landing == path
        assert f"pushed KV lands straight in vLLM's blocks past its own prefix hit ({path}: the tcp channel" in (
            caplog.text
        )
        storages = {t.untyped_storage().data_ptr() for t in d_cache.values()}
        assert {t.untyped_storage().data_ptr() for t in d.receiver.memory.kv} == storages  # vLLM's own memory
        before = {name: t.clone() for name, t in d_cache.items()}
        # P pushes before D's scheduler saw the request: its Reserve is refused (retryable) until D's is allocated
        p.push(StepMetadata(sends=[SendSpec("r1", "t-1", [d.receiver.address], 150, [9, 2, 5, 11, 0], 150)]))
        wait_until(lambda: d.receiver.stats().get("refused", 0) >= 1, 5, "P's Reserve before D has vLLM blocks")
        d.start_loads(StepMetadata(loads=[LoadSpec("r1", "t-1", 150, BS, [3, 7, 1, 8, 6])]))
        _, recving, failed = collect(d, set())
        assert recving == {"r1"} and failed == set()
        assert collect(p, {"r1"})[0] == {"r1"}
        sent = tokens_of(caches[0], p_cache, [9, 2, 5, 11, 0], 150)  # staging moves tokens, direct whole blocks
        assert torch.equal(tokens_of(caches[1], d_cache, [3, 7, 1, 8, 6], 150)[:, :, BS:], sent[:, :, BS:])
        untouched = [b for b in range(10) if b not in (7, 1, 8, 6)]  # block 3 holds D's own prefix: shared
        assert all(torch.equal(d_cache[name][untouched], before[name][untouched]) for name in d_cache)
        stats = d.receiver.stats()
        assert stats["claimed"] == 1 and stats["reservations"] == 0 and stats["free_blocks"] == 10
        assert stats.get("chunks_staged_to_device", 0) == (0 if memory == "host" else 2)  # 118 tokens: 64 + 54
        assert stats["tokens_landed"] == 150 - BS
        assert d.counters["load_ok"] == 1 and d.counters["load_failed"] == 0
        assert d.counters["pushed_tokens_loaded"] == 150 - BS and p.counters["push_ok"] == 1
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("caches", [("FLASH_ATTN/LBNHC", CPU_BACKEND), ("FLASH_ATTN/LBNHC:fp8", "CPU_ATTN:fp8_e4m3")])
def test_a_gpu_prefill_into_a_vllm_cpu_decode_is_refused_and_recomputed(
    caches: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's CPU kernels pack each block (K transposed and tiled for the ISA), so a token of a GPU cache has no
    place pdkv can compute in one: refused at the Reserve, D recomputes, nothing written into its blocks."""
    p, d, _, d_cache = worker_pair(caches=caches)
    try:
        assert d.receiver is not None
        before = {name: t.clone() for name, t in d_cache.items()}
        d.start_loads(StepMetadata(loads=[LoadSpec("r1", "t-1", 150, BS, [3, 7, 1, 8, 6])]))
        p.push(StepMetadata(sends=[SendSpec("r1", "t-1", [d.receiver.address], 150, [9, 2, 5, 11, 0], 150)]))
        assert collect(d, set(), timeout=15)[1:] == ({"r1"}, {"r1"})
        assert collect(p, {"r1"})[0] == {"r1"} and p.counters["push_failed"] == 1
        assert "vLLM's CPU cache packs each block for its kernels" in caplog.text
        assert all(torch.equal(d_cache[name], before[name]) for name in d_cache)
    finally:
        p.close()
        d.close()


def test_a_push_waiting_for_ds_scheduler_holds_up_no_other_request() -> None:
    p, d, _, _ = worker_pair()
    try:
        assert d.receiver is not None
        address = d.receiver.address
        p.push(StepMetadata(sends=[SendSpec("r1", "t-1", [address], 64, [1, 2], 64)]))  # D has not scheduled r1
        wait_until(lambda: d.receiver.stats().get("refused", 0) >= 1, 5, "r1's Reserve refused for now")
        p.push(StepMetadata(sends=[SendSpec("r2", "t-2", [address], 64, [3, 4], 64)]))
        d.start_loads(StepMetadata(loads=[LoadSpec("r2", "t-2", 64, 0, [5, 6])]))
        assert collect(d, set())[1] == {"r2"}  # while r1's Reserve is still being retried
        assert d.receiver.stats()["reserved"] == 1
        d.start_loads(StepMetadata(loads=[LoadSpec("r1", "t-1", 64, 0, [7, 8])]))
        _, recving, failed = collect(d, set())
        assert recving == {"r1"} and failed == set() and d.counters["load_ok"] == 2
        released = collect(p, {"r1", "r2"})[0]
        released |= collect(p, set())[0] if released != {"r1", "r2"} else set()  # the two may settle apart
        assert released == {"r1", "r2"} and p.counters["push_ok"] == 2
    finally:
        p.close()
        d.close()


def test_a_request_aborted_while_its_transfer_opens_is_cancelled_once_open_and_released_after() -> None:
    p, d, _, _ = worker_pair()
    try:
        assert d.receiver is not None
        p.push(StepMetadata(sends=[SendSpec("r1", "t-1", [d.receiver.address], 150, [9, 2, 5, 11, 0], 64)]))
        wait_until(lambda: d.receiver.stats().get("refused", 0) >= 1, 5, "r1's Reserve refused for now")
        assert p.results({"r1"}) == (set(), set(), set())  # vLLM aborted it: its blocks stay held while it opens
        d.start_loads(StepMetadata(loads=[LoadSpec("r1", "t-1", 150, 0, [3, 7, 1, 8, 6])]))
        _, recving, failed = collect(d, set())
        assert recving == failed == {"r1"}  # P cancelled once open: 2 of its 3 chunks were never computed
        assert collect(p, set())[0] == {"r1"}  # released once the cancelled transfer settled
        assert p.counters["push_failed"] == 1 and p.counters["push_ok"] == 0
        assert d._blocks is not None and d._blocks.num_used == 0
    finally:
        p.close()
        d.close()


def test_in_place_load_of_another_prompts_kv_fails_only_after_its_blocks_are_released() -> None:
    p, d, _, _ = worker_pair()
    try:
        assert d.receiver is not None and d._blocks is not None
        p.push(StepMetadata(sends=[SendSpec("r1", "t-1", [d.receiver.address], 64, [1, 2], 64, b"A" * 16)]))
        d.start_loads(StepMetadata(loads=[LoadSpec("r1", "t-1", 64, 0, [3, 4], prompt_key=b"B" * 16)]))
        _, recving, failed = collect(d, set())
        assert recving == failed == {"r1"}  # vLLM recomputes into blocks pdkv no longer holds
        assert d._blocks.num_used == 0 and d.receiver.stats()["prompt_mismatches"] == 1
        assert d.counters["load_failed"] == 1 and d.counters["pushed_tokens_loaded"] == 0
    finally:
        p.close()
        d.close()


def test_the_worker_sides_counters_become_the_reference_workers_series_each_increment_once() -> None:
    """What vLLM's ``/metrics`` gets (connector.py's stats path, end to end in tests/test_vllm_integration.py): each
    step's delta of the worker side's counters, summed, as the reference workers' ``pdkv_*`` series."""
    p, d, _, _ = worker_pair()
    try:
        assert d.receiver is not None and d.layout is not None and p.sender is not None
        p.push(StepMetadata(sends=[SendSpec("r1", "t-1", [d.receiver.address], 64, [1, 2], 64)]))
        d.start_loads(StepMetadata(loads=[LoadSpec("r1", "t-1", 64, 0, [3, 4])]))
        assert collect(d, set()) == (set(), {"r1"}, set())
        assert collect(p, {"r1"})[0] == {"r1"}
        p_step, d_step = p.stats_delta(), d.stats_delta()
        assert p.stats_delta() == d.stats_delta() == {}  # handed over once: vLLM sums the steps' deltas
        # the sender's and receiver's own counters, as the reference workers' pdkv_transfer_events_total
        p_events = {k: p_step.pop(k) for k in list(p_step) if k.startswith("events|")}
        d_events = {k: d_step.pop(k) for k in list(d_step) if k.startswith("events|")}
        assert p_events["events|prefill|chunks_sent"] == p.sender.stats()["chunks_sent"] == 1
        assert d_events["events|decode|chunks_landed"] == 1 and d_events["events|decode|claimed"] == 1
        assert not any(k.rsplit("|", 1)[1] in GAUGES for k in (*p_events, *d_events))
        events = {
            (labels["role"], labels["event"]): v for name, labels, v in stats.series(d_events) if name == stats.EVENTS
        }
        assert events[("decode", "bytes_landed")] == d.receiver.stats()["bytes_landed"]
        # each transfer's time, throughput and D's wait, observed once, for the reference workers' histograms
        seconds, gbps = p_step.pop("pdkv_transfer_seconds|prefill"), p_step.pop("pdkv_transfer_gbps|prefill")
        [chunk], [tail] = p_step.pop("pdkv_chunk_seconds|prefill"), p_step.pop("pdkv_transfer_tail_seconds|prefill")
        [wait] = d_step.pop("pdkv_transfer_wait_seconds|decode")
        assert len(seconds) == len(gbps) == 1 and seconds[0] > 0 and wait > 0
        # one chunk: its post to its verdict is the exposed tail and all of the transfer, and its GB/s the wire's
        assert 0 < chunk <= tail <= seconds[0]
        assert gbps[0] == pytest.approx(p.sender.stats()["bytes_raw"] / chunk / 1e9)
        assert p_step == {"push_ok": 1, "push_tokens": 64, "push_bytes": p.sender.stats()["bytes_raw"]}
        assert d_step == {"load_ok": 1, "pushed_tokens_loaded": 64, "load_bytes": p_step["push_bytes"]}
        # a push D cannot use: D recomputes, and says so
        p.push(StepMetadata(sends=[SendSpec("r2", "t-2", [d.receiver.address], 64, [5, 6], 64, b"A" * 16)]))
        d.start_loads(StepMetadata(loads=[LoadSpec("r2", "t-2", 64, 0, [7, 8], prompt_key=b"B" * 16)]))
        assert collect(d, set()) == (set(), {"r2"}, {"r2"})
        both = stats.merged(stats.merged(p_step, d_step), d.stats_delta())
        got = {
            (name, tuple(sorted(labels.items()))): value
            for name, labels, value in stats.series(both)
            if name != stats.EVENTS
        }
        assert got == {
            ("pdkv_transfers", (("outcome", "ok"), ("role", "prefill"))): 1,
            ("pdkv_transfer_bytes", (("role", "prefill"),)): p_step["push_bytes"],
            ("pdkv_transfer_tokens", (("role", "prefill"),)): 64,
            ("pdkv_transfers", (("outcome", "ok"), ("role", "decode"))): 1,
            ("pdkv_transfers", (("outcome", "failed"), ("role", "decode"))): 1,
            ("pdkv_fallbacks", (("reason", "transfer_failed"), ("role", "decode"))): 1,
            ("pdkv_transfer_bytes", (("role", "decode"),)): p_step["push_bytes"],
            ("pdkv_transfer_tokens", (("role", "decode"),)): 64,
            ("pdkv_prompt_tokens", (("role", "decode"), ("source", "transferred"))): 64,
        }
        assert all(labels.keys() == {"role", *stats.SERIES[name][1]} for name, labels, _ in stats.series(both))
        # observations join across steps and workers (vLLM's aggregate), and become one histogram series each
        observed = stats.merged(
            {"pdkv_transfer_seconds|prefill": seconds}, {"pdkv_transfer_seconds|prefill": [0.5], "push_ok": 2}
        )
        assert observed == {"pdkv_transfer_seconds|prefill": [*seconds, 0.5], "push_ok": 2}
        assert list(stats.histogram_series({**observed, "pdkv_unknown|decode": [1.0]})) == [
            ("pdkv_transfer_seconds", {"role": "prefill"}, [*seconds, 0.5])
        ]
    finally:
        p.close()
        d.close()


def test_a_local_hit_inside_a_block_is_no_load_and_writes_nothing() -> None:
    """vLLM's prefix cache holds whole blocks; a hit that is not (a scheduler bug) would have P write into a block
    other requests may read: the transfer is cancelled before any grant and vLLM recomputes."""
    p, d, _, d_cache = worker_pair()
    try:
        assert d.receiver is not None
        before = {name: t.clone() for name, t in d_cache.items()}
        p.push(StepMetadata(sends=[SendSpec("r1", "t-1", [d.receiver.address], 150, [9, 2, 5, 11, 0], 150)]))
        d.start_loads(StepMetadata(loads=[LoadSpec("r1", "t-1", 150, 40, [3, 7, 1, 8, 6])]))
        _, recving, failed = collect(d, set())
        assert recving == failed == {"r1"}
        assert collect(p, {"r1"})[0] == {"r1"} and p.counters["push_failed"] == 1
        assert all(torch.equal(d_cache[name], before[name]) for name in d_cache)
        assert d.receiver.stats().get("bytes_landed", 0) == 0
    finally:
        p.close()
        d.close()


def test_a_full_local_hit_moves_nothing() -> None:
    """D's prefix cache holds all the pushed tokens: the scheduler plans no load and discards the transfer, P's
    Reserve is refused for good, and not a byte moves."""
    p, d, _, d_cache = worker_pair()
    try:
        assert d.receiver is not None
        before = {name: t.clone() for name, t in d_cache.items()}
        p.push(StepMetadata(sends=[SendSpec("r1", "t-1", [d.receiver.address], 128, [9, 2, 5, 11], 128)]))
        wait_until(lambda: d.receiver.stats().get("refused", 0) >= 1, 5, "P's Reserve before D's scheduler saw it")
        d.start_loads(
            StepMetadata(discards=[Discard("t-1")])
        )  # what SchedulerSide.after_alloc emits for a full local hit
        assert collect(p, {"r1"})[0] == {"r1"}
        wait_until(lambda: p.counters["push_failed"] == 1, 5, "the push to be refused")
        assert d.receiver.stats().get("bytes_landed", 0) == 0 and p.sender is not None
        assert p.sender.stats().get("bytes_raw", 0) == 0
        assert all(torch.equal(d_cache[name], before[name]) for name in d_cache)
    finally:
        p.close()
        d.close()


class _Gate:
    """A step's event that the test completes: until then ``synchronize`` blocks (its kernels are still running)."""

    def __init__(self, name: str, log: list[tuple[str, str]]) -> None:
        self.name, self.log, self.done = name, log, threading.Event()

    def record(self) -> None:
        self.log.append(("record", self.name))

    def synchronize(self) -> None:
        self.log.append(("wait", self.name))
        assert self.done.wait(10), f"event {self.name} never completed"


def test_p_posts_a_chunk_only_after_the_step_that_computed_it_ran_and_d_writes_only_after_vllm_allocated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a GPU these are CUDA events marked on vLLM's stream; here fakes that block until the test completes them."""
    log: list[tuple[str, str]] = []
    made: dict[str, _Gate] = {}

    def maker(side: str) -> Callable[[], StepEvent]:
        def make() -> StepEvent:  # p1, p2, ...: the events P's steps mark; d1, ...: D's
            name = f"{side}{sum(k.startswith(side) for k in made) + 1}"
            made[name] = _Gate(name, log)
            return made[name]

        return make

    real_send = OutgoingTransfer.send_chunk

    def send_chunk(self: OutgoingTransfer, index: int) -> None:
        log.append(("post", str(index)))
        real_send(self, index)

    monkeypatch.setattr(OutgoingTransfer, "send_chunk", send_chunk)
    p, d, p_cache, d_cache = worker_pair(p_events=maker("p"), d_events=maker("d"))
    try:
        assert d.receiver is not None
        blocks = [9, 2, 5, 11, 0]
        p.push(StepMetadata(sends=[SendSpec("r1", "t-1", [d.receiver.address], 150, blocks, 64)]))  # step 1: chunk 0
        wait_until(lambda: ("wait", "p1") in log, 5, "the push thread waiting for step 1's event")
        d.start_loads(StepMetadata(loads=[LoadSpec("r1", "t-1", 150, 0, [3, 7, 1, 8, 6])]))
        wait_until(lambda: ("wait", "d1") in log, 5, "the loader waiting for the event of the step that allocated")
        assert not any(kind == "post" for kind, _ in log) and d.receiver.stats().get("reserved", 0) == 0
        made["d1"].done.set()  # D may now be written: P's Reserve is granted vLLM's blocks once P opens
        made["p1"].done.set()  # step 1 ran: chunk 0 may go
        wait_until(lambda: ("post", "0") in log, 5, "chunk 0 posted")
        p.push(StepMetadata(sends=[SendSpec("r1", "t-1", [d.receiver.address], 150, blocks, 150)]))  # step 2
        wait_until(lambda: ("wait", "p2") in log, 5, "the push thread waiting for step 2's event")
        assert ("post", "1") not in log
        made["p2"].done.set()
        assert collect(d, set())[1] == {"r1"} and collect(p, {"r1"})[0] == {"r1"}
        posts = [i for i, entry in enumerate(log) if entry[0] == "post"]
        assert [log[i][1] for i in posts] == ["0", "1", "2"]
        assert log.index(("wait", "p1")) < posts[0] and log.index(("wait", "p2")) < posts[1]
        assert log.index(("record", "p2")) > posts[0]  # chunks 1-2 were not computed when chunk 0 went
        for name in p_cache:  # direct: whole blocks
            assert torch.equal(d_cache[name][[3, 7, 1, 8, 6]], p_cache[name][blocks])
    finally:
        for gate in made.values():
            gate.done.set()
        p.close()
        d.close()


def test_a_transfer_that_never_comes_fails_the_load_within_its_timeout() -> None:
    p, d, _, _ = worker_pair({"transfer_timeout_s": 1.0})
    try:
        t0 = time.monotonic()
        d.start_loads(StepMetadata(loads=[LoadSpec("r2", "never-pushed", 64, 0, [1, 2])]))
        _, recving, failed = collect(d, set(), timeout=10)
        assert recving == {"r2"} and failed == {"r2"}  # reported finished AND failed: vLLM recomputes
        assert time.monotonic() - t0 < 5
        assert d.receiver is not None and d.receiver.stats()["free_blocks"] == 10
    finally:
        p.close()
        d.close()


def test_a_dead_decode_receiver_costs_the_push_not_the_blocks() -> None:
    p, d, _, _ = worker_pair({"reserve_timeout_s": 0.5, "handshake_timeout_s": 0.5})
    try:
        assert d.receiver is not None
        address = d.receiver.address
        d.close()  # D is gone before P pushes
        p.push(StepMetadata(sends=[SendSpec("r3", "t-3", [address], 64, [1, 2], 64)]))
        sending, _, _ = collect(p, {"r3"}, timeout=10)
        assert sending == {"r3"}  # vLLM may free P's blocks: nothing was written from them
        wait_until(lambda: p.counters["push_failed"] == 1, 5, "push counted as failed")
    finally:
        p.close()


# -- the shared cache tier (a real redis-server) ---------------------------------------------------
def test_scheduler_loads_the_tiers_leading_chunks_and_saves_only_what_it_computes() -> None:
    held: set[bytes] = set()
    s = SchedulerSide(
        FP,
        64,
        is_producer=False,
        is_consumer=False,
        tier_lookup=lambda pk: leading([k in held for k in pk.keys]) * pk.chunk_size,
    )
    prompt = list(range(300))  # 4 full chunks of 64, and a partial one that is never cached
    req = request("t1", prompt, None)
    full = list(s._full_chunk_keys(req).keys)
    assert full == chunk_keys(prompt, FP, 64)[:4]
    held.update(full[:3])
    assert s.num_new_matched_tokens(req, 64) == (128, True)  # 3 chunks held, 1 cached by vLLM itself
    s.after_alloc(req, [1, 2, 3, 4, 5], 128)
    step = s.build(sched_output(new=[("t1", [1, 2, 3, 4, 5], 192)], scheduled={"t1": 64}))
    [load] = step.loads
    assert (load.num_tokens, load.skip_tokens, load.tier_keys) == (192, 64, full[:3])
    [save] = step.saves
    assert (save.first_chunk, save.keys) == (3, full[:4])  # chunk 3 was computed here; 0-2 came from the tier
    rest = s.build(sched_output(cached=[("t1", None, 256)], scheduled={"t1": 44}))
    assert rest.saves == []  # chunk 3 was offered already; the partial chunk never is
    fresh = request("t2", [7] * 130, None)  # a miss: each full chunk is offered once, in the step that computes it
    assert s.num_new_matched_tokens(fresh, 0) == (0, False)
    s.after_alloc(fresh, [9, 10], 0)
    fresh_keys = list(s._full_chunk_keys(fresh).keys)
    first = s.build(sched_output(new=[("t2", [9, 10], 0)], scheduled={"t2": 64})).saves
    second = s.build(sched_output(cached=[("t2", [11], 64)], scheduled={"t2": 66})).saves
    assert [(x.first_chunk, x.keys, x.block_ids) for x in first + second] == [
        (0, fresh_keys[:1], [9, 10]),
        (1, fresh_keys[:2], [9, 10, 11]),
    ]


def test_a_prefix_saved_by_one_instance_is_loaded_by_another(redis_server) -> None:  # noqa: ANN001 - fixture
    from pdkv.cache_engine import KVCacheEngine
    from pdkv.integration.vllm.metadata import LoadSpec, SaveSpec

    namespace = f"vllm-test-{time.monotonic_ns()}:"
    cfg = convert_config(
        {
            "transfer": {"chunk_size": 64},
            "tier": {"memory_bytes": 0, "redis_url": redis_server.url, "redis_namespace": namespace},
        }
    )
    cache = lambda layout: KVCacheEngine(layout, cfg.tier, 64, fingerprint=FP)  # noqa: E731 - what PdkvConnector builds
    a_cache, b_cache = vllm_cpu_cache(8, seed=5), vllm_cpu_cache(8)
    a = WorkerSide(cfg, FP, is_producer=False, is_consumer=False, agent_name="a", cache=cache)
    b = WorkerSide(cfg, FP, is_producer=False, is_consumer=False, agent_name="b", cache=cache)
    a.register(*vllm_cache_layout(a_cache, BS, CPU_BACKEND))
    b.register(*vllm_cache_layout(b_cache, BS, CPU_BACKEND))
    try:
        keys = chunk_keys(list(range(192)), FP, 64)  # 3 chunks of 64 tokens over A's blocks [6, 1, 4, 0, 7, 2]
        a.save(StepMetadata(saves=[SaveSpec("r", 0, keys[:2], [6, 1, 4, 0])]))
        a.save(StepMetadata(saves=[SaveSpec("r", 2, keys, [6, 1, 4, 0, 7, 2])]))  # the next step: chunk 2 only
        assert a.cache is not None and a.cache.flush(10)
        assert a.cache.stats()["redis"].written_bytes == 3 * (HEADER_BYTES + a.layout.chunk_bytes(64))  # type: ignore[union-attr]
        assert (
            b.cache is not None and b.cache.lookup(PromptKeys(tuple(keys), 192, 64, FP)) == 192
        )  # B sees what A wrote
        before = {n: t[5].clone() for n, t in b_cache.items()}
        b.start_loads(
            StepMetadata(loads=[LoadSpec("r", "", 192, 32, [5, 3, 2, 1, 0, 4], keys)])
        )  # B's prefix cache holds tokens < 32
        _, recving, failed = collect(b, set())
        assert recving == {"r"} and failed == set()
        a_layout, a_views = vllm_cache_layout(a_cache, BS, CPU_BACKEND)
        b_layout, b_views = vllm_cache_layout(b_cache, BS, CPU_BACKEND)
        want = gather(a_layout, a_views, [6, 1, 4, 0, 7, 2], 32, 160)
        assert torch.equal(gather(b_layout, b_views, [5, 3, 2, 1, 0, 4], 32, 160), want)
        assert all(
            torch.equal(t[5][:, :, :32], before[n][:, :, :32]) for n, t in b_cache.items()
        )  # block 5, tokens < 32: untouched
        # a chunk gone from the tier (evicted since the lookup): the load fails and vLLM recomputes
        b.start_loads(
            StepMetadata(
                loads=[
                    LoadSpec(
                        "r2", "", 256, 0, [0, 1, 2, 3, 4, 5, 6, 7], chunk_keys(list(range(192)) + [9] * 64, FP, 64)
                    )
                ]
            )
        )
        _, recving, failed = collect(b, set())
        assert failed == {"r2"} and b.counters["tier_load_failed"] == 1
    finally:
        a.close()
        b.close()


# -- pdkv launch --engine vllm ----------------------------------------------------------------------
def test_launcher_hands_the_connector_its_whole_config_but_never_the_secret_on_argv() -> None:
    from pdkv.launch.vllm import CONNECTOR_FIELDS, vllm_command

    cfg = convert_config(
        {
            "role": "decode",
            "secret": "s3cret-value",
            "num_blocks": 96,
            "control_port": 7123,
            "tier": {"redis_url": "redis://127.0.0.1:6399/0", "redis_namespace": "team-a:"},
            "transfer": {"transfer_timeout_s": 8},
            "channel": {"name": "tcp", "options": {"streams": 2}},
        }
    )
    cmd, info = vllm_command(cfg, "/models/m", ["--enforce-eager"], python="py")
    assert not any("s3cret-value" in arg for arg in cmd)  # argv is world-readable through ps
    ktc = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert ktc["kv_role"] == "kv_consumer" and ktc["kv_load_failure_policy"] == "recompute"
    seen = convert_config(ktc["kv_connector_extra_config"])  # what the connector parses
    assert all(getattr(seen, f) == getattr(cfg, f) for f in CONNECTOR_FIELDS)
    assert seen.tier.redis_url == "redis://127.0.0.1:6399/0" and seen.tier.redis_namespace == "team-a:"
    assert info["remote_port"] == 7123 and cmd[-1] == "--enforce-eager"
    with pytest.raises(ConfigError, match="--port"):
        vllm_command(cfg, "/models/m", ["--port", "9"])
