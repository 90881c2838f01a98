"""Every test closes what it opened: a test that leaves a thread or a file descriptor behind fails.

The suite runs in one process for 10 minutes; what one test leaves running (a channel's I/O threads, a socket,
a pipe) is still there for every test after it, and a worker that reconnects to many peers would leak the same
way. So after each test's teardown this plugin compares the process's threads and fds with what it had before
the test's setup. What a wider-scoped fixture (module, session) opens belongs to that fixture while it lives and
must be gone once it is finalized: it counts against the test in whose teardown that happened.

A thread may need a moment to end after the close that stopped it, and what only unreachable objects still
hold goes with the next garbage collection: leftovers are collected, then waited for up to ``SETTLE_S``, before
they count. ``PDKV_LEAKCHECK=report:PATH`` writes what each test left to PATH instead of
failing it (to survey a tree); ``PDKV_LEAKCHECK=off`` turns the check off.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Generator
from typing import Any

import pytest
import zmq

SETTLE_S = 3.0
# Threads that live as long as the process by design, started on first use by libraries, not by a test.
PROCESS_THREADS = (
    "pdkv-redis-sweep",  # pdkv.tier.redis_pool: one per process, sweeps every pool
    "asyncio_",  # an event loop's default executor: pytest's loops own theirs
)

Resource = tuple[str, str]  # ("thread", "name#ident") or ("fd", "N -> target")


def _snapshot() -> set[Resource]:
    out: set[Resource] = set()
    for t in threading.enumerate():
        if t.ident is not None and not t.name.startswith(PROCESS_THREADS):
            out.add(("thread", f"{t.name}#{t.ident}"))
    for fd in os.listdir("/proc/self/fd"):
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
        self.owned: dict[Any, set[Resource]] = {}  # live wider-scoped fixture -> what its setup opened
        self.released: set[Resource] = set()  # what fixtures finalized during the current test owned
        self.before: set[Resource] = set()

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest) -> Any:
        if fixturedef.scope == "function":
            return (yield)
        before = _snapshot()
        try:
            return (yield)
        finally:
            self.owned[fixturedef] = self.owned.get(fixturedef, set()) | (_snapshot() - before)

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_post_finalizer(self, fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest) -> Any:
        try:
            return (yield)
        finally:
            self.released |= self.owned.pop(fixturedef, set())

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Generator[None, None, None]:
        self.before = _snapshot()
        self.released = set()
        return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
        result = yield
        left = self._left()
        if left:  # what only garbage still holds (a closed channel in a reference cycle) is not a leak
            gc.collect()
            left = self._left()
        deadline = time.monotonic() + SETTLE_S
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = self._left()
        if left:
            self._found(item, left)
        return result

    def _left(self) -> set[Resource]:
        now = _snapshot()
        live = set().union(*self.owned.values()) if self.owned else set()
        return (now - self.before - live) | (now & self.released)

    def _found(self, item: pytest.Item, left: set[Resource]) -> None:
        lines = sorted(f"{kind} {what}" for kind, what in left)
        if self.report_path:
            with open(self.report_path, "a") as out:
                out.write(f"{item.nodeid}\t{len(lines)}\t{' | '.join(lines)}\n")
            return
        pytest.fail(
            f"{item.nodeid} left {len(lines)} thread(s)/fd(s) behind after its teardown (close every channel, "
            "sender, receiver and worker a test opens; tests/leakcheck.py):\n  " + "\n  ".join(lines),
            pytrace=False,
        )


def register(config: pytest.Config) -> None:
    """Register the check (from ``tests/conftest.py``'s ``pytest_configure``), unless turned off."""
    mode = os.environ.get("PDKV_LEAKCHECK", "fail")
    if mode != "off" and os.path.isdir("/proc/self/fd"):
        # Process-wide singletons, made on first use and kept by design: made now, they are in every baseline.
        zmq.Context.instance().socket(zmq.PAIR).close()  # its I/O thread's epoll and eventfds, made with a socket
        config.pluginmanager.register(LeakCheck(mode), "pdkv-leakcheck")
