"""Soak: many requests through the router while faults are injected; nothing may hang or leak.

Starts real processes exactly as a user does (``pdkv launch``): one prefill
worker, two decode workers and the router, on a tiny random model over the tcp
channel with short leases and timeouts and a shared secret (so every control
and data connection authenticates, restarts included). The second decode
worker's channel sits behind a ``CorruptingProxy``: it advertises the proxy's
port (``advertise_port``), so the prefill worker's chunks reach it through the
proxy, which forwards every byte unchanged until told to flip one. It first
computes every prompt's fault-free answer (greedy, ``ignore_eos``, fixed
``max_tokens``) on a decode worker alone, then sends ``--requests`` requests
through the router from a small thread pool while a fault thread:

* corrupts a chunk in flight: the proxy flips one byte in the payload of the
  next DATA frame to the second decode worker, which must fail the chunk's
  checksum (``checksum_failures`` on its /metrics goes up) and compute the
  prompt itself (``pdkv_fallbacks_total`` goes up);
* SIGKILLs a decode worker, restarts it and registers the new one through the
  router's admin API (``DELETE``/``POST /pdkv/workers``);
* stalls the prefill worker (SIGSTOP, then SIGCONT a couple of seconds later);
* and some clients drop their connection mid-stream.

Every request ends as one of: ``recovered`` (output identical to the
fault-free run), ``failed_cleanly`` (an HTTP error or an error event),
``dropped`` (the client hung up on purpose), ``mismatched`` (a 200 with other
tokens: must be 0) or ``hung`` (no answer within its timeout: must be 0).
Afterwards every live worker's reservations, reserved blocks, in-flight bytes
and open transfers, read from ``/metrics``, must return to zero (``leaked``).
The report counts faults by kind, and for corrupted chunks how many the decode
worker detected and recomputed: a corrupted chunk that was not detected is an
error, as is a fault that could not be injected.

A decode worker that recomputes a prompt answers with the same tokens, so
output equality cannot tell a transfer from a silent recompute. The soak
therefore samples every decode worker's counters while it runs and reports
where the prompts' KV came from: tokens transferred, tokens recomputed, and
each fallback (by reason) sorted into "after a fault" (it happened while a
fault was in effect: from its injection to ``SETTLE_S`` after it ended) or
"without a fault", which must be none. A request may fail cleanly only while a
fault is in effect, and at most ``concurrency`` per decode kill or prefill
stall (the requests in flight then).

    python benchmarks/soak.py --requests 200 --json

Exits non-zero when anything hung, leaked or mismatched.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import http.client
import json
import os
import random
import signal
import socket
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pdkv.auth import control_token
from pdkv.channels.tcp.wire import DATA, HDR_SIZE, HEADER, NOTIF_FOLLOWS, READ_REQ
from pdkv.demo import metric
from pdkv.launch.procs import WorkerProcess, start_worker

MAX_TOKENS = 8
SAMPLE_S = 0.2  # how often the decode workers' KV counters are read
LEAK_GAUGES = (
    "pdkv_reservations",
    "pdkv_reserved_blocks",
    "pdkv_inflight_bytes",
    "pdkv_open_transfers",
)
PROXIED = 1  # the decode worker whose channel is reached through the corrupting proxy
WORKER_CONFIG: dict[str, Any] = {
    "channel": {"name": "tcp"},
    "secret": "soak-secret",
    "num_blocks": 256,
    "dtype": "float32",
    # short leases and timeouts: a dead peer is noticed within seconds, so the soak is short and nothing waits long
    "transfer": {"chunk_size": 32, "lease_s": 1, "heartbeat_s": 0.25, "transfer_timeout_s": 5, "handshake_timeout_s": 3,
                 "reserve_timeout_s": 3, "chunk_timeout_s": 5, "claim_timeout_s": 10, "drain_timeout_s": 2},
}  # fmt: skip
SETTLE_S = WORKER_CONFIG["transfer"]["transfer_timeout_s"] + WORKER_CONFIG["transfer"]["lease_s"] + 1.0
"""How long a fault's effects may outlast it: a transfer it stalled times out, or its lease expires, by then."""
ROUTER_CONFIG: dict[str, Any] = {
    "secret": WORKER_CONFIG["secret"],  # the router cancels transfers on the decode workers: their control token
    "router": {"connect_timeout_s": 2, "prefill_timeout_s": 15, "decode_timeout_s": 30, "read_timeout_s": 15,
               "health_timeout_s": 2, "health_interval_s": 1, "max_retries": 2},
}  # fmt: skip


