"""A chunk's verdict on its data connection (issue 46, item 1): over tcp the decode side lands and verifies each chunk
on the thread that received it and answers on the same connection (``protocol.ChunkVerdict`` in an ANSWER frame);
the prefill side applies the answer on the thread that reads it. Real sockets on 127.0.0.1, both frame loops: every
test checks that the KV came over the channel, and what went over the control plane instead (nothing per chunk).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
import pytest

from pdkv.channels.tcp import streams
from pdkv.channels.tcp.frames import FRAMES_ENV_VAR
from pdkv.config import TransferConfig
from pdkv.errors import ChecksumError, TransferError
from pdkv.transfer import protocol
from pdkv.transfer.receiver import KVReceiver

from tests.conftest import TCP_AND_NIXL, MakePair, Pair, wait_until
from tests.test_pool import pooled_peer, warm
from tests.test_transfer import assert_same_kv

POOLED = TransferConfig(chunk_size=32, lease_s=5, drain_timeout_s=2, pool_tokens=32)


def record_replies(receiver: KVReceiver) -> list[str]:
    """The type of every control message ``receiver`` sends from now on (the book and the pools send through
    ``reply``)."""
    sent: list[str] = []
    reply = receiver.reply

    def recording(identity: bytes, msg: protocol.Message) -> None:
        sent.append(type(msg).__name__)
        reply(identity, msg)

    receiver.reply = recording  # type: ignore[method-assign]
    return sent


@pytest.mark.parametrize(
    ("channel", "loop"),
    [("tcp", "native"), ("tcp", "python"), pytest.param("nixl", "", marks=TCP_AND_NIXL[1].marks)],
    ids=["tcp-native", "tcp-python", "nixl"],
)
def test_every_chunk_is_answered_on_its_data_connection_and_none_on_the_control_plane(
    make_pair: MakePair, channel: str, loop: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over tcp the answer is an ANSWER frame on the chunk's connection (with either frame loop); over nixl a
    notification of its own, picked up by the watcher that polls the transfer (channels/answers.py)."""
    monkeypatch.setenv(FRAMES_ENV_VAR, "0" if loop == "python" else "1")
    pair = make_pair(config=POOLED, channel=channel)
    assert pair.receiver.arrivals.verdicts
    peer = warm(pair)
    sent = record_replies(pair.receiver)
    before_d, before_p = pair.receiver.stats(), pair.sender.stats()
    pool = peer.pool
    assert pool is not None
    # a pooled request (one chunk, its Reserve on the notice) and a reserved one of three chunks
    pooled = pair.sender.open("pooled", pair.receiver.address, 30, [10, 11], prompt_key=b"K" * 16)
    pooled.send_all()
    pooled.wait(10)
    nxt = peer.pool  # the next pool came in the verdict: held before wait() returned, no Pool message
    assert nxt is not None and nxt.generation > pool.generation
    got = pair.receiver.wait("pooled", 10, prompt_key=b"K" * 16)
    assert_same_kv(pair, [10, 11], got.blocks, 30)
    pair.allocator.free(got.blocks)
    table = [20, 21, 22, 23, 24, 25]
    longer = pair.sender.open("longer", pair.receiver.address, 90, table)
    longer.send_all()
    longer.wait(10)
    got = pair.receiver.wait("longer", 10)
    assert_same_kv(pair, table, got.blocks, 90)
    pair.allocator.free(got.blocks)
    d, p = pair.receiver.stats(), pair.sender.stats()
    assert d["verdicts_sent"] - before_d.get("verdicts_sent", 0) == 4  # 1 + 3 chunks, each answered over tcp
    assert d["tokens_landed"] - before_d["tokens_landed"] == 120
    assert p["chunks_landed"] - before_p["chunks_landed"] == 4 and p["reserved_from_pool"] == 1
    # the Reserve of the longer request is answered on the control plane; no chunk, pool or refusal is
    assert sent == ["Reserved"], sent


