"""The examples a newcomer copies from must keep working."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("channel", ["tcp", "nixl"])
def test_synthetic_transfer_between_two_processes(channel: str) -> None:
    if channel == "nixl":
        pytest.importorskip("nixl", reason="the nixl extra is not installed")
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "synthetic_transfer.py"),
            "--channel",
            channel,
            "--requests",
            "5",
            "--tokens",
            "300",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout)
    assert summary["verified"] == 5
    assert summary["leaked_blocks"] == 0
    assert summary["bytes_moved"] == 5 * 300 * 8 * 2 * 4 * 64 * 2  # 8 layers, K+V, 4 heads of 64, bf16


def test_standalone_cache_stores_a_real_prompt_and_retrieves_it_bit_identical() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "standalone_cache.py")], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    report = json.loads(out.stdout)
    n, chunk = report["prompt_tokens"], report["chunk_size"]
    assert n % chunk, "the prompt should end in a partial chunk, so the example shows one stored and retrieved"
    assert report["stored_tokens"] == report["looked_up_tokens"] == report["retrieved_tokens"] == n
    assert report["bit_identical"] is True
    assert report["resumed_loaded_tokens"] == (n - 1) // chunk * chunk  # every chunk before the last token's
    assert report["generated_equal"] is True
    assert report["restarted_hits_by_level"] == {
        "memory": 0,
        "disk": -(-n // chunk),
    }  # after the restart, all from disk
