"""What every level on a shared server has in common: sealed values checked on read, a bad value a counted miss.

A level whose values live in another process (Redis, Redis Cluster, an S3
bucket, a third party's backend) cannot trust what it reads back: anyone who
reaches the server can write there. ``SharedStoreTier`` writes values in
``pdkv.tier.base``'s format (header, payload, with a secret a seal) and checks
each one it reads (``read_value``). A value that fails is a miss, counted by
reason (``stats().rejected``: ``pdkv_tier_rejected_total``), logged once per
key and deleted, so the next store puts a good one there. Workers sharing a
server must share its secret (and a namespace), or each deletes the others'
values.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence
from typing import Any

import torch

from pdkv.layout import KVLayout
from pdkv.tier.base import LeafTier, encode_value, read_value

log = logging.getLogger(__name__)

FAILED: Any = object()  # a key's result when its server could not be asked (a value None: not there)
_LOGGED_KEYS = 4096  # rejected keys remembered so each is logged once (a poisoned key read again and again logs once)


class SharedStoreTier(LeafTier):
    """A level on a shared server; subclasses move bytes, this class makes and checks them."""

    remote = True

    def __init__(self, layout: KVLayout, name: str, secret: str = "") -> None:
        """``secret``: seal every value written and take only values sealed with it (``pdkv.tier.base``)."""
        super().__init__(layout, name)
        self._secret = secret.encode()
        self._logged: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    def encode(self, keys: Sequence[bytes], chunks: Sequence[torch.Tensor]) -> list[bytes]:
        """The stored form of each chunk under its key."""
        return [encode_value(self.layout, key, chunk, self._secret) for key, chunk in zip(keys, chunks, strict=True)]

    def accept(self, key: bytes, value: bytes | memoryview, out: torch.Tensor) -> bool:
        """Check ``value`` read for ``key`` and copy it into ``out``; False (counted, logged, deleted) when it fails."""
        rejection = read_value(self.layout, key, value, out, self._secret)
        if rejection is None:
            return True
        self._count(errors=1)
        self._reject(rejection.reason)
        if key not in self._logged:
            self._logged[key] = None
            if len(self._logged) > _LOGGED_KEYS:
                self._logged.popitem(last=False)
            log.warning(
                "%s tier: chunk %s refused (%s: %s); deleted, it will be recomputed",
                self.name,
                self.where(key),
                rejection.reason,
                rejection.detail,
            )
        self.remove([key])
        return False

    def accept_run(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor], values: Sequence[Any]) -> int:
        """How many leading values were read and accepted into ``outs``: the run ends at the first that could not
        be asked (``FAILED``), is not there (None: the index hears it is gone), or fails its checks."""
        for i, (key, out, value) in enumerate(zip(keys, outs, values, strict=True)):
            if value is FAILED:
                return i
            if value is None:
                self._changed(removed=(key,))  # not on the server (evicted, expired, deleted, never stored)
                return i
            if not self.accept(key, value, out):
                return i
        return len(keys)

    def where(self, key: bytes) -> str:
        """How the log names ``key``'s value on the server (its key or object name)."""
        return key.hex()
