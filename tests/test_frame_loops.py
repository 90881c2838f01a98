"""The tcp target's two DATA frame loops agree: the native one (csrc/kvframes.cpp) and the Python one, its reference.

The same frames (valid, malformed, out of grant, revoked mid-transfer, cut
short) go to a target serving with each loop; the bytes that landed, what the
target answered (HELLO_OK, ACK, NACK, ERROR: type, transfer ids, the message
without the connection's label) and the notifications delivered must be the
same. The native loop must also have landed the valid frames itself (no
``Lander.land`` call: the Python loop lands every frame through it), and
its grant check must be ``Grants``' own, call for call.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import re
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pdkv import native
from pdkv.channels.grants import BlockGrid, Grants, GridSpans
from pdkv.channels.tcp import TcpChannel, TcpOptions, wire
from pdkv.channels.tcp import native as tcp_native
from pdkv.channels.tcp.lander import Lander
from pdkv.channels.tcp.wire import DATA, HEADER, LAST, MAGIC, NOTIF_FOLLOWS, RUN, VERSION
from pdkv.errors import ChannelError

from tests.conftest import FRAME_LOOPS, wait_until

pytestmark = pytest.mark.skipif(not native.available(), reason="the native kernels are not built")

TOKEN = b"k" * 16
REGION = 8192
OPEN_REGION = 64 << 10  # room for a frame as large as max_frame_bytes, which must not wait behind owed ACKs
GRANTED = 4096  # the guarded region's first bytes are granted to TOKEN
TIMEOUT = 10.0

Step = bytes | Callable[["Rig"], None]  # bytes to send, or an action on the target between sends


@dataclass
class Rig:
    """A target with a guarded region (0: its first ``GRANTED`` bytes granted to ``TOKEN``) and an open one (1)."""

    channel: TcpChannel
    regions: list[bytearray]
    python_lands: list[int] = field(default_factory=list)  # frames the Python loop landed (or refused)


@pytest.fixture
def rig(frame_loop: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Rig]:
    channel = TcpChannel("t", TcpOptions(io_timeout=2, connect_timeout=2, max_frame_bytes=64 << 10))
    rig = Rig(channel, [bytearray(REGION), bytearray(OPEN_REGION)])
    guarded = channel.register(rig.regions[0])
    channel.register(rig.regions[1])
    channel.guard(guarded)
    channel.grant(TOKEN, "write", [(guarded, 0, GRANTED)])
    assert channel.target.frames.native is (frame_loop == "native")
    land = Lander.land

    def counted(self: Lander, *args: object, **kwargs: object) -> str:
        rig.python_lands.append(1)
        return land(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Lander, "land", counted)
    yield rig
    channel.close()


def _hdr(ftype: int, xfer: int = 0, length: int = 0, aux: int = 0, flags: int = 0, shares: int = 0) -> bytes:
    return HEADER.pack(MAGIC, VERSION, ftype, flags, shares, aux, 0, xfer, 0, length)


def _hello(token: bytes = TOKEN, name: bytes = b"peer") -> bytes:
    return _hdr(wire.HELLO, xfer=11, length=len(token + name), shares=len(token)) + token + name


def _data(xfer: int, runs: list[tuple[int, int, int]], flags: int = LAST, shares: int = 1, notif: bytes = b"") -> bytes:
    """A DATA frame with its payload: run k's bytes are all k+1 (so what landed where shows which run it was)."""
    nbytes = sum(n for _, _, n in runs)
    frame = wire.data_frame(xfer, runs, nbytes, flags | (NOTIF_FOLLOWS if notif else 0), shares, len(notif))
    return bytes(frame) + b"".join(bytes([k + 1]) * n for k, (_, _, n) in enumerate(runs)) + notif


# A read of the open region: the target sends the ACKs it holds first, so every answer is in before we hang up
SYNC = _hdr(wire.READ_REQ, xfer=99, aux=1, length=8)


def _unlabelled(text: str) -> str:
    """``text`` without the connection's label (its port differs from run to run)."""
    return re.sub(r"t<-\S+ \('peer'\)", "", text)


