"""Every test closes what it opened: a test file that leaves a thread or a file descriptor behind fails.

The suite runs in one process for 10 minutes; what one test leaves running (a channel's I/O threads, a socket,
a pipe) is still there for every test after it, and a worker that reconnects to many peers would leak the same
way. So once a test module is over (its last test torn down, its module-scoped fixtures finalized) this plugin
compares the process's threads and fds (and the test thread's network namespace: a test that enters a rig's
host and stays there moves every later test's sockets onto it) with what it had before the module's first test,
and fails that last teardown if anything is left, naming the test after which each leftover was first seen.
Checked per module, not per test, because a module-scoped fixture's objects may open connections lazily during
any of its tests (a channel's link to its peer) and close them only when the fixture is finalized. What a
session-scoped fixture opened belongs to it while it lives.

One exception, for file descriptors only: UCX (under the nixl and ucx channels) gives some of a closed worker's
resources back asynchronously, and after a refused or broken endpoint sometimes not at all while the process
lives (seen: 0 to 20 fds in a module, varying run to run, none in a loop of 10 channels that open, write and close).
In a module that opened a UCX-based channel, leftover fds are a warning; leftover threads still fail it.

A thread may need a moment to end after the close that stopped it, and what only unreachable objects still
hold goes with the next garbage collection: leftovers are collected, then waited for up to ``SETTLE_S``, before
they count. ``PDKV_LEAKCHECK=report:PATH`` appends what each module left to PATH instead of failing (to survey a
tree); ``PDKV_LEAKCHECK=off`` turns the check off.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
import warnings
from collections.abc import Generator
from typing import Any

import pytest
import zmq
import zmq.asyncio

SETTLE_S = 5.0
# Threads that live as long as the process by design, started on first use by libraries, not by a test.
PROCESS_THREADS = (
    "pdkv-redis-sweep",  # pdkv.tier.redis_pool: one per process, sweeps every pool
    "pdkv-tier-deadlines",  # pdkv.tier.bounds: one per process, ends every shared level's late requests
    "asyncio_",  # an event loop's default executor: pytest's loops own theirs
    "tqdm_monitor",  # tqdm's one monitor thread, started with the first progress bar
)

Resource = tuple[str, str]  # ("thread", "name#ident"), ("fd", "N -> target") or ("netns", "net:[inode]")


def _process_fds() -> set[int]:
    """Our ends of multiprocessing's helper processes (its forkserver, its resource tracker): one each per process,
    started on first use and kept until exit by design. Their fds are private attributes, read only here."""
    from multiprocessing import forkserver, resource_tracker

    fds = (
        getattr(forkserver._forkserver, "_forkserver_alive_fd", None),
        getattr(resource_tracker._resource_tracker, "_fd", None),
    )
    return {fd for fd in fds if fd is not None}


def _snapshot() -> set[Resource]:
    # The network namespace the test thread is in: a test that enters a rig's host (pdkv.bench.netrig) and never
    # comes back leaves every later test's sockets on that host, where 127.0.0.1 is another machine's loopback.
    out: set[Resource] = {("netns", os.readlink("/proc/thread-self/ns/net"))}
    kept = _process_fds()
    for t in threading.enumerate():
        if t.ident is not None and not t.name.startswith(PROCESS_THREADS):
            out.add(("thread", f"{t.name}#{t.ident}"))
    for fd in os.listdir("/proc/self/fd"):
        if int(fd) in kept:
            continue
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the listing's own fd, closed by now
        if target.startswith(("socket:", "pipe:", "anon_inode:")):
            out.add(("fd", f"{fd} -> {target}"))
    return out


class LeakCheck:
    def __init__(self, mode: str) -> None:
        self.report_path = mode.removeprefix("report:") if mode.startswith("report:") else ""
        self.session_owned: dict[Any, set[Resource]] = {}  # live session/package fixture -> what its setup opened
        self.module_start: set[Resource] | None = None
        self.ucx_start = 0
        self.first_seen: dict[Resource, str] = {}  # a resource new in this module -> the test after which it was

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest) -> Any:
        if fixturedef.scope not in ("session", "package"):
            return (yield)
        before = _snapshot()
        try:
            return (yield)
        finally:
            self.session_owned[fixturedef] = self.session_owned.get(fixturedef, set()) | (_snapshot() - before)

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_post_finalizer(self, fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest) -> Any:
        try:
            return (yield)
        finally:
            self.session_owned.pop(fixturedef, None)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, Any]:
        """Around a test's whole protocol: after it, pytest has dropped the test's fixture values too."""
        if self.module_start is None:  # the module's first test: before its module fixtures are set up
            self.module_start = _snapshot()
            self.first_seen = {}
            self.ucx_start = _ucx_channels_opened()
        result = yield
        for res in self._left():
            self.first_seen.setdefault(res, item.nodeid)
        if nextitem is None or nextitem.path != item.path:  # the module is over, its fixtures finalized
            self._end_of_module(item)
        return result

    def _left(self) -> set[Resource]:
        assert self.module_start is not None
        owned = set().union(*self.session_owned.values()) if self.session_owned else set()
        return _snapshot() - self.module_start - owned

    def _end_of_module(self, item: pytest.Item) -> None:
        left = self._left()
        if left:
            gc.collect()
            left = self._left()
        deadline = time.monotonic() + SETTLE_S
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = self._left()
        self.module_start = None
        if _ucx_channels_opened() > self.ucx_start and not any(kind == "thread" for kind, _ in left):
            if left:
                warnings.warn(
                    f"{item.path.name} ran UCX-based channels and left {len(left)} fd(s) behind "
                    f"(UCX frees some asynchronously, see tests/leakcheck.py): {sorted(what for _, what in left)}",
                    stacklevel=1,
                )
            return
        if not left:
            return
        by_test: dict[str, list[str]] = {}
        for res in sorted(left):
            by_test.setdefault(self.first_seen.get(res, item.nodeid), []).append(" ".join(res))
        if self.report_path:
            with open(self.report_path, "a") as out:
                for nodeid, what in by_test.items():
                    out.write(f"{nodeid}\t{len(what)}\t{' | '.join(what)}\n")
            return
        lines = [f"{nodeid}: {', '.join(what)}" for nodeid, what in by_test.items()]
        message = (
            f"{item.path.name} left {len(left)} thread(s)/fd(s) behind once its tests and fixtures were done (close "
            "every channel, sender, receiver and worker a test opens; tests/leakcheck.py), first seen after:\n  "
            + "\n  ".join(lines)
        )
        # The test's own reports are out by now: this one is an error of its teardown, counted as a failure.
        report = pytest.TestReport(item.nodeid, item.location, {}, "failed", message, "teardown")
        item.ihook.pytest_runtest_logreport(report=report)


def _ucx_channels_opened() -> int:
    """Channels the UCX-based libraries opened so far (0 for one never imported)."""
    return sum(
        m.OPEN.opened for name in ("pdkv.channels.nixl.lib", "pdkv.channels.ucx.lib") if (m := sys.modules.get(name))
    )


def register(config: pytest.Config) -> None:
    """Register the check (from ``tests/conftest.py``'s ``pytest_configure``), unless turned off."""
    mode = os.environ.get("PDKV_LEAKCHECK", "fail")
    if mode != "off" and os.path.isdir("/proc/self/fd"):
        # Process-wide singletons, made on first use and kept by design: made now, they are in every baseline.
        zmq.Context.instance().socket(zmq.PAIR).close()  # its I/O thread's epoll and eventfds, made with a socket
        zmq.asyncio.Context.instance().socket(zmq.PAIR).close()  # the KV-event subscriber's (its own singleton)
        config.pluginmanager.register(LeakCheck(mode), "pdkv-leakcheck")
