"""The cache tier's backend contract as checks: what a backend author runs against a level before shipping it.

pdkv/tier/README.md, "The backend contract", says what a level must do;
each rule there is one function here (``RULES``), run against the level
through a ``Harness`` the author fills in: how to open a handle on the store
(``open``), and where it applies, how to reach its stored values around the
level (``raw``: the kit damages, swaps and plants values with it), a handle
on a store that does not answer (``dead``), whether two handles share one
store (``shared``), whether a secret seals values (``seals``) and how to point
the level at a store that misbehaves (``hostile``: the kit runs that store on
127.0.0.1, ``pdkv.testing.hostile``, and holds the level to its bounds: a
trickle is cut at its timeout, a huge declared value is not read, a
malformed answer is a counted failure, never an exception). A rule that
cannot apply (a memory level's values never leave the process: there is
nothing to damage) reports why instead of passing silently::

    from pdkv.testing.tier_conformance import Harness, run_conformance

    def test_my_backend_keeps_the_contract(tmp_path):
        report = run_conformance(Harness(open=lambda layout, secret: MyTier(layout, MyTier.Options(...), "mine"),
                                         raw=..., dead=..., shared=True, seals=True))
        assert not [rule for rule, result in report.items() if result != "passed"]

``run_conformance`` runs every rule and raises ``ConformanceError`` naming
each one broken; ``check(rule, harness)`` runs one (for
``pytest.mark.parametrize("rule", RULES)``). Keys are fresh per run (a
fingerprint of their own), so a shared store can be checked again and again.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import torch

from pdkv.errors import LayoutError
from pdkv.keys import chunk_keys
from pdkv.layout import KVLayout
from pdkv.testing.hostile import HUGE_BYTES, HostileServer
from pdkv.tier.base import MAGIC, CacheTier

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
TOKENS = 8
HANG_S = 60.0  # a call on a dead store that takes longer than this is a hang, whatever its timeouts
# chunks of 24 tokens of this are 6 MiB: over S3's smallest part (5 MiB), so a backend that uploads in parts does
LARGE = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=8, dtype="float32")
LARGE_TOKENS = 24


class ConformanceError(AssertionError):
    """A backend broke a rule of the contract; the message names the rule and what happened."""


@dataclass
class Raw:
    """The store's values as bytes, reached around the level: by chunk key, the stored value (None: absent)."""

    read: Callable[[bytes], bytes | None]
    write: Callable[[bytes, bytes], None]


@dataclass
class Hostile:
    """How the kit points a level at a misbehaving store. ``serve(behaviour, timeout_s)`` runs one on 127.0.0.1
    (``pdkv.testing.hostile``: ``resp_server``, ``s3_server``, or your protocol's own); ``open(layout, address)``
    opens a handle on the store at ``address`` ("127.0.0.1:PORT") whose timeout per request is ``timeout_s``."""

    serve: Callable[[str, float], AbstractContextManager[HostileServer]]
    open: Callable[[KVLayout, str], CacheTier]
    timeout_s: float = 0.5


@dataclass
class Harness:
    """How the kit reaches a backend. ``open(layout, secret)`` opens a handle on the store under test (``secret`` is
    "" unless ``seals``); the kit closes every handle it opens."""

    open: Callable[[KVLayout, str], CacheTier]
    raw: Raw | None = None  # None: values never leave the process (a memory level)
    dead: Callable[[KVLayout], CacheTier] | None = None  # a handle on a store that does not answer (None: local)
    shared: bool = False  # handles open at once see one store (a server), as two workers do
    seals: bool = False  # a secret seals values (pdkv.tier.base): written without it, they are misses
    hostile: Hostile | None = None  # None: a local level (no store on the network to misbehave)


