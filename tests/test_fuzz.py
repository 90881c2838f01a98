"""Fuzzing the two surfaces a hostile peer can reach: control messages and tcp frames.

A network peer controls every byte of both, so neither may crash a worker,
allocate past its configured limits or write outside registered memory, and
the worker must keep serving well-behaved peers afterwards. Examples are
bounded (``max_examples``) and every wait has a timeout, so the file stays
fast and can never hang; ``derandomize`` keeps CI runs reproducible.
"""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdkv.channels import TransferOp
from pdkv.channels.tcp import TcpChannel, TcpOptions, wire
from pdkv.channels.tcp.frames import FRAMES_ENV_VAR
from pdkv.channels.tcp.wire import HEADER, LAST, MAGIC, NOTIF_FOLLOWS, SECRET, VERSION
from pdkv.errors import ProtocolError
from pdkv.transfer import protocol

from tests.conftest import FRAME_LOOPS, MakePair, Pair, wait_until

FUZZ = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
TIMEOUT = 10.0

# -- control messages -----------------------------------------------------------------------------------

TAGS = [
    "hello",
    "auth",
    "reserve",
    "reserved",
    "refused",
    "landed",
    "heartbeat",
    "cancel",
    "done",
    "error",
]
U64 = st.integers(min_value=0, max_value=(1 << 64) - 1)
I64 = st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1)
HOSTILE_INT = st.one_of(
    I64,
    U64,
    st.sampled_from([0, -1, 1, 1 << 31, 1 << 32, 1 << 62, (1 << 63) - 1, (1 << 64) - 1]),
)
# ids: empty, control characters, just past MAX_ID_LEN, well past it
HOSTILE_STR = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", "\x00"]),
    st.sampled_from([protocol.MAX_ID_LEN, protocol.MAX_ID_LEN + 1, 100_000]).map(
        lambda n: "r" * n
    ),  # built lazily: short reprs
)
HOSTILE_BYTES = st.one_of(st.binary(max_size=80), st.sampled_from([0, 65, 100_000]).map(lambda n: b"m" * n))
LEAF = st.one_of(st.none(), st.booleans(), HOSTILE_INT, st.floats(), HOSTILE_STR, HOSTILE_BYTES)
ANY_VALUE = st.recursive(
    LEAF,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6),
        st.dictionaries(st.text(max_size=12), inner, max_size=6),
    ),
    max_leaves=20,
)


def _layout() -> st.SearchStrategy[dict[str, Any]]:
    """A layout as the wire carries it (a map): KVLayout itself refuses bad values at construction."""
    return st.fixed_dictionaries(
        {
            "num_layers": HOSTILE_INT,
            "num_kv_heads": HOSTILE_INT,
            "head_dim": HOSTILE_INT,
            "block_size": HOSTILE_INT,
            "dtype": st.sampled_from(["float32", "bfloat16", "float16", "int8", "nope", ""]),
        },
        optional={
            "order": st.sampled_from(["NHD", "HND", "??"]),
            "kind": st.sampled_from(["cross_layer", "x"]),
        },
    )


