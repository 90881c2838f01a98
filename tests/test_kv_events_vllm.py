"""pdkv's KV events against vLLM's own code (``vllm.distributed.kv_events`` in the vLLM test environment).

vLLM's ``KVEventBatch`` decodes what a pdkv worker publishes, read through
vLLM's replay protocol; pdkv's stream follower and index follow vLLM's own
``ZmqEventPublisher``, including the batches it published before pdkv
subscribed (its replay socket). The real vLLM server's events are in
tests/test_vllm_integration.py. Skipped, saying why, where the vLLM
environment cannot be built (tests/vllm_env.py).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path
from typing import Any

import aiohttp

from pdkv.config import KVEventsConfig
from pdkv.engine.reference import ReferenceEngine
from pdkv.keys import chunk_keys
from pdkv.kv_events.index import PrefixIndex
from pdkv.kv_events.subscriber import EventStream, cancel
from pdkv.kv_events.wire import external_hash

from tests.test_kv_events import CHUNK, PROMPT, completion, events_worker, until
from tests.test_tier_worker import serve

PEER = Path(__file__).with_name("vllm_kv_events_peer.py")
BS = 16
TOKENS = list(range(1000, 1064))  # 4 blocks of vLLM's 16


def line(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    text = proc.stdout.readline()
    assert text, f"the vLLM peer exited: {proc.stderr.read()[-3000:] if proc.stderr else ''}"
    return json.loads(text)


def vllm_stored(i: int, medium: str = "GPU") -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": [f"{i:064x}"],
        "parent": f"{i - 1:064x}" if i else None,
        "token_ids": TOKENS[i * BS : (i + 1) * BS],
        "block_size": BS,
        "lora_id": None,
        "medium": medium,
    }


def test_vllm_decodes_what_a_pdkv_worker_publishes_and_pdkv_follows_vllms_publisher(
    vllm_env_python: str, model_dir: Path, tmp_path: Path
) -> None:
    fingerprint = ReferenceEngine.load(str(model_dir), progress=False).fingerprint

    async def scenario() -> None:
        worker = events_worker(model_dir)
        runner, url = await serve(worker)
        proc = None
        try:
            async with aiohttp.ClientSession() as s:
                info = (await (await s.get(url + "/pdkv/info")).json())["kv_events"]
                assert (await s.post(url + "/v1/completions", json=completion(PROMPT))).status == 200
            await asyncio.to_thread(worker.tiering.tier.flush)
            ipc = f"ipc://{tmp_path}/vllm"
            proc = subprocess.Popen(
                [
                    vllm_env_python,
                    str(PEER),
                    info["endpoint"],
                    info["replay_endpoint"],
                    info["topic"],
                    ipc + "-pub",
                    ipc + "-replay",
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            first = await asyncio.to_thread(line, proc)
            seen = first["pdkv"]
            # pdkv's kv_events: is vLLM's --kv-events-config, plus pdkv's own fields (hash form, medium, CURVE)
            assert first["config_fields"] == [
                f for f in KVEventsConfig.__struct_fields__ if f not in KVEventsConfig.PDKV_FIELDS
            ]
            # what vLLM's classes read: the start-up AllBlocksCleared, then each full chunk in memory (CPU, LOCAL)
            # with pdkv's chunk key as its hash (vLLM's default integer form: the low 64 bits), chained to its parent,
            # its 32 token ids, block_size 32
            events = [e for b in seen for e in b["events"]]
            assert [b["seq"] for b in seen] == list(range(len(seen))) and all(b["dp_rank"] == 0 for b in seen)
            assert events[0] == {"type": "AllBlocksCleared"}
            keys = [external_hash(k, use_int=True) for k in chunk_keys(PROMPT, fingerprint, CHUNK)[:3]]
            assert [e for e in events[1:] if e["type"] == "BlockStored"] == [
                {
                    "type": "BlockStored",
                    "block_hashes": [keys[i]],
                    "parent": keys[i - 1] if i else None,
                    "token_ids": PROMPT[i * CHUNK : (i + 1) * CHUNK],
                    "block_size": CHUNK,
                    "medium": "CPU",
                    "locality": "LOCAL",
                    "lora_id": None,
                }
                for i in range(3)
            ]
            assert (await asyncio.to_thread(line, proc)) == {"vllm": "ready"}

            async def publish(*events: dict[str, Any]) -> None:
                assert proc is not None and proc.stdin is not None
                proc.stdin.write(json.dumps(list(events)) + "\n")
                proc.stdin.flush()
                await asyncio.to_thread(line, proc)

            # two batches before pdkv subscribes (its start-up replay from 0 gets them), then live ones
            await publish(vllm_stored(0), vllm_stored(1))
            await publish(vllm_stored(2))
            index = PrefixIndex()
            index.track("vllm")
            stream = EventStream(
                "vllm", ipc + "-pub", ipc + "-replay", info["topic"], index.apply, index.clear, check_s=0.5
            )
            task = asyncio.get_running_loop().create_task(stream.run())
            try:
                await until(lambda: index.match(TOKENS, ["vllm"])["vllm"] == 48, "vLLM's replayed batches", timeout=30)
                await publish(vllm_stored(3))  # live (or, if the subscription is not through yet, found by a replay)
                await until(lambda: index.match(TOKENS, ["vllm"])["vllm"] == 64, "vLLM's live batch", timeout=30)
                await publish({"type": "BlockRemoved", "block_hashes": [f"{1:064x}"], "medium": "GPU"})
                await until(lambda: index.match(TOKENS, ["vllm"])["vllm"] == 16, "vLLM's removal", timeout=30)
                assert stream.stats["replayed"] >= 2 and stream.stats["lost"] == 0 and stream.stats["malformed"] == 0
            finally:
                await cancel(task)
        finally:
            if proc is not None:
                if proc.poll() is None and proc.stdin is not None:
                    proc.stdin.write("quit\n")
                    proc.stdin.flush()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            await runner.cleanup()

    asyncio.run(scenario())
