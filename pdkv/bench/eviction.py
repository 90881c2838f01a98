"""Eviction on a prefix-chained trace: the offline optimum, policy replays, their cost (`pdkv bench ttft`, part 2).

A trace here is a list of requests, each the chained chunk keys of its
prompt (``pdkv.keys``), all chunks the same size. A request is served the
way a worker is: it looks its keys up and is credited the *leading run* of
cached ones (a lookup stops at the first miss), then stores the ones it
computed. The block hit rate is credited chunks over all chunks.

What the optimum (``optimum``) maximizes: that credit summed over the
requests, over every schedule in which the cache holds at most C chunks
between two requests and a chunk enters only when a request that contains
it is served (then its KV exists). It is exact, not a heuristic bound.
Relax the credit to "every cached chunk of the request counts", whether or
not the chunks before it are cached: that can only raise any schedule's
score, and the relaxed problem is plain caching with optional admission of
unit-size items (each request a batch of distinct keys), whose optimum is
Belady's MIN (keep the C chunks whose next use is soonest, among the cached
ones and the request's own; drop chunks never used again; the usual
exchange argument holds for batches, and ties do not change the relaxed
score). On chained keys a parent is in every request its
child is in, so its next use is never later than its child's; breaking ties
children-first therefore keeps the cache closed under parents, and in such
a cache a request's cached chunks are exactly a leading run. That schedule
scores the same under both credits, so the relaxed upper bound is reached
by a real schedule: it is the optimum for the trace's credit, for any
policy, online or offline, with or without admission control. The run
checks the two scores are equal. MIN with ties broken parents-first
(``optimum(...).min_parents_first``) is the same relaxed optimum credited
the trace's way: what a block-level MIN loses to children kept without
their parent.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections.abc import Sequence

from pdkv.errors import PdkvError
from pdkv.tier.policy import EvictionPolicy, make_policy

Requests = Sequence[Sequence[bytes]]
NEVER = 1 << 62  # the next use of a chunk used no more


def next_uses(requests: Requests) -> list[list[int]]:
    """For each request and chunk, the index of the next request that asks for the chunk again (``NEVER`` if none)."""
    out: list[list[int]] = [[] for _ in requests]
    seen: dict[bytes, int] = {}
    for t in range(len(requests) - 1, -1, -1):
        out[t] = [seen.get(k, NEVER) for k in requests[t]]
        for k in requests[t]:
            seen[k] = t
    return out


def infinite_hit_rate(requests: Requests) -> float:
    """Share of all chunks seen before: what an unbounded cache is credited."""
    seen: set[bytes] = set()
    hits = total = 0
    for keys in requests:
        total += len(keys)
        hits += sum(k in seen for k in keys)
        seen.update(keys)
    return hits / total


@dataclasses.dataclass(frozen=True)
class Optimum:
    """The offline optimum at one size, as hit rates (see the module docstring)."""

    capacity_blocks: int
    hit_rate: float  # the optimum: MIN with ties children-first, credited the trace's way
    relaxed_hit_rate: float  # MIN credited per cached chunk (an upper bound; equal to ``hit_rate``)
    min_parents_first: float  # MIN with ties parents-first, credited the trace's way


def _min(
    requests: Requests, nexts: Sequence[Sequence[int]], capacity: int, children_first: bool
) -> tuple[int, int, int]:
    """Belady's MIN with optional admission over unit chunks: (leading-run hits, per-chunk hits, chunks)."""
    cache: dict[bytes, tuple[int, int]] = {}
    heap: list[tuple[int, int, bytes]] = []  # max-heap through negation: latest next use, then the tie-break, first
    run_hits = block_hits = total = 0
    for t, keys in enumerate(requests):
        leading = True
        for k in keys:
            if k in cache:
                block_hits += 1
                run_hits += leading
            else:
                leading = False
        total += len(keys)
        for depth, (k, nxt) in enumerate(zip(keys, nexts[t], strict=True)):
            if nxt == NEVER:
                cache.pop(k, None)
                continue
            rank = (nxt, depth if children_first else -depth)
            cache[k] = rank
            heapq.heappush(heap, (-rank[0], -rank[1], k))
        while len(cache) > capacity:
            nxt_neg, tie_neg, k = heapq.heappop(heap)
            if cache.get(k) == (-nxt_neg, -tie_neg):
                del cache[k]
        if len(heap) > 4 * len(cache) + 1024:  # drop stale entries
            heap = [(-r[0], -r[1], k) for k, r in cache.items()]
            heapq.heapify(heap)
    return run_hits, block_hits, total


