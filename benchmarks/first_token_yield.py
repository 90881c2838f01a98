"""What the engine's yield after a streamed first token (``first_token_yield_s``, issue 46) buys and costs on one
worker that is already decoding: new requests' time to first token against the gaps between the running streams'
tokens, with the yield on (the default) and off, in the same run.

    python benchmarks/first_token_yield.py --streams 4 --arrivals 30 --rounds 2

Each round starts a worker per setting (one at a time, the same config but ``first_token_yield_s``), runs
``--streams`` long streamed requests on it, and while they decode sends ``--arrivals`` short streamed requests, one
every ``--every-s``. It prints one JSON line: per setting, the arrivals' TTFT (p50, p90) and the running streams'
inter-token gaps (p50, p99, and the p50 of the gaps that span an arrival's first token: what the yield makes a
running stream wait); and the yield's ratios against no yield. The baseline is the same worker with the yield off:
the only difference between the two is the setting under test.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from pdkv.errors import PdkvError
from pdkv.testing.http import stream_events
from pdkv.testing.procs import start_worker

PROMPT = [(i * 37) % 300 + 3 for i in range(64)]
RUNNING_TOKENS = 1500  # enough to outlast the arrivals; the worker stops under them
START_TIMEOUT_S = 120.0  # for the running streams' first tokens


def _stream(url: str, max_tokens: int, times: list[float], prompt: list[int]) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    for event in stream_events(url + "/v1/completions", body, 600):
        if event.get("choices"):
            times.append(time.perf_counter())


def _running(url: str, times: list[float], prompt: list[int]) -> None:
    """A long stream in the background, until it ends or the worker stops under it."""
    try:
        _stream(url, RUNNING_TOKENS, times, prompt)
    except (OSError, http.client.HTTPException, PdkvError):  # the stream cut when its worker stops
        pass


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def one_setting(yield_s: float, streams: int, arrivals: int, every_s: float, workdir: Path) -> dict[str, Any]:
    """One worker with ``first_token_yield_s = yield_s``: the arrivals' TTFT and the running streams' gaps (ms)."""
    config = workdir / f"yield-{yield_s}.yaml"
    config.write_text(yaml.safe_dump({"first_token_yield_s": yield_s, "tier": {"enabled": False}, "num_blocks": 1024}))
    worker = start_worker("decode", "--host", "127.0.0.1", "--port", "0", "--config", str(config), timeout=300)
    try:
        _stream(worker.url, 2, [], PROMPT)  # warm
        running: list[list[float]] = [[] for _ in range(streams)]
        threads = [
            threading.Thread(target=_running, args=(worker.url, running[i], PROMPT[i:]), daemon=True)
            for i in range(streams)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while min(len(r) for r in running) < 5:  # every stream decoding before the arrivals begin
            if time.monotonic() > deadline or not all(t.is_alive() for t in threads):
                raise PdkvError(f"first_token_yield: the running streams did not start decoding (got {running!r:.200})")
            time.sleep(0.01)
        ttfts, firsts = [], []
        for i in range(arrivals):
            times: list[float] = []
            sent = time.perf_counter()
            _stream(worker.url, 2, times, PROMPT[: 32 + i % 16])
            ttfts.append(times[0] - sent)
            firsts.append(times[0])
            time.sleep(every_s)
        stopped = time.perf_counter()
    finally:
        worker.stop()
    gaps, spanning = [], []
    for r in running:
        stamps = [t for t in r if t <= stopped]
        for a, b in zip(stamps, stamps[1:], strict=False):
            gaps.append(b - a)
            if any(a < f <= b for f in firsts):
                spanning.append(b - a)
    ms = 1e3
    return {
        "first_token_yield_s": yield_s,
        "ttft_ms": {"p50": ms * statistics.median(ttfts), "p90": ms * _percentile(ttfts, 0.9)},
        "gap_ms": {
            "p50": ms * statistics.median(gaps),
            "p99": ms * _percentile(gaps, 0.99),
            "spanning_a_first_token_p50": ms * statistics.median(spanning) if spanning else None,
        },
        "gaps": len(gaps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--arrivals", type=int, default=30)
    parser.add_argument("--every-s", type=float, default=0.1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--yield-s", type=float, default=0.005)
    args = parser.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):  # on, off, off, on, ...: the order the machine's load drifts in is shared
            for name in ("on", "off") if r % 2 == 0 else ("off", "on"):
                value = args.yield_s if name == "on" else 0.0
                runs[name].append(one_setting(value, args.streams, args.arrivals, args.every_s, Path(tmp)))

    def mean(name: str, *path: str) -> float:
        values = []
        for run in runs[name]:
            v: Any = run
            for key in path:
                v = v[key]
            values.append(v)
        return statistics.mean(values)

    print(
        json.dumps(
            {
                "bench": "first_token_yield",
                "baseline": "the same worker with first_token_yield_s 0, same run, rounds alternating",
                "runs": runs,
                "ratio_ttft_p50": mean("on", "ttft_ms", "p50") / mean("off", "ttft_ms", "p50"),
                "ratio_ttft_p90": mean("on", "ttft_ms", "p90") / mean("off", "ttft_ms", "p90"),
                "ratio_gap_p50": mean("on", "gap_ms", "p50") / mean("off", "gap_ms", "p50"),
                "ratio_gap_p99": mean("on", "gap_ms", "p99") / mean("off", "gap_ms", "p99"),
            }
        )
    )


if __name__ == "__main__":
    main()
