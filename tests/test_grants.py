"""The capability table (``pdkv.channels.grants.Grants``) against the plainest model of it: the set of bytes each
token may write in each region. Grants and revokes in any order, overlapping, touching or not (a pool's blocks, a
reservation's taken back as it lands or when it is claimed), leave it holding exactly the model's bytes and admitting
a frame exactly when every byte of every run is in the model."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdkv.channels.grants import Grants
from pdkv.errors import ChannelError

RANGES = st.lists(st.tuples(st.integers(0, 1), st.integers(0, 200), st.integers(1, 60)), min_size=1, max_size=5)


def _model_admits(model: dict[tuple[bytes, int], set[int]], token: bytes, frame: list[tuple[int, int, int]]) -> bool:
    return all(set(range(o, o + n)) <= model.get((token, r), set()) for r, o, n in frame)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    ops=st.lists(st.tuples(st.booleans(), st.sampled_from([b"a", b"b"]), RANGES), max_size=12),
    token=st.sampled_from([b"a", b"b"]),
    frame=RANGES,
)
def test_grants_admit_exactly_the_bytes_granted_and_not_revoked(
    ops: list[tuple[bool, bytes, list[tuple[int, int, int]]]], token: bytes, frame: list[tuple[int, int, int]]
) -> None:
    grants = Grants()
    for region in (0, 1):
        grants.guard(region)
    model: dict[tuple[bytes, int], set[int]] = {}
    for give, who, ranges in ops:
        for region, offset, length in ranges:
            held = model.setdefault((who, region), set())
            span = set(range(offset, offset + length))
            model[(who, region)] = held | span if give else held - span
        if give:
            grants.grant(who, "write", ranges)
        else:
            assert grants.revoke(who, "write", ranges, 0.0)
    for (who, _, region), intervals in grants._ranges.items():
        assert {b for lo, hi in intervals for b in range(lo, hi)} == model.get((who, region), set())
    if _model_admits(model, token, frame):
        grants.end(grants.begin_many(token, "write", frame))
    else:
        with pytest.raises(ChannelError, match="no write grant"):
            grants.begin_many(token, "write", frame)
