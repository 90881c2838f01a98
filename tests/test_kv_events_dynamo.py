"""NVIDIA Dynamo's standalone KV indexer (``python -m dynamo.indexer``, ai-dynamo-runtime, in the ``dev`` extra) reads a
pdkv worker's KV events.

A real pdkv prefill worker process with ``kv_events`` on and a small memory
level is registered with a real indexer process over its HTTP API
(``POST /register`` with the worker's ``endpoint`` and ``replay_endpoint``
from ``/pdkv/info``). The worker then sees prompts with shared prefixes, an
eviction (``BlockRemoved``) and a resync (``AllBlocksCleared`` and every
block again). At each check, Dynamo's ``/query`` overlap for a prompt must
equal the tokens the worker then loads from its tier for it
(``pdkv_prompt_tokens{source="tier"}``).

Dynamo applies one worker's batches in order, so a check first waits for a
marker prompt's blocks to show up in Dynamo: everything the worker published
before them (the evictions its store caused included) has been applied.

The same stream with the hashes as bytes (``use_int_block_hashes: false``,
vLLM's opt-out) is not indexed at all: Dynamo decodes integer hashes only
and logs each batch it drops. That test keeps the default honest: if pdkv
went back to bytes, the first test fails and this one says why.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pdkv.netaddr import free_port
from pdkv.testing.procs import WorkerProcess, start_configured

pytest.importorskip(
    "dynamo.indexer", reason="Dynamo's indexer comes with the dev extra: pip install -e '.[dev]' (ai-dynamo-runtime)"
)

CHUNK = 32
CHUNK_BYTES = 2 * 2 * CHUNK * 2 * 16 * 4  # the tiny model: layers, k/v, tokens, kv heads, head dim, float32
A = [(i * 37) % 300 + 3 for i in range(100)]  # 3 full chunks (+4 tokens)
B = A[:64] + [(i * 13) % 280 + 7 for i in range(40)]  # A's first 2 chunks, then 1 of its own (+8)
C = [(i * 11) % 290 + 5 for i in range(70)]  # 2 chunks, nothing shared
MARKERS = [
    [(i * 17 + 101 * m) % 310 + 2 for i in range(CHUNK)] for m in range(4)
]  # 1 chunk each, nothing shared (the vocabulary is 320)
TIMEOUT_S = 20.0


def http(method: str, url: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def wait_for(
    pred: Callable[[], bool], what: str, timeout: float = TIMEOUT_S, nudge: Callable[[], object] | None = None
) -> None:
    """Poll ``pred``; ``nudge`` (if any) runs about once a second while it is false."""
    deadline = time.monotonic() + timeout
    next_nudge = time.monotonic() + 1.0
    while not pred():
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what}"
        if nudge is not None and time.monotonic() >= next_nudge:
            nudge()
            next_nudge = time.monotonic() + 1.0
        time.sleep(0.1)


class Indexer:
    """A ``python -m dynamo.indexer`` process on a free port, its log in a file."""

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        with log.open("w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dynamo.indexer", "--port", str(self.port), "--threads", "1"],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        wait_for(self._up, "dynamo.indexer to listen")

    def _up(self) -> bool:
        assert self.proc.poll() is None, f"dynamo.indexer exited: {self.log.read_text()[-2000:]}"
        try:
            return http("GET", self.url + "/workers")[0] == 200
        except OSError:
            return False

    def register(self, instance_id: int, worker: WorkerProcess, model: str) -> None:
        events = http("GET", worker.url + "/pdkv/info")[1]["kv_events"]
        body = {
            "instance_id": instance_id,
            "endpoint": events["endpoint"],
            "replay_endpoint": events["replay_endpoint"],
            "block_size": events["block_size"],
            "model_name": model,
        }
        status, answer = http("POST", self.url + "/register", body)
        assert status == 201, answer

    def overlap(self, tokens: list[int], model: str, instance_id: int) -> int:
        """The tokens Dynamo predicts the worker holds of ``tokens``, on any tier (0 before it indexed anything)."""
        status, answer = http("POST", self.url + "/query", {"token_ids": tokens, "model_name": model})
        if status == 404:  # no indexer for the model yet: nothing decoded
            return 0
        assert status == 200, answer
        return int(answer["instances"].get(str(instance_id), {}).get("longest_matched", 0))

    def query(self, tokens: list[int], model: str) -> dict[str, Any]:
        status, answer = http("POST", self.url + "/query", {"token_ids": tokens, "model_name": model})
        assert status == 200, answer
        return dict(answer)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def indexer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Indexer]:
    idx = Indexer(tmp_path_factory.mktemp("dynamo") / "indexer.log")
    try:
        yield idx
    finally:
        idx.close()


def start_events_worker(model_dir: Path, path: Path, **kv_events: Any) -> WorkerProcess:
    """A prefill worker whose memory level holds 4 chunks (no disk: an eviction is a BlockRemoved), publishing its
    KV events."""
    config = {
        "model": str(model_dir),
        "num_blocks": 128,
        "transfer": {"chunk_size": CHUNK},
        "tier": {"enabled": True, "memory_bytes": 4 * CHUNK_BYTES},
        "kv_events": {
            "enable_kv_cache_events": True,
            "endpoint": "tcp://*:0",
            "replay_endpoint": "tcp://*:0",
            **kv_events,
        },
    }
    return start_configured("prefill", config, path, timeout=120)


def resync(worker: WorkerProcess) -> None:
    """Ask the worker to publish everything again (AllBlocksCleared, then each block held)."""
    assert http("POST", worker.url + "/pdkv/kv-events/resync")[0] == 200


def first_seen(
    indexer: Indexer, worker: WorkerProcess, tokens: list[int], expected: int, model: str, instance_id: int
) -> None:
    """Wait for Dynamo to index ``tokens``, just after registering: a PUB socket drops what it sends before the
    subscription reaches it, and Dynamo notices a loss only at the next batch (then replays it), so a quiet
    stream is nudged with resyncs, as a pdkv router's stream would be by its replay probe."""
    wait_for(
        lambda: indexer.overlap(tokens, model, instance_id) == expected,
        f"{expected} tokens indexed by Dynamo",
        nudge=lambda: resync(worker),
    )