class _Run:
    """One run's fresh keys and chunks."""

    def __init__(self) -> None:
        self.fingerprint = f"conformance-{uuid.uuid4().hex}"
        self._count = 0

    def keys(self, n: int, salt: str = "", base: int | None = None) -> list[bytes]:
        """``n`` prefix-chained keys of one new prompt (the same prompt again with ``base``)."""
        if base is None:
            base, self._count = self._count, self._count + 1
        return chunk_keys([base * 100_000 + i for i in range(n * TOKENS)], self.fingerprint, TOKENS, salt)


def chunk(seed: int, tokens: int = TOKENS) -> torch.Tensor:
    return torch.randn(LAYOUT.chunk_shape(tokens), generator=torch.Generator().manual_seed(seed))


def buffers(n: int, tokens: int = TOKENS) -> list[torch.Tensor]:
    """Read buffers full of NaN: a byte a miss wrote shows."""
    return [torch.full(LAYOUT.chunk_shape(tokens), float("nan")) for _ in range(n)]


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise ConformanceError(what)


def _totals(tier: CacheTier) -> dict[str, int]:
    """hits, misses and errors (rejected values included) over the level's stats."""
    out = {"hits": 0, "misses": 0, "errors": 0}
    for s in tier.stats().values():
        out["hits"] += s.hits
        out["misses"] += s.misses
        out["errors"] += s.errors
    return out


@contextmanager
def _opened(h: Harness, secret: str = "", layout: KVLayout = LAYOUT) -> Iterator[CacheTier]:
    tier = h.open(layout, secret)
    try:
        yield tier
    finally:
        tier.close()


def _flushed(tier: CacheTier) -> None:
    """Wait for writes a level queued (a composed cache writes behind); a plain level wrote already."""
    flush = getattr(tier, "flush", None)
    if flush is not None:
        _expect(flush(30.0), "queued writes did not finish within 30 s")


# -- the rules ----------------------------------------------------------------------------
def round_trip(h: Harness, run: _Run) -> str | None:
    """Batched put, has, get: what was put reads back bit for bit, counted as hits, the first absent key a miss."""
    ks = run.keys(5)
    data = [chunk(i) for i in range(4)]
    with _opened(h) as tier:
        before = _totals(tier)
        tier.put(ks[:4], data, [None, *ks[:3]])
        _flushed(tier)
        _expect(tier.has(ks) == [True] * 4 + [False], f"has after putting 4 of 5 keys: {tier.has(ks)}")
        outs = buffers(5)
        got = tier.get(ks, outs)
        _expect(got == 4, f"get of 4 stored keys and an absent one returned {got}, expected 4")
        _expect(all(torch.equal(o, d) for o, d in zip(outs, data, strict=False)), "a chunk read back differs")
        _expect(bool(outs[4].isnan().all()), "a miss wrote into its buffer")
        after = _totals(tier)
        _expect(after["hits"] - before["hits"] == 4, f"hits counted {after['hits'] - before['hits']}, expected 4")
        _expect(after["misses"] - before["misses"] == 1, "the absent key was not counted as one miss")
    return None


def prefix_shaped(h: Harness, run: _Run) -> str | None:
    """get and contains stop at the first absent key, even when later keys are stored."""
    ks = run.keys(4)
    with _opened(h) as tier:
        tier.put([ks[0], ks[1], ks[3]], [chunk(0), chunk(1), chunk(3)])
        _flushed(tier)
        _expect(tier.contains(ks) == 2, f"contains over a gap at 2: {tier.contains(ks)}")
        outs = buffers(4)
        _expect(tier.get(ks, outs) == 2, "get did not stop at the gap")
        _expect(bool(outs[2].isnan().all() and outs[3].isnan().all()), "get wrote past the gap")
    return None


def empty_batches(h: Harness, run: _Run) -> str | None:
    """Empty batches are answered, not refused."""
    with _opened(h) as tier:
        _expect(tier.has([]) == [] and tier.get([], []) == 0 and tier.remove([]) == 0, "an empty batch misanswered")
        tier.put([], [])
    return None


