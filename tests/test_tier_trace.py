"""The Mooncake trace replayed through the real memory level, as `pdkv bench ttft` does.

The trace lives beside the repository (../shared/data/mooncake-traces/, or
$PDKV_MOONCAKE_TRACE); without it these tests are skipped with that reason.
"""

from __future__ import annotations

import numpy as np
import pytest

from pdkv.bench.ttft import (
    TRACE_BLOCK_TOKENS,
    block_tokens,
    infinite_hit_rate,
    load_trace,
    simulated_hit_rate,
    trace_keys,
    trace_path,
)
from pdkv.keys import chunk_keys
from pdkv.tier.policy import POLICIES

TRACE = trace_path()
pytestmark = pytest.mark.skipif(TRACE is None, reason="the Mooncake trace is not beside the repository (../shared/data/mooncake-traces/) and $PDKV_MOONCAKE_TRACE is unset")


def test_the_trace_bound_is_the_documented_one() -> None:
    assert TRACE is not None
    seen: set[int] = set()
    hits = total = 0
    for r in load_trace(TRACE):
        hits += sum(h in seen for h in r.hash_ids)
        total += len(r.hash_ids)
        seen.update(r.hash_ids)
    assert round(hits / total, 3) == 0.366


def test_trace_keys_are_what_a_worker_computes_for_the_prompt() -> None:
    assert TRACE is not None
    requests = load_trace(TRACE, limit=40)
    keys = trace_keys(requests, "fp")
    for r, ks in list(zip(requests, keys, strict=True))[::8]:
        prompt = np.concatenate([block_tokens(h) for h in r.hash_ids])
        assert chunk_keys(prompt, "fp", TRACE_BLOCK_TOKENS) == ks


@pytest.fixture(scope="module")
def keys() -> list[list[bytes]]:
    assert TRACE is not None
    return trace_keys(load_trace(TRACE, limit=1000), "fp")


@pytest.mark.parametrize("policy", POLICIES)
def test_memory_level_reaches_the_bound_only_when_nothing_is_evicted(keys: list[list[bytes]], policy: str) -> None:
    bound = infinite_hit_rate(keys)
    unique = len({k for ks in keys for k in ks})
    assert simulated_hit_rate(keys, unique, policy) == pytest.approx(bound)
    assert 0 < simulated_hit_rate(keys, 256, policy) < bound
