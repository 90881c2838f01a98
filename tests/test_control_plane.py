"""The control plane trusts no unproven message: a routing id is no identity, and leases renew on answered beats.

A receiver's ROUTER knows a sender only by its routing id. These tests are the attacks of issue 38 against a real
sender/receiver pair with a shared secret: a peer without the secret that knows (here: is handed) the routing id of
the authenticated prefill connects with it and sends every message a sender may send; a message forged onto the
authenticated connection itself, untagged or with a wrong tag. Neither may change anything. Then the heartbeats:
a receiver whose answers are lost (a one-way partition) is given up by the sender within the lease, and told.
"""

from __future__ import annotations

import re
import time

import pytest
import zmq

from pdkv.auth import message_tag
from pdkv.config import TransferConfig
from pdkv.errors import TransferError
from pdkv.layout import gather
from pdkv.transfer import protocol
from pdkv.transfer.incoming import State
from pdkv.transfer.peers import Beats, ReceiverPeer, new_beat

from tests.conftest import MakePair, Pair, wait_until

SECRET = "control-plane-secret"
TIMEOUT = 10.0


def _push(pair: Pair, transfer_id: str, num_tokens: int, table: list[int]) -> None:
    """One transfer through the real pair, checked bit for bit; its blocks go back to the allocator."""
    xfer = pair.sender.open(transfer_id, pair.receiver.address, num_tokens, table)
    xfer.send_all()
    xfer.wait(TIMEOUT)
    _check_landed(pair, transfer_id, num_tokens, table)


def _check_landed(pair: Pair, transfer_id: str, num_tokens: int, table: list[int]) -> None:
    got = pair.receiver.wait(transfer_id, TIMEOUT)
    a = gather(pair.p_layout, pair.p_kv, table, 0, num_tokens)
    b = gather(pair.d_layout, pair.d_kv, got.blocks, 0, num_tokens)
    assert bool((a == b).all()), "the KV that landed differs from the KV sent"
    pair.allocator.free(got.blocks)


def _peer(pair: Pair) -> ReceiverPeer:
    return pair.sender.handshake.peers[pair.receiver.address]


def _pool_generation(pair: Pair) -> int:
    wait_until(lambda: _peer(pair).pool is not None, TIMEOUT, "the receiver to grant the sender a pool")
    pool = _peer(pair).pool
    assert pool is not None
    return pool.generation


def _hostile_messages(transfer_id: str, generation: int) -> list[protocol.Message]:
    """Everything a sender may send after its handshake, aimed at its open transfer and its pool."""
    return [
        protocol.Heartbeat([transfer_id], 1),
        protocol.Cancel(transfer_id, "attacker", writes_may_land=False),
        protocol.Done(transfer_id, False),
        protocol.ReturnPool(generation),
        protocol.Reserve(transfer_id, 16),
        protocol.Auth(b"\0" * 32),
    ]


def test_a_peer_without_the_secret_cannot_take_over_a_sender_s_routing_id(make_pair: MakePair) -> None:
    """Issue 38's takeover: a DEALER that claims the authenticated sender's routing id, with no Hello and no
    secret, sends each message. The sender's pipe stays its own, its transfer and its pool stay untouched."""
    pair = make_pair(secrets=(SECRET, SECRET))
    _push(pair, "warm", 32, [0, 1])
    generation = _pool_generation(pair)
    identity = _peer(pair).identity
    xfer = pair.sender.open("victim", pair.receiver.address, 64, [2, 3, 4, 5])  # reserved, nothing sent yet
    before = pair.receiver.stats()

    attacker = zmq.Context.instance().socket(zmq.DEALER)
    attacker.setsockopt(zmq.LINGER, 0)
    attacker.setsockopt(zmq.ROUTING_ID, identity)
    attacker.connect(pair.receiver.address)
    try:
        for msg in _hostile_messages("victim", generation):
            attacker.send(protocol.encode(msg))
        time.sleep(0.5)  # the receiver's loop has long handled whatever reached it
    finally:
        attacker.close(0)

    after = pair.receiver.stats()
    assert after["reservations"] == before["reservations"] == 1, "the attacker's Cancel/Done ended the transfer"
    assert after["pooled_blocks"] == before["pooled_blocks"] > 0, "the attacker's ReturnPool took the pool back"
    xfer.send_all()  # the real sender goes on over its own pipe
    xfer.wait(TIMEOUT)
    _check_landed(pair, "victim", 64, [2, 3, 4, 5])
    assert pair.sender.counters["peers_lost"] == 0, "the real sender's control pipe was cut"
    _push(pair, "after", 32, [6, 7])  # and its pool is still good for the next request
    assert pair.sender.counters["transfers_failed"] == 0