def first_write_stays(h: Harness, run: _Run) -> str | None:
    """A key already stored is left as it is: a second put of it changes nothing."""
    ks = run.keys(1)
    with _opened(h) as tier:
        tier.put(ks, [chunk(10)])
        _flushed(tier)
        tier.put(ks, [chunk(11)])
        _flushed(tier)
        outs = buffers(1)
        _expect(tier.get(ks, outs) == 1 and torch.equal(outs[0], chunk(10)), "a second put replaced the first value")
    return None


def remove(h: Harness, run: _Run) -> str | None:
    """remove drops the keys and answers how many were stored."""
    ks = run.keys(4)
    with _opened(h) as tier:
        tier.put(ks[:3], [chunk(i) for i in range(3)])
        _flushed(tier)
        removed = tier.remove([ks[0], ks[1], ks[3]])
        _expect(removed == 2, f"remove of 2 stored keys and an absent one returned {removed}")
        _expect(tier.has(ks[:3]) == [False, False, True], f"has after remove: {tier.has(ks[:3])}")
        _expect(tier.get(ks[:1], buffers(1)) == 0, "a removed key was served")
    return None


def shape_is_checked(h: Harness, run: _Run) -> str | None:
    """A chunk asked for as another token count is a miss, not an error and not KV."""
    ks = run.keys(1)
    with _opened(h) as tier:
        tier.put(ks, [chunk(20)])
        _flushed(tier)
        outs = buffers(1, TOKENS // 2)
        _expect(tier.get(ks, outs) == 0, "a chunk stored for 8 tokens was served as 4")
    return None


def arguments_are_checked(h: Harness, run: _Run) -> str | None:
    """Malformed calls raise LayoutError before anything is stored: a count mismatch, a short key, a wrong shape."""
    ks = run.keys(2)
    calls: dict[str, Callable[[CacheTier], object]] = {
        "two keys, one chunk": lambda t: t.put(ks, [chunk(0)]),
        "a 5-byte key": lambda t: t.put([b"short"], [chunk(0)]),
        "a chunk of another shape": lambda t: t.put(ks[:1], [torch.zeros(3, 3)]),
        "one key, two buffers": lambda t: t.get(ks[:1], buffers(2)),
    }
    with _opened(h) as tier:
        for what, call in calls.items():
            try:
                call(tier)
            except LayoutError:
                continue
            raise ConformanceError(f"{what}: no LayoutError")
        _expect(tier.has(ks) == [False, False], "a refused put stored something")
    return None


def _bad_values(good: bytes, other: bytes) -> dict[str, bytes]:
    flipped = bytearray(good)
    flipped[-40] ^= 0x01  # in the payload (or a seal's tag)
    old = bytearray(good)
    old[: len(MAGIC)] = b"PDKVKV01"
    return {
        "a flipped payload byte": bytes(flipped),
        "truncated": good[:-100],
        "not a chunk": b"garbage",
        "an old format version": bytes(old),
        "another key's value": other,
    }


def damaged_values_are_misses(h: Harness, run: _Run) -> str | None:
    """A corrupt, truncated, foreign-format or swapped value is a counted miss, never KV; the next put repairs it."""
    if h.raw is None:
        return "values never leave the process: there are no stored bytes to damage"
    ks = run.keys(6)  # five to damage (``_bad_values``), the last one's value swapped in
    with _opened(h) as tier:
        tier.put(ks, [chunk(30 + i) for i in range(len(ks))])
        _flushed(tier)
        good, other = h.raw.read(ks[0]), h.raw.read(ks[-1])
        _expect(good is not None and other is not None, "raw.read found no value for a key just put")
        assert good is not None and other is not None
        for (what, value), key in zip(_bad_values(good, other).items(), ks, strict=False):
            h.raw.write(key, value)
            before = _totals(tier)
            outs = buffers(1)
            _expect(tier.get([key], outs) == 0, f"{what}: served")
            _expect(_totals(tier)["errors"] > before["errors"], f"{what}: the refusal was not counted")
            tier.put([key], [chunk(99)])  # repaired by the next store
            _flushed(tier)
            _expect(tier.get([key], outs) == 1 and torch.equal(outs[0], chunk(99)), f"{what}: not replaced by a put")
    return None


def other_salt_is_another_partition(h: Harness, run: _Run) -> str | None:
    """The same tokens under another salt are other keys: a miss; a value copied there from the first salt is a
    counted miss (its header names the key it was written for), also for a handle opened after it was planted."""
    a, b = run.keys(1, salt="tenant-a", base=7), run.keys(1, salt="tenant-b", base=7)
    _expect(a != b, "two salts gave the same key")
    with _opened(h) as tier:
        tier.put(a, [chunk(40)])
        _flushed(tier)
        _expect(tier.get(b, buffers(1)) == 0, "a chunk stored under one salt was served under another")
    if h.raw is None:
        return None
    value = h.raw.read(a[0])
    _expect(value is not None, "raw.read found no value for a key just put")
    assert value is not None
    h.raw.write(b[0], value)
    with _opened(h) as tier:  # a level that indexes its store at start (disk) sees the planted value too
        outs = buffers(1)
        _expect(tier.get(b, outs) == 0, "a value written under another salt's key was served")
        _expect(bool(outs[0].isnan().all()), "a foreign value reached the buffer")
        _expect(_totals(tier)["errors"] == 1, "the foreign value was not counted as one error")
    return None


def sealed(h: Harness, run: _Run) -> str | None:
    """With a secret, only values sealed with it are served: one written without it, or with another, is a counted
    miss; a reader without a secret still reads sealed values."""
    if not (h.seals and h.shared):
        return "the backend does not seal values" if not h.seals else "one handle at a time: nobody else writes"
    ks = run.keys(3)
    with _opened(h, "conformance-secret") as tier:
        for i, writer_secret in enumerate(("", "another-secret")):
            with _opened(h, writer_secret) as writer:
                writer.put(ks[i : i + 1], [chunk(50 + i)])
                _flushed(writer)
            before = _totals(tier)
            outs = buffers(1)
            _expect(tier.get(ks[i : i + 1], outs) == 0, f"a value sealed with {writer_secret or 'no secret'!r} served")
            _expect(bool(outs[0].isnan().all()), "an unsealed value reached the buffer")
            _expect(_totals(tier)["errors"] > before["errors"], "the unsealed value was not counted")
        tier.put(ks[2:], [chunk(52)])
        _flushed(tier)
        with _opened(h) as reader:
            outs = buffers(1)
            _expect(reader.get(ks[2:], outs) == 1 and torch.equal(outs[0], chunk(52)), "a sealed value unreadable")
    return None


def shared_between_handles(h: Harness, run: _Run) -> str | None:
    """What one handle stores, another handle on the same store serves (two workers on one server)."""
    if not h.shared:
        return "one handle at a time (a local level)"
    ks = run.keys(2)
    with _opened(h) as writer, _opened(h) as reader:
        writer.put(ks, [chunk(60), chunk(61)])
        _flushed(writer)
        outs = buffers(2)
        _expect(reader.get(ks, outs) == 2 and torch.equal(outs[1], chunk(61)), "another handle did not see the put")
    return None


def dead_store_is_a_miss(h: Harness, run: _Run) -> str | None:
    """A store that does not answer costs misses and a logged warning, never an exception, and no call hangs."""
    if h.dead is None:
        return "a local level: no server to lose"
    ks = run.keys(2)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    pdkv_log = logging.getLogger("pdkv")
    pdkv_log.addHandler(handler)
    tier = h.dead(LAYOUT)
    try:
        start = time.monotonic()
        tier.ping()
        tier.put(ks, [chunk(70), chunk(71)])
        _flushed(tier)
        answers = (tier.has(ks), tier.get(ks, buffers(2)), tier.contains(ks), tier.remove(ks))
        took = time.monotonic() - start
    finally:
        tier.close()
        pdkv_log.removeHandler(handler)
    _expect(answers == ([False, False], 0, 0, 0), f"a dead store answered {answers}")
    _expect(took < HANG_S, f"calls on a dead store took {took:.0f}s: they must be bounded by the level's timeouts")
    _expect(_totals(tier)["errors"] >= 1, "the failure was not counted in stats().errors")
    _expect(bool(records), "no warning was logged")
    return None


def concurrent_writers(h: Harness, run: _Run) -> str | None:
    """Threads writing one key at once leave one whole value (one of theirs), and threads reading and writing
    their own keys at once each read back exactly what they wrote."""
    (key,) = run.keys(1)
    own = [run.keys(3) for _ in range(4)]
    errors: list[BaseException] = []
    with _opened(h) as tier:
        start = threading.Barrier(8)

        def write_one(seed: int) -> None:
            try:
                start.wait(10)
                tier.put([key], [chunk(80 + seed)])
            except BaseException as exc:  # noqa: BLE001 - reported below, with the rule's name
                errors.append(exc)

        def own_keys(i: int) -> None:
            try:
                start.wait(10)
                for _ in range(3):
                    tier.put(own[i], [chunk(90 + 3 * i + j) for j in range(3)])
                    _flushed(tier)
                    outs = buffers(3)
                    got = tier.get(own[i], outs)
                    if got != 3 or not all(torch.equal(outs[j], chunk(90 + 3 * i + j)) for j in range(3)):
                        raise ConformanceError(f"thread {i} read {got} of its 3 chunks, or other bytes")
            except BaseException as exc:  # noqa: BLE001 - reported below, with the rule's name
                errors.append(exc)

        threads = [threading.Thread(target=write_one, args=(i,)) for i in range(4)]
        threads += [threading.Thread(target=own_keys, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(HANG_S)
        _expect(not any(t.is_alive() for t in threads), "a thread hung")
        _expect(not errors, f"concurrent calls failed: {errors[:3]}")
        _flushed(tier)
        outs = buffers(1)
        _expect(tier.get([key], outs) == 1, "after 4 concurrent puts of one key, it is not served")
        _expect(any(torch.equal(outs[0], chunk(80 + i)) for i in range(4)), "the value is none of the 4 written")
    return None


@contextmanager
def _hostile(h: Harness, behaviour: str, layout: KVLayout = LAYOUT) -> Iterator[tuple[CacheTier, HostileServer]]:
    """A handle on a store that misbehaves as ``behaviour`` says, and the store."""
    assert h.hostile is not None
    with h.hostile.serve(behaviour, h.hostile.timeout_s) as server:
        tier = h.hostile.open(layout, server.address)
        try:
            yield tier, server
        finally:
            tier.close()


def _bounded_miss(h: Harness, run: _Run, behaviour: str, what: str = "get") -> tuple[float, HostileServer]:
    """Ask a store misbehaving as ``behaviour`` about one key (``what``: get or has): a counted miss, never an
    exception; how long the call took, and the store."""
    (key,) = run.keys(1)
    with _hostile(h, behaviour) as (tier, server):
        before = _totals(tier)
        outs = buffers(1)
        start = time.monotonic()
        try:
            answer = tier.get([key], outs) if what == "get" else tier.has([key])
        except Exception as exc:
            raise ConformanceError(f"{what} raised {type(exc).__name__}: {exc}") from exc
        took = time.monotonic() - start
        _expect(
            answer in (0, [False]) and bool(outs[0].isnan().all()),
            f"{what} answered {answer} from a store that {behaviour}s",
        )
        _expect(_totals(tier)["errors"] > before["errors"], f"a store that {behaviour}s: the failure was not counted")
    return took, server


def trickle_is_cut_at_the_timeout(h: Harness, run: _Run) -> str | None:
    """A store that trickles its answers (a byte every quarter of the timeout: no socket read ever times out) costs
    a read (get, has) at most about its timeout per request, then a counted miss."""
    if h.hostile is None:
        return "a local level: no store on the network"
    for what in ("get", "has"):
        took, _ = _bounded_miss(h, run, "trickle", what)
        limit = 3 * h.hostile.timeout_s
        _expect(
            took < limit, f"a trickled answer held {what} {took:.1f}s, the level's timeout is {h.hostile.timeout_s:g}s"
        )
    return None


def huge_value_is_not_read(h: Harness, run: _Run) -> str | None:
    """A store that declares a value far longer than a chunk's (a gigabyte) is refused before the value is read:
    the read ends within about the timeout, a counted miss, and the client takes in a small part of it at most."""
    if h.hostile is None:
        return "a local level: no store on the network"
    took, server = _bounded_miss(h, run, "huge")
    _expect(
        server.sent < HUGE_BYTES // 4,
        f"the client read {server.sent >> 20} MiB of a value declared longer than a chunk's: it must stop at its "
        "declared length",
    )
    _expect(took < 3 * h.hostile.timeout_s, f"a huge answer held get {took:.1f}s")
    return None


def malformed_answer_is_a_counted_failure(h: Harness, run: _Run) -> str | None:
    """A store whose answers break the protocol (a length that is not a number, a multipart upload without its id)
    costs counted failures, never an exception: puts (a large chunk too) are no-ops, reads misses."""
    if h.hostile is None:
        return "a local level: no store on the network"
    small, large = run.keys(1), run.keys(1)
    with _hostile(h, "malformed", LARGE) as (tier, _):
        start = time.monotonic()
        try:
            tier.put(large, [torch.zeros(LARGE.chunk_shape(LARGE_TOKENS))])
            tier.put(small, [torch.zeros(LARGE.chunk_shape(TOKENS))])
            got = tier.get(small + large, [torch.empty(LARGE.chunk_shape(t)) for t in (TOKENS, LARGE_TOKENS)])
        except Exception as exc:
            raise ConformanceError(f"a malformed answer escaped as {type(exc).__name__}: {exc}") from exc
        took = time.monotonic() - start
        _expect(got == 0, f"get served {got} chunks from a store that answers malformed")
        _expect(_totals(tier)["errors"] >= 1, "malformed answers: no failure counted")
    _expect(took < HANG_S, f"calls on a store that answers malformed took {took:.0f}s")
    return None


RULES: dict[str, Callable[[Harness, _Run], str | None]] = {
    f.__name__: f
    for f in (
        round_trip,
        prefix_shaped,
        empty_batches,
        first_write_stays,
        remove,
        shape_is_checked,
        arguments_are_checked,
        damaged_values_are_misses,
        other_salt_is_another_partition,
        sealed,
        shared_between_handles,
        dead_store_is_a_miss,
        concurrent_writers,
        trickle_is_cut_at_the_timeout,
        huge_value_is_not_read,
        malformed_answer_is_a_counted_failure,
    )
}


HOSTILE_RULES = frozenset(
    ("trickle_is_cut_at_the_timeout", "huge_value_is_not_read", "malformed_answer_is_a_counted_failure")
)
"""The rules that need ``Harness.hostile`` (n/a without it)."""


def check(rule: str, harness: Harness) -> str:
    """Run one rule: "passed", or "n/a: why" where it cannot apply; ``ConformanceError`` when it is broken."""
    try:
        why = RULES[rule](harness, _Run())
    except ConformanceError as exc:
        raise ConformanceError(f"{rule}: {exc}") from None
    return "passed" if why is None else f"n/a: {why}"


def run_conformance(harness: Harness) -> dict[str, str]:
    """Run every rule; each one's result (``check``). Raises ``ConformanceError`` naming every rule broken."""
    results: dict[str, str] = {}
    broken: list[str] = []
    for rule in RULES:
        try:
            results[rule] = check(rule, harness)
        except ConformanceError as exc:
            broken.append(str(exc))
    if broken:
        raise ConformanceError("; ".join(broken))
    return results