def _answers(data: bytes) -> list[tuple[str, object]]:
    """The frames the target sent: (type, what identifies it: an ACK's transfer ids one by one, an ERROR's or NACK's
    text without connection labels)."""
    out: list[tuple[str, object]] = []
    pos = 0
    while pos + wire.HDR_SIZE <= len(data):
        _, _, ftype, _, _, aux, _, xfer, _, length = HEADER.unpack_from(data, pos)
        payload = data[pos + wire.HDR_SIZE : pos + wire.HDR_SIZE + length]
        pos += wire.HDR_SIZE + length
        name = wire.FRAME_NAMES.get(ftype, str(ftype))
        if ftype == wire.ACK:
            # one entry an id: how ACKs batch depends on how the frames arrived, not on the loop
            ids = [xfer, *(int.from_bytes(payload[i : i + 8], "little") for i in range(0, length, 8))]
            out.extend((name, i) for i in ids)
        elif ftype in (wire.NACK, wire.ERROR):
            out.append((name, (xfer, _unlabelled(payload.decode()))))
        else:
            out.append((name, None))
    return out


def _run(rig: Rig, steps: list[Step]) -> tuple[list[bytes], list[tuple[str, object]], list[bytes]]:
    """Send ``steps`` on one connection, half-close, read until the target hangs up; (regions, answers, notes)."""
    received = bytearray()
    with socket.create_connection(("127.0.0.1", rig.channel.port), timeout=TIMEOUT) as sock:
        # bytes between actions go in one send (one segment on loopback): whether the target finds more input
        # waiting after a frame, which decides whether it answers before a later frame fails, must not depend on
        # how fast it reads
        for is_bytes, group in itertools.groupby(steps, lambda step: isinstance(step, bytes)):
            if is_bytes:
                sock.sendall(b"".join(group))  # type: ignore[arg-type]
            else:
                for action in group:
                    action(rig)  # type: ignore[operator]
        with contextlib.suppress(OSError):  # the target may have hung up already (a bad frame ends a scenario)
            sock.shutdown(socket.SHUT_WR)
        with contextlib.suppress(OSError):
            while chunk := sock.recv(1 << 16):
                received += chunk
    wait_until(lambda: not rig.channel.target._accepted, TIMEOUT, "the target to end the connection")
    notes = [n.payload for n in rig.channel.get_notifications()]
    return [bytes(r) for r in rig.regions], _answers(bytes(received)), notes


def _landed(region: int, offset: int, value: int) -> Callable[[Rig], None]:
    """Wait until the byte at ``offset`` of ``region`` is ``value``: the frame before has landed."""

    def wait(rig: Rig) -> None:
        wait_until(lambda: rig.regions[region][offset] == value, TIMEOUT, "the frame to land")

    return wait


def _hung_up(rig: Rig) -> None:
    """Wait until the target gave the connection up (a stalled frame: io_timeout without a byte)."""
    wait_until(lambda: not rig.channel.target._accepted, TIMEOUT, "the target to give up the stalled frame")


def _revoke(rig: Rig) -> None:
    assert rig.channel.revoke(TOKEN, "write", [(0, 0, GRANTED)], TIMEOUT)


