"""``channels/answers.py``: a write that asks for an answer over a channel whose only way back is a notification
(nixl), both ends of it, with every malformed or misdirected answer refused (the real agents: test_channel_nixl.py)."""

from __future__ import annotations

import struct

import pytest

from pdkv.channels import answers
from pdkv.channels.answers import Asks
from pdkv.channels.handle import Notification, TransferHandle, XferState
from pdkv.channels.inbox import NotificationInbox


def reply(kind: int, ask: bytes, body: bytes) -> bytes:
    """An answer echoing ``ask`` (the handle's id and its write's random bytes, as the framed notice carried them)."""
    return answers.ANSWER + bytes([kind]) + ask + body


def ask_of(framed: bytes) -> bytes:
    return framed[1:17]


def other_id(ask: bytes, step: int = 1) -> bytes:
    ident, nonce = struct.unpack("<Q8s", ask)
    return struct.pack("<Q8s", ident + step, nonce)


@pytest.mark.parametrize("answer_first", [False, True])
def test_a_write_completes_once_written_and_answered_in_either_order(answer_first: bool) -> None:
    asks, handle = Asks(), TransferHandle("d", "write", 10)
    framed = asks.ask(handle, b"notice")
    assert framed[:1] == bytes([answers.ASK]) and framed[17:] == b"notice" and asks
    assert struct.unpack("<Q", framed[1:9])[0] == handle.id
    if answer_first:
        assert asks.answered("d", reply(answers.ANSWERED, ask_of(framed), b"verdict"))
        assert handle.state is XferState.PENDING  # its bytes are not known to be done yet
        asks.written(handle)
    else:
        asks.written(handle)
        assert handle.state is XferState.PENDING  # done, but not answered
        assert asks.answered("d", reply(answers.ANSWERED, ask_of(framed), b"verdict"))
    assert handle.state is XferState.DONE and handle.answer == b"verdict" and not asks


def test_a_refusal_fails_the_write_and_a_stray_answer_is_left_alone() -> None:
    asks, handle = Asks(), TransferHandle("d", "write", 10)
    ask = ask_of(asks.ask(handle, b"n"))
    guessed = struct.pack("<Q8s", handle.id, bytes(8))  # the right id, without the write's random bytes
    assert not asks.answered("other", reply(answers.ANSWERED, ask, b"x"))  # not the peer we asked
    assert not asks.answered("d", reply(answers.ANSWERED, other_id(ask), b"x"))  # not an id we asked with
    assert not asks.answered("d", reply(answers.REFUSED, guessed, b"forged"))  # a guessed id fails nothing
    assert not asks.answered("d", reply(answers.ANSWERED, guessed, b"forged"))  # nor completes anything
    assert not asks.answered("d", reply(9, ask, b"x"))  # no such kind
    assert not asks.answered("d", answers.ANSWER + b"\x02\x01")  # shorter than its head
    assert not asks.answered("d", reply(answers.ANSWERED, ask, b"x" * (answers.MAX_ANSWER_BYTES + 1)))
    assert not asks.answered("d", b"an ordinary notification")
    assert handle.state is XferState.PENDING
    assert asks.answered("d", reply(answers.REFUSED, ask, b"no room"))
    assert handle.state is XferState.ERROR and "no room" in (handle.error or "") and not asks
    assert not asks.answered("d", reply(answers.ANSWERED, ask, b"late"))  # answered once


def test_the_target_delivers_plain_notifications_and_answers_asked_ones_together() -> None:
    inbox = NotificationInbox()
    taken: list[list[Notification]] = []

    def answer(notifs: list[Notification]) -> list[bytes]:
        taken.append(notifs)
        if any(n.payload == b"boom" for n in notifs):
            raise ZeroDivisionError("division by zero" + " and more" * 1000)
        return [b"seen " + n.payload for n in notifs]

    try:
        assert answers.serve(inbox, [("p", answers.frame(b"plain")), ("p", b"")]) == []  # b"": not framed
        inbox.answerer = answer
        seven, nine, eight = (struct.pack("<Q8s", i, bytes([i]) * 8) for i in (7, 9, 8))
        got = answers.serve(inbox, [("p", answers.frame(b"one", ask=seven)), ("q", answers.frame(b"two", ask=nine))])
        assert got == [
            ("p", reply(answers.ANSWERED, seven, b"seen one")),
            ("q", reply(answers.ANSWERED, nine, b"seen two")),
        ]
        assert [[n.payload for n in batch] for batch in taken] == [[b"one", b"two"]]  # one pass, one call
        failed = answers.serve(inbox, [("p", answers.frame(b"boom", ask=eight))])
        assert failed[0][1].startswith(reply(answers.REFUSED, eight, b"")) and b"division" in failed[0][1]
        assert len(failed[0][1]) == len(reply(answers.REFUSED, eight, b"")) + answers.MAX_REASON_BYTES  # cut
        assert [(n.peer, n.payload) for n in inbox.drain()] == [("p", b"plain"), ("p", b"")]
    finally:
        inbox.close()
