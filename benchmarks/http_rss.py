"""A decode worker's memory across adversarial HTTP phases (issue 17, item 6).

Starts a decode and a prefill worker (default model, tcp) and the router as
``pdkv launch`` processes, then runs, in order: 20 ordinary requests through
the router, 3 prompts of ``--prompt-mb`` MB straight to the decode worker,
malformed bodies (nesting 100,000 deep, a lone surrogate, content parts, a
non-string role, ``Infinity``), 50 connections that send half a 10 MB body
and hang on, and 20 ordinary requests again. After each phase it reads the
decode worker's anonymous RSS (``RssAnon``: the model's file-backed pages come
and go under memory pressure, the heap does not) and prints one JSON object:
``{"bench": "http_rss", "prompt_mb": N, "phases": [{"phase", "decode_rss_anon_mib", "answers"}, ...]}``.

Run it against an older checkout to see what a change bought:
``PYTHONPATH=/path/to/old/checkout python benchmarks/http_rss.py``.
"""

from __future__ import annotations

import argparse
import json
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pdkv.testing.procs import WorkerProcess, start_worker

HALF_SENT = 50
HOLD_S = 12.0


def rss_anon_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssAnon")) / 1024


def post(url: str, body: bytes, timeout: float = 600) -> tuple[int, float]:
    """(status, seconds) of one POST; an HTTP error status is an answer, not a failure."""
    started = time.monotonic()
    req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            resp.read()
            return resp.status, time.monotonic() - started
    except urllib.error.HTTPError as exc:
        exc.read()
        return exc.code, time.monotonic() - started


def ordinary(router: str, n: int, salt: str) -> list[int]:
    codes = set()
    for i in range(n):
        prompt = f"{salt} request {i}: " + " ".join(f"word{j * (i + 3)}" for j in range(150))
        codes.add(
            post(
                router + "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": 8, "temperature": 0}).encode()
            )[0]
        )
    return sorted(codes)


def half_sent(url: str) -> None:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(
            b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000\r\n\r\n{"prompt": "' + b"x" * 200_000
        )
        sock.settimeout(HOLD_S)
        try:
            sock.recv(100)
        except OSError:
            pass


def run(prompt_mb: float) -> dict[str, Any]:
    env = {"OMP_NUM_THREADS": "1"}
    workers: list[WorkerProcess] = []
    phases: list[dict[str, Any]] = []
    try:
        decode = start_worker("decode", "--port", "0", "--channel", "tcp", timeout=600, env=env)
        workers.append(decode)
        prefill = start_worker("prefill", "--port", "0", "--channel", "tcp", timeout=600, env=env)
        workers.append(prefill)
        router = start_worker(
            "router", "--port", "0", "--prefill", prefill.url, "--decode", decode.url, timeout=120, env=env
        )
        workers.append(router)

        def phase(name: str, **extra: Any) -> None:
            phases.append({"phase": name, "decode_rss_anon_mib": round(rss_anon_mib(decode.proc.pid)), **extra})

        phase("ready")
        phase("20 ordinary requests", answers=ordinary(router.url, 20, "warm"))
        big = json.dumps({"prompt": "lorem ipsum dolor sit amet " * int(prompt_mb * 37_000), "max_tokens": 1}).encode()
        phase(f"3 prompts of {prompt_mb:g} MB", answers=[post(decode.url + "/v1/completions", big) for _ in range(3)])
        bad = [
            b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            b'{"prompt": "a\\ud800"}',
            b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}',
            b'{"messages": [{"role": 5, "content": "x"}]}',
            b'{"prompt": "hi", "temperature": Infinity}',
        ]
        codes = {
            post(decode.url + "/v1/" + ("chat/completions" if b"messages" in b else "completions"), b)[0]
            for b in bad * 4
        }
        phase("malformed bodies", answers=sorted(codes))
        with ThreadPoolExecutor(HALF_SENT) as pool:
            list(pool.map(lambda _: half_sent(decode.url), range(HALF_SENT)))
        phase(f"{HALF_SENT} half-sent bodies held {HOLD_S:g} s")
        phase("20 ordinary requests again", answers=ordinary(router.url, 20, "later"))
    finally:
        for w in reversed(workers):
            w.stop()
    return {"bench": "http_rss", "prompt_mb": prompt_mb, "phases": phases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-mb", type=float, default=10.0, help="size of each oversized prompt (default 10)")
    print(json.dumps(run(parser.parse_args().prompt_mb)))


if __name__ == "__main__":
    main()
