"""No class under pdkv/router/ grows past 250 lines, so that the router's request flow never becomes one class doing
every job again: ``Proxy`` runs each request through rooms of one job each (``failover``, ``prefill_hop``,
``decode_hop``, ``upstream``, ``answers``, ``abandoning``), and a new job gets a room of its own.
"""

from __future__ import annotations

from pathlib import Path

from test_channel_shape import LIMIT, class_sizes, oversized  # the same measure and limit as channels/

ROUTER = Path(__file__).resolve().parent.parent / "pdkv" / "router"


def test_every_class_under_the_router_stays_under_the_limit() -> None:
    over = oversized(class_sizes(ROUTER), {})
    assert not over, "classes too long: split them into rooms of one job each\n" + "\n".join(over)


def test_the_check_sees_the_router_and_its_rooms() -> None:
    sizes = class_sizes(ROUTER)
    for room in ("proxy.py:Proxy", "failover.py:Failover", "prefill_hop.py:PrefillHop", "decode_hop.py:DecodeHop"):
        assert 0 < sizes.get(room, 0) < LIMIT, f"{room} not measured under {ROUTER}: {sorted(sizes)}"