# Well-typed structs with hostile contents: msgspec constructors do not validate, the decoder must.
STRUCTS = st.one_of(
    st.builds(protocol.Reserve, transfer_id=HOSTILE_STR, num_tokens=HOSTILE_INT),
    st.builds(protocol.Heartbeat, transfer_ids=st.lists(HOSTILE_STR, max_size=50), seq=HOSTILE_INT),
    st.builds(protocol.BeatAck, seq=HOSTILE_INT),
    st.builds(protocol.Cancel, transfer_id=HOSTILE_STR, reason=HOSTILE_STR),
    st.builds(protocol.Done, transfer_id=HOSTILE_STR, ok=st.booleans()),
    st.builds(protocol.Auth, proof=HOSTILE_BYTES),
    st.builds(protocol.Landed, transfer_id=HOSTILE_STR, chunk_indices=st.lists(HOSTILE_INT, max_size=20)),
    st.builds(protocol.Error, message=HOSTILE_STR),
    st.builds(
        protocol.Refused,
        transfer_id=HOSTILE_STR,
        reason=HOSTILE_STR,
        retryable=st.booleans(),
    ),
    st.builds(
        protocol.Reserved,
        transfer_id=HOSTILE_STR,
        mode=st.sampled_from(["direct", "staging", "bogus"]),
        block_ids=st.lists(HOSTILE_INT, max_size=20),
        staging_slots=st.lists(HOSTILE_INT, max_size=20),
        lease_s=st.floats(),
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("hello"),
            "protocol_version": HOSTILE_INT,
            "agent": HOSTILE_STR,
            "model_fingerprint": st.sampled_from(["model-a", "other", ""]),
            "layout": _layout(),
            "chunk_size": HOSTILE_INT,
            "channel": st.sampled_from(["mock", "tcp", ""]),
            "channel_metadata": HOSTILE_BYTES,
            "kv_regions": st.lists(HOSTILE_INT, max_size=20),
        },
        optional={
            "staging_region": HOSTILE_INT,
            "nonce": HOSTILE_BYTES,
            "auth": HOSTILE_BYTES,
        },
    ),
)
# Maps that look like messages: known and unknown tags, missing, extra and mistyped fields.
TAGGED_MAPS = st.builds(
    lambda tag, fields: {"type": tag, **fields},
    st.one_of(st.sampled_from(TAGS), st.text(max_size=10), HOSTILE_INT, st.none()),
    st.dictionaries(
        st.sampled_from(
            [
                "request_id",
                "num_tokens",
                "request_ids",
                "reason",
                "ok",
                "proof",
                "layout",
                "chunk_size",
                "agent",
                "extra",
            ]
        ),
        ANY_VALUE,
        max_size=6,
    ),
)


def _encode(obj: Any) -> bytes:
    return msgspec.msgpack.encode(obj)


HOSTILE_MESSAGES = st.one_of(
    st.binary(max_size=512),
    STRUCTS.map(_encode),
    TAGGED_MAPS.map(_encode),
    ANY_VALUE.map(_encode),
    st.just(2000).map(lambda n: b"\x91" * n),  # deeply nested arrays
    st.just(b"\xc6\xff\xff\xff\xff"),  # a bin32 header claiming 4 GiB
)


@settings(FUZZ, max_examples=400)
@given(HOSTILE_MESSAGES)
def test_decode_raises_only_protocol_error(data: bytes) -> None:
    try:
        protocol.decode(data)
    except ProtocolError:
        pass


def test_decode_refuses_oversized_messages() -> None:
    with pytest.raises(ProtocolError, match="exceeds"):
        protocol.decode(b"\x00" * (protocol.MAX_MESSAGE_BYTES + 1))