@dataclass
class Counts:
    requests: int = 0
    concurrency: int = 4
    recovered: int = 0
    failed_cleanly: int = 0
    dropped: int = 0
    mismatched: int = 0
    hung: int = 0
    leaked: int = 0
    # fault kind -> times injected: corrupt_chunk, decode_sigkill, prefill_stall, client_drop
    injected: collections.Counter[str] = field(default_factory=collections.Counter)
    # corrupted chunks: checksum failures their decode worker counted, and prompts it computed itself meanwhile
    corrupt_detected: int = 0
    corrupt_recomputed: int = 0
    faults: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    leaks: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    # where the decode workers' prompt KV came from, counted from the first request through the router
    transferred_tokens: int = 0
    recomputed_tokens: int = 0
    fallbacks_after_fault: collections.Counter[str] = field(default_factory=collections.Counter)  # by reason
    fallbacks_without_fault: collections.Counter[str] = field(default_factory=collections.Counter)  # must stay empty
    failed_without_fault: int = 0  # requests that failed cleanly while no fault was in effect: must be 0
    windows: list[list[Any]] = field(default_factory=list)  # [fault kind, start, end] in monotonic s; end inf while in effect

    @property
    def failed_cleanly_bound(self) -> int:
        """The requests that may fail: those in flight when a decode worker dies or the prefill worker stalls."""
        return self.concurrency * (self.injected["decode_sigkill"] + self.injected["prefill_stall"])

    def during_fault(self, start: float, end: float) -> bool:
        """Whether [start, end] overlaps a fault's window, stretched by ``SETTLE_S``."""
        return any(start <= w_end + SETTLE_S and end >= w_start for _, w_start, w_end in self.windows)

    @contextlib.contextmanager
    def fault_window(self, kind: str) -> Iterator[None]:
        """Marks the time a fault is in effect (open-ended until the block exits)."""
        window = [kind, time.monotonic(), float("inf")]
        self.windows.append(window)
        try:
            yield
        finally:
            window[2] = time.monotonic()


# The router's admin endpoints, with the secret and no admin_token, want the secret's control token.
ADMIN = {"Authorization": f"Bearer {control_token(WORKER_CONFIG['secret'])}"}