def test_without_data_verdicts_each_transfer_is_acknowledged_by_landed(make_pair: MakePair) -> None:
    """The path before, kept to measure against: the control plane's ``Landed`` carries the verification."""
    config = TransferConfig(chunk_size=32, lease_s=5, drain_timeout_s=2, pool_tokens=32, data_verdicts=False)
    pair = make_pair(config=config, channel="tcp")
    assert not pair.receiver.arrivals.verdicts
    warm(pair)
    sent = record_replies(pair.receiver)
    xfer = pair.sender.open("pooled", pair.receiver.address, 30, [10, 11])
    xfer.send_all()
    xfer.wait(10)
    got = pair.receiver.wait("pooled", 10)
    assert_same_kv(pair, [10, 11], got.blocks, 30)
    pair.allocator.free(got.blocks)
    assert sent == ["Landed"] and pair.receiver.stats().get("verdicts_sent", 0) == 0


def test_a_checksum_mismatch_comes_back_as_the_chunks_verdict(
    make_pair: MakePair, frame_loop: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P's checksum lies (as a corrupted chunk would): D refuses the chunk, and P's waiter hears why from the
    verdict, not from a timeout."""
    pair = make_pair(config=POOLED, channel="tcp")
    warm(pair)
    answered = pair.receiver.stats()["verdicts_sent"]
    sums, summed = pair.sender.source.sums, streams.finish  # hashed ahead of the send, or in it (a sealed write)
    monkeypatch.setattr(pair.sender.source, "sums", lambda chunks: [v ^ 1 for v in sums(chunks)])
    monkeypatch.setattr(streams, "finish", lambda *a: summed(*a) ^ 1)
    xfer = pair.sender.open("corrupt", pair.receiver.address, 30, [10, 11])
    xfer.send_all()
    with pytest.raises(ChecksumError, match="failed its checksum"):
        xfer.wait(10)
    with pytest.raises(TransferError, match="failed its checksum"):
        pair.receiver.wait("corrupt", 10)
    assert pair.receiver.stats()["checksum_failures"] == 1
    assert pair.receiver.stats()["verdicts_sent"] == answered  # "landed" only once it verified


def _tamper_tag(answer: bytes) -> bytes:
    return answer[:-1] + bytes([answer[-1] ^ 1])


def _garble(answer: bytes) -> bytes:
    return b"\xc1" + answer[1:]  # 0xc1: never used in msgpack


def _swapped(answer: bytes) -> bytes:
    """The receiver's own verdict on chunk 0 or 1, as if it answered the write of the other (a relay swapping two
    answers)."""
    verdict = protocol.open_verdict(answer, None)
    return protocol.seal_verdict(msgspec.structs.replace(verdict, chunk_index=1 - verdict.chunk_index), b"")


@pytest.mark.parametrize(
    ("secret", "tamper", "counter"),
    [
        ("s3cret", _tamper_tag, "forged_verdicts"),
        ("", _garble, "malformed_verdicts"),
    ],
    ids=["tag", "malformed"],
)
def test_an_answer_that_is_not_the_receivers_verdict_fails_the_transfer(
    make_pair: MakePair, secret: str, tamper: Callable[[bytes], bytes], counter: str
) -> None:
    """Whoever sits on a clear data connection could say chunks landed that never did: a verdict not tagged under
    the session's key (or not a verdict at all) fails the transfer instead of counting its chunk."""
    pair: Pair = make_pair(config=POOLED, channel="tcp", secrets=(secret, secret))
    warm(pair)
    inbox = pair.d_channel.inbox
    answer = inbox.answerer
    assert answer is not None
    inbox.answerer = lambda notifs: [tamper(a) for a in answer(notifs)]
    xfer = pair.sender.open("lied-about", pair.receiver.address, 30, [10, 11])
    xfer.send_all()
    with pytest.raises(TransferError, match="answer was refused"):
        xfer.wait(10)
    assert pair.sender.stats()[counter] == 1 and pair.sender.stats()["chunks_landed"] == 2  # the warm-up's two
    wait_until(lambda: pair.sender.stats()["open_transfers"] == 0, 5, "the sender to settle")
    pair.receiver.cancel("lied-about", "the test is over")  # it did land at D: nobody claims it