class HostileDealer:
    """A raw DEALER speaking to a receiver; ``sync`` waits until everything sent so far was handled."""

    def __init__(self, address: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.reserved: list[protocol.Reserved] = []

    def send(self, data: bytes) -> None:
        self.sock.send(data)

    def sync(self) -> None:
        """A Refused for a fresh id comes back only after every earlier message was processed (one loop, in order)."""
        token = f"sync-{uuid.uuid4().hex}"
        self.sock.send(
            protocol.encode(protocol.Reserve(token, 0))
        )  # invalid (num_tokens >= 1): always answered with Error
        deadline = time.monotonic() + TIMEOUT
        while True:
            remaining = deadline - time.monotonic()
            assert remaining > 0, "the receiver stopped answering"
            if not self.sock.poll(int(remaining * 1000)):
                continue
            try:
                msg = protocol.decode(self.sock.recv())
            except ProtocolError:
                continue
            if isinstance(msg, protocol.Reserved):
                self.reserved.append(msg)
            if isinstance(msg, protocol.Error) and "num_tokens" in msg.message:
                return

    def close(self) -> None:
        self.sock.close(0)


def _push(pair: Pair, request_id: str, num_tokens: int, table: list[int]) -> None:
    """One well-behaved transfer, checked bit for bit; its blocks go back to the allocator."""
    from pdkv.layout import gather

    xfer = pair.sender.open(request_id, pair.receiver.address, num_tokens, table)
    xfer.send_all()
    xfer.wait(TIMEOUT)
    got = pair.receiver.wait(request_id, TIMEOUT)
    a = gather(pair.p_layout, pair.p_kv, table, 0, num_tokens)
    b = gather(pair.d_layout, pair.d_kv, got.blocks, 0, num_tokens)
    assert bool((a == b).all()), "the KV that landed differs from the KV sent"
    pair.allocator.free(got.blocks)


@pytest.mark.parametrize("admitted", [False, True], ids=["stranger", "after-valid-hello"])
def test_hostile_control_messages_never_break_a_live_receiver(make_pair: MakePair, admitted: bool) -> None:
    """A hostile DEALER (admitted with a valid Hello, or not) cannot crash, overallocate or leak the receiver."""
    pair = make_pair()
    receiver, allocator = pair.receiver, pair.allocator
    dealer = HostileDealer(receiver.address)
    try:
        if admitted:  # a compatible Hello makes its Reserves reach the allocator
            dealer.send(
                protocol.encode(
                    msgspec.structs.replace(
                        protocol.make_hello(
                            agent=pair.p_channel.agent_name,
                            channel=pair.p_channel.name,
                            channel_metadata=pair.p_channel.metadata(),
                            fingerprint="model-a",
                            layout=pair.p_layout,
                            chunk_size=receiver.config.chunk_size,
                            kv_regions=[],
                            staging_region=-1,
                        ),
                        data_token=b"T" * 16,
                    )
                )
            )
            dealer.sync()

        @settings(FUZZ, max_examples=60)
        @given(
            st.lists(
                st.one_of(
                    HOSTILE_MESSAGES,
                    st.builds(
                        protocol.Reserve,
                        transfer_id=st.text(min_size=1, max_size=8),
                        # hostile sizes, and sizes that fit: a fuzzer whose Reserves never
                        # reach the allocator tests nothing
                        num_tokens=st.one_of(HOSTILE_INT, st.integers(1, 64)),
                    ).map(protocol.encode),
                ),
                min_size=1,
                max_size=5,
            )
        )
        def attack(messages: list[bytes]) -> None:
            for data in messages:
                dealer.send(data)
            # and one Reserve that fits, whatever was drawn: the hostile ones above must not be all that is tested
            dealer.send(protocol.encode(protocol.Reserve(f"fits-{uuid.uuid4().hex[:8]}", 1 + 7 * len(messages))))
            dealer.sync()
            assert receiver.loop.thread.is_alive(), "the receiver loop died"
            stats = receiver.stats()
            assert 0 <= stats["free_blocks"] <= allocator.num_blocks
            assert stats["reserved_blocks"] + stats["pooled_blocks"] + stats["free_blocks"] <= allocator.num_blocks, (
                "blocks allocated past the allocator's size"
            )
            for r in dealer.reserved:
                assert len(set(r.block_ids)) == len(r.block_ids) and all(
                    b < allocator.num_blocks for b in r.block_ids
                ), r

        attack()
        # give back whatever the fuzzer managed to reserve, as a sender that gives up would
        for r in dealer.reserved:
            dealer.send(protocol.encode(protocol.Cancel(r.transfer_id, "fuzz over")))
        dealer.sync()
        wait_until(
            lambda: receiver.stats()["reservations"] == 0,
            TIMEOUT,
            "the fuzzer's reservations to be released",
        )
        assert pair.held_blocks() == 0  # every block free, or in a pool (the admitted dealer's, the sender's)
        if admitted:
            assert dealer.reserved, "no hostile Reserve ever reached the allocator: the fuzzer is too weak"
        # and the pair still completes a normal transfer
        _push(pair, "after-fuzz", 100, list(range(40, 47)))
        assert pair.held_blocks() == 0  # every block free, or in a pool (the admitted dealer's, the sender's)
    finally:
        dealer.close()


# -- tcp frames ------------------------------------------------------------------------------------------

REGION = 4096
NREGIONS = 3


def _hdr(
    ftype: int,
    *,
    version: int = VERSION,
    flags: int = 0,
    shares: int = 0,
    aux: int = 0,
    notif: int = 0,
    xfer: int = 0,
    offset: int = 0,
    length: int = 0,
) -> bytes:
    return HEADER.pack(MAGIC, version, ftype, flags, shares, aux, notif, xfer, offset, length)


def _hello(name: bytes = b"fuzzer", sid: int = 7) -> bytes:
    return _hdr(wire.HELLO, xfer=sid, length=len(name)) + name


def _pattern(i: int) -> bytes:
    return bytes((i * 37 + j * 11 + 5) & 0xFF for j in range(REGION))


def writable_ranges(stream: bytes, nregions: int = NREGIONS) -> list[tuple[int, int, int]]:
    """(region, start, end) of every DATA frame in ``stream`` that names a range inside a region.

    Follows the framing from the module docstring, as the target does, and
    stops where the target must: bad magic/version or an unknown frame type.
    Only these ranges may change; this is a superset of what a correct
    target writes (it also stops at the first frame that fails a check).
    """
    out, pos = [], 0
    while pos + HEADER.size <= len(stream):
        magic, version, ftype, flags, _shares, aux, notif, _xfer, offset, length = HEADER.unpack_from(stream, pos)
        pos += HEADER.size
        if magic != MAGIC or version != VERSION:
            break
        if ftype == wire.DATA:  # aux runs of (region, offset, length), then their bytes
            table = stream[pos : pos + aux * wire.RUN.size]
            for region, start, n in wire.RUN.iter_unpack(table[: len(table) - len(table) % wire.RUN.size]):
                if region < nregions and 0 < n and start + n <= REGION:
                    out.append((region, start, start + n))
            pos += len(table) + length + (notif if flags & NOTIF_FOLLOWS and flags & LAST else 0)
        elif ftype in (wire.HELLO, wire.NOTIF):
            pos += length
        elif ftype != wire.READ_REQ:
            break
    return out


@dataclass
class Target:
    channel: TcpChannel
    regions: list[bytearray]
    good: TcpChannel
    good_src: int
    baseline: int = 0  # connections the good peer keeps open


def _make_target(secret: str = "", frame_loop: str = "native") -> Iterator[Target]:
    with pytest.MonkeyPatch.context() as mp:  # the target serves DATA frames with this loop (conftest FRAME_LOOPS)
        mp.setenv(FRAMES_ENV_VAR, "1" if frame_loop == "native" else "0")
        yield from _make_channels(secret)


def _make_channels(secret: str) -> Iterator[Target]:
    opts = TcpOptions(
        io_timeout=3,
        connect_timeout=3,
        max_frame_bytes=1 << 20,
        max_notif_bytes=256,
        secret=secret,
    )
    channel = TcpChannel("target", opts)
    regions = [bytearray(_pattern(i)) for i in range(NREGIONS)]
    for buf in regions:
        channel.register(buf)
    good = TcpChannel("good", TcpOptions(io_timeout=3, connect_timeout=3, secret=secret))
    src = good.register(bytearray(b"\xab" * REGION))
    good.add_peer(channel.metadata())
    yield Target(channel, regions, good, src)
    good.close()
    channel.close()


@pytest.fixture(scope="module", params=FRAME_LOOPS)
def target(request: pytest.FixtureRequest) -> Iterator[Target]:
    yield from _make_target(frame_loop=request.param)


@pytest.fixture(scope="module", params=FRAME_LOOPS)
def guarded_target(request: pytest.FixtureRequest) -> Iterator[Target]:
    """A target with a shared secret, which the fuzzer does not know."""
    yield from _make_target(secret="fuzz-secret", frame_loop=request.param)


def _send_raw(port: int, stream: bytes) -> None:
    """Send ``stream`` then half-close and read until the target hangs up (bounded by the socket timeout)."""
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:
        try:  # the target may hang up (even reset) before we are done: that counts as hanging up
            sock.sendall(stream)
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(1 << 16):
                pass
        except TimeoutError:
            raise AssertionError("the target neither answered nor hung up within the timeout") from None
        except OSError:
            pass


def _wait_served(t: Target) -> None:
    """Wait until the target's reader of the fuzzer's connection has ended (only the good peer's stay).

    A reader may still be landing the tail of what was sent when the socket
    closes on our side; checking memory before it ends would miss a write.
    """
    wait_until(
        lambda: len(t.channel.target._accepted) <= t.baseline,
        TIMEOUT,
        "the target to finish serving the fuzzer's connection",
    )


def _check_and_restore(t: Target, stream: bytes) -> None:
    allowed = writable_ranges(stream)
    for i, buf in enumerate(t.regions):
        pristine = _pattern(i)
        if buf == pristine:
            continue
        changed = [j for j in range(REGION) if buf[j] != pristine[j]]
        stray = [j for j in changed if not any(r == i and lo <= j < hi for r, lo, hi in allowed)]
        assert not stray, (
            f"region {i}: {len(stray)} bytes written outside every range a DATA frame named (first at {stray[0]})"
        )
        buf[:] = pristine
    t.channel.get_notifications()  # a valid frame may notify; drop it


def _assert_still_serves(t: Target, tag: bytes) -> None:
    t.channel.get_notifications()
    handle = t.good.write("target", [TransferOp(t.good_src, 0, 2, 0, REGION)], notif=tag)
    t.good.wait(handle, TIMEOUT)
    assert t.regions[2] == b"\xab" * REGION
    wait_until(
        lambda: any(n.payload == tag for n in t.channel.get_notifications()),
        TIMEOUT,
        "the good peer's notification",
    )
    t.regions[2][:] = _pattern(2)
    t.baseline = len(t.channel.target._accepted)


@st.composite
def data_frames(draw: st.DrawFn, opening: st.SearchStrategy[bytes] | None = None) -> bytes:
    """A HELLO (or ``opening``) then DATA/READ_REQ/NOTIF frames whose every field is drawn from near-valid and
    hostile values."""
    out = draw(opening) if opening is not None else _hello(sid=draw(U64))
    for _ in range(draw(st.integers(1, 3))):
        ftype = draw(st.sampled_from([wire.DATA, wire.DATA, wire.DATA, wire.READ_REQ, wire.NOTIF, wire.ACK, 0, 200]))
        length = draw(
            st.one_of(
                st.integers(0, REGION + 8),
                st.sampled_from([1 << 20, (1 << 20) + 1, 1 << 62, (1 << 64) - 1]),
            )
        )
        offset = draw(st.one_of(st.integers(0, REGION + 8), st.sampled_from([(1 << 64) - 8, 1 << 63])))
        if ftype == wire.DATA and draw(st.booleans()):
            offset = 0  # a DATA frame's offset field must be 0: its runs name where it lands
        flags = draw(st.sampled_from([LAST, LAST, 0, LAST | NOTIF_FOLLOWS, NOTIF_FOLLOWS, 0x80, 0xFF]))
        notif = draw(st.sampled_from([0, 0, 4, 256, 257, (1 << 32) - 1]))
        aux = draw(st.sampled_from([0, 1, 2, 3, 99, (1 << 32) - 1]))
        runs: list[tuple[int, int, int]] = []
        if ftype == wire.DATA:  # a run table of near-valid and hostile runs, its count told true or not
            runs = draw(
                st.lists(st.tuples(st.integers(0, 4), st.integers(0, REGION + 8), st.integers(0, 300)), max_size=4)
            )
            if draw(st.booleans()):
                aux = len(runs)
        hdr = _hdr(
            ftype,
            version=draw(st.sampled_from([VERSION, VERSION, VERSION, 0, 2])),
            flags=flags,
            shares=draw(st.sampled_from([1, 1, 0, 2, wire.MAX_STREAMS, wire.MAX_STREAMS + 1, 0xFFFF])),
            aux=aux,
            notif=notif,
            xfer=draw(U64),
            offset=offset,
            length=length,
        )
        hdr += b"".join(wire.RUN.pack(*run) for run in runs)
        # a payload that matches the declared length when it is small, or is cut short
        payload_len = min(length, REGION + 8) if draw(st.booleans()) else draw(st.integers(0, 64))
        out += hdr + b"\x5a" * payload_len + b"n" * min(notif, 300)
    return out


@st.composite
def mutated_frames(draw: st.DrawFn) -> bytes:
    """A valid stream (HELLO + DATA with notification) with a few bytes flipped, cut or inserted."""
    valid = bytearray(
        _hello()
        + wire.data_frame(5, [(1, 100, 40), (1, 300, 24)], 64, LAST | NOTIF_FOLLOWS, 1, 3)
        + b"\x5a" * 64
        + b"abc"
    )
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "flip", "cut", "insert"]))
        pos = draw(st.integers(0, len(valid) - 1))
        if op == "flip":
            valid[pos] ^= draw(st.integers(1, 255))
        elif op == "cut":
            del valid[pos : pos + draw(st.integers(1, 16))]
        else:
            valid[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        if not valid:
            break
    return bytes(valid)


@pytest.mark.parametrize(
    "strategy",
    [
        st.binary(max_size=256),
        st.binary(max_size=256).map(lambda b: _hello() + b),
        data_frames(),
        mutated_frames(),
    ],
    ids=["garbage", "hello-then-garbage", "hostile-fields", "mutated-valid"],
)
def test_tcp_frames_never_write_outside_named_ranges(target: Target, strategy: st.SearchStrategy[bytes]) -> None:
    _assert_still_serves(target, b"before")

    @FUZZ
    @given(strategy)
    def attack(stream: bytes) -> None:
        _send_raw(target.channel.port, stream)
        _wait_served(target)
        _check_and_restore(target, stream)

    attack()
    _assert_still_serves(target, b"after")


@st.composite
def unproven_openings(draw: st.DrawFn) -> bytes:
    """Handshakes of a peer without the secret: a HELLO with or without SECRET, then maybe a made-up proof."""
    name = b"fuzzer"
    if not draw(st.booleans()):
        return _hello(name, sid=draw(U64))
    nonce = draw(st.binary(min_size=16, max_size=16))
    out = _hdr(wire.HELLO, flags=SECRET, xfer=draw(U64), length=len(nonce + name))
    out += nonce + name
    if draw(st.booleans()):
        given = draw(st.binary(min_size=0, max_size=40))
        out += _hdr(wire.AUTH, length=len(given)) + given
    return out


def test_without_the_secret_no_stream_lands_a_byte(guarded_target: Target) -> None:
    """Against a target with a secret, even in-bounds DATA frames land nothing until a proof checks out."""
    t = guarded_target
    _assert_still_serves(t, b"before")

    @FUZZ
    @given(data_frames(unproven_openings()))
    def attack(stream: bytes) -> None:
        _send_raw(t.channel.port, stream)
        _wait_served(t)
        assert [bytes(b) for b in t.regions] == [_pattern(i) for i in range(NREGIONS)]
        assert t.channel.get_notifications() == []

    attack()
    assert t.channel.stats()["auth_failures"] >= 1
    _assert_still_serves(t, b"after")


def test_random_garbage_changes_nothing(target: Target) -> None:
    """Random bytes without a valid header name no range: not one byte may change."""

    @FUZZ
    @given(st.binary(min_size=1, max_size=512).filter(lambda b: not b.startswith(MAGIC)))
    def attack(stream: bytes) -> None:
        _send_raw(target.channel.port, stream)
        _wait_served(target)
        assert [bytes(b) for b in target.regions] == [_pattern(i) for i in range(NREGIONS)]
        assert target.channel.get_notifications() == []

    attack()