def optimum(requests: Requests, capacity_blocks: int, nexts: Sequence[Sequence[int]] | None = None) -> Optimum:
    """The best block hit rate any policy can reach on ``requests`` holding ``capacity_blocks`` chunks."""
    if capacity_blocks < 1:
        raise PdkvError(f"the optimum needs a capacity of at least one chunk, got {capacity_blocks}")
    nexts = next_uses(requests) if nexts is None else nexts
    run_hits, block_hits, total = _min(requests, nexts, capacity_blocks, children_first=True)
    if run_hits != block_hits:  # the proof in the module docstring says this cannot happen on chained keys
        raise PdkvError(
            f"MIN with ties children-first credited {run_hits} leading-run hits but {block_hits} chunk hits: are the "
            "keys prefix-chained?"
        )
    parents_first, _, _ = _min(requests, nexts, capacity_blocks, children_first=False)
    return Optimum(capacity_blocks, run_hits / total, block_hits / total, parents_first / total)


def reuse_oracle_lru(requests: Requests, capacity_blocks: int, nexts: Sequence[Sequence[int]] | None = None) -> float:
    """LRU that is told which chunks will ever be asked for again (and keeps only those): a reference, not a policy.

    What an online policy lacks is knowledge of the future; this separates
    the part "will it come back" from "when": if it reaches the optimum, the
    gap left by the online policies is the question of which prompts return.
    """
    nexts = next_uses(requests) if nexts is None else nexts
    order: dict[bytes, None] = {}  # insertion-ordered: oldest first
    hits = total = 0
    for t, keys in enumerate(requests):
        for k in keys:
            if k not in order:
                break
            hits += 1
        total += len(keys)
        for k, nxt in zip(keys, nexts[t], strict=True):
            order.pop(k, None)
            if nxt != NEVER:
                order[k] = None
        while len(order) > capacity_blocks:
            del order[next(iter(order))]
    return hits / total


@dataclasses.dataclass(frozen=True)
class Replay:
    """One policy on one trace at one size, replayed on the policy alone (no values)."""

    policy: str
    capacity_blocks: int
    hit_rate: float
    unreachable_share: (
        float  # mean share of cached chunks a lookup cannot reach (an earlier chunk of their prompt is not cached)
    )


def policy_replay(requests: Requests, capacity_blocks: int, policy: str, samples: int = 24) -> Replay:
    """Serve ``requests`` through the ``policy`` as ``MemoryTier`` does (look up, touch the leading run, admit the
    rest with parents).

    ``samples`` times along the way, count the cached chunks whose parent
    chain is broken (unreachable by any lookup): the bytes a policy that
    evicts parents before children wastes.
    """
    p = make_policy(policy, capacity_blocks)
    parent: dict[bytes, bytes | None] = {}
    resident: set[bytes] = set()
    every = max(len(requests) // samples, 1)
    shares: list[float] = []
    hits = total = 0
    for t, keys in enumerate(requests):
        got = serve(p, keys, resident)
        hits += got
        total += len(keys)
        for i, k in enumerate(keys):
            parent.setdefault(k, keys[i - 1] if i else None)
        if t % every == every - 1 and resident:
            shares.append(_unreachable(resident, parent) / len(resident))
    return Replay(policy, capacity_blocks, hits / total, sum(shares) / len(shares) if shares else 0.0)


def serve(p: EvictionPolicy, keys: Sequence[bytes], resident: set[bytes] | None = None) -> int:
    """One request through a policy of unit chunks; returns the leading run it was credited."""
    got = 0
    for k in keys:
        if k not in p:
            break
        got += 1
    for k in keys[:got]:
        p.touch(k)
    for i in range(got, len(keys)):
        k = keys[i]
        if k in p:
            continue
        victims = p.admit(k, 1, keys[i - 1] if i else None)
        if resident is not None:
            resident.difference_update(victims or ())
            resident.add(k)
    return got


def _unreachable(resident: set[bytes], parent: dict[bytes, bytes | None]) -> int:
    """How many resident chunks have an ancestor that is not resident."""
    reachable: dict[bytes, bool] = {}

    def walk(k: bytes) -> bool:
        path = []
        while k not in reachable:
            up = parent[k]
            if up is None:
                reachable[k] = True
                break
            if up not in resident:
                reachable[k] = False
                break
            path.append(k)
            k = up
        ok = reachable[k]
        for node in path:
            reachable[node] = ok
        return ok

    return sum(not walk(k) for k in resident)


def policy_costs(
    requests: Requests, policies: Sequence[str], capacity_blocks: int = 100_000, repeats: int = 3
) -> list[dict[str, float | str]]:
    """Microseconds each policy spends per request and per chunk (lookup run, touches, admissions, evictions), best of
    ``repeats`` replays taken in turns, with the ratio to the first policy's (the baseline) from the same run."""
    chunks = sum(map(len, requests))
    best = dict.fromkeys(policies, float("inf"))
    for _ in range(repeats):
        for policy in policies:
            p = make_policy(policy, capacity_blocks)
            start = time.perf_counter()
            for keys in requests:
                serve(p, keys)
            best[policy] = min(best[policy], time.perf_counter() - start)
    base = best[policies[0]]
    return [
        {
            "policy": policy,
            "capacity_blocks": capacity_blocks,
            "us_per_request": round(s / len(requests) * 1e6, 2),
            "us_per_chunk": round(s / chunks * 1e6, 3),
            "ratio": round(s / base, 3),
        }
        for policy, s in best.items()
    ]
