"""The soak's traffic: its prompts, their fault-free answers, and one request through the router with its outcome."""

from __future__ import annotations

import http.client
import json
import random
import socket
import time
from typing import Any

from pdkv.testing.http import request

from soak.cluster import Cluster

MAX_TOKENS = 8


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
