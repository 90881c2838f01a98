"""The soak itself: the cluster up, traffic from a thread pool, the faults on a schedule, then the counts."""

from __future__ import annotations

import functools
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pdkv.testing.model import write_tiny_model

from soak.cluster import Cluster
from soak.faults import corrupt_chunk, kill_and_restart_decode, stall_prefill
from soak.monitor import KVMonitor, read_leaks
from soak.report import Counts
from soak.traffic import fault_free, one_request, prompts


def soak(
    n: int,
    concurrency: int = 4,
    timeout: float = 60.0,
    drop_every: int = 8,
    workdir: Path | None = None,
) -> Counts:
    """Run the soak and return its counts; the processes are always stopped."""
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
                        counts.errors.append(f"fault {name} never triggered: traffic stalled before request {at}")
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
                    counts.errors.append(f"fault kill_and_restart_decode did not finish before request {i}")
            start = time.monotonic()
            try:
                outcome, detail = one_request(router_url, ps[i % len(ps)], expected[i % len(ps)], drop, timeout)
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
