"""Prefill on one host, decode on another, a real link between them (pdkv.bench.netrig).

Hosts are network namespaces joined by veth pairs: ``a`` (the hub: the
prefill worker and the router) and ``b`` (decode), plus ``c``, a decode
host that disappears. Every role is a ``pdkv launch`` process started on its
host with nothing but ``--host`` (and the shared secret a worker bound beyond
loopback needs): the channel must follow, tcp, nixl (UCX's tcp transport) and
ucx alike. The test itself talks from host ``a``. The oracle is the reference
engine generating the whole request in this process.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from pdkv.bench.netrig import UCX_ENV, Host, Link, NetRig
from pdkv.channels.tcp import TcpChannel
from pdkv.config import TransferConfig, convert_config
from pdkv.engine.reference import ReferenceEngine
from pdkv.engine.sampling import SamplingParams
from pdkv.errors import ChannelError, ConfigError, PeerUnreachableError
from pdkv.memory import EMULATE_ENV
from pdkv.netaddr import free_port
from pdkv.testing.http import get_text, metric
from pdkv.testing.model import single_thread, write_tiny_model
from pdkv.testing.procs import WorkerProcess
from pdkv.transfer.params import sign_push
from pdkv.worker.prefill import NOT_OPENED
from pdkv.worker.server import warn_if_data_plane_local

from tests.conftest import wait_until

SECRET = "two-hosts-test-secret"
ENV = {"OMP_NUM_THREADS": "1"}  # tiny models gain nothing from threads; every role shares two cores
MAX_TOKENS = 12
NUM_BLOCKS = 512
VOCAB = 320  # the tiny model's
SHORT = [(7 * i + 3) % VOCAB for i in range(150)]
LONG = [(13 * i + 5) % VOCAB for i in range(2100)]
SLOW_RATE = "5mbit"  # a long prompt's KV (about 1 MB) takes about two seconds here: a fault can land mid-transfer
# Short timeouts, so the faults end in seconds; every one is still a timeout the worker obeys.
TRANSFER = {
    "transfer_timeout_s": 6,
    "chunk_timeout_s": 6,
    "lease_s": 3,
    "heartbeat_s": 0.5,
    "drain_timeout_s": 2,
    "handshake_timeout_s": 5,
    "reserve_timeout_s": 5,
}
TCP_OPTIONS = {"io_timeout": 2.0, "connect_timeout": 2.0}
ROUTER = {
    "connect_timeout_s": 3,
    "prefill_timeout_s": 20,
    "decode_timeout_s": 15,
    "read_timeout_s": 15,
    "max_retries": 1,
    "health_interval_s": 600,
}


def post(url: str, body: dict[str, Any], timeout: float = 60.0) -> tuple[int, dict[str, Any]]:
    """POST JSON from the calling thread's host; (status, JSON body) for errors too."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def metrics(worker: WorkerProcess) -> str:
    return get_text(worker.url + "/metrics", timeout=30)


def greedy(prompt: list[int], **extra: Any) -> dict[str, Any]:
    return {
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }


@dataclass
class Deployment:
    """A prefill worker on the hub, a decode worker on another host, a router on the hub."""

    prefill: WorkerProcess
    decode: WorkerProcess
    router: WorkerProcess
    link: Link
    kv_memory: str = "host"  # emulated: both workers run with PDKV_EMULATE_DEVICE=1

    def complete(self, prompt: list[int], timeout: float = 60.0) -> tuple[int, dict[str, Any]]:
        return post(self.router.url + "/v1/completions", greedy(prompt), timeout)


