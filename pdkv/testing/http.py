"""HTTP as a client of pdkv's servers sees it: JSON in and out, a server-sent event stream, Prometheus text.

The demo, the benchmarks and the tests all talk to workers and routers over
real HTTP with these few calls (the standard library's client, so that a
measurement carries no client framework's overhead and a test sees exactly
the bytes a user's client would).
"""

from __future__ import annotations

import http.client
import json
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

from pdkv.errors import PdkvError


def post_json(
    url: str, body: dict[str, Any], timeout: float = 300.0, headers: dict[str, str] | None = None
) -> dict[str, Any]:
    """POST a JSON body (with ``headers`` besides its content type), return the JSON answer; an HTTP error status
    raises ``urllib.error.HTTPError``."""
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json", **(headers or {})}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def request(
    method: str, url: str, body: Any = None, headers: dict[str, str] | None = None, timeout: float = 60.0
) -> tuple[int, bytes]:
    """One HTTP call that returns the status and body of any answer, an error status included.

    ``body``: bytes go out exactly as given (malformed input is a test's point),
    anything else but None as JSON. A refused or timed-out connection raises
    ``OSError``: no answer is not an answer.
    """
    parts = urllib.parse.urlsplit(url)
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)
    try:
        conn.request(
            method,
            parts.path + (f"?{parts.query}" if parts.query else ""),
            data,
            {"Content-Type": "application/json", **(headers or {})},
        )
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def get_text(url: str, timeout: float = 30.0) -> str:
    """GET ``url``, return the body as text (a /metrics page, a health answer)."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def stream_events(
    url: str, body: dict[str, Any], timeout: float = 300.0, headers: dict[str, str] | None = None
) -> Iterator[dict[str, Any]]:
    """POST ``body`` with ``stream`` on (and ``headers``) and yield each server-sent event's JSON; an in-band error
    raises ``PdkvError``."""
    req = urllib.request.Request(
        url, json.dumps({**body, "stream": True}).encode(), {"Content-Type": "application/json", **(headers or {})}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise PdkvError(f"{url} answered an error: {event['error'].get('message')}")
            yield event


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus sample over the series that carry ``labels``."""
    total = 0.0
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        if series.split("{", 1)[0] == name and all(f'{k}="{v}"' in series for k, v in labels.items()):
            total += float(value)
    return total
