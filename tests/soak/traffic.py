"""The soak's traffic: its prompts, their fault-free answers, and one request through the router with its outcome."""

from __future__ import annotations

import http.client
import json
import random
import socket
import threading
import time
from typing import Any

from pdkv.testing.http import request

from soak.cluster import Cluster

MAX_TOKENS = 8
DROP_SETTLE_S = 1.0  # after a client hung up, until its transfer's chunks surely stopped (DropGate.quiet)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Distinct prompts of 40..120 tokens (several 32-token chunks each), ids inside the tiny vocabulary."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randrange(40, 121))] for _ in range(n)]


def body(prompt: list[int], stream: bool = False) -> dict[str, Any]:
    return {
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
    }


def fault_free(cluster: Cluster, ps: list[list[int]]) -> list[list[int]]:
    """Each prompt's answer from a decode worker alone, before any fault: the reference."""
    out = []
    for p in ps:
        status, raw = request("POST", cluster.decode[0].url + "/v1/completions", body(p), timeout=60)
        if status != 200:
            raise RuntimeError(f"fault-free generation failed: HTTP {status}: {raw[:300]!r}")
        out.append(json.loads(raw)["choices"][0]["token_ids"])
    return out


class TrafficGate:
    """The block's requests from a fault's trigger on, held until the fault is armed (corrupt_chunk).

    A fault that acts on traffic still to come (the proxy flips the next chunk) is injected once ``at`` of the
    block's requests are done, and first waits for the drops to settle. Without a hold, the requests between its
    trigger and the block's gate could all finish meanwhile, and the traffic then waited at the gate for the lane,
    while the armed proxy waited for a chunk that no request would send (the long soak failed so, more often the
    faster a request was). The lane holds from its block's start (``hold_from``), the fault releases once armed
    (``release``); the requests before the trigger are never held, so the trigger is always reached.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._from: int | None = None  # the first request held, None when nothing is

    def hold_from(self, index: int) -> None:
        with self._cond:
            self._from = index

    def release(self) -> None:
        with self._cond:
            self._from = None
            self._cond.notify_all()

    def wait(self, index: int, timeout: float) -> bool:
        """Whether request ``index`` may start (False: still held after ``timeout`` s)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._from is None or index < self._from, timeout)


class DropGate:
    """The traffic's client drops, held off while a fault must see every chunk it touches checked (corrupt_chunk).

    A client that hangs up after the first event (P streams it at once) has the router cancel its transfer while
    the KV may still be on its way to D, and a chunk of a cancelled transfer is rightly never checked: a byte
    flipped in it goes unnoticed. The lane holds drops from the start of such a fault's block until the fault is
    done (``hold``, ``release``); a drop due meanwhile is owed, and paid by the first request after, so the soak
    drops as many clients as it would have.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held = False
        self._owed = 0  # drops due and not made yet
        self._dropping = 0  # requests in flight that hang up after their first event
        self._last_drop = float("-inf")  # when the last of them hung up

    def begin(self, due: bool) -> bool:
        """Whether the request starting now drops (``due``: its turn came): one ``end`` must follow."""
        with self._cond:
            self._owed += due
            if self._held or not self._owed:
                return False
            self._owed -= 1
            self._dropping += 1
            return True

    def end(self, dropped: bool) -> None:
        """A request ``begin`` let drop (``dropped``) is over."""
        if dropped:
            with self._cond:
                self._dropping -= 1
                self._last_drop = time.monotonic()
                self._cond.notify_all()

    def hold(self) -> None:
        """No request starting from now drops, until ``release``."""
        with self._cond:
            self._held = True

    def release(self) -> None:
        with self._cond:
            self._held = False

    def quiet(self, timeout: float) -> None:
        """Wait until no request that hangs up is in flight, and the last one hung up ``DROP_SETTLE_S`` ago (its
        transfer's cancel reaches P and D well within it); RuntimeError if one still is after ``timeout`` s."""
        with self._cond:
            if not self._cond.wait_for(lambda: not self._dropping, timeout):
                raise RuntimeError(f"a request that hangs up was still in flight after {timeout}s")
            settled = self._last_drop + DROP_SETTLE_S
        time.sleep(max(0.0, settled - time.monotonic()))


def one_request(router: str, prompt: list[int], expected: list[int], drop: bool, timeout: float) -> tuple[str, str]:
    """Send one request through the router; returns (outcome, detail).

    ``drop``: stream it and hang up after the first event, as a client that
    goes away mid-answer. Every socket operation has ``timeout``, and the
    whole request a deadline of ``timeout``: past it the request counts as hung.
    """
    deadline = time.monotonic() + timeout
    host, port = router.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps(body(prompt, stream=True)),
            {"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        if resp.status != 200:
            return "failed_cleanly", f"HTTP {resp.status}: {resp.read()[:200]!r}"
        ids: list[int] = []
        while True:
            if time.monotonic() > deadline:
                return "hung", "stream still open past the request timeout"
            line = resp.readline()
            if not line:
                return "failed_cleanly", "stream ended without [DONE]"
            text = line.decode().strip()
            if not text.startswith("data: "):
                continue
            if text == "data: [DONE]":
                break
            event = json.loads(text[6:])
            if "error" in event:
                return (
                    "failed_cleanly",
                    f"error event: {str(event['error'].get('message'))[:200]}",
                )
            for choice in event.get("choices", []):
                ids.extend(choice.get("token_ids", []))
            if drop and ids:
                conn.sock.shutdown(socket.SHUT_RDWR) if conn.sock else None
                return "dropped", "client hung up mid-stream"
        if ids == expected:
            return "recovered", ""
        return "mismatched", f"got {ids}, fault-free {expected}"
    except TimeoutError:
        return "hung", f"no answer within {timeout}s"
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return "failed_cleanly", f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