def write_config(
    path: Path, model: Path, channel: str = "tcp", options: dict[str, Any] | None = None, **extra: Any
) -> Path:
    options = {**(TCP_OPTIONS if channel == "tcp" else {}), **(options or {})}
    cfg = {
        "model": str(model),
        "secret": SECRET,
        "num_blocks": NUM_BLOCKS,
        "tier": {"enabled": False},
        "transfer": TRANSFER,
        "channel": {"name": channel, "options": options},
        "router": ROUTER,
        **extra,
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def deploy(hub: Host, link: Link, config: Path, env: dict[str, str] | None = None) -> Deployment:
    """P on the hub and D on ``link``'s host, each given only its own address as ``--host``; then the router on the
    hub."""
    env = {**ENV, **(env or {})}
    with ThreadPoolExecutor(2) as pool:
        d = pool.submit(
            link.host.start_worker,
            "decode",
            "--config",
            str(config),
            "--host",
            link.addr,
            "--port",
            "0",
            timeout=240,
            env=env,
        )
        p = pool.submit(
            hub.start_worker,
            "prefill",
            "--config",
            str(config),
            "--host",
            link.hub_addr,
            "--port",
            "0",
            timeout=240,
            env=env,
        )
        decode, prefill = d.result(), p.result()
    router = hub.start_worker(
        "router",
        "--config",
        str(config),
        "--host",
        link.hub_addr,
        "--port",
        "0",
        "--prefill",
        prefill.url,
        "--decode",
        decode.url,
        timeout=60,
    )
    return Deployment(prefill, decode, router, link)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("two-hosts") / "tiny", max_position_embeddings=4096)


@pytest.fixture(scope="module")
def expected(model: Path) -> dict[int, list[int]]:
    """Greedy tokens of each prompt generated whole in this process: what every deployment must answer."""
    engine = ReferenceEngine.load(str(model), progress=False, max_kv_tokens=4096)
    with single_thread():
        return {
            len(p): engine.generate(
                p, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
            ).output_token_ids
            for p in (SHORT, LONG)
        }


@pytest.fixture(scope="module")
def hub(netrig: NetRig) -> Iterator[Host]:
    """The hub host, entered by the test's thread for the module: HTTP from the test goes out from host ``a``."""
    with netrig.hub.entered():
        yield netrig.hub


@pytest.fixture(scope="module")
def link_b(netrig: NetRig) -> Link:
    return netrig.add_host("b")


@pytest.fixture(scope="module")
def tcp_pd(hub: Host, link_b: Link, model: Path, tmp_path_factory: pytest.TempPathFactory) -> Deployment:
    return deploy(hub, link_b, write_config(tmp_path_factory.mktemp("tcp") / "worker.yaml", model))


@pytest.fixture(scope="module")
def nixl_pd(hub: Host, link_b: Link, model: Path, tmp_path_factory: pytest.TempPathFactory) -> Deployment:
    """nixl over UCX's tcp transport; UCX_NET_DEVICES is left to follow each worker's --host."""
    return deploy(
        hub, link_b, write_config(tmp_path_factory.mktemp("nixl") / "worker.yaml", model, channel="nixl"), env=UCX_ENV
    )


@pytest.fixture(scope="module")
def ucx_pd(hub: Host, link_b: Link, model: Path, tmp_path_factory: pytest.TempPathFactory) -> Deployment:
    return deploy(
        hub, link_b, write_config(tmp_path_factory.mktemp("ucx") / "worker.yaml", model, channel="ucx"), env=UCX_ENV
    )


@pytest.fixture(scope="module")
def emulated_pd(hub: Host, link_b: Link, model: Path, tmp_path_factory: pytest.TempPathFactory) -> Deployment:
    """tcp with both workers' KV in emulated device memory (PDKV_EMULATE_DEVICE): every chunk through pinned staging."""
    deployment = deploy(
        hub, link_b, write_config(tmp_path_factory.mktemp("emulated") / "worker.yaml", model), env={EMULATE_ENV: "1"}
    )
    return dataclasses.replace(deployment, kv_memory="emulated")


@pytest.fixture(params=["tcp", "nixl", "ucx", "emulated"])
def pd(request: pytest.FixtureRequest) -> Deployment:
    deployment: Deployment = request.getfixturevalue(f"{request.param}_pd")
    return deployment


def assert_transferred(d: Deployment, before_d: str, prompt_tokens: int) -> None:
    """The decode worker got the whole prompt's KV over the link: no fallback, every prompt token transferred."""
    after = metrics(d.decode)
    assert metric(after, "pdkv_fallbacks_total") == metric(before_d, "pdkv_fallbacks_total"), (
        "the decode worker recomputed"
    )
    moved = metric(after, "pdkv_prompt_tokens_total", source="transferred") - metric(
        before_d, "pdkv_prompt_tokens_total", source="transferred"
    )
    assert moved == prompt_tokens