SCENARIOS: dict[str, list[Step]] = {
    "valid": [
        _hello(),
        _data(1, [(0, 0, 100), (1, 500, 50)], notif=b"note-1"),
        _data(2, [(0, 200, 64)], flags=0, shares=0),  # a share of two frames: this one not LAST
        _data(2, [(1, 0, 32), (0, 300, 8)]),
        SYNC,
    ],
    "malformed-flags": [_hello(), _data(1, [(0, 0, 16)]), _data(2, [(0, 0, 16)], flags=0x80)],
    "overlapping-runs": [_hello(), _data(1, [(0, 0, 16), (0, 8, 16)])],
    "run-outside-region": [_hello(), _data(1, [(1, OPEN_REGION - 8, 16)])],
    "out-of-grant": [
        _hello(),
        _data(1, [(1, 0, 16), (0, GRANTED - 8, 16)]),  # one run past the grant: none of them lands
        _data(2, [(0, 0, 16)], notif=b"after"),
        SYNC,
    ],
    "revoked-mid-transfer": [
        _hello(),
        _data(3, [(0, 0, 64)], flags=0, shares=0),
        _landed(0, 0, 1),
        _revoke,
        _data(3, [(0, 64, 64)]),
        _data(4, [(1, 0, 8)]),
        SYNC,
    ],
    "burst-then-large": [
        _hello(),
        *(_data(10 + i, [(0, 16 * i, 16), (1, 16 * i, 16)], notif=b"n%d" % i) for i in range(40)),
        _data(99, [(1, 0, OPEN_REGION)]),  # owed ACKs go out before it lands
        _data(100, [(0, 0, 8)], notif=b""),
        SYNC,
    ],
    "two-shares-on-one-connection": [
        _hello(),
        _data(1, [(0, 0, 16)], shares=2),
        _data(2, [(1, 0, 16)]),
        _data(1, [(0, 16, 16)], shares=2),  # a share of transfer 1 ended here already
    ],
    "truncated-notification": [_hello(), _data(1, [(1, 0, 16)], notif=b"note")[:-2]],
    "truncated-payload": [_hello(), _data(1, [(1, 0, 16)]), _data(2, [(1, 100, 4096)])[:-1000]],
    "truncated-run-table": [_hello(), _data(1, [(1, 0, 16)]), _data(2, [(1, 0, 8), (1, 8, 8)])[: wire.HDR_SIZE + 30]],
    "stalled-payload": [
        _hello(),
        _data(1, [(1, 0, 16)]),
        _data(2, [(1, 100, 4096)])[:-1000],
        _landed(1, 100, 1),  # the connection is being served
        _hung_up,
    ],
    "truncated-header": [_hello(), _data(1, [(1, 0, 16)]), _hdr(DATA, 2)[:20]],
    "notif-inside-share": [_hello(), _data(1, [(0, 0, 16)], flags=0, shares=0), _hdr(wire.NOTIF, length=2) + b"hi"],
    "data-of-another-transfer": [_hello(), _data(1, [(0, 0, 16)], flags=0, shares=0), _data(2, [(0, 16, 16)])],
    "notif-frame-between": [
        _hello(),
        _data(1, [(0, 0, 16)]),
        _hdr(wire.NOTIF, length=2) + b"hi",
        _data(2, [(1, 0, 8)]),
        SYNC,
    ],
}


@pytest.fixture(scope="module")
def reference() -> dict[str, tuple[object, ...]]:
    """The Python loop's outcome of each scenario, filled by its runs (which pytest orders first: ``FRAME_LOOPS``)."""
    return {}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("frame_loop", list(reversed(FRAME_LOOPS)), indirect=True)
