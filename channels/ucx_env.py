"""What the UCX-based channels (nixl, ucx) share about UCX's process-wide state.

UCX reads its settings from the environment once, when it loads or creates a
context, and tears itself down with the interpreter. So both channels set
pdkv's defaults before they import their library (``apply_env_defaults``; a
user's own value always wins), point UCX at the interface of their ``host``
before they create a context (``ucx_follow_host``), and close channels left
open at exit while UCX is still whole (``OpenChannels``). The raw UCX
baseline (``pdkv.bench.ucx_raw``) uses the same functions, so both sides of
that comparison run the same settings.
"""

from __future__ import annotations

import atexit
import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from pdkv.netaddr import interface_of, is_loopback, is_wildcard

if TYPE_CHECKING:
    from pdkv.channels.base import Channel

log = logging.getLogger(__name__)

# UCX settings every UCX-based channel (nixl, ucx) applies before UCX loads,
# unless the user already set them; channels/README.md, "nixl", says why each matters.
UCX_ENV_DEFAULTS: dict[str, str] = {
    "UCX_MODULES": "^ib",  # the bundled libuct_ib_efa loads a 2nd libnl-route: SIGSEGV at exit
    "UCX_NET_DEVICES": "lo",  # loopback unless told otherwise, like every pdkv socket
}


# Which variables pdkv set, and to what, as NAME=VALUE;...: in the environment, so a process started from this
# one (a benchmark's receiver) still tells pdkv's defaults from a user's own values.
DEFAULTS_VAR = "PDKV_ENV_DEFAULTS"


def _defaulted() -> dict[str, str]:
    entries = (item.partition("=") for item in os.environ.get(DEFAULTS_VAR, "").split(";") if item)
    return {name: value for name, _, value in entries}


def _record_default(name: str, value: str) -> None:
    record = {**_defaulted(), name: value}
    os.environ[DEFAULTS_VAR] = ";".join(f"{k}={v}" for k, v in record.items())


def apply_env_defaults(defaults: Mapping[str, str]) -> dict[str, str]:
    """Set each variable that is not already in the environment; return those set.

    Native libraries (UCX) read their settings from the environment when they
    load or create a context, so this runs before the import; a user's own
    value always wins.
    """
    applied = {k: v for k, v in defaults.items() if k not in os.environ}
    os.environ.update(applied)
    for name, value in applied.items():
        _record_default(name, value)
    return applied


def ucx_follow_host(host: str) -> None:
    """Point UCX at the network interface that holds ``host``, unless the user set ``UCX_NET_DEVICES``.

    pdkv's default, loopback, suits a worker on 127.0.0.1; a worker told to
    listen on another address has peers on other hosts, which loopback
    cannot reach (and UCX wants interface names, not addresses). A wildcard
    host means every interface. Runs before the channel creates its UCX
    context, which is when UCX reads the variable; it is process-wide.
    """
    var = "UCX_NET_DEVICES"
    if os.environ.get(var) != _defaulted().get(var) or is_loopback(host):
        return  # the user's choice, or loopback as by default
    device = "all" if is_wildcard(host) else interface_of(host)
    if device is None:
        log.warning(
            "UCX: no network interface holds %s, so UCX stays on %s=%s and cannot reach other hosts; "
            "set %s to the interface peers reach this host through (e.g. eth0)",
            host,
            var,
            os.environ[var],
            var,
        )
        return
    if device != os.environ[var]:
        log.info(
            "UCX: %s=%s (the interface that holds host %s; set %s yourself to choose another)", var, device, host, var
        )
    os.environ[var] = device
    _record_default(var, device)


class OpenChannels:
    """The channels of one library still open, closed at interpreter exit while that library is still whole.

    Make one at module level right after the library is imported: its exit
    hook is registered then, after the library's own, so it runs before them
    (``atexit`` runs last-registered first) whichever of nixl and ucx a process
    loaded first.

    Held strongly until closed: a channel its owner dropped without ``close``
    still has threads running (a nixl channel's watcher holds the agent, not
    the channel). Had it been forgotten, such a thread would still be inside
    a library call when the interpreter finalizes; Python then ends it with
    ``pthread_exit``, whose unwinding through the binding's C++ frames
    aborts the process ("terminate called without an active exception").
    """

    def __init__(self) -> None:
        self._open: set[Channel] = set()
        self.opened = 0  # channels of this library ever opened in this process (the test suite's leak check reads it)
        atexit.register(self.close_all)

    def add(self, channel: Channel) -> None:
        self._open.add(channel)
        self.opened += 1

    def discard(self, channel: Channel) -> None:
        self._open.discard(channel)

    def close_all(self) -> None:
        """Close channels left open, stopping their service and progress threads before the interpreter tears down."""
        for channel in list(self._open):
            channel.close()
