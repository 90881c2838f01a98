"""The watcher: NIXL tells nobody when a transfer finishes or a notification arrives, so a thread of the channel's
own asks, and turns what it finds into the events the layers above sleep on (channels/README.md, "nixl")."""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
import time

from pdkv.channels.grants import Grants
from pdkv.channels.nixl.agent import Agent, Region
from pdkv.channels.nixl.options import NixlOptions
from pdkv.channels.nixl.transfers import Transfers
from pdkv.channels.regions import RegionTable
from pdkv.errors import ChannelError

log = logging.getLogger(__name__)

PR_SET_TIMERSLACK = 29  # prctl(2)
WATCH_TIMER_SLACK_NS = 1000


def tighten_timer_slack(ns: int) -> bool:
    """Let the calling thread's timed waits end within ``ns`` of their timeout; False where that cannot be set.

    Linux lets a thread's sleep run up to its timer slack (50 us by default) past
    the timeout, so the watcher's 50 us pause while a transfer is in flight
    measured ~130 us (p50) here, ~80 us with 1 us of slack: NIXL sends the
    target's notification only when this side's ``check_xfer_state`` sees the
    transfer done, so each pause is latency every chunk pays.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        return bool(ctypes.CDLL(None, use_errno=True).prctl(PR_SET_TIMERSLACK, ctypes.c_ulong(ns), 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


class Watcher:
    """Finds finished transfers and new notifications for those who sleep until they happen: fast after an event,
    backing off while something may still come, asleep when nothing can (no region of ``regions`` open to a
    write, by ``grants``)."""

    def __init__(
        self, agent: Agent, options: NixlOptions, transfers: Transfers, regions: RegionTable[Region], grants: Grants
    ) -> None:
        self._agent = agent
        self._options = options
        self._transfers = transfers
        self._regions = regions
        self._grants = grants
        # set by a post, a grant, a registration or close: the watcher polls at its fastest again
        self._activity = threading.Event()
        self._moved_at = time.monotonic()  # the last grant, post or completed transfer or notification
        self.polls = 0  # the watcher's passes: none while nothing can arrive
        self.thread = threading.Thread(target=self._watch, name=f"nixl-{agent.name}-watch", daemon=True)
        self.thread.start()

    def moved(self) -> None:
        """A transfer was posted or a grant given: poll at the fastest again."""
        self._moved_at = time.monotonic()
        self._activity.set()

    def wake(self) -> None:
        """Something may arrive that could not before (a region registered, open to every peer until guarded)."""
        self._activity.set()

    def stop(self) -> None:
        """Wake the thread to find the channel closed, and wait for it (unless this is it)."""
        self._activity.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=5.0)

    def _watch(self) -> None:
        tighten_timer_slack(WATCH_TIMER_SLACK_NS)
        pause: float | None = self._options.watch_min_s
        while not self._agent.closed:
            self._activity.wait(pause)
            self._activity.clear()
            self.polls += 1
            try:
                moved = self._transfers.look()
            except ChannelError as exc:
                if not self._agent.closed:
                    log.warning("nixl: watcher: %s", exc)
                moved = 0
            pause = self._next_pause(pause, bool(moved) or self._transfers.busy())

    def _next_pause(self, pause: float | None, active: bool) -> float | None:
        """The watcher's next pause: ``watch_min_s`` while things move, doubling up to ``granted_poll_s`` while a
        peer holds a grant here and something moved within ``granted_idle_s``, else up to ``max_poll_interval_s``
        (an idle grant, or a region open to every peer); None (sleep until a post, grant, registration or close)
        when no notification can arrive and no peer may read here. Its polls are what progresses the agent where
        NIXL's progress thread is off (the default: channels/README.md, "nixl")."""
        opts = self._options
        if active:
            self._moved_at = time.monotonic()
            return opts.watch_min_s
        with self._agent.lock:
            regions = [region for region, _ in self._regions.items()]
        # a peer's READ of a region granted for reading needs this agent's progress too (no progress thread)
        exposure = self._grants.exposure(regions)
        if exposure == "closed":
            exposure = self._grants.exposure(regions, "read")
        if exposure == "closed":
            return None
        recent = time.monotonic() - self._moved_at < opts.granted_idle_s
        cap = opts.granted_poll_s if exposure == "granted" and recent else opts.max_poll_interval_s
        return min(2 * (pause or opts.watch_min_s), cap)