def test_both_loops_land_and_answer_the_same(
    rig: Rig,
    frame_loop: str,
    scenario: str,
    reference: dict[str, tuple[object, ...]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Bytes landed, answers, notifications, and what the target logged (why it refused or hung up)."""
    with caplog.at_level(logging.WARNING, logger="pdkv.channels.tcp"):
        outcome = (*_run(rig, SCENARIOS[scenario]), [_unlabelled(r.getMessage()) for r in caplog.records])
    if scenario == "stalled-payload":  # no ERROR frame for a stall: the comparison rests on the log's text
        assert any("then nothing for" in message for message in outcome[3])
    if frame_loop == "python":
        reference[scenario] = outcome
        return
    if scenario not in reference:
        pytest.fail("run with the python loop's case first (pytest orders it so unless a -k filter dropped it)")
    assert outcome == reference[scenario]
    if scenario in ("valid", "burst-then-large"):
        assert rig.python_lands == []  # every frame landed natively


def test_the_valid_scenario_lands_and_acks_everything(rig: Rig) -> None:
    """What both loops must agree on is right, not only the same."""
    regions, answers, notes = _run(rig, SCENARIOS["valid"])
    assert (
        regions[0][:100] == b"\x01" * 100 and regions[0][200:264] == b"\x01" * 64 and regions[0][300:308] == b"\x02" * 8
    )
    assert regions[1][500:550] == b"\x02" * 50 and regions[1][:32] == b"\x01" * 32
    assert answers[0] == ("HELLO_OK", None)
    assert [xfer for name, xfer in answers if name == "ACK"] == [1, 2]
    assert notes == [b"note-1"]


def test_revoke_waits_for_a_frame_still_landing(rig: Rig) -> None:
    """A frame admitted before the revoke holds it (the fence) until its last byte landed, in either loop."""
    frame = _data(5, [(0, 0, GRANTED)])
    with socket.create_connection(("127.0.0.1", rig.channel.port), timeout=TIMEOUT) as sock:
        sock.sendall(_hello() + frame[: len(frame) - 1000])
        wait_until(lambda: rig.regions[0][0] == 1, TIMEOUT, "the frame to start landing")
        assert not rig.channel.revoke(TOKEN, "write", [(0, 0, GRANTED)], 0.2)
        done: list[bool] = []
        fence = threading.Thread(target=lambda: done.append(rig.channel.revoke(TOKEN, "write", [(0, 0, 16)], TIMEOUT)))
        fence.start()
        sock.sendall(frame[len(frame) - 1000 :])
        fence.join(TIMEOUT)
        assert done == [True]
        assert rig.regions[0][:GRANTED] == b"\x01" * GRANTED


RUNS = st.lists(st.tuples(st.integers(0, 2), st.integers(0, 300), st.integers(1, 80)), min_size=1, max_size=4)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    guarded=st.sets(st.integers(0, 2)),
    ops=st.lists(st.tuples(st.booleans(), st.sampled_from([b"a", b"b"]), RUNS), max_size=8),
    token=st.sampled_from([b"a", b"b"]),
    frame=RUNS,
)
def test_the_native_grant_check_is_grants_own(
    guarded: set[int],
    ops: list[tuple[bool, bytes, list[tuple[int, int, int]]]],
    token: bytes,
    frame: list[tuple[int, int, int]],
) -> None:
    """After any grants and revokes, the native mirror admits exactly the frames ``Grants.begin_many`` admits."""
    grants = Grants()
    mirror = tcp_native.GrantMirror()
    grants.mirror_to(mirror)
    for region in guarded:
        grants.guard(region)
    for give, who, ranges in ops:
        if give:
            grants.grant(who, "write", ranges)
        else:
            assert grants.revoke(who, "write", ranges, 0.0)
    assert_mirror_agrees(grants, mirror, token, frame)


def assert_mirror_agrees(
    grants: Grants, mirror: tcp_native.GrantMirror, token: bytes, frame: list[tuple[int, int, int]]
) -> None:
    """The native mirror admits ``frame`` for ``token`` exactly when ``Grants.begin_many`` does."""
    try:
        grants.end(grants.begin_many(token, "write", frame))
        python_admits = True
    except ChannelError:
        python_admits = False
    native_ticket = mirror.begin(token, b"".join(RUN.pack(*run) for run in frame))
    assert (native_ticket is not None) == python_admits
    if native_ticket:
        mirror.end(native_ticket)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    ops=st.lists(
        st.tuples(st.booleans(), st.sampled_from([b"a", b"b"]), st.lists(st.integers(0, 40), min_size=1, max_size=4)),
        max_size=8,
    ),
    token=st.sampled_from([b"a", b"b"]),
    frame=RUNS,
    mirror_later=st.booleans(),
)
@example(ops=[(True, b"a", [0, 1]), (False, b"a", [1])], token=b"a", frame=[(2, 0, 8)], mirror_later=False)
@example(ops=[(True, b"a", [0, 1]), (False, b"a", [1])], token=b"a", frame=[(2, 8, 1)], mirror_later=True)
def test_the_native_grant_check_is_grants_own_over_a_grid(
    ops: list[tuple[bool, bytes, list[int]]], token: bytes, frame: list[tuple[int, int, int]], mirror_later: bool
) -> None:
    """The same over a grid of blocks (``GridSpans``, the ranges built natively), the mirror attached before the
    grants or after them (``mirror_to`` copies the grids held)."""
    grants, mirror = Grants(), tcp_native.GrantMirror()
    grid = BlockGrid((0, 2), 8)
    if not mirror_later:
        grants.mirror_to(mirror)
    for region in (0, 1, 2):
        grants.guard(region)
    for give, who, blocks in ops:
        if give:
            grants.grant(who, "write", GridSpans(grid, grid.spans(blocks)))
        else:
            assert grants.revoke(who, "write", GridSpans(grid, grid.spans(blocks)), 0.0)
    if mirror_later:
        grants.mirror_to(mirror)
    assert_mirror_agrees(grants, mirror, token, frame)
