"""Where a pushed prompt's KV lands on D: vLLM's own blocks, the ones vLLM allocated past D's local prefix hit.

``landing_path`` is the rule (one function, logged at start and kept on
``WorkerSide.landing``). The receiver is built over vLLM's own KV tensors
(registered with the channel once) and ``VllmBlocks`` is its allocator: a
transfer is granted exactly the blocks D's scheduler allocated to its request
past D's local prefix hit, and its ``Reserved`` says how many tokens that hit
holds (``protocol.Reserved.held_tokens``), so P pushes only the tokens past it,
the channel writes straight into those blocks and nothing is copied afterwards.
The hit's blocks may be cached blocks other requests read: they are never
granted, so never written, with vLLM's prefix caching on (its default) or off.
A full local hit reserves nothing and moves nothing (the scheduler discards the
pushed transfer).

P pushes before D's scheduler has seen the request (the router asks D only
once P answered), so at P's first Reserve there may be no vLLM blocks for it
yet: the receiver refuses it as *retryable* (``OutOfBlocksError``) and P asks
again until the loader, handed the request's blocks, ``expect``s the
transfer, within P's ``reserve_timeout_s``. The cost: P's chunks go once D has
scheduled the request, not while P computes them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Iterable
from typing import Literal

import torch

from pdkv.blocks import BlockAllocator
from pdkv.errors import LayoutError, OutOfBlocksError
from pdkv.memory import in_reach

LandingPath = Literal["direct", "staged"]


def landing_path(kv: torch.Tensor, channel_memory: Collection[str]) -> LandingPath:
    """Where D's receiver lands pushed KV, given vLLM's cache (one of its tensors) and the channel.

    * ``direct``: the channel addresses the memory vLLM's cache is in (any
      channel and a host cache; nixl and a CUDA cache): the channel writes
      into the request's blocks.
    * ``staged``: it does not (tcp or ucx and a CUDA cache, or emulated device
      memory): chunks land in the receiver's pinned host staging slots and are
      scattered into the request's blocks on the cache's device, on pdkv's own
      stream (``pdkv.staging``). Layouts that differ between P and D (block
      size, head order, a codec) are staged whatever the memory: the receiver
      admits them in staging mode (``admission.admit``).

    vLLM's prefix caching does not decide: the blocks of D's own hit are never
    granted (module docstring). Layouts pdkv cannot describe never get here:
    ``kvcache.vllm_cache_layout`` refuses them by name at start.
    """
    return "direct" if in_reach(kv, channel_memory) else "staged"


class VllmBlocks(BlockAllocator):
    """The receiver's allocator over vLLM's own cache: a transfer gets the blocks vLLM allocated to its request.

    vLLM owns every block; pdkv holds a request's blocks from the grant
    until the receiver frees them (handed over, or failed and fenced), and
    ``withdraw`` waits for that before a failure is reported, so vLLM never
    recomputes into blocks a late write of P's may still land in. The
    transfers of one request (``group``: the head windows several prefill
    ranks push when P runs more tensor-parallel ranks than D) are granted the
    same blocks, each landing its own heads; the blocks are vLLM's again once
    every one of them freed its grant.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise LayoutError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._cond = threading.Condition()
        # transfer id -> the vLLM blocks its request was allocated past D's local prefix hit, that hit in tokens, and
        # the request's group
        self._expected: dict[str, tuple[list[int], int, str]] = {}
        self._granted: dict[str, list[int]] = {}  # transfer id -> blocks the receiver granted (writable by P)
        self._members: dict[str, set[str]] = {}  # group -> its transfers holding a grant
        self._owner: dict[int, str] = {}  # granted block -> the group of the transfers it is granted to

    @property
    def num_free(self) -> int:
        """Blocks of vLLM's cache not held for a transfer (vLLM's own use is vLLM's business)."""
        with self._cond:
            return self.num_blocks - len(self._owner)

    @property
    def num_used(self) -> int:
        with self._cond:
            return len(self._owner)

    def expect(self, transfer_id: str, block_ids: list[int], held_tokens: int = 0, group: str = "") -> None:
        """Let ``transfer_id`` be granted ``block_ids``: vLLM's blocks for its request past its ``held_tokens`` (D's
        local prefix hit, which P then does not push), in prompt order. Blocks of the hit are never granted: they
        may be cached blocks other requests read. ``group``: the request, when several transfers land in its
        blocks (each its own heads); default: the transfer alone."""
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad or len(set(block_ids)) != len(block_ids) or held_tokens < 0:
            raise LayoutError(
                f"vLLM blocks {block_ids} past {held_tokens} tokens for transfer {transfer_id!r}: ids must be distinct "
                f"and in [0, {self.num_blocks}), the tokens held not negative"
            )
        with self._cond:
            self._expected[transfer_id] = (list(block_ids), held_tokens, group or transfer_id)

    def allocate(self, n: int) -> list[int]:
        raise OutOfBlocksError("vLLM's blocks are granted per transfer, to the request vLLM allocated them to")

    def held_for(self, transfer_id: str) -> int:
        """D's local prefix hit for the transfer's request, once the loader expects it (0 until then)."""
        with self._cond:
            return self._expected.get(transfer_id, ([], 0, ""))[1]

    def allocate_for(self, transfer_id: str, n: int, held: int = 0) -> list[int]:
        """The first ``n`` blocks past the request's local hit, once the loader expects them, for a transfer admitted
        past ``held`` tokens; until then (or if the loader's word came between ``held_for`` and here) a retryable
        refusal."""
        with self._cond:
            blocks, expected_held, group = self._expected.get(transfer_id, (None, 0, ""))
            if blocks is None or expected_held != held:
                raise OutOfBlocksError(
                    f"D's scheduler has not allocated vLLM blocks for transfer {transfer_id!r} past {held} tokens yet "
                    "(P asks again)"
                )
            taken_elsewhere = sum(self._owner.get(b, group) != group for b in blocks[:n])
            if len(blocks) < n or taken_elsewhere:
                raise OutOfBlocksError(
                    f"transfer {transfer_id!r} needs {n} blocks; vLLM allocated {len(blocks)} to its request, "
                    f"{taken_elsewhere} of them held by another request's transfer"
                )
            del self._expected[transfer_id]
            taken = self._granted[transfer_id] = blocks[:n]
            self._members.setdefault(group, set()).add(transfer_id)
            self._owner.update(dict.fromkeys(taken, group))
        return list(taken)

    def free(self, blocks: Iterable[int]) -> None:
        """The receiver is done with these blocks (handed over or failed and fenced) for one transfer: they are
        vLLM's alone again once no transfer of their group holds them."""
        blocks = list(blocks)
        if not blocks:
            return
        with self._cond:
            group = self._owner.get(blocks[0], "")
            members = self._members.get(group, set())
            holder = next((t for t in members if self._granted[t] == blocks), None)
            if holder is None:
                raise LayoutError(f"free of vLLM blocks not granted as one transfer (double free?): {blocks}")
            del self._granted[holder]
            members.discard(holder)
            if not members:  # the group's last grant: the blocks are vLLM's again
                del self._members[group]
                for b in blocks:
                    del self._owner[b]
            self._cond.notify_all()

    def withdraw(self, transfer_id: str, timeout: float) -> bool:
        """Grant ``transfer_id`` nothing more; wait (``timeout`` s) until blocks granted to it were freed.

        False if they were not within ``timeout``: a late write may still land in them.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            self._expected.pop(transfer_id, None)
            while transfer_id in self._granted:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True
