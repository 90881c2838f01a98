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
        [sys.executable, str(ROOT / "examples" / "synthetic_transfer.py"), "--channel", channel, "--requests", "5", "--tokens", "300"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout)
    assert summary["verified"] == 5
    assert summary["leaked_blocks"] == 0
    assert summary["bytes_moved"] == 5 * 300 * 8 * 2 * 4 * 64 * 2  # 8 layers, K+V, 4 heads of 64, bf16
