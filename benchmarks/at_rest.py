"""What a worker's channel costs while no request moves: a prefill worker's (a ``KVSender`` over its KV, nothing
sent) and a decode worker's (a ``KVReceiver`` nobody reserved from), against the same channel with nothing
registered, measured in the same run.

    python benchmarks/at_rest.py --channels tcp,nixl --seconds 3

Prints one JSON line: per channel and side, the process's CPU as a percentage of one core over ``--seconds``
(every thread: ``pdkv.bench.cpu.process_cpu_s``), and over nixl the watcher's passes a second (``watch_polls``);
``over_bare`` is the side's CPU less the bare channel's. A prefill worker's regions are sealed (it only pushes), so
over nixl its watcher sleeps at rest; left open it polled every ``max_poll_interval_s`` (issue 46's history file, "A
ninth session").
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

import torch

from pdkv.bench.cpu import process_cpu_s
from pdkv.bench.transfer import FINGERPRINT, SENDER_LAYOUT
from pdkv.blocks import BlockAllocator
from pdkv.channels import Channel, create_channel
from pdkv.config import TransferConfig
from pdkv.transfer.receiver import KVReceiver
from pdkv.transfer.sender import KVSender

BLOCKS = 64


def at_rest(channel: Channel, seconds: float, settle: float) -> dict[str, float | None]:
    """The process's CPU (% of a core) and the channel's watcher passes a second over ``seconds`` of rest, from
    ``settle`` seconds after the side was set up (its start-up work done)."""
    time.sleep(settle)
    polls0, cpu0 = getattr(channel, "watch_polls", None), process_cpu_s(os.getpid())
    time.sleep(seconds)
    polls1, cpu1 = getattr(channel, "watch_polls", None), process_cpu_s(os.getpid())
    return {
        "cpu_pct": round((cpu1 - cpu0) / seconds * 100, 2),
        "watch_polls_per_s": None if polls0 is None or polls1 is None else round((polls1 - polls0) / seconds, 1),
    }


def side(
    kind: str, name: str, seconds: float, settle: float, make: Callable[[Channel, list[torch.Tensor]], object] | None
) -> dict:
    """One channel of ``kind`` at rest, with what ``make`` sets up over a KV buffer (None: nothing registered)."""
    channel = create_channel(kind, f"rest-{name}-{os.getpid()}")
    part = None
    try:
        kv = [torch.zeros(t.shape, dtype=t.dtype) for t in SENDER_LAYOUT.allocate(BLOCKS)]
        part = make(channel, kv) if make is not None else None
        return at_rest(channel, seconds, settle)
    finally:
        if part is not None:
            part.close()  # type: ignore[attr-defined]
        channel.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--channels", default="tcp,nixl")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--settle", type=float, default=1.0, help="seconds after a side is set up before its span")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = TransferConfig()
    makers: dict[str, Callable[[Channel, list[torch.Tensor]], object] | None] = {
        "bare": None,
        "prefill": lambda ch, kv: KVSender(ch, SENDER_LAYOUT, kv, FINGERPRINT, config),
        "decode": lambda ch, kv: KVReceiver(ch, SENDER_LAYOUT, kv, BlockAllocator(BLOCKS), FINGERPRINT, config),
    }
    out: dict[str, object] = {"seconds": args.seconds}
    for kind in args.channels.split(","):
        rows = {label: side(kind, label, args.seconds, args.settle, make) for label, make in makers.items()}
        for label in ("prefill", "decode"):
            rows[label]["over_bare_pct"] = round(rows[label]["cpu_pct"] - rows["bare"]["cpu_pct"], 2)  # type: ignore[operator]
        out[kind] = rows
    print(json.dumps(out))


if __name__ == "__main__":
    main()
