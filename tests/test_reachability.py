"""Verdicts on unreachable peers (``channels/reachability.py``): how long each holds, and who tries once one lapsed.

Unit tests on a clock of our own; ``tests/test_two_hosts.py`` and ``tests/test_channel_tcp.py`` see the same through
a real channel.
"""

from __future__ import annotations

import collections

import pytest

from pdkv.channels.mock import MockChannel
from pdkv.channels.reachability import FIRST_RETRY_S, Reachability
from pdkv.errors import PeerUnreachableError

RETRY_S = 10.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def verdicts() -> tuple[Reachability, Clock, collections.Counter[str]]:
    clock, counters = Clock(), collections.Counter[str]()
    return Reachability("tcp", "p", RETRY_S, counters, clock), clock, counters


def holds_for(r: Reachability, clock: Clock, peer: str) -> float:
    """How long the verdict on ``peer`` holds from now: the first instant (in steps of 0.25 s, exact in binary) a
    caller may try."""
    start = clock.now
    while True:
        try:
            r.check(peer, trial=True)
        except PeerUnreachableError:
            clock.now += 0.25
            continue
        return clock.now - start


def test_a_peer_never_reached_is_not_tried_again_for_retry_s() -> None:
    """A wrong address (a channel left on loopback, a firewall): one probe per ``unreachable_retry_s``, failure after
    failure, so requests do not each pay a connect."""
    r, clock, counters = verdicts()
    r.check("d")
    r.record("d", "refused")
    assert holds_for(r, clock, "d") == RETRY_S
    r.record("d", "refused")
    assert holds_for(r, clock, "d") == RETRY_S
    assert counters["peer_unreachable"] == 2


def test_a_peer_reached_before_is_tried_again_soon_then_backs_off_up_to_retry_s() -> None:
    """A link that was up and failed (a route that flapped, a decode host rebooting): tried again after
    ``FIRST_RETRY_S``, twice that after the next failure, and so on up to ``unreachable_retry_s``; once reached
    again, the next failure starts over."""
    r, clock, _ = verdicts()
    r.reached("d")
    waits = []
    for _ in range(7):
        r.record("d", "network is unreachable")
        waits.append(holds_for(r, clock, "d"))
    assert waits == [min(RETRY_S, FIRST_RETRY_S * 2**i) for i in range(7)]
    assert waits[-2:] == [RETRY_S, RETRY_S]  # capped
    r.reached("d")
    r.record("d", "refused")
    assert holds_for(r, clock, "d") == FIRST_RETRY_S


def test_a_lapsed_verdict_lets_one_caller_try_while_the_others_still_fail_at_once() -> None:
    """Half-open: the first caller after the verdict lapsed tries; the rest fail at once until it reports, instead
    of each dialling (a blackholed address costs each of them a connect timeout)."""
    r, clock, _ = verdicts()
    r.record("d", "timed out")
    clock.now += RETRY_S
    r.check("d")  # a look (a peer's metadata loaded, say) claims nothing
    r.check("d", trial=True)  # this one tries
    for trial in (False, True):
        with pytest.raises(PeerUnreachableError, match=r"tried again in 10.0s\): timed out"):
            r.check("d", trial)
    r.reached("d")  # it got through: everyone may go
    r.check("d", trial=True)


def test_new_metadata_is_tried_at_once_and_counts_as_never_reached() -> None:
    r, clock, _ = verdicts()
    r.reached("d")
    r.record("d", "refused")
    r.forget("d")  # the peer re-added with another address
    r.check("d")
    r.record("d", "refused")
    assert holds_for(r, clock, "d") == RETRY_S


def test_a_removed_peer_leaves_nothing_behind() -> None:
    """A decode worker restarts under a new agent name: removing the old one drops what was known of it (else a
    long-running prefill worker holds a name for every restart it saw). A failure under that name afterwards is a
    never-reached peer's, with the full verdict."""
    with MockChannel("p") as channel:
        channel.reachability.reached("d-old")
        channel.remove_peer("d-old")
        with pytest.raises(PeerUnreachableError, match=r"tried again in 10.0s\)"):
            raise channel.reachability.record("d-old", "refused")
