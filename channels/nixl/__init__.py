"""The NIXL channel: the real NIXL agent (``nixl._api.nixl_agent``), UCX backend by default.

DRAM<->DRAM between processes runs without a GPU (so CI tests it); CUDA tensors register as VRAM. How it maps onto
the ``Channel`` interface, the UCX environment it sets, and why NIXL's progress thread is off by default (and keeps a
delay where it is on): channels/README.md, "nixl".

Its rooms, one job each: ``lib`` the library, imported once UCX's environment is set, and its errors; ``options``;
``agent`` the agent created with the progress delay pdkv keeps, its lock, and the memory registered with it;
``meta`` what ``metadata()`` carries and the checks a peer's passes; ``peers`` the peers' agents loaded (and
parked past ``remove_peer``) and their regions; ``lists`` the prepared descriptor lists every transfer is made
from; ``transfers`` the requests posted and settled; ``notices`` notifications taken, delivered or answered;
``watcher`` the thread that finds finished transfers and notifications; ``channel`` the facade, ``NixlChannel``.
"""

from __future__ import annotations

from pdkv.channels.nixl.agent import create_nixl_agent, keep_delay_config
from pdkv.channels.nixl.channel import NixlChannel
from pdkv.channels.nixl.lib import NIXL_ENV_DEFAULTS, NIXL_ERRORS, describe_nixl_error
from pdkv.channels.nixl.lists import Desc, ListKey
from pdkv.channels.nixl.meta import METADATA_VERSION, MemType
from pdkv.channels.nixl.options import NixlOptions
from pdkv.channels.nixl.transfers import NixlTransferHandle
from pdkv.channels.nixl.watcher import PR_SET_TIMERSLACK, WATCH_TIMER_SLACK_NS, tighten_timer_slack

__all__ = [
    "METADATA_VERSION",
    "NIXL_ENV_DEFAULTS",
    "NIXL_ERRORS",
    "PR_SET_TIMERSLACK",
    "WATCH_TIMER_SLACK_NS",
    "Desc",
    "ListKey",
    "MemType",
    "NixlChannel",
    "NixlOptions",
    "NixlTransferHandle",
    "create_nixl_agent",
    "describe_nixl_error",
    "keep_delay_config",
    "tighten_timer_slack",
]
