"""Where the decode workers' prompt KV came from while the soak ran, and what every worker holds after it."""

from __future__ import annotations

import threading
import time

from pdkv.testing.http import metric, request
from pdkv.testing.procs import WorkerProcess

from soak.cluster import Cluster
from soak.report import Counts

SAMPLE_S = 0.2  # how often the decode workers' KV counters are read

LEAK_GAUGES = (
    "pdkv_reservations",
    "pdkv_reserved_blocks",
    "pdkv_inflight_bytes",
    "pdkv_open_transfers",
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
            _, raw = request("GET", worker.url + "/metrics", timeout=5)
        except OSError:
            return None  # dead, or being replaced: what it did since its last sample is lost with it
        text = raw.decode()
        computed = metric(text, "pdkv_prompt_tokens_total", source="computed") + metric(
            text, "pdkv_prompt_tokens_total", source="tier"
        )
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
                    kind = (
                        self.counts.fallbacks_after_fault
                        if self.counts.during_fault(prev_t, t)
                        else self.counts.fallbacks_without_fault
                    )
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
                _, raw = request("GET", w.url + "/metrics", timeout=5)
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