def assert_nothing_held(*workers: WorkerProcess, timeout: float = 20.0) -> None:
    """Every worker's gauges back to idle: no reservation, no reserved or lost block, nothing in flight, nothing
    running."""

    def idle(worker: WorkerProcess) -> bool:
        text = metrics(worker)
        return (
            metric(text, "pdkv_reservations") == 0
            and metric(text, "pdkv_reserved_blocks") == 0
            and metric(text, "pdkv_open_transfers") == 0
            and metric(text, "pdkv_inflight_bytes") == 0
            and metric(text, "pdkv_running_requests") == 0
            and metric(text, "pdkv_free_blocks") + metric(text, "pdkv_pooled_blocks") == NUM_BLOCKS  # pools: not leaked
        )

    for worker in workers:
        wait_until(lambda w=worker: idle(w), timeout, f"{worker.role} worker at {worker.url} to hold nothing")


# -- it works: every plane follows --host --------------------------------------------------------------


def test_host_alone_puts_every_plane_on_the_link(tcp_pd: Deployment) -> None:
    info = json.loads(get_text(tcp_pd.decode.url + "/pdkv/info"))
    assert info["remote_host"] == tcp_pd.link.addr  # the receiver the router hands to P is on host b, not 127.0.0.1
    assert tcp_pd.decode.info["receiver"].startswith(f"tcp://{tcp_pd.link.addr}:")


