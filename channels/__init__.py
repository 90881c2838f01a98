"""Transfer channels, installed as ``pdkv.channels``.

``create_channel`` imports a channel lazily so that a missing optional
dependency (nixl, ucxx) only matters to whoever asks for that channel, and
then as an error that names the extra to install.
"""

from __future__ import annotations

import importlib
from typing import Any

from pdkv.channels.base import Channel
from pdkv.channels.handle import BlockWrite, Notification, TransferHandle, TransferOp, XferState, merge_ops
from pdkv.errors import ChannelNotInstalledError, ConfigError

# name -> (module, class, extra that provides its dependencies or None)
CHANNELS: dict[str, tuple[str, str, str | None]] = {
    "mock": ("pdkv.channels.mock", "MockChannel", None),
    "tcp": ("pdkv.channels.tcp", "TcpChannel", None),
    "nixl": ("pdkv.channels.nixl", "NixlChannel", "nixl"),
    "ucx": ("pdkv.channels.ucx", "UcxChannel", "ucx"),
}


def channel_class(name: str) -> type[Channel]:
    """The channel class for ``name``; a clear error if unknown or not installed."""
    try:
        module_name, class_name, extra = CHANNELS[name]
    except KeyError:
        raise ConfigError(f"channel: unknown channel {name!r}; expected one of {sorted(CHANNELS)}") from None
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if extra is None:
            raise
        raise ChannelNotInstalledError(
            f"channel {name!r} needs the '{extra}' extra: pip install 'pdkv[{extra}]' ({exc})"
        ) from exc
    cls: type[Channel] = getattr(module, class_name)
    return cls


def create_channel(name: str, agent_name: str, options: dict[str, Any] | None = None) -> Channel:
    """Build a channel by name with options from config."""
    cls = channel_class(name)
    return cls(agent_name, cls.parse_options(options))


__all__ = [
    "CHANNELS",
    "BlockWrite",
    "Channel",
    "Notification",
    "TransferHandle",
    "TransferOp",
    "XferState",
    "channel_class",
    "create_channel",
    "merge_ops",
]
