"""router.disaggregate: whether a prompt's KV moves (issue 18 part 2).

The policy is a pure function, tested on numbers; then real workers (tiny
model, tcp channel) behind real routers show that ``never`` moves no KV,
``always`` moves all of it, and ``auto`` serves each prompt one way and counts
it, the decode worker's own metrics agreeing with the router's count.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import openai
import pytest
import yaml

from pdkv.router.disaggregation import DecodeCosts, WayCost, decide
from pdkv.testing.http import get_text as get
from pdkv.testing.http import metric
from pdkv.testing.model import write_tiny_model
from pdkv.testing.procs import WorkerProcess, start_worker

# -- the policy, on numbers ---------------------------------------------------------------------


def _costs(**per_token: float) -> DecodeCosts:
    costs = DecodeCosts()
    for way, rate in per_token.items():
        costs.cost(way).observe(rate * 1000, 1000, 1.0)  # type: ignore[arg-type]
    return costs


def test_never_and_always_ignore_what_was_measured() -> None:
    costs = _costs(transfer=1.0, local=0.001)
    assert decide("never", 4000, 0, costs, False, 0).way == "local"
    assert decide("always", 4000, 0, costs, False, 0).way == "transfer"  # even when local measured faster


def test_a_short_prompt_stays_local_in_every_mode_but_never_says_never() -> None:
    for mode in ("always", "auto"):
        d = decide(mode, 10, 64, DecodeCosts(), False, 0)  # type: ignore[arg-type]
        assert (d.way, d.reason) == ("local", "short_prompt")
    assert decide("never", 10, 64, DecodeCosts(), False, 0).reason == "never"


def test_auto_measures_every_way_before_it_trusts_one() -> None:
    costs = DecodeCosts()
    seen = []
    for _ in range(3):
        d = decide("auto", 500, 0, costs, True, 0)
        assert d.reason == "unmeasured"
        seen.append(d.way)
        costs.cost(d.way).observe(1.0, 500, 0.3)
    assert seen == ["transfer", "transfer_codec", "local"]
    assert decide("auto", 500, 0, costs, True, 0).reason == "faster"


@pytest.mark.parametrize(
    ("rates", "want"),
    [
        ({"transfer": 0.002, "local": 0.010}, "transfer"),  # a fast link: moving KV beats recomputing
        ({"transfer": 0.030, "local": 0.010}, "local"),  # a slow link: recomputing wins
        (
            {"transfer": 0.030, "transfer_codec": 0.008, "local": 0.010},
            "transfer_codec",
        ),  # the codec saves the slow link
    ],
)
def test_auto_takes_the_way_with_the_lowest_cost_per_token(rates: dict[str, float], want: str) -> None:
    d = decide("auto", 2048, 0, _costs(**rates), "transfer_codec" in rates, 0)
    assert (d.way, d.reason) == (want, "faster")


def test_auto_re_measures_the_least_measured_way_every_n_requests() -> None:
    costs = _costs(transfer=0.030, local=0.010)
    costs.cost("local").observe(10.0, 1000, 0.3)  # local: 2 samples, transfer: 1
    ways = []
    for _ in range(10):
        ways.append(decide("auto", 1000, 0, costs, False, 5).way)
        costs.decided += 1
    assert ways.count("transfer") == 2 and ways[4] == ways[9] == "transfer"  # requests 5 and 10 explore
    assert {w for i, w in enumerate(ways) if i not in (4, 9)} == {"local"}


def test_a_way_cost_follows_new_samples_by_its_weight() -> None:
    cost = WayCost()
    cost.observe(2.0, 1000, 0.5)
    cost.observe(4.0, 1000, 0.5)
    assert cost.per_token == pytest.approx(0.003) and cost.samples == 2
    cost.observe(1.0, 0, 0.5)  # nothing to learn from an empty prompt
    assert cost.samples == 2


# -- real workers behind real routers -------------------------------------------------------------

PROMPT = "A key-value cache moves from the prefill worker to the decode worker, chunk by chunk. " * 2
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


@dataclass
class Cluster:
    prefill: WorkerProcess
    decode: WorkerProcess
    routers: dict[str, WorkerProcess]

    def stream(self, mode: str) -> str:
        client = openai.OpenAI(base_url=self.routers[mode].url + "/v1", api_key="unused", max_retries=0, timeout=120)
        chunks = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, stream=True)
        return "".join(c.choices[0].text for c in chunks if c.choices)

    def kv(self) -> dict[str, float]:
        text = get(self.decode.url + "/metrics")
        return {
            "transferred": metric(text, "pdkv_prompt_tokens_total", source="transferred"),
            "computed": metric(text, "pdkv_prompt_tokens_total", source="computed"),
            "fallbacks": metric(text, "pdkv_fallbacks_total"),
            "prefill_requests": metric(get(self.prefill.url + "/metrics"), "pdkv_requests_total"),
        }


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("disagg")
    model = write_tiny_model(tmp / "tiny")
    cfg = tmp / "worker.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "model": str(model),
                "channel": {"name": "tcp"},
                "num_blocks": 256,
                "transfer": {"chunk_size": 32},
                "tier": {"enabled": False},
            }
        )
    )
    with ThreadPoolExecutor(2) as pool:
        p, d = pool.map(
            lambda role: start_worker(role, "--config", str(cfg), "--port", "0", timeout=180, env=ONE_THREAD),
            ("prefill", "decode"),
        )
    routers: dict[str, WorkerProcess] = {}
    try:
        for mode in ("never", "always", "auto"):
            rcfg = tmp / f"router-{mode}.yaml"
            rcfg.write_text(yaml.safe_dump({"router": {"disaggregate": mode, "disaggregate_explore_every": 0}}))
            routers[mode] = start_worker(
                "router", "--config", str(rcfg), "--port", "0", "--prefill", p.url, "--decode", d.url, timeout=60
            )
        yield Cluster(p, d, routers)
    finally:
        for proc in (*routers.values(), p, d):
            proc.stop()


def _prompt_tokens(cluster: Cluster) -> int:
    client = openai.OpenAI(base_url=cluster.decode.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1).usage.prompt_tokens


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def _ways(router: WorkerProcess) -> dict[str, float]:
    text = get(router.url + "/metrics")
    return {
        way: metric(text, "pdkv_router_disaggregation_total", way=way)
        for way in ("transfer", "transfer_codec", "local")
    }


def test_never_moves_no_kv_and_always_moves_all_of_it(cluster: Cluster) -> None:
    n = _prompt_tokens(cluster)
    before = cluster.kv()
    local = cluster.stream("never")
    mid = cluster.kv()
    assert _delta(mid, before) == {"transferred": 0, "computed": n, "fallbacks": 0, "prefill_requests": 0}
    moved = cluster.stream("always")
    assert _delta(cluster.kv(), mid) == {"transferred": n, "computed": 0, "fallbacks": 0, "prefill_requests": 1}
    assert moved == local  # greedy: the same answer either way
    assert _ways(cluster.routers["never"])["local"] == 1 and _ways(cluster.routers["always"])["transfer"] == 1


def test_auto_serves_each_prompt_one_way_and_the_decode_worker_agrees(cluster: Cluster) -> None:
    n = _prompt_tokens(cluster)
    before = cluster.kv()
    for _ in range(6):
        cluster.stream("auto")
    ways = _ways(cluster.routers["auto"])
    assert ways["transfer"] >= 1 and ways["local"] >= 1, ways  # both measured before either is trusted
    assert ways["transfer"] + ways["local"] == 6
    d = _delta(cluster.kv(), before)
    assert d == {
        "transferred": n * ways["transfer"],
        "computed": n * ways["local"],
        "fallbacks": 0,
        "prefill_requests": ways["transfer"],
    }
