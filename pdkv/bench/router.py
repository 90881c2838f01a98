"""``pdkv bench router``: the latency the router adds and the requests per second it carries.

A trivial backend (one process, no model, answering at once) plays both a
prefill and a decode worker; the router runs as ``pdkv launch --role
router`` in front of it, so what is measured is the router's own cost:
parsing, choosing, the two hops, relaying. Baseline, in the same run and
against the same backend: the client doing the two hops itself (prefill with
``max_tokens`` 1, then decode with the answer's ``kv_transfer_params``),
which is what a client would do without a router. A single direct decode
call is reported too, as the floor.

* latency: ``--requests`` sequential non-streamed requests, router and
  baseline alternating in rounds so a burst of load on a shared machine hits
  both; p50 and p99 of each, the ms the router adds and the ratio.
* throughput: ``--requests`` requests with ``--concurrency`` in flight,
  router against baseline; requests/s and the ratio.

Prints one JSON object with ``--json``: ``{"bench": "router", "baseline":
WHAT, "results": [{"metric", "router", "baseline", "ratio", ...}, ...]}``.
Every wait has a timeout (``TIMEOUT_S``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from pdkv.bench import plot
from pdkv.testing.procs import start_worker

TIMEOUT_S = 30.0
ROUNDS = 5
BASELINE = "the client doing the prefill and decode hops itself, same backend, same run"


def _backend_app() -> web.Application:
    """A worker with no model: prefill answers with pdkv's params, decode with a fixed completion."""

    async def generate(http: web.Request) -> web.Response:
        body = await http.json()
        kv = body.get("kv_transfer_params") or {}
        choice = {"index": 0, "text": "x" if kv.get("do_remote_decode") else "hello world", "finish_reason": "length"}
        answer: dict[str, Any] = {"object": "text_completion", "choices": [choice]}
        if kv.get("do_remote_decode"):
            answer["kv_transfer_params"] = {
                "do_remote_prefill": True,
                "transfer_id": kv.get("transfer_id"),
                "first_token_id": 1,
                "transfer_started": True,
            }
        return web.json_response(answer)

    async def ok(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "remote_host": "127.0.0.1", "remote_port": 1})

    app = web.Application()
    app.router.add_post("/v1/completions", generate)
    app.router.add_get("/health", ok)
    app.router.add_get("/pdkv/info", ok)
    app.router.add_delete("/pdkv/transfers/{tid}", ok)
    return app


def _serve_backend(port_out: Any) -> None:
    async def main() -> None:
        runner = web.AppRunner(_backend_app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port_out.send(runner.addresses[0][1])
        await asyncio.Event().wait()

    asyncio.run(main())


async def _latencies(call: Callable[[], Awaitable[None]], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await call()
        out.append(time.perf_counter() - t0)
    return out


async def _rate(call: Callable[[], Awaitable[None]], n: int, concurrency: int) -> float:
    left = iter(range(n))

    async def lane() -> None:
        for _ in left:
            await call()

    t0 = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(concurrency)))
    return n / (time.perf_counter() - t0)


def _pct(samples: list[float], q: float) -> float:
    return statistics.quantiles(samples, n=100, method="inclusive")[q - 1] * 1e3 if q < 100 else max(samples) * 1e3