def _http(
    method: str, url: str, body: Any = None, timeout: float = 30.0, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    """One HTTP call; an HTTP error status is returned, not raised (it is a clean failure, not a crash)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data, {"Content-Type": "application/json", **(headers or {})}, method=method
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Distinct prompts of 40..120 tokens (several 32-token chunks each), ids inside the tiny vocabulary."""
    rng = random.Random(seed)
    return [
        [rng.randrange(3, 300) for _ in range(rng.randrange(40, 121))] for _ in range(n)
    ]


def body(prompt: list[int], stream: bool = False) -> dict[str, Any]:
    return {
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
    }


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    """``n`` bytes, or None on a clean close before the first of them."""
    buf = bytearray()
    while len(buf) < n:
        data = sock.recv(n - len(buf))
        if not data:
            if buf:
                raise ConnectionError(f"closed after {len(buf)} of {n} bytes")
            return None
        buf += data
    return bytes(buf)


class CorruptingProxy:
    """A TCP forwarder in front of a tcp channel listener that flips a byte of a chunk when armed.

    Bytes towards the listener are read frame by frame (the framing of
    channels/tcp.py), so that an armed flip lands in the middle of the next
    DATA payload and never in a header, a handshake or a notification: the
    channel then sees nothing wrong but a chunk whose bytes changed, exactly
    what a bad NIC, cable or switch does, and only the receiver's checksum can
    tell. The other direction is forwarded untouched.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.server.getsockname()[1]
        self.cond = threading.Condition()
        self.armed = 0  # flips still to make
        self.flipped = 0  # flips made
        self.conns: set[socket.socket] = set()
        threading.Thread(target=self._accept, name="soak-proxy", daemon=True).start()

    def arm(self) -> int:
        """Flip a byte of the next DATA payload; returns the flip count to wait for (``wait_flipped``)."""
        with self.cond:
            self.armed += 1
            return self.flipped + self.armed

    def wait_flipped(self, count: int, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.flipped >= count, timeout)

    def _take(self) -> bool:
        with self.cond:
            if not self.armed:
                return False
            self.armed -= 1
            return True

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return  # closed
            threading.Thread(
                target=self._serve, args=(client,), name="soak-proxy-conn", daemon=True
            ).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.upstream, timeout=5)
        except OSError:  # the worker is down (being restarted): the channel sees a refused connection
            client.close()
            return
        upstream.settimeout(None)
        with self.cond:
            self.conns.update((client, upstream))
        back = threading.Thread(
            target=self._pipe_back, args=(upstream, client), daemon=True
        )
        back.start()
        try:
            self._forward_frames(client, upstream)
        except OSError:
            pass  # either side went away: hang up both, as a dead link would
        finally:
            for sock in (client, upstream):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            back.join(10)
            with self.cond:
                self.conns.difference_update((client, upstream))
            client.close()
            upstream.close()

    @staticmethod
    def _pipe_back(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _forward_frames(self, src: socket.socket, dst: socket.socket) -> None:
        while (hdr := _recv_exact(src, HDR_SIZE)) is not None:
            _, _, ftype, flags, _, _, notif, _, _, length = HEADER.unpack(hdr)
            dst.sendall(hdr)
            # a READ_REQ's length is what it asks for, not what follows it
            payload = 0 if ftype == READ_REQ else length
            flip_at = payload // 2 if ftype == DATA and self._take() else -1
            self._copy(src, dst, payload, flip_at)
            if ftype == DATA and flags & NOTIF_FOLLOWS:
                self._copy(src, dst, notif, -1)

    def _copy(
        self, src: socket.socket, dst: socket.socket, n: int, flip_at: int
    ) -> None:
        """Forward ``n`` bytes, inverting the one at ``flip_at`` (-1: none) on the way."""
        pos = 0
        while pos < n:
            data = src.recv(min(n - pos, 1 << 20))
            if not data:
                raise ConnectionError(
                    f"closed inside a frame, {pos} of {n} bytes forwarded"
                )
            if pos <= flip_at < pos + len(data):
                flipped = bytearray(data)
                flipped[flip_at - pos] ^= 0xFF
                dst.sendall(flipped)
                with self.cond:
                    self.flipped += 1
                    self.cond.notify_all()
            else:
                dst.sendall(data)
            pos += len(data)

    def close(self) -> None:
        self.server.close()
        with self.cond:
            conns = list(self.conns)
        for sock in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Cluster:
    """The processes under test; ``decode`` entries are replaced when a worker is restarted.

    Decode worker ``PROXIED`` listens for chunks on a fixed port (a restart
    takes it again) behind ``proxy``, and advertises the proxy's port.
    """

    def __init__(self, workdir: Path, model: Path) -> None:
        self.workdir, self.model = workdir, model
        self.lock = threading.Lock()
        self.prefill: WorkerProcess | None = None
        self.decode: list[WorkerProcess] = []
        self.router: WorkerProcess | None = None
        self.dead: list[WorkerProcess] = []
        self.proxied_port = _free_port()
        self.proxy = CorruptingProxy(self.proxied_port)

    def _config(self, name: str, cfg: dict[str, Any]) -> str:
        path = self.workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return str(path)

    def start_worker(self, role: str, index: int = 0) -> WorkerProcess:
        """The prefill worker, or decode worker ``index`` (``PROXIED`` behind the proxy)."""
        cfg = {**WORKER_CONFIG, "model": str(self.model)}
        if role == "decode" and index == PROXIED:
            options = {"port": self.proxied_port, "advertise_port": self.proxy.port}
            cfg["channel"] = {**cfg["channel"], "options": options}
        path = self._config(f"{role}{index}", cfg)
        return start_worker(role, "--config", path, "--port", "0", timeout=120)

    def start(self) -> None:
        with ThreadPoolExecutor(3) as pool:  # start-up is mostly imports: overlap them
            futs = [
                pool.submit(self.start_worker, r, i)
                for r, i in (("prefill", 0), ("decode", 0), ("decode", PROXIED))
            ]
            self.prefill, *self.decode = [f.result() for f in futs]
        args = ["--prefill", self.prefill.url] + [
            a for d in self.decode for a in ("--decode", d.url)
        ]
        self.router = start_worker(
            "router",
            "--config",
            self._config("router", ROUTER_CONFIG),
            "--port",
            "0",
            *args,
            timeout=120,
        )

    def live_workers(self) -> list[WorkerProcess]:
        with self.lock:
            return [
                w
                for w in [self.prefill, *self.decode]
                if w is not None and w.proc.poll() is None
            ]

    def stop(self) -> None:
        for w in [self.router, *self.decode, self.prefill, *self.dead]:
            if w is not None:
                w.stop(timeout=5)
        self.proxy.close()


def fault_free(cluster: Cluster, ps: list[list[int]]) -> list[list[int]]:
    """Each prompt's answer from a decode worker alone, before any fault: the reference."""
    out = []
    for p in ps:
        status, raw = _http(
            "POST", cluster.decode[0].url + "/v1/completions", body(p), timeout=60
        )
        if status != 200:
            raise RuntimeError(
                f"fault-free generation failed: HTTP {status}: {raw[:300]!r}"
            )
        out.append(json.loads(raw)["choices"][0]["token_ids"])
    return out


def one_request(
    router: str, prompt: list[int], expected: list[int], drop: bool, timeout: float
) -> tuple[str, str]:
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


def kill_and_restart_decode(cluster: Cluster, counts: Counts, monitor: KVMonitor, cycle: int = 0) -> None:
    """SIGKILL a decode worker (alternating between the two), start a new one, swap it in through the admin API."""
    with counts.fault_window("decode_sigkill"):
        _kill_and_restart_decode(cluster, counts, monitor, cycle)


def _kill_and_restart_decode(cluster: Cluster, counts: Counts, monitor: KVMonitor, cycle: int) -> None:
    assert cluster.router is not None
    index = cycle % len(cluster.decode)
    with cluster.lock:
        victim = cluster.decode[index]
    monitor.sample(victim)  # its counts so far, before they die with it
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(10)
    counts.injected["decode_sigkill"] += 1
    counts.faults.append(f"SIGKILL decode {victim.url}")
    _http(
        "DELETE",
        cluster.router.url + "/pdkv/workers",
        {"role": "decode", "url": victim.url},
        timeout=10,
        headers=ADMIN,
    )
    fresh = cluster.start_worker("decode", index)
    status, raw = _http(
        "POST",
        cluster.router.url + "/pdkv/workers",
        {"role": "decode", "url": fresh.url},
        timeout=10,
        headers=ADMIN,
    )
    if status not in (200, 201):
        raise RuntimeError(
            f"registering the restarted decode worker failed: HTTP {status}: {raw[:300]!r}"
        )
    with cluster.lock:
        cluster.decode[index] = fresh
        cluster.dead.append(victim)
    counts.faults.append(f"restarted decode as {fresh.url} and registered it")


def stall_prefill(cluster: Cluster, counts: Counts, seconds: float = 2.0) -> None:
    """A slow peer: the prefill worker freezes (SIGSTOP) mid-traffic, then resumes."""
    assert cluster.prefill is not None
    with counts.fault_window("prefill_stall"):
        cluster.prefill.proc.send_signal(signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            cluster.prefill.proc.send_signal(signal.SIGCONT)
    counts.injected["prefill_stall"] += 1
    counts.faults.append(f"SIGSTOP prefill for {seconds}s")


def _events(worker: WorkerProcess) -> tuple[float, float]:
    """A decode worker's (checksum failures, fallbacks) so far, from its /metrics."""
    _, raw = _http("GET", worker.url + "/metrics", timeout=5)
    text = raw.decode()
    return metric(
        text, "pdkv_transfer_events_total", event="checksum_failures"
    ), metric(text, "pdkv_fallbacks_total")


def corrupt_chunk(cluster: Cluster, counts: Counts, wait_s: float = 30.0) -> None:
    """Flip one byte of the next chunk on its way to the proxied decode worker; it must notice and recompute.

    Noticing is its checksum failure counter going up, and not noticing
    within ``wait_s`` is an error in the report; recomputing is its fallback
    counter going up (the request may also fail cleanly: its output is
    checked like every other's).
    """
    with counts.fault_window("corrupt_chunk"):
        _corrupt_chunk(cluster, counts, wait_s)


def _corrupt_chunk(cluster: Cluster, counts: Counts, wait_s: float) -> None:
    with cluster.lock:
        victim = cluster.decode[PROXIED]
    checksum_failures, fallbacks = _events(victim)
    target = cluster.proxy.arm()
    if not cluster.proxy.wait_flipped(target, wait_s):
        raise RuntimeError(f"no chunk went to decode {victim.url} within {wait_s}s")
    counts.injected["corrupt_chunk"] += 1
    counts.faults.append(f"flipped a byte of a chunk on its way to decode {victim.url}")
    deadline = time.monotonic() + wait_s
    while (now := _events(victim))[0] <= checksum_failures or now[1] <= fallbacks:
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    counts.corrupt_detected += int(now[0] - checksum_failures)
    counts.corrupt_recomputed += int(now[1] - fallbacks)
    if now[0] <= checksum_failures:
        counts.errors.append(
            f"fault corrupt_chunk went undetected: decode {victim.url} counted no checksum failure within {wait_s}s"
        )


def _fallbacks_by_reason(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("pdkv_fallbacks_total{"):
            series, _, value = line.rpartition(" ")
            reason = series.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = out.get(reason, 0.0) + float(value)
    return out


class KVMonitor:
    """Samples every decode worker's prompt-KV counters while the soak runs, so that a fallback is seen with the
    time it happened in (and the counts of a decode worker survive its SIGKILL: it is sampled just before).

    Each sample adds what changed since the worker's previous one to ``counts``: transferred tokens, recomputed
    tokens (computed or from its own cache tier) and fallbacks, each sorted by ``Counts.during_fault`` over the
    interval since the previous sample. Decode workers only recompute a prompt as a fallback.
    """

    def __init__(self, cluster: Cluster, counts: Counts) -> None:
        self.cluster, self.counts = cluster, counts
        self.lock = threading.Lock()
        self.last: dict[str, tuple[float, float, float, dict[str, float]]] = {}
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="soak-kv-monitor", daemon=True)

    @staticmethod
    def _read(worker: WorkerProcess) -> tuple[float, float, dict[str, float]] | None:
        try:
            _, raw = _http("GET", worker.url + "/metrics", timeout=5)
        except OSError:
            return None  # dead, or being replaced: what it did since its last sample is lost with it
        text = raw.decode()
        computed = metric(text, "pdkv_prompt_tokens_total", source="computed") + metric(text, "pdkv_prompt_tokens_total", source="tier")
        return metric(text, "pdkv_prompt_tokens_total", source="transferred"), computed, _fallbacks_by_reason(text)

    def baseline(self) -> None:
        """Start counting from now (the fault-free reference answers are computed on a decode worker before)."""
        with self.lock:
            for w in self.cluster.decode:
                now = self._read(w)
                if now is not None:
                    self.last[w.url] = (time.monotonic(), *now)

    def sample(self, worker: WorkerProcess) -> None:
        t = time.monotonic()
        now = self._read(worker)
        if now is None:
            return
        with self.lock:
            prev_t, transferred, computed, fallbacks = self.last.get(worker.url, (t, 0.0, 0.0, {}))
            self.last[worker.url] = (t, *now)
            self.counts.transferred_tokens += int(now[0] - transferred)
            self.counts.recomputed_tokens += int(now[1] - computed)
            for reason, value in now[2].items():
                n = int(value - fallbacks.get(reason, 0.0))
                if n:
                    kind = self.counts.fallbacks_after_fault if self.counts.during_fault(prev_t, t) else self.counts.fallbacks_without_fault
                    kind[reason] += n

    def _run(self) -> None:
        while not self.stopped.wait(SAMPLE_S):
            with self.cluster.lock:
                workers = list(self.cluster.decode)
            for w in workers:
                self.sample(w)

    def start(self) -> None:
        self.baseline()
        self.thread.start()

    def stop(self) -> None:
        """A last sample of every live decode worker, after the windows of the last faults are known."""
        self.stopped.set()
        self.thread.join(10)
        for w in self.cluster.live_workers():
            if w.role == "decode":
                self.sample(w)


def read_leaks(cluster: Cluster, wait_s: float) -> dict[str, float]:
    """Non-zero leak gauges per live worker, polled until all are zero or ``wait_s`` passed (things settle)."""
    deadline = time.monotonic() + wait_s
    while True:
        leaks: dict[str, float] = {}
        for w in cluster.live_workers():
            try:
                _, raw = _http("GET", w.url + "/metrics", timeout=5)
            except OSError as exc:
                leaks[f"{w.role} {w.url} unreachable: {exc}"] = 1.0
                continue
            for gauge in LEAK_GAUGES:
                value = metric(raw.decode(), gauge)
                if value:
                    leaks[f"{w.role} {w.url} {gauge}"] = value
        if not leaks or time.monotonic() > deadline:
            return leaks
        time.sleep(0.2)


def soak(
    n: int,
    concurrency: int = 4,
    timeout: float = 60.0,
    drop_every: int = 8,
    workdir: Path | None = None,
) -> Counts:
    """Run the soak and return its counts; the processes are always stopped."""
    from pdkv.engine.testing import write_tiny_model

    tmp = tempfile.TemporaryDirectory(prefix="pdkv-soak-") if workdir is None else None
    root = Path(tmp.name) if tmp else workdir
    assert root is not None
    cluster = Cluster(root, write_tiny_model(root / "model"))
    counts = Counts(requests=n, concurrency=concurrency)
    monitor = KVMonitor(cluster, counts)
    try:
        cluster.start()
        assert cluster.router is not None
        router_url = cluster.router.url
        ps = prompts(min(n, 16))
        expected = fault_free(cluster, ps)
        done = 0
        done_lock = threading.Condition()
        # Faults cycle every ``block`` requests: a chunk is corrupted in flight at 1/8 of the block, a decode
        # worker is killed at 1/4; the requests of the block's second half wait (bounded) for its restart, so the
        # restarted worker really serves traffic; the prefill worker is stalled at 3/4. Triggers count finished
        # requests, not seconds, so a slow machine sees the same interleaving.
        block = min(n, 100)
        starts = range(0, n - block + 1, block)
        restarted = [threading.Event() for _ in starts]

        def wait_done(at: int) -> bool:
            with done_lock:
                return done_lock.wait_for(lambda: done >= at, timeout=timeout * 4)

        def faults() -> None:
            for k, b in enumerate(starts):
                for at, fault, event in (
                    (
                        b + block // 8,
                        functools.partial(corrupt_chunk, cluster, counts),
                        None,
                    ),
                    (
                        b + max(1, block // 4),
                        functools.partial(kill_and_restart_decode, cluster, counts, monitor, k),
                        restarted[k],
                    ),
                    (
                        b + (3 * block) // 4,
                        functools.partial(stall_prefill, cluster, counts),
                        None,
                    ),
                ):
                    name = fault.func.__name__
                    if not wait_done(at):
                        counts.errors.append(
                            f"fault {name} never triggered: traffic stalled before request {at}"
                        )
                        return
                    try:
                        fault()
                    except Exception as exc:  # noqa: BLE001 - a fault that could not be injected is reported, never skipped
                        counts.errors.append(f"fault {name} failed: {exc}")
                    finally:
                        if event is not None:
                            event.set()

        def task(i: int) -> tuple[str, str, float, float]:
            nonlocal done
            drop = drop_every > 0 and i % drop_every == drop_every - 1
            for k, b in enumerate(starts):
                gate = b + block // 2
                if gate <= i < gate + block // 2 and not restarted[k].wait(timeout * 4):
                    counts.errors.append(
                        f"fault kill_and_restart_decode did not finish before request {i}"
                    )
            start = time.monotonic()
            try:
                outcome, detail = one_request(
                    router_url, ps[i % len(ps)], expected[i % len(ps)], drop, timeout
                )
                return outcome, detail, start, time.monotonic()
            finally:
                with done_lock:
                    done += 1
                    done_lock.notify_all()

        t0 = time.monotonic()
        monitor.start()
        injector = threading.Thread(target=faults, name="soak-faults", daemon=True)
        injector.start()
        with ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(task, range(n)))
        injector.join(timeout * 4)
        counts.seconds = round(time.monotonic() - t0, 1)
        for outcome, detail, start, end in results:
            setattr(counts, outcome, getattr(counts, outcome) + 1)
            if outcome == "failed_cleanly" and not counts.during_fault(start, end):
                counts.failed_without_fault += 1
            if outcome == "dropped":
                counts.injected["client_drop"] += 1
                counts.faults.append("client dropped its connection mid-stream")
            elif detail and len(counts.errors) < 20:
                counts.errors.append(f"{outcome}: {detail}")
        counts.leaks = read_leaks(cluster, wait_s=15)
        counts.leaked = int(sum(counts.leaks.values()))
        monitor.stop()
        return counts
    finally:
        cluster.stop()
        if tmp:
            tmp.cleanup()


def problems(counts: Counts) -> list[str]:
    """What makes a soak fail; empty when it passed."""
    out = [f"{what}: {n}" for what, n in (("hung", counts.hung), ("leaked", counts.leaked), ("mismatched", counts.mismatched)) if n]
    out += [e for e in counts.errors if e.startswith("fault")]
    if counts.fallbacks_without_fault:
        out.append(f"prompts recomputed while no fault was in effect: {dict(counts.fallbacks_without_fault)}")
    if counts.failed_without_fault:
        out.append(f"requests failed while no fault was in effect: {counts.failed_without_fault}")
    if counts.failed_cleanly > counts.failed_cleanly_bound:
        out.append(f"failed cleanly: {counts.failed_cleanly}, more than the {counts.failed_cleanly_bound} in flight at the faults that can fail one")
    if not counts.transferred_tokens:
        out.append("no prompt's KV was transferred")
    return out


def summary(counts: Counts) -> dict[str, Any]:
    faults = sorted(set(counts.faults), key=counts.faults.index)
    return {
        "requests": counts.requests,
        "faults_injected": sum(counts.injected.values()),
        "faults_by_kind": dict(sorted(counts.injected.items())),
        "corrupt_chunks": {
            "injected": counts.injected["corrupt_chunk"],
            "detected": counts.corrupt_detected,
            "recomputed": counts.corrupt_recomputed,
        },
        "recovered": counts.recovered,
        "failed_cleanly": counts.failed_cleanly,
        "failed_cleanly_bound": counts.failed_cleanly_bound,
        "failed_without_fault": counts.failed_without_fault,
        "kv": {
            "transferred_prompt_tokens": counts.transferred_tokens,
            "recomputed_prompt_tokens": counts.recomputed_tokens,
            "fallbacks_after_fault": dict(sorted(counts.fallbacks_after_fault.items())),
            "fallbacks_without_fault": dict(sorted(counts.fallbacks_without_fault.items())),
        },
        "dropped_by_client": counts.dropped,
        "mismatched": counts.mismatched,
        "hung": counts.hung,
        "leaked": counts.leaked,
        "seconds": counts.seconds,
        "faults": [
            f"{f} x{counts.faults.count(f)}" if counts.faults.count(f) > 1 else f
            for f in faults
        ],
        "leaks": counts.leaks,
        "errors": counts.errors,
        "problems": problems(counts),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="per-request timeout in seconds (past it: hung)",
    )
    ap.add_argument(
        "--drop-every",
        type=int,
        default=8,
        help="every Nth request hangs up mid-stream (0: none)",
    )
    ap.add_argument("--json", action="store_true", help="print only the JSON summary")
    args = ap.parse_args(argv)
    counts = soak(args.requests, args.concurrency, args.timeout, args.drop_every)
    out = summary(counts)
    print(json.dumps(out, indent=None if args.json else 2))
    return 1 if problems(counts) else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
