"""The KV-aware prefix policy: a router following real pdkv workers' KV events sends a prompt where its prefix is
cached.

Two prefill workers (tiny model, memory tier, KV events on) and one decode
worker behind a ``pdkv launch --role router --policy prefix`` process with
the model's tokenizer; the router finds the first prefill worker's stream in
its ``/pdkv/info`` and is told the second's in ``router.kv_events`` (as for
a vLLM server started with ``--kv-events-config``). The cost rule itself
(cached tokens against load) is unit tested at the end with a stand-in for
the event index.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from pdkv.config import KVEventSource, RouterConfig, convert_config
from pdkv.errors import ConfigError
from pdkv.router.app import Router
from pdkv.router.policy import PrefixAware, Prompt
from pdkv.router.pool import WorkerState
from pdkv.testing.http import get_text as get
from pdkv.testing.http import metric, post_json
from pdkv.testing.model import write_tiny_model
from pdkv.testing.procs import WorkerProcess, start_worker

from tests.conftest import wait_until

ONE_THREAD = {"OMP_NUM_THREADS": "1"}
CHUNK = 32
SYSTEM = "The quick brown fox jumps over the lazy dog. Paris is the capital of France, Berlin of Germany. " * 3
OTHER = "A key-value cache moves from the prefill worker to the decode worker, chunk by chunk, over a channel. " * 3


@dataclass
class Cluster:
    router: WorkerProcess
    prefill: list[WorkerProcess]
    decode: WorkerProcess


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("router-kv")
    model = write_tiny_model(tmp / "tiny")
    worker_cfg = tmp / "worker.yaml"
    worker_cfg.write_text(
        yaml.safe_dump(
            {
                "model": str(model),
                "num_blocks": 512,
                "transfer": {"chunk_size": CHUNK},
                "kv_events": {"enable_kv_cache_events": True, "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"},
            }
        )
    )
    with ThreadPoolExecutor(3) as pool:
        futures = [
            pool.submit(start_worker, role, "--config", str(worker_cfg), "--port", "0", timeout=180, env=ONE_THREAD)
            for role in ("prefill", "prefill", "decode")
        ]
        procs = [f.result() for f in futures]
    p1, p2, d = procs
    # p1's stream is found in its /pdkv/info; p2's is named in the config, as for a vLLM started by hand
    p2_events = json.loads(get(p2.url + "/pdkv/info"))["kv_events"]
    named = [{"worker": p2.url, "endpoint": p2_events["endpoint"], "replay_endpoint": p2_events["replay_endpoint"]}]
    router_cfg = tmp / "router.yaml"
    router_cfg.write_text(
        yaml.safe_dump(
            {
                "router": {
                    "policy": "prefix",
                    "tokenizer": str(model),
                    "prefix_chunk_tokens": CHUNK,
                    "kv_events_check_s": 0.5,
                    "kv_events": named,
                }
            }
        )
    )
    router = start_worker(
        "router",
        "--config",
        str(router_cfg),
        "--port",
        "0",
        "--prefill",
        p1.url,
        "--prefill",
        p2.url,
        "--decode",
        d.url,
        timeout=120,
    )
    try:
        yield Cluster(router, [p1, p2], d)
    finally:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(WorkerProcess.stop, (router, *procs)))


def cached(c: Cluster, prompt: str) -> dict[str, int]:
    return post_json(c.router.url + "/pdkv/kv-index", {"prompt": prompt})["cached_tokens"]


def complete(url: str, prompt: str) -> dict[str, Any]:
    return post_json(url + "/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True})


def picks(c: Cluster) -> dict[str, float]:
    text = get(c.router.url + "/metrics")
    return {p.url: metric(text, "pdkv_router_picks_total", role="prefill", worker=p.url) for p in c.prefill}


def test_the_router_sends_a_prompt_to_the_worker_whose_events_say_it_caches_the_prefix(cluster: Cluster) -> None:
    c = cluster
    wait_until(
        lambda: set(json.loads(get(c.router.url + "/pdkv/kv-index"))["workers"]) == {p.url for p in c.prefill},
        30,
        "the router to follow both prefill streams",
    )
    streams = {
        url: w["stream"]["endpoint"] for url, w in json.loads(get(c.router.url + "/pdkv/kv-index"))["workers"].items()
    }
    assert streams == {p.url: json.loads(get(p.url + "/pdkv/info"))["kv_events"]["endpoint"] for p in c.prefill}
    transferred = metric(get(c.decode.url + "/metrics"), "pdkv_prompt_tokens_total", source="transferred")
    prompt_tokens = 0
    # OTHER is computed on the second worker directly, behind the router's back: only its events can tell the router
    complete(c.prefill[1].url, OTHER)
    wait_until(
        lambda: cached(c, OTHER)[c.prefill[1].url] >= 3 * CHUNK, 30, "OTHER's chunks in the second worker's events"
    )
    before = picks(c)
    for i in range(3):
        prompt_tokens += complete(c.router.url, f"{OTHER}Question {i}: what moves?")["usage"]["prompt_tokens"]
    after = picks(c)
    assert (
        after[c.prefill[1].url] - before[c.prefill[1].url] == 3 and after[c.prefill[0].url] == before[c.prefill[0].url]
    )
    # a new prefix goes to the first worker (equal cost, rotation), then follows it there
    first = complete(c.router.url, SYSTEM + "Question: where is Paris?")
    prompt_tokens += first["usage"]["prompt_tokens"]
    holder = max(c.prefill, key=lambda p: picks(c)[p.url] - after[p.url])
    wait_until(lambda: cached(c, SYSTEM)[holder.url] >= 3 * CHUNK, 30, "SYSTEM's chunks in the holder's events")
    tier_before = metric(get(holder.url + "/metrics"), "pdkv_prompt_tokens_total", source="tier")
    before = picks(c)
    for i in range(3):
        prompt_tokens += complete(c.router.url, f"{SYSTEM}Question {i}: where is Berlin?")["usage"]["prompt_tokens"]
    assert picks(c)[holder.url] - before[holder.url] == 3
    assert (
        metric(get(holder.url + "/metrics"), "pdkv_prompt_tokens_total", source="tier") - tier_before >= 3 * 3 * CHUNK
    )
    text = get(c.router.url + "/metrics")
    assert metric(text, "pdkv_router_decisions_total", policy="prefix", role="prefill", reason="kv_hit") >= 6
    assert metric(text, "pdkv_router_kv_stream_events_total", worker=holder.url, event="lost") == 0
    d_metrics = get(c.decode.url + "/metrics")  # every prompt's KV came over the channel
    assert metric(d_metrics, "pdkv_prompt_tokens_total", source="transferred") - transferred == prompt_tokens
    assert metric(d_metrics, "pdkv_fallbacks_total") == 0


def test_kv_index_endpoint_refuses_bad_bodies(cluster: Cluster) -> None:
    req = urllib.request.Request(
        cluster.router.url + "/pdkv/kv-index", b"[1, 2]", {"Content-Type": "application/json"}, method="POST"
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 400 and "prompt" in json.loads(err.value.read())["error"]["message"]


class _Index:
    """Stands in for the event index: what each worker caches of any prompt."""

    def __init__(self, cached: dict[str, int]) -> None:
        self.cached = cached

    def cached_tokens(self, tokens: np.ndarray, candidates: list[WorkerState], salt: str = "") -> dict[str, int]:
        return {w.url: self.cached[w.url] for w in candidates if w.url in self.cached}


def test_prefill_cost_is_uncached_tokens_plus_weighted_load() -> None:
    a, b, c = (WorkerState("prefill", u, healthy=True) for u in ("a", "b", "c"))
    prompt = Prompt(np.arange(1000), 1000, 256, "ids")
    config = RouterConfig()
    policy = PrefixAware(
        config.prefix_cache_entries, config.prefix_max_imbalance, _Index({"a": 768, "b": 256}), load_weight=1.0
    )  # type: ignore[arg-type]
    assert policy.choose("prefill", [a, b, c], prompt) == (a, "kv_hit")
    a.inflight_tokens = 600  # 232 + 600 > 744 + 0: b is cheaper
    assert policy.choose("prefill", [a, b, c], prompt) == (b, "kv_load_balanced")
    policy.load_weight = 0.1  # load matters less: back to the longest prefix
    assert policy.choose("prefill", [a, b, c], prompt) == (a, "kv_hit")
    # a worker without a stream is costed by where the router itself last sent the prompt's prefix
    policy.kv = _Index({"a": 0, "b": 0})  # type: ignore[assignment]
    policy.served(c, prompt)
    assert policy.choose("prefill", [a, b, c], prompt) == (c, "kv_hit")
    # no candidate with a stream, or a prompt that is text: the router's own guess decides, as before
    policy.kv = _Index({})  # type: ignore[assignment]
    assert policy.choose("prefill", [a, b, c], prompt) == (c, "prefix_hit")


def test_kv_routing_config_errors_fail_at_start(tmp_path: Path) -> None:
    streams = [KVEventSource(worker="http://10.0.0.1:8000", endpoint="tcp://10.0.0.1:5557")]
    with pytest.raises(ConfigError, match="router.tokenizer is not set"):
        asyncio.run(Router.start(RouterConfig(policy="prefix", kv_events=streams)))
    with pytest.raises(ConfigError, match="router.tokenizer .* tokenizer.json"):
        asyncio.run(Router.start(RouterConfig(policy="prefix", tokenizer=str(tmp_path))))
    with pytest.raises(ConfigError, match="router.kv_events\\[0\\].endpoint"):
        convert_config({"router": {"kv_events": [{"worker": "http://10.0.0.1:8000", "endpoint": "10.0.0.1:5557"}]}})