async def _measure(router: str, backend: str, requests: int, concurrency: int) -> dict[str, Any]:
    body = {"model": "bench", "prompt": "The quick brown fox jumps over the lazy dog.", "max_tokens": 16}
    timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as s:

        async def post(url: str, payload: dict[str, Any]) -> dict[str, Any]:
            async with s.post(url + "/v1/completions", json=payload) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"{url} answered {resp.status}: {await resp.text()}")
                return await resp.json()

        async def via_router() -> None:
            await post(router, body)

        async def by_hand() -> None:
            prefill = await post(
                backend,
                {
                    **body,
                    "max_tokens": 1,
                    "kv_transfer_params": {
                        "do_remote_decode": True,
                        "remote_host": "127.0.0.1",
                        "remote_port": 1,
                        "transfer_id": "t",
                    },
                },
            )
            await post(backend, {**body, "kv_transfer_params": prefill["kv_transfer_params"]})

        async def decode_only() -> None:
            await post(backend, body)

        per_round = max(1, requests // ROUNDS)
        await _latencies(via_router, 20)  # warm connections and code paths
        await _latencies(by_hand, 20)
        lat: dict[str, list[float]] = {"router": [], "baseline": [], "decode_only": []}
        for _ in range(ROUNDS):
            lat["router"] += await _latencies(via_router, per_round)
            lat["baseline"] += await _latencies(by_hand, per_round)
            lat["decode_only"] += await _latencies(decode_only, per_round)
        rates: dict[str, list[float]] = {"router": [], "baseline": []}
        for _ in range(ROUNDS):
            rates["router"].append(await _rate(via_router, per_round, concurrency))
            rates["baseline"].append(await _rate(by_hand, per_round, concurrency))
    results = []
    for q in (50, 99):
        r, b = _pct(lat["router"], q), _pct(lat["baseline"], q)
        results.append(
            {
                "metric": f"p{q}_ms",
                "router": r,
                "baseline": b,
                "added_ms": r - b,
                "ratio": r / b,
                "decode_only": _pct(lat["decode_only"], q),
            }
        )
    rps, base_rps = statistics.median(rates["router"]), statistics.median(rates["baseline"])
    results.append(
        {
            "metric": "requests_per_s",
            "router": rps,
            "baseline": base_rps,
            "ratio": rps / base_rps,
            "concurrency": concurrency,
        }
    )
    return {"bench": "router", "baseline": BASELINE, "requests": per_round * ROUNDS, "results": results}


def _table(out: dict[str, Any]) -> str:
    lines = [
        f"router vs {out['baseline']} ({out['requests']} requests per side)",
        f"{'metric':>16}  {'router':>9}  {'baseline':>9}  {'ratio':>6}",
    ]
    for row in out["results"]:
        extra = (
            f"  (+{row['added_ms']:.2f} ms; decode alone {row['decode_only']:.2f} ms)"
            if "added_ms" in row
            else f"  ({row['concurrency']} in flight)"
        )
        lines.append(f"{row['metric']:>16}  {row['router']:9.2f}  {row['baseline']:9.2f}  {row['ratio']:6.2f}{extra}")
    return "\n".join(lines)


def draw(out: dict[str, Any], path: str) -> None:
    """``--plot``: latency percentiles of the router, its baseline and a decode call alone; requests/s in the note."""
    rows = [r for r in out["results"] if "decode_only" in r]
    rate = next(r for r in out["results"] if r["metric"] == "requests_per_s")
    plot.bars(
        path,
        f"pdkv bench router ({out['requests']} requests per side)",
        "latency (ms)",
        [r["metric"] for r in rows],
        {
            "router": [r["router"] for r in rows],
            "baseline: both hops by the client": [r["baseline"] for r in rows],
            "one decode call alone": [r["decode_only"] for r in rows],
        },
        note=f"requests/s at {rate['concurrency']} in flight: router {rate['router']:.0f}, baseline "
        f"{rate['baseline']:.0f} (ratio {rate['ratio']:.2f})",
    )


def run(args: argparse.Namespace) -> int:
    requests, concurrency = getattr(args, "requests", 500), getattr(args, "concurrency", 32)
    plot.check(getattr(args, "plot", None))
    ctx = multiprocessing.get_context("spawn")
    port_in, port_out = ctx.Pipe(duplex=False)
    backend_proc = ctx.Process(target=_serve_backend, args=(port_out,), daemon=True)
    backend_proc.start()
    router = None
    try:
        if not port_in.poll(TIMEOUT_S):
            raise RuntimeError(f"the trivial backend did not start within {TIMEOUT_S:.0f}s")
        backend = f"http://127.0.0.1:{port_in.recv()}"
        router = start_worker("router", "--prefill", backend, "--decode", backend, "--port", "0", timeout=TIMEOUT_S)
        out = asyncio.run(_measure(router.url, backend, requests, concurrency))
    finally:
        if router is not None:
            router.stop()
        backend_proc.terminate()
        backend_proc.join(TIMEOUT_S)
    print(json.dumps(out) if getattr(args, "json", False) else _table(out))
    if getattr(args, "plot", None):
        draw(out, args.plot)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--json", action="store_true")
    raise SystemExit(run(parser.parse_args()))
