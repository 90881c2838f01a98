"""pdkv: prefill/decode disaggregated KV transfer.

``pdkv.KVCacheEngine`` (store / retrieve / lookup of a prompt's KV in the
cache tiers, pdkv/cache_engine.py) and ``pdkv.PromptKeys`` are the library
surface for engine integrators; they are imported on first use, so
``import pdkv`` (the router, the CLI) does not pull in torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from pdkv.cache_engine import KVCacheEngine
    from pdkv.keys import PromptKeys
    from pdkv.transfer.protocol import PROTOCOL_VERSION

__all__ = ["PROTOCOL_VERSION", "KVCacheEngine", "PromptKeys", "__version__"]

_LAZY = {"KVCacheEngine": "pdkv.cache_engine", "PromptKeys": "pdkv.keys", "PROTOCOL_VERSION": "pdkv.transfer.protocol"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pdkv' has no attribute {name!r}")
