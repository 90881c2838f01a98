"""``KVCacheEngine``: pdkv's cache tiers as a library, with the store / retrieve / lookup contract of LMCache.

Whoever runs an engine hands it token ids and a paged KV buffer; it keys the tokens into chained chunks
(``pdkv.keys``), moves them between the buffer and the tiers (``pdkv.tier``) and says which tokens it loaded.
pdkv's own workers and its vLLM connector call it too: one store path, one load path. The contract, call by call,
and its parity with LMCache: pdkv/tier/README.md, "The contract".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

import numpy as np
import torch

from pdkv import native
from pdkv.config import TierConfig, convert_config
from pdkv.errors import CacheRequestError, ConfigError, PdkvError
from pdkv.keys import DEFAULT_CHUNK_SIZE, PromptKeys, check_salt
from pdkv.layout import BlockTable, KVLayout, used_blocks
from pdkv.tier import CacheTier, TieredCache, TierStats, build_tier

Tokens = Sequence[int] | np.ndarray | torch.Tensor | PromptKeys
"""Token ids, or the same already keyed."""


def suffix_mask(num_tokens: int, start: int) -> torch.Tensor:
    """The mask that selects tokens ``[start, num_tokens)``: False before ``start``, True from it."""
    return torch.arange(num_tokens) >= start


class KVCacheEngine:
    """Store, retrieve and look up a prompt's KV chunks in pdkv's tiers; see the module docstring.

    ``tier_config``: a ``TierConfig`` (or a mapping of its fields) whose
    levels the engine builds, or levels already built (a ``CacheTier``). The
    engine owns them either way: ``close()`` closes them.
    ``load_batch_chunks``: chunks read per batch by ``retrieve`` (the host
    staging memory it needs); None takes the config's.
    ``save_unfull_chunk``: whether a partial last chunk is stored, looked up
    and retrieved (LMCache's switch; see the module docstring for why pdkv's
    default is True where LMCache's is False).
    """

    def __init__(
        self,
        layout: KVLayout,
        tier_config: TierConfig | Mapping[str, Any] | CacheTier,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        *,
        fingerprint: str,
        load_batch_chunks: int | None = None,
        save_unfull_chunk: bool = True,
    ) -> None:
        if not isinstance(chunk_size, int) or chunk_size <= 0:
            raise ConfigError(f"KVCacheEngine chunk_size must be a positive integer, got {chunk_size!r}")
        if not isinstance(fingerprint, str) or not fingerprint:
            raise ConfigError(
                "KVCacheEngine fingerprint must be a non-empty string naming the model (pdkv.keys.model_fingerprint), "
                f"got {fingerprint!r}"
            )
        if load_batch_chunks is not None and (not isinstance(load_batch_chunks, int) or load_batch_chunks <= 0):
            raise ConfigError(
                f"KVCacheEngine load_batch_chunks must be a positive integer or None, got {load_batch_chunks!r}"
            )
        if not isinstance(save_unfull_chunk, bool):
            raise ConfigError(f"KVCacheEngine save_unfull_chunk must be True or False, got {save_unfull_chunk!r}")
        self.layout = layout
        self.chunk_size = chunk_size
        self.save_unfull_chunk = save_unfull_chunk
        self.fingerprint = fingerprint
        if isinstance(tier_config, CacheTier):
            config = TierConfig()
            levels = tier_config
        else:
            config = (
                tier_config
                if isinstance(tier_config, TierConfig)
                else convert_config({"tier": dict(tier_config)}, "KVCacheEngine tier_config").tier
            )
            built = build_tier(config, layout)
            if built is None:
                raise ConfigError(
                    "KVCacheEngine tier_config enables no cache level: set enabled: true and memory_bytes > 0, a "
                    "disk_path, a redis_url or levels"
                )
            levels = built
        self.tier: TieredCache = (
            levels
            if isinstance(levels, TieredCache)
            else TieredCache([levels], config.write_behind_bytes, config.flush_timeout_s)
        )
        """The levels behind this engine (for their statistics; reading or writing them directly bypasses the
        contract)."""
        self.load_batch_chunks = load_batch_chunks or config.load_batch_chunks
        self._closed = False

    # -- the contract ---------------------------------------------------------------
    def keys(self, tokens: Tokens, salt: str | None = None) -> PromptKeys:
        """``tokens`` keyed as this engine keys them, under ``salt`` (None: unsalted, or the keys' own salt);
        already keyed, checked against the engine's fingerprint and chunk size and against ``salt``."""
        if salt is not None:
            check_salt(salt)
        if isinstance(tokens, PromptKeys):
            if (tokens.fingerprint, tokens.chunk_size) != (self.fingerprint, self.chunk_size):
                raise CacheRequestError(
                    f"keys made for fingerprint {tokens.fingerprint!r} and chunk_size {tokens.chunk_size}; this "
                    f"engine's are {self.fingerprint!r} and {self.chunk_size}"
                )
            if salt is not None and salt != tokens.salt:  # never served under another partition than the one asked for
                raise CacheRequestError(f"keys made under cache salt {tokens.salt!r}; the call names salt {salt!r}")
            return tokens
        if isinstance(tokens, torch.Tensor):
            ids = tokens.detach().cpu().numpy()
        else:
            try:
                ids = np.asarray(tokens)
            except (TypeError, ValueError) as exc:
                raise CacheRequestError(
                    f"tokens must be a 1-D sequence of token ids, got {type(tokens).__name__} ({exc})"
                ) from None
        if ids.ndim != 1 or (ids.size and (ids.dtype == np.bool_ or not np.issubdtype(ids.dtype, np.integer))):
            raise CacheRequestError(
                f"tokens must be a 1-D sequence of integer token ids, got shape {ids.shape} of {ids.dtype}"
            )
        return PromptKeys.of(ids.astype(np.int64, copy=False), self.fingerprint, self.chunk_size, salt or "")

    def lookup(self, tokens: Tokens, *, salt: str | None = None) -> int:
        """How many leading tokens are cached (what ``retrieve`` would load), without loading them."""
        self._check_open()
        keyed = self.keys(tokens, salt)
        held = self.tier.contains(keyed.keys[: self._num_chunks(keyed)])
        return min(held * self.chunk_size, keyed.num_tokens)

    def store(
        self,
        tokens: Tokens,
        kv_buffer: Sequence[torch.Tensor],
        block_table: BlockTable,
        mask: torch.Tensor | None = None,
        *,
        salt: str | None = None,
    ) -> int:
        """Put the chunks the mask selects into the tiers (memory now, the rest behind); return the tokens put."""
        self._check_open()
        keyed = self.keys(tokens, salt)
        start = self._mask_start(mask, keyed.num_tokens, "store")
        if start % self.chunk_size:
            raise CacheRequestError(
                f"store: the mask's False prefix ({start} tokens) must be a multiple of chunk_size "
                f"({self.chunk_size}): chunks are stored whole, and the KV of masked tokens is not read"
            )
        self._check_buffer(kv_buffer, block_table, keyed.num_tokens)
        first = start // self.chunk_size
        spans = keyed.spans()
        candidates = range(first, self._num_chunks(keyed))
        held = self.tier.has_local([keyed.keys[i] for i in candidates])
        todo = [i for i, h in zip(candidates, held, strict=True) if not h]
        if not todo:
            return 0
        paged = native.PagedBuffer(self.layout, kv_buffer)  # the buffer read once for all its chunks
        chunks = [paged.gather_summed(block_table, *spans[i])[0].cpu() for i in todo]
        self.tier.put(
            [keyed.keys[i] for i in todo], chunks, [keyed.keys[i - 1] if i else None for i in todo]
        )  # parents: for tier.memory_policy prefix
        return sum(spans[i][1] for i in todo)

    def retrieve(
        self,
        tokens: Tokens,
        kv_buffer: Sequence[torch.Tensor],
        block_table: BlockTable,
        mask: torch.Tensor | None = None,
        *,
        salt: str | None = None,
    ) -> torch.Tensor:
        """Load the longest cached run of chunks from the first True token into the buffer; return the mask of
        tokens written."""
        self._check_open()
        keyed = self.keys(tokens, salt)
        start = self._mask_start(mask, keyed.num_tokens, "retrieve")
        self._check_buffer(kv_buffer, block_table, keyed.num_tokens)
        loaded = torch.zeros(keyed.num_tokens, dtype=torch.bool)
        if start == keyed.num_tokens:
            return loaded
        first = start // self.chunk_size
        last = self._num_chunks(keyed)
        spans = keyed.spans()[first:last]
        keys = keyed.keys[first:last]
        staging = [
            torch.empty(self.layout.chunk_shape(self.chunk_size), dtype=self.layout.torch_dtype)
            for _ in range(min(self.load_batch_chunks, len(keys)))
        ]
        end = start
        paged = native.PagedBuffer(self.layout, kv_buffer)  # the buffer read once for all its chunks
        for batch in range(0, len(keys), self.load_batch_chunks):
            batch_spans = spans[batch : batch + self.load_batch_chunks]
            outs = [
                staging[j]
                if length == self.chunk_size
                else torch.empty(self.layout.chunk_shape(length), dtype=self.layout.torch_dtype)
                for j, (_, length) in enumerate(batch_spans)
            ]
            got = self.tier.get(
                keys[batch : batch + len(batch_spans)], outs, keyed.keys[first + batch - 1] if first + batch else None
            )
            for (chunk_start, length), chunk in zip(batch_spans[:got], outs, strict=False):
                skip = max(start - chunk_start, 0)  # tokens of the first chunk the caller already has
                paged.scatter_summed(block_table, chunk_start + skip, chunk[:, :, skip:] if skip else chunk)
                end = chunk_start + length
            if got < len(batch_spans):
                break
        loaded[start:end] = True
        if end > start and kv_buffer[0].is_cuda:
            torch.cuda.current_stream(kv_buffer[0].device).synchronize()
        return loaded

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every write queued for the slower levels is written; False if ``timeout`` (default
        ``flush_timeout_s``) ran out first."""
        return self.tier.flush(timeout)

    def stats(self) -> dict[str, TierStats]:
        """Each level's counters (hits, misses, bytes, evictions, ...), by level name."""
        return self.tier.stats()

    def close(self) -> None:
        """Finish the queued writes (bounded by ``flush_timeout_s``) and close every level. Idempotent."""
        if not self._closed:
            self._closed = True
            self.tier.close()

    def __enter__(self) -> KVCacheEngine:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- checks ---------------------------------------------------------------------
    def _num_chunks(self, keyed: PromptKeys) -> int:
        """How many of the prompt's chunks the calls consider: all, or the full ones only (``save_unfull_chunk``
        False)."""
        return len(keyed.keys) if self.save_unfull_chunk else keyed.num_tokens // self.chunk_size

    def _check_open(self) -> None:
        if self._closed:
            raise PdkvError("this KVCacheEngine is closed")

    @staticmethod
    def _mask_start(mask: torch.Tensor | None, num_tokens: int, call: str) -> int:
        """Index of the mask's first True token (``num_tokens`` when none), after checking it is ``FFF...TTT``."""
        if mask is None:
            return 0
        if (
            not isinstance(mask, torch.Tensor)
            or mask.dtype != torch.bool
            or mask.dim() != 1
            or mask.numel() != num_tokens
        ):
            got = f"{tuple(mask.shape)} {mask.dtype}" if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise CacheRequestError(
                f"{call}: mask must be a 1-D torch.bool tensor with one entry per token ({num_tokens}), got {got}"
            )
        flags = mask.cpu()
        start = num_tokens - int(flags.sum())
        if bool(flags[:start].any()):
            first_true = int(flags.nonzero()[0])
            false_after = first_true + int((~flags[first_true:]).nonzero()[0])
            raise CacheRequestError(
                f"{call}: mask must be False for a prefix of the tokens and True for the rest (FFF...TTT, as in "
                f"LMCache): token {first_true} is True but token {false_after} after it is False"
            )
        return start

    def _check_buffer(self, kv_buffer: Sequence[torch.Tensor], block_table: BlockTable, num_tokens: int) -> None:
        """The buffer is in this engine's layout and the table covers every token of the call, ids in range."""
        used_blocks(self.layout, self.layout.validate_buffer(kv_buffer), block_table, 0, num_tokens)