@pytest.mark.parametrize("tag", ["none", "wrong"])
def test_a_message_forged_onto_the_authenticated_pipe_is_dropped(make_pair: MakePair, tag: str) -> None:
    """Even on the sender's own connection, a message without its session's tag changes nothing: the tag, not
    the routing id, says who sent it."""
    pair = make_pair(secrets=(SECRET, SECRET))
    _push(pair, "warm", 32, [0, 1])
    generation = _pool_generation(pair)
    peer = _peer(pair)
    xfer = pair.sender.open("victim", pair.receiver.address, 64, [2, 3, 4, 5])
    before = pair.receiver.stats()
    forged = [protocol.Cancel("victim", "forged"), protocol.Done("victim", False), protocol.ReturnPool(generation)]
    dealer = pair.sender._dealers._socks[peer][0]

    def forge() -> None:  # on the sender's I/O thread, which owns the socket
        for msg in forged:
            data = protocol.encode(msg)
            frames = [data] if tag == "none" else [data, message_tag(b"k" * 32, "sender", data)]
            dealer.send_multipart(frames)

    pair.sender.loop.call_soon(forge)
    wait_until(
        lambda: pair.receiver.counters["unauthenticated_messages"] == len(forged),
        TIMEOUT,
        "the receiver to drop every forged message",
    )
    after = pair.receiver.stats()
    assert after["reservations"] == before["reservations"] == 1
    assert after["pooled_blocks"] == before["pooled_blocks"] > 0
    xfer.send_all()
    xfer.wait(TIMEOUT)
    _check_landed(pair, "victim", 64, [2, 3, 4, 5])


def test_routing_ids_cannot_be_guessed(make_pair: MakePair) -> None:
    """The id after the agent name is random, not a counter: a peer's next id says nothing of another's."""
    ids = []
    for _ in range(3):
        pair = make_pair()
        _push(pair, "t", 32, [0, 1])
        ids.append(_peer(pair).identity.decode())
    suffixes = [i.rsplit("/", 1)[1] for i in ids]
    assert all(re.fullmatch(r"[0-9a-f]{16}", s) for s in suffixes), ids
    assert len(set(suffixes)) == 3


def test_without_a_secret_messages_travel_untagged(make_pair: MakePair) -> None:
    """No secret, no session keys: nothing is tagged, nothing dropped (loopback deployments keep working)."""
    pair = make_pair()
    _push(pair, "t", 32, [0, 1])
    assert _peer(pair).session_key == b""
    assert pair.receiver.counters["unauthenticated_messages"] == 0


# -- heartbeats, acknowledged -------------------------------------------------------------------------

BEATS = TransferConfig(chunk_size=32, lease_s=1.0, heartbeat_s=0.1, drain_timeout_s=0.5)


def _lose_beat_acks(pair: Pair) -> list[float]:
    """Make the receiver's answers to heartbeats vanish on the way, as a cut return path would; returns the list
    the time of each lost one is appended to."""
    lost: list[float] = []
    reply = pair.receiver._router.send

    def send(identity: bytes, msg: protocol.Message) -> None:
        if isinstance(msg, protocol.BeatAck):
            lost.append(time.monotonic())
            return
        reply(identity, msg)

    pair.receiver._router.send = send  # type: ignore[method-assign]
    return lost


