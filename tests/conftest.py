"""Shared fixtures for the CPU test suite."""

from __future__ import annotations

import importlib.util
import itertools
import os
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from pdkv.bench.netrig import NetRig, unavailable
from pdkv.blocks import BlockAllocator
from pdkv.channels import Channel, create_channel
from pdkv.channels.tcp.frames import FRAMES_ENV_VAR
from pdkv.config import TransferConfig
from pdkv.layout import KVLayout
from pdkv.memory import emulate_device, in_reach
from pdkv.testing.model import single_thread, write_tiny_model
from pdkv.testing.redis import INSTALL_HINT, LocalRedis, local_redis, server_binary
from pdkv.transfer.receiver import KVReceiver
from pdkv.transfer.sender import KVSender

import leakcheck

if TYPE_CHECKING:
    from aiohttp import web

    from pdkv.worker.server import Worker

_names = itertools.count()

# -- in CI, a skip is a failure unless the test needs a GPU -----------------------------------
GPU_SKIPS = ("no GPU", "no CUDA")  # the only skip reasons CI accepts: how a GPU-only test must word its reason
_ci_skips: list[str] = []


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _disallowed_skip(report: pytest.TestReport | pytest.CollectReport) -> str | None:
    """The reason of a skip CI must not accept, or None."""
    if not (_in_ci() and report.skipped) or hasattr(report, "wasxfail"):
        return None
    longrepr = report.longrepr
    reason = str(longrepr[2] if isinstance(longrepr, tuple) else longrepr).removeprefix("Skipped: ")
    return None if reason.startswith(GPU_SKIPS) else reason


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, None, None]:
    """With CI set, a test that skips for any reason but a missing GPU fails: CI must run the whole suite."""
    outcome = yield
    report = outcome.get_result()
    reason = _disallowed_skip(report)
    if reason is not None:
        report.outcome = "failed"
        report.longrepr = (
            f"skipped in CI ({reason}): with CI set, only tests that need a GPU may skip (a reason "
            f"starting {' or '.join(map(repr, GPU_SKIPS))})"
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, None, None]:
    """The same for a whole module skipped at collection: noted here, failed in ``pytest_sessionfinish``."""
    outcome = yield
    reason = _disallowed_skip(outcome.get_result())
    if reason is not None:
        _ci_skips.append(f"{collector.nodeid}: {reason}")


def pytest_configure(config: pytest.Config) -> None:
    """Every test closes what it opened (tests/leakcheck.py)."""
    leakcheck.register(config)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _ci_skips:
        terminalreporter.section("skipped in CI (only tests that need a GPU may skip)", red=True)
        for line in _ci_skips:
            terminalreporter.line(line)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _ci_skips and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def wait_until(pred: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    """Poll ``pred`` until true; fail the test (never hang) after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.005)


def held_blocks(stats: dict[str, int], num_blocks: int) -> int:
    """Blocks of a receiver (its ``stats()``) neither free nor in a sender's pool: held by reservations, or
    leaked. A pool is granted ahead to each connected sender and held between requests by design (README,
    "Pools"), so a leak check counts its blocks as the pool's: 0 means every block is back."""
    return num_blocks - stats["free_blocks"] - stats["pooled_blocks"]


def held_slots(stats: dict[str, int], staging_slots: int) -> int:
    """Staging slots of a receiver neither free nor in a sender's staged pool (``held_blocks``' count for slots):
    0 means every slot is back."""
    return staging_slots - stats["free_staging_slots"] - stats["pooled_slots"]


KV_MEMORIES = ("host", "emulated")

TCP_AND_NIXL = [
    "tcp",
    pytest.param(
        "nixl",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("nixl") is None,
            reason="the 'nixl' extra is not installed: pip install 'pdkv[nixl]'",
        ),
    ),
]
"""The real channels a transfer test runs over: tcp (the receiver checks every write) and nixl (it cannot)."""
"""Where a ``make_pair`` KV lives in a test marked ``device_emulation``: host memory, and emulated device memory
(``pdkv.memory.emulate_device``: no host view, so a host-only channel must stage it, as with KV in VRAM)."""


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test marked ``device_emulation`` that makes pairs runs once per ``KV_MEMORIES``."""
    if "make_pair" in metafunc.fixturenames and metafunc.definition.get_closest_marker("device_emulation"):
        metafunc.parametrize("kv_memory", KV_MEMORIES)


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """torch on one thread for a module's tests (the engines' tests: two cores, and their timing and results stay
    those of one thread); ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    with single_thread():
        yield


@pytest.fixture
def kv_memory() -> str:
    """Host memory, unless the test is marked ``device_emulation`` (then parametrized over ``KV_MEMORIES``)."""
    return "host"


FRAME_LOOPS = ["native", "python"]
"""The loops a tcp target can serve DATA frames with (channels/tcp/frames.py): the native one where the kernels load,
and the Python one, its reference; tests of what a target lands run against both."""


