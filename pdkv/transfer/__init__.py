"""The transfer path: a request's KV from the prefill worker's blocks to the decode worker's (README.md here).

``KVSender`` and ``KVReceiver`` are imported on first use: the router builds with ``pdkv.transfer.params``
and must not pull in torch through this package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdkv.transfer.receiver import KVReceiver
    from pdkv.transfer.sender import KVSender

__all__ = ["KVReceiver", "KVSender"]

_LAZY = {"KVSender": "pdkv.transfer.sender", "KVReceiver": "pdkv.transfer.receiver"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pdkv.transfer' has no attribute {name!r}")