def test_a_verdict_counts_only_for_the_chunk_its_write_carried(make_pair: MakePair) -> None:
    """Two genuine verdicts swapped between the writes of chunks 0 and 1: each names a chunk of the transfer, yet
    neither answers its own write, so the transfer fails instead of counting chunks on another write's word."""
    pair = make_pair(config=POOLED, channel="tcp")
    warm(pair)
    inbox = pair.d_channel.inbox
    answer = inbox.answerer
    assert answer is not None
    inbox.answerer = lambda notifs: [_swapped(a) for a in answer(notifs)]
    xfer = pair.sender.open("swapped", pair.receiver.address, 64, [10, 11, 12, 13])
    with pytest.raises(TransferError, match="answered the write of chunk"):
        xfer.send_all()  # chunk 0's swapped verdict may fail the transfer while chunk 1 is still being posted
        xfer.wait(10)
    assert pair.sender.stats()["malformed_verdicts"] >= 1 and xfer.landed == set()
    wait_until(lambda: pair.sender.stats()["open_transfers"] == 0, 5, "the sender to settle")
    pair.receiver.cancel("swapped", "the test is over")  # both chunks did land at D: nobody claims them


def test_a_pooled_request_gets_its_next_pool_in_the_verdict_every_time(make_pair: MakePair) -> None:
    """Back-to-back one-chunk requests each find the pool the previous verdict carried: none reserves, and none
    waits for a ``Pool`` message."""
    pair = make_pair(config=POOLED, channel="tcp")
    peer = warm(pair)
    sent = record_replies(pair.receiver)
    generations = []
    for i in range(5):
        assert peer.pool is not None, f"request {i} found no pool"
        generations.append(peer.pool.generation)
        xfer = pair.sender.open(f"r{i}", pair.receiver.address, 12, [30 + i])
        assert xfer.claim is not None
        xfer.send_all()
        xfer.wait(10)
        got = pair.receiver.wait(f"r{i}", 10)
        assert_same_kv(pair, [30 + i], got.blocks, 12)
        pair.allocator.free(got.blocks)
    assert generations == sorted(set(generations)) and pair.sender.stats()["reserved_from_pool"] == 5
    assert sent == [] and pooled_peer(pair, generations[-1]).pool is not None


@pytest.mark.parametrize("channel", [TCP_AND_NIXL[1]])
def test_a_prefill_workers_watcher_sleeps_between_requests(make_pair: MakePair, channel: str) -> None:
    """Over nixl the sender's watcher polls while a write of its own is in flight or awaits its answer, and sleeps
    once it is answered: no peer may write or read the prefill side's memory (its regions are guarded, nothing
    granted), so nothing can arrive. Left open, it polled every ``max_poll_interval_s`` for good (~850 passes a
    second, ~10% of a core, at rest)."""
    pair = make_pair(config=POOLED, channel=channel)
    warm(pair)
    polls = pair.p_channel.watch_polls  # type: ignore[attr-defined]
    xfer = pair.sender.open("one", pair.receiver.address, 30, [10, 11])
    xfer.send_all()
    xfer.wait(10)
    assert pair.p_channel.watch_polls > polls, "the answer came without the watcher polling"  # type: ignore[attr-defined]
    got = pair.receiver.wait("one", 10)
    assert_same_kv(pair, [10, 11], got.blocks, 30)
    pair.allocator.free(got.blocks)
    wait_until(lambda: pair.sender.stats()["open_transfers"] == 0, 5, "the sender to settle 'one'")
    time.sleep(0.05)  # a pass already under way ends
    rest = pair.p_channel.watch_polls  # type: ignore[attr-defined]
    time.sleep(0.3)
    assert pair.p_channel.watch_polls - rest <= 1  # type: ignore[attr-defined]