@pytest.fixture(params=FRAME_LOOPS)
def frame_loop(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The tcp targets made while the test runs serve DATA frames with this loop."""
    monkeypatch.setenv(FRAMES_ENV_VAR, "1" if request.param == "native" else "0")
    return str(request.param)


@dataclass
class Pair:
    """A sender and a receiver over two mock channels, with their buffers."""

    sender: KVSender
    receiver: KVReceiver
    p_layout: KVLayout
    d_layout: KVLayout
    p_kv: list[torch.Tensor]
    d_kv: list[torch.Tensor]
    p_channel: Channel
    d_channel: Channel
    allocator: BlockAllocator
    kv_memory: str = "host"

    def held_blocks(self) -> int:
        """The receiver's blocks neither free nor pooled (``held_blocks``): 0 once nothing is reserved or leaked."""
        return held_blocks(self.receiver.stats(), self.allocator.num_blocks)

    @property
    def same_layout_mode(self) -> str:
        """The mode a request between identical layouts gets: direct, unless the channel cannot reach the KV
        (then staging)."""
        reached = all(in_reach(t, self.p_channel.memory) for t in self.p_kv) and all(
            in_reach(t, self.d_channel.memory) for t in self.d_kv
        )
        return "direct" if reached else "staging"


MakePair = Callable[..., Pair]
"""What the ``make_pair`` fixture gives a test: ``make_pair(config=..., channel=...)`` -> a connected ``Pair``."""


@pytest.fixture
def make_pair(kv_memory: str) -> Iterator[MakePair]:
    """Factory of sender/receiver pairs in this process (mock channel unless told: ``channel="tcp"`` is real
    sockets), their KV in ``kv_memory``; on teardown asserts the receiver leaked nothing."""
    made: list[Pair] = []

    def make(
        p_layout: KVLayout | None = None,
        d_layout: KVLayout | None = None,
        config: TransferConfig | None = None,
        p_blocks: int = 64,
        d_blocks: int = 64,
        fingerprints: tuple[str, str] = ("model-a", "model-a"),
        secrets: tuple[str, str] = ("", ""),
        channel: str = "mock",
        kv_memory_override: str | None = None,
        allocator: BlockAllocator | None = None,
    ) -> Pair:
        p_layout = p_layout or KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=16, dtype="float32")
        d_layout = d_layout or p_layout
        config = config or TransferConfig(chunk_size=32, lease_s=5, drain_timeout_s=2)
        n = next(_names)
        p_channel, d_channel = create_channel(channel, f"p{n}"), create_channel(channel, f"d{n}")
        p_kv, d_kv = p_layout.allocate(p_blocks), d_layout.allocate(d_blocks)
        gen = torch.Generator().manual_seed(n)
        for t in p_kv:
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
        memory = kv_memory_override or kv_memory
        if memory == "emulated":
            for t in (*p_kv, *d_kv):
                emulate_device(t)
        allocator = allocator or BlockAllocator(d_blocks)
        receiver = KVReceiver(d_channel, d_layout, d_kv, allocator, fingerprints[1], config, secret=secrets[1])
        sender = KVSender(p_channel, p_layout, p_kv, fingerprints[0], config, secret=secrets[0])
        pair = Pair(sender, receiver, p_layout, d_layout, p_kv, d_kv, p_channel, d_channel, allocator, memory)
        made.append(pair)
        return pair

    yield make
    for pair in made:
        pair.sender.close()  # returns its pools (ReturnPool): the blocks come back, none is left for the lease
        wait_until(
            lambda p=pair: p.receiver.stats()["reservations"] == 0,
            10,
            "the receiver to release every reservation",
        )
        stats = pair.receiver.stats()
        pair.receiver.close()
        pair.p_channel.close()
        pair.d_channel.close()
        leaked = held_blocks(stats, pair.allocator.num_blocks)
        assert leaked == 0, f"receiver leaked {leaked} blocks ({stats['pooled_blocks']} in pools)"
        leaked = held_slots(stats, pair.receiver.config.staging_slots)
        assert leaked == 0, f"receiver leaked {leaked} staging slots ({stats['pooled_slots']} in pools)"


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random model (pdkv.testing.model, seed 0) every test of real workers loads; written once, never
    modified."""
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def redis_server() -> Iterator[LocalRedis]:
    """A real redis-server on a free port (the remote tier is tested against a real one, never a fake)."""
    pytest.importorskip("redis", reason="the remote tier needs redis-py: pip install 'pdkv[redis]'")
    if server_binary() is None:
        pytest.skip(f"no redis-server found (the remote tier is tested against a real one): {INSTALL_HINT}")
    with local_redis() as server:
        yield server


@pytest.fixture(scope="session")
def vllm_env_python() -> str:
    """The vLLM environment's Python with this checkout installed (tests/vllm_env.py), built or refreshed once per
    session; the tests that need it skip, saying why, where it cannot be had."""
    from vllm_env import Unavailable, vllm_python

    try:
        return vllm_python()
    except Unavailable as exc:
        pytest.skip(f"vLLM integration not run: {exc}")


@pytest.fixture(scope="module")
def netrig() -> Iterator[NetRig]:
    """A network rig with its hub host ``a``: tests add hosts and start pdkv roles on them (``Host.start_worker``).

    Every process started through it is stopped and every namespace (with its
    interfaces) deleted at the end of the module, whatever happened.
    """
    why = unavailable()
    if why is not None:
        pytest.skip(f"two-host tests: {why}")
    with NetRig() as rig:
        yield rig


async def serve_worker(worker: Worker) -> tuple[web.AppRunner, str]:
    """``worker``'s app served on a free port of 127.0.0.1 in this event loop, as ``pdkv launch`` serves it (handler
    cancellation on: a client that hangs up stops its request): (its runner, its base URL)."""
    from aiohttp import web

    from pdkv.http.web import runner as serving

    runner = serving(worker.app(), worker.config.http)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"
