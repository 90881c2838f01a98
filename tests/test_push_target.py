"""A prefill worker pushes KV only where the router vouches (issue 45, item 3).

Straight at P's HTTP port, whoever reaches it named the address P dials (``remote_host``/``remote_port``), and
P's answer told a closed port ("connection refused") from a silent one ("no Hello reply"): a port scanner, and
the way in for a relay. Real workers and a real router over real HTTP, as in ``test_http_input``: a prefill and a
decode worker sharing a secret with the router, plus a prefill worker without a secret whose operator listed the
receivers it may push to. A "listener" is a socket listening on 127.0.0.1 that never accepts: the kernel still
completes a dial to it, which is how a test sees whether P dialled.
"""

from __future__ import annotations

import json
import select
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from pdkv.config import convert_config
from pdkv.errors import ConfigError
from pdkv.netaddr import HeldPort
from pdkv.router.app import Router
from pdkv.testing.http import metric, request
from pdkv.testing.model import write_tiny_model
from pdkv.transfer.params import sign_push
from pdkv.worker.server import Worker

from tests.test_http_input import HTTP_LIMITS, PROMPT, SECRET, Loop, serve, worker

HANDSHAKE_TIMEOUT_S = 2.0  # how long P waits on a silent receiver: the tests wait that out, so short
DIAL_WAIT_S = 0.5  # how long, once P answered, a test still looks for a dial it made (P dials before it answers)


@dataclass
class Stack:
    loop: Loop
    decode: Worker
    listed: HeldPort  # the one receiver port the allowlisted prefill worker may push to
    urls: dict[str, str]  # prefill (secret), decode, router, allowlisted (no secret, allowed_receivers)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    model = write_tiny_model(tmp_path_factory.mktemp("model") / "tiny")
    transfer = {"chunk_size": 32, "transfer_timeout_s": 30, "handshake_timeout_s": HANDSHAKE_TIMEOUT_S}
    listed = HeldPort()  # held (bound, not listening) so nothing else takes it; a Listener may still bind it
    workers = {
        "prefill": worker(model, "prefill", transfer=transfer),
        "decode": worker(model, "decode"),
        "allowlisted": worker(
            model,
            "prefill",
            secret="",
            transfer={**transfer, "allowed_receivers": [f"127.0.0.1:{listed.port}", "[::1]"]},
        ),
    }
    loop = Loop()
    runners, urls = [], {}
    for name, w in workers.items():
        r, urls[name] = loop.run(serve(w.app(), HTTP_LIMITS))
        runners.append(r)
    router_config = convert_config(
        {"router": {"prefill": [urls["prefill"]], "decode": [urls["decode"]], "health_interval_s": 60}}
    )
    router = loop.run(Router.start(router_config.router, convert_config({"http": HTTP_LIMITS}).http, SECRET))
    r, urls["router"] = loop.run(serve(router.app(), HTTP_LIMITS))
    runners.append(r)
    try:
        yield Stack(loop, workers["decode"], listed, urls)
    finally:
        listed.release()
        for r in reversed(runners):
            loop.run(r.cleanup())
        loop.run(router.close())
        loop.close()


def receiver(stack: Stack) -> tuple[str, int]:
    info = json.loads(request("GET", stack.urls["decode"] + "/pdkv/info")[1])
    return info["remote_host"], info["remote_port"]


def target(port: int, transfer_id: str) -> dict[str, Any]:
    return {"do_remote_decode": True, "remote_host": "127.0.0.1", "remote_port": port, "transfer_id": transfer_id}


def prefill(url: str, params: dict[str, Any]) -> tuple[int, Any]:
    status, body = request(
        "POST",
        url + "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "kv_transfer_params": params},
    )
    return status, json.loads(body)


class Listener:
    """A port on 127.0.0.1 that listens and never accepts: ``dialled`` says whether anyone connected."""

    def __init__(self, port: int = 0) -> None:
        self.sock = socket.create_server(("127.0.0.1", port), backlog=16)
        self.port = int(self.sock.getsockname()[1])

    def dialled(self, wait: float = DIAL_WAIT_S) -> bool:
        return bool(select.select([self.sock], [], [], wait)[0])  # readable: a completed connection waits

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def listener() -> Iterator[Listener]:
    lst = Listener()
    try:
        yield lst
    finally:
        lst.close()


def assert_refused(status: int, answer: Any, why: str) -> None:
    assert status == 403, answer
    error = answer["error"]
    assert error["type"] == "PermissionDeniedError" and error["param"] == "kv_transfer_params", answer
    assert why in error["message"], answer


