"""Nobody in the middle: a relay between a prefill and a decode worker gets no handshake and no byte of KV.

Real workers (in-process, tiny model, tcp channel, real sockets) and a router in front of them serve a victim's
ordinary requests, while a relay (``pdkv.testing.relay``: it passes the control messages on and points the decode
worker's data address at itself) asks the prefill worker to handshake through it, as a request straight at the
prefill's HTTP port once could. With a secret the relay's rewritten Hello must fail the transcript-bound proof;
without one, the name it claims is under a live session and must not be re-pointed. Either way the victim's KV goes
straight to the decode worker, over the channel, before and after the relay leaves.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pdkv.config import convert_config
from pdkv.errors import HandshakeError
from pdkv.router.app import Router
from pdkv.testing.http import get_text, metric
from pdkv.testing.http import post_json as post
from pdkv.testing.relay import relay
from pdkv.worker.server import Worker

from tests.test_http_input import Loop, serve, worker

SECRET = "relay-test-secret"
PROMPT = [(i * 37) % 300 + 3 for i in range(100)]  # 4 chunks of 32


@dataclass
class Stack:
    loop: Loop
    prefill: Worker
    decode: Worker
    urls: dict[str, str]

    def receiver_address(self) -> str:
        info = json.loads(get_text(self.urls["decode"] + "/pdkv/info"))
        return f"tcp://{info['remote_host']}:{info['remote_port']}"

    def transferred(self) -> float:
        return metric(get_text(self.urls["decode"] + "/metrics"), "pdkv_prompt_tokens_total", source="transferred")

    def fallbacks(self) -> float:
        return metric(get_text(self.urls["decode"] + "/metrics"), "pdkv_fallbacks_total")

    def victim(self) -> list[int]:
        """One ordinary request through the router; asserts its whole prompt's KV came over the channel."""
        before = self.transferred()
        answer = post(
            self.urls["router"] + "/v1/completions",
            {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "return_token_ids": True},
        )
        assert self.transferred() - before == len(PROMPT) and self.fallbacks() == 0
        return list(answer["choices"][0]["token_ids"])


@pytest.fixture(params=["secret", "no-secret"])
def stack(request: pytest.FixtureRequest, model_dir: Path) -> Iterator[Stack]:
    secret = SECRET if request.param == "secret" else ""
    loop = Loop()
    runners: list[Any] = []
    urls: dict[str, str] = {}
    transfer = {"chunk_size": 32, "transfer_timeout_s": 20, "handshake_timeout_s": 5}
    workers = {role: worker(model_dir, role, secret=secret, transfer=transfer) for role in ("prefill", "decode")}
    router: Router | None = None
    try:
        for role, w in workers.items():
            r, urls[role] = loop.run(serve(w.app(), {}))
            runners.append(r)
        config = convert_config(
            {
                "role": "router",
                "secret": secret,
                "router": {"prefill": [urls["prefill"]], "decode": [urls["decode"]], "health_interval_s": 60},
            }
        )
        router = loop.run(Router.start(config.router, None, secret))
        r, urls["router"] = loop.run(serve(router.app(), {}))
        runners.append(r)
        yield Stack(loop, workers["prefill"], workers["decode"], urls)
    finally:
        for r in reversed(runners):
            loop.run(r.cleanup())
        if router is not None:
            loop.run(router.close())
        loop.close()


def test_a_relay_gets_no_handshake_and_no_kv_before_or_after_it_leaves(stack: Stack) -> None:
    sender = stack.prefill.sender
    assert sender is not None
    expected = stack.victim()  # P holds a live session with D: the relay would re-point it
    with relay(stack.receiver_address()) as r:
        with pytest.raises(HandshakeError) as refused:
            sender.handshake.connect(r.address)  # what a push target naming the relay made P do
        assert r.hellos_rewritten == 1  # it did sit in the middle: D answered it, and it rewrote the answer
        assert stack.victim() == expected
        assert r.data.bytes == 0 and r.data.connections == 0
    if stack.prefill.config.secret:
        assert "did not prove the shared secret over this handshake" in str(refused.value)
        assert sender.stats()["auth_failures"] == 1
    else:
        assert "in a live session" in str(refused.value)
    assert stack.victim() == expected  # gone, it left nothing P dials
