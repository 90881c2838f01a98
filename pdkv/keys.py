"""Prefix-chained chunk keys.

A chunk's key is xxh3-128 over (parent key, model fingerprint, the chunk's
token ids), so equal prefixes give equal keys in every process, on every
machine and across restarts. Python's builtin ``hash`` is salted per
process (PYTHONHASHSEED) and must never be used here: LMCache users lost
every cross-process cache hit to exactly that.

A cache salt (vLLM's ``cache_salt``; per tenant, derived by the router:
``pdkv.router.tenants``) goes into the root the chain starts from, so two
salts share no key at all, not even a first chunk's: nothing one tenant
stores can be found, timed or announced under another tenant's prompt. The
empty salt is today's root, byte for byte, so unsalted keys never moved.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import xxhash

from pdkv.errors import CacheRequestError, ConfigError

DEFAULT_CHUNK_SIZE = 256
KEY_BYTES = 16


def model_fingerprint(model_id: str, config: Mapping[str, Any] | None = None, dtype: str = "") -> str:
    """A stable short id for "the same weights and KV semantics".

    P and D refuse each other at Hello when this differs, and the cache tier
    keys by it, so KV from one model is never served to another.
    """
    blob = json.dumps({"model": model_id, "config": dict(config or {}), "dtype": dtype}, sort_keys=True, default=str)
    return hashlib.blake2b(blob.encode(), digest_size=8).hexdigest()


MAX_SALT_CHARS = 256
"""The longest cache salt taken: a tenant's is 64 hex digits; more is a client sending a document."""


def check_salt(salt: object) -> str:
    """``salt`` if it is a cache salt (a string of at most ``MAX_SALT_CHARS``); ``CacheRequestError`` otherwise."""
    if not isinstance(salt, str) or len(salt) > MAX_SALT_CHARS:
        raise CacheRequestError(f"a cache salt is a string of at most {MAX_SALT_CHARS} characters, got {salt!r:.80}")
    return salt


def _root(fingerprint: str, salt: str = "") -> bytes:
    """The parent of a prompt's first chunk: per model and, when salted, per salt (length-prefixed, so
    no fingerprint/salt pair can spell another)."""
    if not salt:
        return xxhash.xxh3_128_digest(b"pdkv/root/" + fingerprint.encode())
    fp, sb = fingerprint.encode(), check_salt(salt).encode()
    return xxhash.xxh3_128_digest(
        b"pdkv/salted-root/" + len(fp).to_bytes(4, "little") + fp + len(sb).to_bytes(4, "little") + sb
    )


def chunk_key(parent: bytes, fingerprint: str, tokens: Sequence[int] | np.ndarray) -> bytes:
    """Key of one chunk given its parent's key (use ``_root`` for the first)."""
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"chunk tokens must be one-dimensional, got shape {arr.shape}")
    h = xxhash.xxh3_128()
    h.update(parent)
    h.update(fingerprint.encode())
    h.update(len(arr).to_bytes(4, "little"))
    h.update(
        arr.astype("<u4", copy=False).tobytes()
        if (arr >= 0).all() and (arr < 2**32).all()
        else arr.astype("<i8").tobytes()
    )
    return h.digest()


def chunk_spans(num_tokens: int, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Iterator[tuple[int, int]]:
    """``(start, length)`` of each chunk of a prompt; the last may be partial."""
    if chunk_size <= 0:
        raise ConfigError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    for start in range(0, num_tokens, chunk_size):
        yield start, min(chunk_size, num_tokens - start)


def chunk_keys(
    tokens: Sequence[int] | np.ndarray, fingerprint: str, chunk_size: int = DEFAULT_CHUNK_SIZE, salt: str = ""
) -> list[bytes]:
    """Keys of every chunk of ``tokens``, a partial last chunk included, chained from ``salt``'s root."""
    arr = np.asarray(tokens, dtype=np.int64)
    keys: list[bytes] = []
    parent = _root(fingerprint, salt)
    for start, length in chunk_spans(len(arr), chunk_size):
        parent = chunk_key(parent, fingerprint, arr[start : start + length])
        keys.append(parent)
    return keys


@dataclasses.dataclass(frozen=True)
class PromptKeys:
    """A prompt already keyed: its chained chunk keys (a partial last chunk included) and its length.

    ``KVCacheEngine`` calls take one in place of the token ids, so a prompt
    is hashed once however often it is stored, looked up or retrieved (what
    LMCache's ``hashes``/``offsets`` arguments are for), and a process that
    never sees the tokens can still address the cache: vLLM's scheduler keys
    each prompt and sends its workers the keys (16 bytes a chunk), not the
    tokens. ``chunk_size``, ``fingerprint`` and ``salt`` travel with the keys
    so an engine refuses keys made for another model, chunking or salt.
    """

    keys: tuple[bytes, ...]
    num_tokens: int
    chunk_size: int
    fingerprint: str
    salt: str = ""

    def __post_init__(self) -> None:
        if self.chunk_size <= 0:
            raise ConfigError(f"chunk_size must be a positive integer, got {self.chunk_size!r}")
        if self.num_tokens < 0:
            raise CacheRequestError(f"PromptKeys.num_tokens must be >= 0, got {self.num_tokens}")
        expected = -(-self.num_tokens // self.chunk_size)
        if len(self.keys) != expected:
            raise CacheRequestError(
                f"{self.num_tokens} tokens in chunks of {self.chunk_size} have {expected} chunk keys, got "
                f"{len(self.keys)}"
            )
        for key in self.keys:
            if len(key) != KEY_BYTES:
                raise CacheRequestError(f"a chunk key is {KEY_BYTES} bytes (pdkv.keys.chunk_keys), got {len(key)}")
        check_salt(self.salt)

    @classmethod
    def of(
        cls, tokens: Sequence[int] | np.ndarray, fingerprint: str, chunk_size: int = DEFAULT_CHUNK_SIZE, salt: str = ""
    ) -> PromptKeys:
        """Key ``tokens`` (``chunk_keys``) under ``salt``."""
        return cls(tuple(chunk_keys(tokens, fingerprint, chunk_size, salt)), len(tokens), chunk_size, fingerprint, salt)

    def prefix(self, num_tokens: int) -> PromptKeys:
        """The keys of the first ``num_tokens`` tokens: whole chunks, or all of them (a shorter partial
        chunk would have another key, and the tokens to compute it are not here)."""
        if num_tokens == self.num_tokens:
            return self
        if not 0 <= num_tokens < self.num_tokens or num_tokens % self.chunk_size:
            raise CacheRequestError(
                f"a prefix of keyed tokens must be a multiple of chunk_size ({self.chunk_size}) below "
                f"{self.num_tokens}, or all {self.num_tokens} tokens; got {num_tokens}"
            )
        return dataclasses.replace(self, keys=self.keys[: num_tokens // self.chunk_size], num_tokens=num_tokens)

    def spans(self) -> list[tuple[int, int]]:
        """``(start, length)`` of each chunk, like ``chunk_spans``."""
        return list(chunk_spans(self.num_tokens, self.chunk_size))
