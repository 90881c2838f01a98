"""One client request as it goes through the router's rooms (``pdkv.router.proxy`` and the hops it runs)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from pdkv.router.disaggregation import WayCost
from pdkv.router.policy import Prompt

# Every room of the request flow logs under the one name the flow had when it was one module: operators' filters
# and alerts (and tests/test_peer_death.py) match it.
log = logging.getLogger("pdkv.router.proxy")


@dataclass
class Call:
    """One client request as it goes through the router."""

    http: web.Request
    path: str
    body: dict[str, Any]
    prompt: Prompt
    stream: bool
    request_id: str
    arrived: float
    headers: dict[str, str]
    deadline: float | None = None  # monotonic; the client's X-Request-Timeout after arrival
    outcome: str = "cancelled"  # what pdkv_requests_total counts; stays so if the client goes away
    way_cost: WayCost | None = None  # the way it was served, to learn from its second event (router.disaggregate)
    events_sent: int = 0  # server-sent events the client got (a streamed answer)