def test_a_lease_renews_on_the_receiver_s_answer_not_on_the_beat_sent(make_pair: MakePair) -> None:
    """While answers come back, a transfer's lease moves; once they are lost, it stops moving (the sender's
    view of it is the last beat the receiver said it took)."""
    pair = make_pair(config=BEATS, secrets=(SECRET, SECRET))
    xfer = pair.sender.open("held", pair.receiver.address, 64, [0, 1, 2, 3])
    first = xfer.renewed
    wait_until(lambda: xfer.renewed > first, TIMEOUT, "an answered heartbeat to renew the transfer")
    lost = _lose_beat_acks(pair)
    wait_until(lambda: len(lost) >= 1, TIMEOUT, "a heartbeat whose answer is lost")
    frozen = xfer.renewed
    wait_until(lambda: len(lost) >= 3, TIMEOUT, "more heartbeats whose answers are lost")
    assert xfer.renewed == frozen, "the sender renewed a lease on beats nobody answered"
    assert lost[-1] - frozen >= 2 * BEATS.heartbeat_s


def test_a_receiver_whose_answers_are_lost_is_given_up_within_the_lease_and_told(make_pair: MakePair) -> None:
    """A one-way partition: beats arrive, answers do not. The sender gives the receiver up (its transfer fails,
    its pool is dropped) within lease_s of the first lost answer, and tells it: the receiver frees the
    reservation on the sender's Cancel, not on its own lease running out later."""
    pair = make_pair(config=BEATS, secrets=(SECRET, SECRET))
    _push(pair, "warm", 32, [0, 1])
    xfer = pair.sender.open("cut", pair.receiver.address, 64, [2, 3, 4, 5])
    assert pair.receiver.stats()["reservations"] == 1
    lost = _lose_beat_acks(pair)
    wait_until(lambda: xfer.error is not None, 2 * BEATS.lease_s + 2, "the sender to give the receiver up")
    gave_up = time.monotonic()
    assert "answered no heartbeat" in str(xfer.error)
    assert pair.sender.counters["peers_deaf"] == 1
    assert gave_up - lost[0] <= BEATS.lease_s + 0.3, "not detected within lease_s of the first lost answer"
    book = pair.receiver.book

    def ended_on_d() -> bool:
        with book.lock:
            r = book.res.get("cut")
            return r is None or r.state is State.FAILED

    wait_until(ended_on_d, TIMEOUT, "the receiver to end the reservation")
    told = time.monotonic()
    assert told - lost[0] <= BEATS.lease_s + 0.3, "the receiver was not told: it waited out its own lease"
    assert "answered no heartbeat" in (book.res["cut"].error if "cut" in book.res else book.gone["cut"])
    wait_until(lambda: pair.receiver.stats()["pooled_blocks"] == 0, TIMEOUT, "the receiver to take its pool back")
    with pytest.raises(TransferError, match="answered no heartbeat"):
        xfer.wait(TIMEOUT)


def test_beats_are_answered_once_in_order_and_overdue_only_past_the_margin() -> None:
    """A BeatAck for a beat never sent, or answered already, renews nothing; an answer renews past the older
    beats still open (the receiver answers in order: those were lost); overdue counts from the oldest open beat."""
    beats = Beats()
    sent = [new_beat(beats, t, [f"x{t}"], 0, []) for t in (10.0, 11.0, 12.0)]
    assert beats.answered(protocol.BeatAck(sent[-1].seq + 1000)) is None
    assert len(beats.unanswered) == 3
    assert beats.overdue(12.5, margin=3.0) == 0.0
    assert beats.overdue(13.5, margin=3.0) == pytest.approx(3.5)
    got = beats.answered(protocol.BeatAck(sent[1].seq))
    assert got is not None and got.sent == 11.0 and got.transfer_ids == ("x11.0",)
    assert list(beats.unanswered) == [sent[2].seq]
    assert beats.answered(protocol.BeatAck(sent[1].seq)) is None  # twice: nothing
    assert beats.overdue(14.0, margin=3.0) == 0.0  # the oldest open one is now the beat of 12.0