@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["150-tokens", "2100-tokens"])
def test_router_across_the_link_is_token_identical_and_moves_all_kv(
    pd: Deployment, expected: dict[int, list[int]], prompt: list[int]
) -> None:
    before_d, before_p = metrics(pd.decode), metrics(pd.prefill)
    status, body = pd.complete(prompt)
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == expected[len(prompt)]
    assert_transferred(pd, before_d, len(prompt))
    if pd.kv_memory == "emulated":  # the KV went through host slots on both sides, as tcp with KV in VRAM does
        for worker, event in ((pd.decode, "chunks_staged_to_device"), (pd.prefill, "chunks_staged_to_host")):
            moved = metric(metrics(worker), "pdkv_transfer_events_total", event=event) - metric(
                before_d if worker is pd.decode else before_p, "pdkv_transfer_events_total", event=event
            )
            assert moved == -(-len(prompt) // TransferConfig(**TRANSFER).chunk_size), (worker.role, event, moved)
    ok = (
        metric(before_p, "pdkv_transfers_total", outcome="ok") + 1
    )  # P records it once its writes settle: maybe after D answered
    wait_until(
        lambda: metric(metrics(pd.prefill), "pdkv_transfers_total", outcome="ok") == ok,
        10,
        "the prefill side to record the transfer",
    )


def test_kv_digests_equal_across_the_link(pd: Deployment) -> None:
    """The router's two hops by hand, asking both sides for per-layer digests of the prompt's KV."""
    info = json.loads(get_text(pd.decode.url + "/pdkv/info"))
    kv = sign_push(
        {
            "do_remote_decode": True,
            "remote_host": info["remote_host"],
            "remote_port": info["remote_port"],
            "transfer_id": "digest-1",
            "return_kv_digest": True,
        },
        SECRET,
    )
    status, p = post(pd.prefill.url + "/v1/completions", greedy(LONG, max_tokens=1, kv_transfer_params=kv))
    assert status == 200 and p["kv_transfer_params"]["transfer_started"], p
    status, d = post(
        pd.decode.url + "/v1/completions",
        greedy(LONG, kv_transfer_params={**p["kv_transfer_params"], "return_kv_digest": True}),
    )
    assert status == 200, d
    assert d["kv_transfer_params"]["kv_digest"] == p["kv_transfer_params"]["kv_digest"]
    assert len(p["kv_transfer_params"]["kv_digest"]) == 2  # one per layer, bit-identical
    assert_nothing_held(pd.prefill, pd.decode)


def test_the_default_model_across_the_link(hub: Host, link_b: Link, tmp_path: Path) -> None:
    """SmolLM2-135M, P on host a and D on host b: a chat answer through the router equals P's own, all KV moved."""
    cfg = tmp_path / "default.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {"model": "default", "secret": SECRET, "num_blocks": 256, "tier": {"enabled": False}, "router": ROUTER}
        )
    )
    d = deploy(hub, link_b, cfg)
    try:
        chat = {
            "messages": [{"role": "user", "content": "Name three colours of the rainbow."}],
            "max_tokens": 12,
            "temperature": 0,
            "return_token_ids": True,
        }
        status, alone = post(d.prefill.url + "/v1/chat/completions", chat, timeout=120)
        assert status == 200, alone
        before_d = metrics(d.decode)
        status, body = post(d.router.url + "/v1/chat/completions", chat, timeout=120)
        assert status == 200, body
        assert body["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]
        assert body["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
        assert_transferred(d, before_d, body["usage"]["prompt_tokens"])
    finally:
        for worker in (d.router, d.prefill, d.decode):
            worker.stop()


# -- faults only a network shows -------------------------------------------------------------------------


class Background:
    """One request in flight on a thread of the hub (threads start in their creator's namespace)."""

    def __init__(self, url: str, prompt: list[int], timeout: float = 60.0) -> None:
        self.result: tuple[int, dict[str, Any]] | BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(url, prompt, timeout), daemon=True)
        self._thread.start()

    def _run(self, url: str, prompt: list[int], timeout: float) -> None:
        try:
            self.result = post(url + "/v1/completions", greedy(prompt), timeout)
        except BaseException as exc:  # noqa: BLE001 - reported by ``ended``
            self.result = exc

    def ended(self, timeout: float) -> tuple[int, dict[str, Any]]:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"the request did not end within {timeout}s"
        assert not isinstance(self.result, BaseException), f"the request failed without an answer: {self.result!r}"
        assert self.result is not None
        return self.result


def landed(prefill: WorkerProcess) -> float:
    return metric(metrics(prefill), "pdkv_transfer_events_total", event="chunks_landed")


def wait_mid_transfer(prefill: WorkerProcess, landed_before: float) -> None:
    """Until the first chunk of the new transfer has landed (P counts D's acknowledgements; P is on the hub)."""
    wait_until(lambda: landed(prefill) > landed_before, 30, "the first chunk to land")


def assert_still_open(prefill: WorkerProcess) -> None:
    """The fault hit while the transfer was open (else this test proves nothing)."""
    assert metric(metrics(prefill), "pdkv_open_transfers") == 1, (
        "the transfer finished before the fault: nothing was tested"
    )


def assert_answered_or_failed_clearly(status: int, body: dict[str, Any], want: list[int]) -> None:
    """A request under a fault ends right (recomputed or transferred) or with an error a client can read."""
    if status == 200:
        assert body["choices"][0]["token_ids"] == want
    else:
        assert status >= 500 and body["error"]["message"], body


def test_rate_dropping_to_1mbit_mid_transfer_ends_within_the_timeouts(
    tcp_pd: Deployment, expected: dict[int, list[int]]
) -> None:
    """At 1 Mbit the rest of the KV needs longer than transfer_timeout_s: D gives up and recomputes, right."""
    link = tcp_pd.link
    link.shape(SLOW_RATE)
    try:
        before_d = metrics(tcp_pd.decode)
        request = Background(tcp_pd.router.url, LONG)
        wait_mid_transfer(tcp_pd.prefill, landed(tcp_pd.prefill))
        link.shape("1mbit")
        assert_still_open(tcp_pd.prefill)
        status, body = request.ended(TRANSFER["transfer_timeout_s"] + 30)
        assert status == 200 and body["choices"][0]["token_ids"] == expected[len(LONG)], body
    finally:
        link.shape("unshaped")
    after_d = metrics(tcp_pd.decode)
    fell_back = metric(after_d, "pdkv_fallbacks_total") - metric(before_d, "pdkv_fallbacks_total")
    moved = metric(after_d, "pdkv_prompt_tokens_total", source="transferred") - metric(
        before_d, "pdkv_prompt_tokens_total", source="transferred"
    )
    assert (fell_back, moved) == (1, 0)  # timed out, recomputed: never half of each
    assert_nothing_held(tcp_pd.prefill, tcp_pd.decode)


def test_link_down_mid_transfer_ends_every_request_and_leaks_nothing(
    tcp_pd: Deployment, expected: dict[int, list[int]]
) -> None:
    """A pulled cable for longer than io_timeout and lease_s: both sides give the transfer up on their own timeouts."""
    link = tcp_pd.link
    before_p = metrics(tcp_pd.prefill)
    link.shape(SLOW_RATE)
    try:
        request = Background(tcp_pd.router.url, LONG)
        wait_mid_transfer(tcp_pd.prefill, landed(tcp_pd.prefill))
        link.down()
        assert_still_open(tcp_pd.prefill)
        time.sleep(TRANSFER["lease_s"] + 1)  # the cable stays out past every data-path timeout
        link.up()
        status, body = request.ended(60)
        assert_answered_or_failed_clearly(status, body, expected[len(LONG)])
    finally:
        link.up()
        link.shape("unshaped")
    failed_before = metric(before_p, "pdkv_transfers_total", outcome="failed")
    # the router may answer (routing around the dead worker) before P's link times out: wait for P to settle it
    wait_until(
        lambda: metric(metrics(tcp_pd.prefill), "pdkv_transfers_total", outcome="failed") == failed_before + 1,
        30,
        "P to count the transfer failed",
    )
    assert_nothing_held(tcp_pd.prefill, tcp_pd.decode)
    status, body = tcp_pd.complete(SHORT)  # and the pair works again
    assert status == 200 and body["choices"][0]["token_ids"] == expected[len(SHORT)]


def test_decode_host_disappearing_mid_transfer_ends_the_request_and_frees_the_prefill_side(
    netrig: NetRig, hub: Host, tcp_pd: Deployment, model: Path, expected: dict[int, list[int]], tmp_path: Path
) -> None:
    """Host c loses power mid-transfer (cable first, then its processes, then its namespace): P frees everything."""
    link = netrig.add_host("c", SLOW_RATE)
    cfg = write_config(
        tmp_path / "c.yaml",
        model,
        router={**ROUTER, "decode_timeout_s": 4, "read_timeout_s": 4, "connect_timeout_s": 2},
    )
    decode = link.host.start_worker(
        "decode", "--config", str(cfg), "--host", link.addr, "--port", "0", timeout=240, env=ENV
    )
    # on the hub's address towards b, where P is too: the hub's end towards c goes with c
    router = hub.start_worker(
        "router",
        "--config",
        str(cfg),
        "--host",
        tcp_pd.link.hub_addr,
        "--port",
        "0",
        "--prefill",
        tcp_pd.prefill.url,
        "--decode",
        decode.url,
        timeout=60,
    )
    before_p = metrics(tcp_pd.prefill)
    request = Background(router.url, LONG)
    wait_mid_transfer(tcp_pd.prefill, landed(tcp_pd.prefill))
    netrig.remove_host("c")
    assert_still_open(tcp_pd.prefill)
    status, body = request.ended(60)
    assert_answered_or_failed_clearly(status, body, expected[len(LONG)])
    failed_before = metric(before_p, "pdkv_transfers_total", outcome="failed")
    # the router may answer (routing around the dead worker) before P's link times out: wait for P to settle it
    wait_until(
        lambda: metric(metrics(tcp_pd.prefill), "pdkv_transfers_total", outcome="failed") == failed_before + 1,
        30,
        "P to count the transfer failed",
    )
    assert_nothing_held(tcp_pd.prefill)


def metrics_on(host: Host, worker: WorkerProcess) -> str:
    """A worker's metrics scraped from its own host: the test's host ``a`` cannot reach it across a cut link."""
    script = (
        "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())"
    )
    return host.run(sys.executable, "-c", script, worker.url + "/metrics").stdout


@pytest.mark.parametrize("cut", ["decode-to-prefill", "prefill-to-decode"])
def test_a_one_way_partition_is_seen_on_both_sides_within_the_lease(
    tcp_pd: Deployment, expected: dict[int, list[int]], cut: str
) -> None:
    """Issue 38: one direction of the link cut, the other open. P holds a pool at D (pools are on by default), so
    it heartbeats D; D's answers (or P's beats) are lost. P gives D up within lease_s of the cut (it renews only on
    D's answers), D takes the pool back within lease_s too, and the pair works again once the link is whole."""
    status, body = tcp_pd.complete(SHORT)  # handshaken, a pool held
    assert status == 200 and body["choices"][0]["token_ids"] == expected[len(SHORT)]
    link, lease = tcp_pd.link, TRANSFER["lease_s"]
    d_host = link.host
    wait_until(lambda: metric(metrics_on(d_host, tcp_pd.decode), "pdkv_pooled_blocks") > 0, 10, "D to grant a pool")
    deaf_before = metric(metrics(tcp_pd.prefill), "pdkv_transfer_events_total", event="peers_deaf")
    lapsed_before = metric(metrics_on(d_host, tcp_pd.decode), "pdkv_transfer_events_total", event="pools_lapsed")
    end = d_host if cut == "decode-to-prefill" else link.hub
    link.unroute(end)
    cut_at = time.monotonic()
    try:
        wait_until(
            lambda: metric(metrics(tcp_pd.prefill), "pdkv_transfer_events_total", event="peers_deaf") > deaf_before,
            lease + 10,
            "P to give D up",
        )
        p_saw = time.monotonic() - cut_at
        wait_until(  # its blocks then wait out the late-write hold before they are free
            lambda: (
                metric(metrics_on(d_host, tcp_pd.decode), "pdkv_transfer_events_total", event="pools_lapsed")
                > lapsed_before
            ),
            lease + 10,
            "D to take P's pool back",
        )
        d_saw = time.monotonic() - cut_at
    finally:
        link.reroute(end)
    # within the lease, give or take a heartbeat and a scrape (a metrics poll is a process started on the host)
    assert p_saw <= lease + 1.0, f"P saw the partition after {p_saw:.2f}s (lease_s={lease})"
    assert d_saw <= lease + 1.5, f"D saw the partition after {d_saw:.2f}s (lease_s={lease})"
    wait_until(lambda: metric(metrics_on(d_host, tcp_pd.decode), "pdkv_pooled_blocks") == 0, 10, "the pool's blocks")
    before_d = metrics(tcp_pd.decode)
    status, body = tcp_pd.complete(SHORT)  # P handshakes again: the pair works, the KV over the link
    assert status == 200 and body["choices"][0]["token_ids"] == expected[len(SHORT)], body
    assert_transferred(tcp_pd, before_d, len(SHORT))
    assert_nothing_held(tcp_pd.prefill, tcp_pd.decode)


# -- a data plane that cannot work is reported at the handshake ----------------------------------------


def test_an_unreachable_data_plane_is_reported_at_handshake_not_hidden(
    tcp_pd: Deployment, model: Path, expected: dict[int, list[int]], tmp_path: Path
) -> None:
    """The failure of the issue: D's channel explicitly left on 127.0.0.1 while it serves host b.

    P's handshake opens the data path, finds it unreachable, warns (naming the
    address in its log) and counts it once, and every request fails its
    transfer at once (the second without trying again: no second probe), the
    caller told only that it could not be opened, and is recomputed, right.
    """
    cfg = write_config(tmp_path / "d.yaml", model, options={"host": "127.0.0.1"})
    link = tcp_pd.link
    decode = link.host.start_worker(
        "decode", "--config", str(cfg), "--host", link.addr, "--port", "0", timeout=240, env=ENV
    )
    try:
        info = json.loads(get_text(decode.url + "/pdkv/info"))
        kv = {"do_remote_decode": True, "remote_host": info["remote_host"], "remote_port": info["remote_port"]}
        before = metrics(tcp_pd.prefill)
        for i in range(2):
            status, p = post(
                tcp_pd.prefill.url + "/v1/completions",
                greedy(
                    SHORT, max_tokens=1, kv_transfer_params=sign_push({**kv, "transfer_id": f"unreachable-{i}"}, SECRET)
                ),
            )
            assert status == 200 and p["kv_transfer_params"]["transfer_started"] is False, p
            assert p["kv_transfer_params"]["transfer_error"] == NOT_OPENED  # what listens where: only in P's log
            status, d = post(decode.url + "/v1/completions", greedy(SHORT, kv_transfer_params=p["kv_transfer_params"]))
            assert status == 200 and d["choices"][0]["token_ids"] == expected[len(SHORT)]
        after = metrics(tcp_pd.prefill)
        # one probe found it, the second request failed on that verdict without waiting on a connect again
        assert (
            metric(after, "pdkv_transfer_events_total", event="peer_unreachable")
            - metric(before, "pdkv_transfer_events_total", event="peer_unreachable")
            == 1
        )
        assert (
            metric(after, "pdkv_transfers_total", outcome="unreachable")
            - metric(before, "pdkv_transfers_total", outcome="unreachable")
            == 2
        )
        assert metric(metrics(decode), "pdkv_fallbacks_total", reason="not_started") == 2
    finally:
        decode.stop()


def test_a_worker_whose_channel_stays_on_loopback_says_so_at_start(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="pdkv.worker.server"):
        warn_if_data_plane_local("127.0.0.1", "127.0.0.1")
        warn_if_data_plane_local("10.1.2.3", "10.1.2.3")
        assert not caplog.records
        warn_if_data_plane_local("10.1.2.3", "127.0.0.1")
    assert "peers on other hosts cannot reach" in caplog.records[0].getMessage()


def test_host_is_where_the_channel_listens_unless_the_channel_says_otherwise() -> None:
    config = convert_config({"role": "decode", "host": "10.1.2.3"})
    assert config.channel_options()["host"] == "10.1.2.3" and config.advertised_host() == "10.1.2.3"
    config = convert_config(
        {"role": "decode", "host": "10.1.2.3", "channel": {"name": "tcp", "options": {"host": "10.9.9.9"}}}
    )
    assert config.channel_options()["host"] == "10.9.9.9"
    config = convert_config({"role": "decode", "host": "0.0.0.0", "advertise_host": "192.0.2.7"})
    assert config.channel_options()["advertise_host"] == "192.0.2.7" and config.advertised_host() == "192.0.2.7"
    with pytest.raises(ConfigError, match="'host' = '0.0.0.0' listens on every address"):
        convert_config({"role": "decode", "host": "0.0.0.0"}).advertised_host()
    with pytest.raises(ConfigError, match="advertise_host"):
        TcpChannel("wild", TcpChannel.parse_options({"host": "0.0.0.0"}))
    with (
        TcpChannel("t", TcpChannel.parse_options({})) as channel,
        pytest.raises(ChannelError, match="no address to dial"),
    ):
        channel.add_peer(
            msgspec.msgpack.encode({**msgspec.msgpack.decode(channel.metadata()), "name": "p", "host": "0.0.0.0"})
        )


def test_connect_fails_loudly_then_fast_and_tries_a_new_address_at_once(caplog: pytest.LogCaptureFixture) -> None:
    """The channel's eager probe, on loopback: a refused address is one warning, one count, then an instant refusal."""
    with TcpChannel("a", TcpChannel.parse_options({})) as a, TcpChannel("b", TcpChannel.parse_options({})) as b:
        a.register(bytearray(64))
        b.register(bytearray(64))
        real = msgspec.msgpack.decode(b.metadata())
        peer = a.add_peer(msgspec.msgpack.encode({**real, "port": free_port()}))
        with caplog.at_level(logging.WARNING, logger="pdkv.channels.base"):
            for _ in range(2):
                with pytest.raises(PeerUnreachableError, match="refused"):
                    a.connect(peer, 5.0)
        assert a.stats()["peer_unreachable"] == 1 and len(caplog.records) == 1
        assert peer == a.add_peer(b.metadata())  # the right address: tried at once, not after unreachable_retry_s
        a.connect(peer, 5.0)
        assert a.stats()["peer_unreachable"] == 1