def test_an_unsigned_target_straight_at_p_is_refused_and_nothing_is_dialled(stack: Stack, listener: Listener) -> None:
    status, answer = prefill(stack.urls["prefill"], target(listener.port, "unsigned"))
    assert_refused(status, answer, "push target not signed by the router: kv_transfer_params carry no push_proof")
    assert not listener.dialled(), "P dialled an address nobody vouched for"


def test_a_tampered_or_foreign_signature_is_refused_and_nothing_is_dialled(stack: Stack, listener: Listener) -> None:
    host, port = receiver(stack)
    signed = sign_push(target(port, "tampered") | {"remote_host": host}, SECRET)
    proof = signed["push_proof"]
    for params in (
        {**signed, "remote_port": listener.port},  # the router's signature, another port
        {**signed, "remote_port": listener.port, "transfer_id": "other"},  # and another transfer
        {**signed, "push_proof": proof[:-1] + ("0" if proof[-1] != "0" else "1")},  # one digit changed
        {**signed, "push_proof": "ä" * 64},  # not even hex
        {**signed, "codec": "zstd"},  # the signature covers the codec too
        sign_push(target(listener.port, "foreign"), "another-secret"),  # a well-formed signature, wrong secret
    ):
        status, answer = prefill(stack.urls["prefill"], params)
        assert_refused(status, answer, "push target not signed by the router: push_proof does not match")
    assert not listener.dialled(), "P dialled a target whose signature does not check out"
    assert stack.decode.receiver.stats()["reservations"] == 0  # type: ignore[union-attr]  # nor reserved on D


def test_the_routers_requests_still_move_the_kv_over_the_channel(stack: Stack) -> None:
    """P refuses every unsigned target, so KV that moves came to a target the router signed."""
    before = request("GET", stack.urls["decode"] + "/metrics")[1].decode()
    for _ in range(2):  # the first handshakes, the second rides the link it made
        status, body = request(
            "POST", stack.urls["router"] + "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0}
        )
        assert status == 200, body
    after = request("GET", stack.urls["decode"] + "/metrics")[1].decode()
    prompt_tokens = json.loads(body)["usage"]["prompt_tokens"]
    moved = metric(after, "pdkv_prompt_tokens_total", source="transferred") - metric(
        before, "pdkv_prompt_tokens_total", source="transferred"
    )
    assert moved == 2 * prompt_tokens
    assert metric(after, "pdkv_fallbacks_total") == metric(before, "pdkv_fallbacks_total"), "D recomputed"
    router_metrics = request("GET", stack.urls["router"] + "/metrics")[1].decode()
    assert metric(router_metrics, "pdkv_router_fallbacks_total") == 0


def test_a_closed_and_a_silent_port_get_the_same_answer(stack: Stack, listener: Listener) -> None:
    """Signed (the router names a dead receiver, or one that never answers): P dials, fails, and tells the caller
    the same either way; only its log says which."""
    with HeldPort() as closed:  # bound, not listening: a dial is refused at once
        answers = [
            prefill(stack.urls["prefill"], sign_push(target(port, "same"), SECRET))
            for port in (closed.port, listener.port)
        ]
    assert listener.dialled(0), "P never dialled the silent receiver the router signed"
    (closed_status, closed_answer), (silent_status, silent_answer) = answers
    assert closed_status == silent_status == 200
    told = [a["kv_transfer_params"] for a in (closed_answer, silent_answer)]
    assert told[0] == told[1] and told[0]["transfer_started"] is False, told
    for port in (closed.port, listener.port):
        assert str(port) not in told[0]["transfer_error"]


def test_the_allowlist_refuses_an_unlisted_receiver_without_a_secret(stack: Stack, listener: Listener) -> None:
    for params in (
        target(listener.port, "unlisted"),  # the host is listed with another port only
        {**target(listener.port, "unlisted-name"), "remote_host": "localhost"},  # listed hosts are not resolved
    ):
        status, answer = prefill(stack.urls["allowlisted"], params)
        assert_refused(status, answer, "is not one of this prefill worker's transfer.allowed_receivers")
    assert not listener.dialled(), "P dialled a receiver its operator did not list"
    listed = Listener(stack.listed.port)  # the listed one is dialled (no secret: no signature wanted)
    try:
        status, answer = prefill(stack.urls["allowlisted"], target(listed.port, "listed"))
        assert status == 200 and answer["kv_transfer_params"]["transfer_started"] is False, answer
        assert listed.dialled(0)
    finally:
        listed.close()


@pytest.mark.parametrize(
    ("entry", "why"),
    [("127.0.0.1:0", "port must be a number"), ("", "names no host"), ("[::1", "is not host"), ("h:x", "port")],
)
def test_allowed_receivers_are_validated(entry: str, why: str) -> None:
    with pytest.raises(ConfigError, match="transfer.allowed_receivers") as caught:
        convert_config({"transfer": {"allowed_receivers": [entry]}})
    assert why in str(caught.value)
