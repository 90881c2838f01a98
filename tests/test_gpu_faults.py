"""The GPU check's fault part (tests/gpu/check.py, ``--parts faults``), run here with the KV in emulated device
memory: the same code (``pdkv.testing.faults``), so CI runs the faults the GPU check injects.

D killed mid-transfer with KV in its device memory, D restarted on the same address, memory P released refused:
each ends in a clean failure or a recompute, no wrong byte, no leaked registration (pdkv's regions and NIXL's own
word), and the JSON-able result says so field by field.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from pdkv.testing.faults import CFG, LAYOUT, SLACK_S, run_faults

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("nixl") is None, reason="the 'nixl' extra is not installed: pip install 'pdkv[nixl]'"
)


def test_the_gpu_checks_faults_end_cleanly_with_kv_in_emulated_device_memory() -> None:
    out = run_faults("emulated")
    json.dumps(out)  # what the GPU check writes: it must serialize as it is
    assert "error" not in out, out.get("traceback")

    killed = out["killed_mid_transfer"]
    assert killed["stopped_mid_transfer"], killed
    # P hears D died from whichever comes first: its control connection dropping, or a write in flight failing (a
    # race: under load the write's failure wins about one run in six, on the base this was written on too)
    died = ("lost the control connection to receiver", "channel write failed: the peer disconnected")
    assert killed["outcome"].startswith(tuple(f"TransferError: {why}" for why in died)), killed
    assert killed["seconds"] < CFG.transfer_timeout_s + SLACK_S
    assert killed["sender_holds_nothing"], killed
    regions = LAYOUT.num_tensors + 1  # the sender's KV tensors and its staging area: no region more, none less
    assert killed["registrations"] == {"pdkv_regions": regions, "sender_regions": regions, "nixl_registered": True}

    restarted = out["restarted_same_address"]
    assert restarted["same_address"] and restarted["outcome"] == "ok", restarted
    assert restarted["decode"] == "adopted" and restarted["wrong_bytes"] == 0, restarted
    assert restarted["decode_reservations"] == 0 and restarted["sender_holds_nothing"], restarted
    assert restarted["registrations"]["pdkv_regions"] == regions and restarted["registrations"]["nixl_registered"]

    released = out["released_region"]
    assert released["nixl_registered_before_release"] and not released["nixl_registered_after_release"], released
    assert released["write_into_released_region"].startswith("ChannelError"), released
    assert released["outcome"].startswith("TransferError") and released["decode"] == "recompute", released
    assert released["decode_blocks_back"] and released["sender_holds_nothing"], released

    assert out["ok"]