def tier_tokens(worker: WorkerProcess) -> int:
    """Prompt tokens the worker loaded from its tier so far."""
    with urllib.request.urlopen(worker.url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    found = re.search(r'^pdkv_prompt_tokens_total\{role="prefill",source="tier"\} (\S+)$', text, re.M)
    return int(float(found.group(1))) if found else 0


def send(worker: WorkerProcess, tokens: list[int]) -> int:
    """Run the prompt on the worker; returns the tokens it loaded from its tier for it."""
    before = tier_tokens(worker)
    status, answer = http("POST", worker.url + "/v1/completions", {"prompt": tokens, "max_tokens": 1, "temperature": 0})
    assert status == 200, answer
    return tier_tokens(worker) - before


def test_dynamos_indexer_predicts_what_a_pdkv_worker_loads(model_dir: Path, indexer: Indexer, tmp_path: Path) -> None:
    model, wid = "pdkv-int", 1
    worker = start_events_worker(model_dir, tmp_path / "worker.yaml")
    try:
        indexer.register(wid, worker, model)
        markers = iter(MARKERS)

        def settle() -> None:
            """Wait until Dynamo applied everything the worker published so far (a new marker's block shows
            up after it)."""
            marker = next(markers)
            assert send(worker, marker) == 0
            wait_for(lambda: indexer.overlap(marker, model, wid) == CHUNK, "the marker's block in Dynamo")

        def check(tokens: list[int]) -> int:
            """Dynamo's overlap for ``tokens`` is what the worker then loads; returns it."""
            predicted = indexer.overlap(tokens, model, wid)
            assert send(worker, tokens) == predicted
            return predicted

        assert send(worker, A) == 0
        first_seen(indexer, worker, A, 96, model, wid)
        # a shared prefix: B's first 2 chunks are A's
        assert check(B) == 64
        # the memory level holds 4 chunks (A's 3, B's own): C's 2 evict the 2 least recently used
        assert send(worker, C) == 0
        settle()
        predictions = [indexer.overlap(p, model, wid) for p in (A, B, C)]
        assert predictions[2] == 64 and min(predictions[:2]) < 96, f"no eviction reached Dynamo: {predictions}"
        assert check(A) == predictions[0]  # and now A's 3 chunks are the most recently used
        # a resync: AllBlocksCleared, then every block the worker holds, parents first (the marker after it
        # evicts the least recently used chunk, not one of A's)
        resync(worker)
        settle()
        assert check(A) == 96
        # pdkv announces its memory level as CPU: Dynamo credits it in its tiers, not in the flat (GPU) scores
        answer = indexer.query(A, model)
        assert (
            answer["instances"][str(wid)]["cpu"] == 96
            and answer["instances"][str(wid)]["gpu"] == 0
            and not answer["scores"]
        )
        assert "Failed to decode" not in indexer.log.read_text()
    finally:
        worker.stop()


def test_memory_medium_gpu_makes_dynamos_scores_count_pdkvs_tier(
    model_dir: Path, indexer: Indexer, tmp_path: Path
) -> None:
    model, wid = "pdkv-gpu", 2
    worker = start_events_worker(model_dir, tmp_path / "worker.yaml", memory_medium="GPU")
    try:
        indexer.register(wid, worker, model)
        assert send(worker, A) == 0
        first_seen(indexer, worker, A, 96, model, wid)
        answer = indexer.query(A, model)
        assert answer["scores"] == {str(wid): {"0": 96}} and answer["instances"][str(wid)]["gpu"] == 96
    finally:
        worker.stop()


def test_with_bytes_hashes_dynamo_drops_every_batch(model_dir: Path, tmp_path: Path) -> None:
    """vLLM's opt-out (whole hashes as bytes): Dynamo decodes none of it, so it predicts nothing while the worker
    loads."""
    model, wid = "pdkv-bytes", 3
    indexer = Indexer(tmp_path / "indexer.log")  # its own: the decode errors it logs are this worker's
    worker = start_events_worker(model_dir, tmp_path / "worker.yaml", use_int_block_hashes=False)
    try:
        indexer.register(wid, worker, model)
        assert send(worker, A) == 0
        wait_for(
            lambda: "data did not match any variant of untagged enum BlockHashValue" in indexer.log.read_text(),
            "Dynamo's decode error",
            nudge=lambda: resync(worker),
        )
        assert indexer.overlap(A, model, wid) == 0
        assert send(worker, A) == 96  # the worker has it all the same
    finally:
        worker.stop()
        indexer.close()
